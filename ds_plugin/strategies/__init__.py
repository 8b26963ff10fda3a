"""Thin adapters from Lightning (Trainer and Fabric) onto the ZeRO engine.

Importing this package imports nothing heavy; the classes load on first use, and
`register_lightning_strategies()` (which `import ds_plugin` calls when Lightning is installed) adds the
names zero0, zero1, zero2, zero3, zero3_offload and zeropp to Lightning's and Fabric's strategy registries.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "Fp8Precision",
    "ZeroFabricStrategy",
    "ZeroPrecision",
    "ZeroStrategy",
    "register_lightning_strategies",
]

_LAZY = {
    "ZeroStrategy": "ds_plugin.strategies.lightning",
    "ZeroPrecision": "ds_plugin.strategies.lightning_precision",
    "Fp8Precision": "ds_plugin.strategies.lightning_fp8",
    "ZeroFabricStrategy": "ds_plugin.strategies.fabric",
}


def register_lightning_strategies() -> list[str]:
    """Register the ds_plugin strategy names with Lightning's Trainer and Fabric (idempotent).

    Returns the registered names. Raises ImportError when Lightning is not installed.
    """
    from ds_plugin.strategies.registry import register_lightning_strategies as register

    return register()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ds_plugin.strategies' has no attribute {name!r}")
