"""The strategy names `import ds_plugin` adds to Lightning: zero0..zero3, zero3_offload, zeropp.

Lightning has no entry-point discovery for strategies: `Trainer(strategy="zeropp")` looks the name up in
`lightning.pytorch.strategies.StrategyRegistry` (Fabric in its own `STRATEGY_REGISTRY`), so the names must
be registered before the Trainer is built. Registering is idempotent; a name some other package already
registered is left alone (with a warning) rather than silently taken over.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["STRATEGY_NAMES", "register_lightning_strategies", "register_names"]

logger = logging.getLogger(__name__)

# name -> description; each name selects the preset of the same name in ds_plugin.presets.
STRATEGY_NAMES = {
    "zero0": "DeepSpeed ZeRO stage 0 (data parallel) on FSDP2",
    "zero1": "DeepSpeed ZeRO stage 1 (optimizer states sharded) on FSDP2",
    "zero2": "DeepSpeed ZeRO stage 2 (+ gradients sharded) on FSDP2",
    "zero3": "DeepSpeed ZeRO stage 3 (+ weights sharded) on FSDP2",
    "zero3_offload": "DeepSpeed ZeRO stage 3 with optimizer and parameter CPU offload",
    "zeropp": "DeepSpeed ZeRO++ (qwZ, hpZ, qgZ) on FSDP2",
}


def _qualname(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def register_names(registry: Any, strategy: type) -> None:
    """Register every name in `STRATEGY_NAMES` for `strategy` in a Lightning or Fabric strategy registry.

    Args:
        registry: Lightning's `StrategyRegistry` or Fabric's `STRATEGY_REGISTRY`.
        strategy: the strategy class; each name passes `config=<name>` to it.
    """
    for name, description in STRATEGY_NAMES.items():
        entry = dict.get(registry, name)  # the registry's own `get` would instantiate the strategy
        if entry is not None:
            if _qualname(entry["strategy"]) != _qualname(strategy):
                logger.warning(
                    "strategy name %r is already registered by %s; ds_plugin leaves it",
                    name,
                    _qualname(entry["strategy"]),
                )
            continue
        registry.register(name, strategy, description=description, config=name)


def register_lightning_strategies() -> list[str]:
    """Make `Trainer(strategy="zeropp")` and the other names work (and `Fabric(strategy=...)` alike).

    Safe to call any number of times. Returns the names registered for the Trainer.

    Raises:
        ImportError: Lightning is not installed.
    """
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from ds_plugin.strategies.fabric import ZeroFabricStrategy
    from ds_plugin.strategies.lightning import ZeroStrategy

    register_names(StrategyRegistry, ZeroStrategy)
    register_names(STRATEGY_REGISTRY, ZeroFabricStrategy)
    return list(STRATEGY_NAMES)
