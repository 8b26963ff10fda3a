"""ds_plugin: DeepSpeed's ZeRO, ZeRO++ and mixed precision on torch.distributed's FSDP2.

Public verbs: `load_config` (a preset name, a DeepSpeed JSON/YAML path, or a dict), `initialize` (model +
config -> ZeRO engine), `apply_zero`, and the config types. Importing the package also makes the Lightning
strategy names (zero0..zero3, zero3_offload, zeropp) available: at once when Lightning is already imported,
else the moment it is.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

from ds_plugin.config import ConfigError, TrainingConfig, from_deepspeed
from ds_plugin.presets import PRESETS, get_preset, load_config

__version__ = "0.1.0"

__all__ = ["PRESETS", "ConfigError", "TrainingConfig", "from_deepspeed", "get_preset", "load_config"]


def _register_strategies() -> None:
    # Lightning looks strategy names up in its registry with no entry-point discovery, so the names must be in
    # place before `Trainer(strategy="zeropp")`.
    try:
        from ds_plugin.strategies import register_lightning_strategies
    except ImportError:  # pragma: no cover - the core works without Lightning
        return
    try:
        register_lightning_strategies()
    except ImportError:
        pass


class _RegisterWhenLightningLoads(importlib.abc.MetaPathFinder):
    """Registers the strategy names right after the `lightning` package finishes importing.

    Importing Lightning costs about 3 s, which `import ds_plugin` (and every `ds-plugin` command) would pay for
    nothing when Lightning is not used. Any `from lightning.pytorch import Trainer` imports the `lightning`
    package first, and its `__init__` loads both `lightning.pytorch` and `lightning.fabric`, so the names are
    registered before a Trainer or Fabric can look them up.
    """

    def find_spec(self, name, path=None, target=None):
        if name != "lightning":
            return None
        sys.meta_path.remove(self)  # one shot, and the lookup below must not find this finder again
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run_module = spec.loader.exec_module

            def exec_module(module) -> None:
                run_module(module)
                _register_strategies()

            spec.loader.exec_module = exec_module
        return spec


if "lightning" in sys.modules:
    _register_strategies()
elif importlib.util.find_spec("lightning") is not None:
    sys.meta_path.insert(0, _RegisterWhenLightningLoads())


def __getattr__(name: str):
    # The engine imports torch.distributed; keep `import ds_plugin` cheap for config-only users (the CLI).
    if name in ("initialize", "ZeroEngine"):
        from ds_plugin.zero import engine

        return getattr(engine, name)
    if name == "apply_zero":
        from ds_plugin.zero.apply import apply_zero

        return apply_zero
    if name == "strategies":  # `ds_plugin.strategies.ZeroStrategy(...)` after a bare `import ds_plugin`
        return importlib.import_module("ds_plugin.strategies")
    raise AttributeError(f"module 'ds_plugin' has no attribute {name!r}")
