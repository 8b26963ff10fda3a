"""ds_plugin: DeepSpeed's ZeRO, ZeRO++ and mixed precision on torch.distributed's FSDP2.

Public verbs: `load_config` (a preset name, a DeepSpeed JSON/YAML path, or a dict), `initialize` (model +
config -> ZeRO engine), `apply_zero`, and the config types. Importing the package also registers the
Lightning strategy names (zero0..zero3, zero3_offload, zeropp) when Lightning is installed.
"""

from __future__ import annotations

from ds_plugin.config import ConfigError, TrainingConfig, from_deepspeed
from ds_plugin.presets import PRESETS, get_preset, load_config

__version__ = "0.1.0"

__all__ = ["PRESETS", "ConfigError", "TrainingConfig", "from_deepspeed", "get_preset", "load_config"]


def _register_strategies() -> None:
    # Lightning looks strategy names up in its registry with no entry-point discovery, so the names must be in
    # place before `Trainer(strategy="zeropp")`: registering is the side effect of `import ds_plugin`.
    try:
        from ds_plugin.strategies import register_lightning_strategies
    except ImportError:  # pragma: no cover - the core works without Lightning
        return
    try:
        register_lightning_strategies()
    except ImportError:
        pass


_register_strategies()


def __getattr__(name: str):
    # The engine imports torch.distributed; keep `import ds_plugin` cheap for config-only users (the CLI).
    if name in ("initialize", "ZeroEngine"):
        from ds_plugin.zero import engine

        return getattr(engine, name)
    if name == "apply_zero":
        from ds_plugin.zero.apply import apply_zero

        return apply_zero
    raise AttributeError(f"module 'ds_plugin' has no attribute {name!r}")
