"""The strategy names `import ds_plugin` adds to Lightning: zero0..zero3, zero3_offload, zeropp. All of
ds_plugin's registration lives here.

Lightning has no entry-point discovery for strategies: `Trainer(strategy="zeropp")` looks the name up in
`lightning.pytorch.strategies.StrategyRegistry` (Fabric in its own `STRATEGY_REGISTRY`), so the names must be
registered before the Trainer is built. `import ds_plugin` calls `register_when_lightning_loads()`: at once if
Lightning is already imported, else right after the `lightning` package finishes importing, so `import ds_plugin`
itself never pays Lightning's ~3 s import (every `ds-plugin` command would).

What is registered is a small factory per framework that imports the adapter module on first use, not the
adapter class: registering therefore never imports `ds_plugin.strategies.lightning` / `fabric`, which import
Lightning, so there is no import loop whichever module loads first. Registering is idempotent; a name some other
package already registered is left alone (with a warning) rather than silently taken over.

One exception, so that a Lightning script written for DeepSpeed runs unchanged: where DeepSpeed is not installed,
Lightning's own DeepSpeed names (`Trainer(strategy="deepspeed_stage_3")`, "deepspeed_stage_2_offload", ... as the
installed Lightning registers them) would only raise Lightning's "you must have DeepSpeed installed"; they then build
ds_plugin's strategy with the same ZeRO stage and offload keywords instead (`deepspeed_names`). Where DeepSpeed is
installed they stay Lightning's.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import sys
from typing import Any

from ds_plugin._after_import import after_import
from ds_plugin._schema import ConfigError

__all__ = ["STRATEGY_NAMES", "deepspeed_names", "register_lightning_strategies", "register_when_lightning_loads"]

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


def trainer_strategy(**kwargs: Any) -> Any:
    """A `ZeroStrategy` (what `Trainer(strategy="zeropp")` builds); imports the adapter on first use.

    Args:
        kwargs: `ZeroStrategy`'s arguments (the registry passes `config=<name>`).
    """
    from ds_plugin.strategies.lightning import ZeroStrategy

    return ZeroStrategy(**kwargs)


def fabric_strategy(**kwargs: Any) -> Any:
    """A `ZeroFabricStrategy` (what `Fabric(strategy="zero3")` builds); imports the adapter on first use.

    Args:
        kwargs: `ZeroFabricStrategy`'s arguments (the registry passes `config=<name>`).
    """
    from ds_plugin.strategies.fabric import ZeroFabricStrategy

    return ZeroFabricStrategy(**kwargs)


#: Lightning's DeepSpeedStrategy reads its config from this variable when none is passed, ignoring its keywords then.
LIGHTNING_CONFIG_ENV = "PL_DEEPSPEED_CONFIG_PATH"


def _deepspeed_name(factory: Any, lightning_name: str, **params: Any) -> Any:
    # What one of Lightning's DeepSpeed names builds here: the ZeRO stage its keywords name (Lightning's default is 2)
    # as the preset, the keywords merged over it as `ZeroStrategy` reads Lightning's DeepSpeedStrategy keywords.
    if LIGHTNING_CONFIG_ENV in os.environ:  # as Lightning reads it: set at all, it names a DeepSpeed JSON file
        path = os.environ[LIGHTNING_CONFIG_ENV]
        if not os.path.isfile(path):
            raise ConfigError(
                f"{LIGHTNING_CONFIG_ENV}={path!r} is not a file; point it at a DeepSpeed JSON, or unset it to use "
                f"the settings strategy={lightning_name!r} stands for"
            )
        logger.info(
            "strategy=%r: the config is %s=%s; the name's own settings %s are not used, as in Lightning",
            lightning_name, LIGHTNING_CONFIG_ENV, path, params or "(stage 2)",
        )  # fmt: skip
        config, params = path, {}
    else:
        config = f"zero{params.get('stage', 2)}"
    logger.info("strategy=%r runs on ds_plugin's ZeRO (DeepSpeed is not installed): config %s", lightning_name, config)
    return factory(config=config, **params)


def trainer_deepspeed_name(lightning_name: str, **params: Any) -> Any:
    """What `Trainer(strategy="deepspeed_stage_3")` builds where DeepSpeed is not installed: a `ZeroStrategy`."""
    return _deepspeed_name(trainer_strategy, lightning_name, **params)


def fabric_deepspeed_name(lightning_name: str, **params: Any) -> Any:
    """What `Fabric(strategy="deepspeed_stage_3")` builds where DeepSpeed is not installed: a `ZeroFabricStrategy`."""
    return _deepspeed_name(fabric_strategy, lightning_name, **params)


def _deepspeed_installed() -> bool:
    # The installed distribution, so an aliased `import deepspeed` (a `ds-plugin launch` rank where DeepSpeed is not
    # installed, ds_plugin.deepspeed._alias) does not count. (Lightning's own check would count it: it imports the
    # module when the distribution is missing; the names are mapped here all the same.)
    try:
        importlib.metadata.distribution("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _is_lightnings_deepspeed(strategy: Any) -> bool:
    return getattr(strategy, "__name__", None) == "DeepSpeedStrategy" and str(
        getattr(strategy, "__module__", "")
    ).startswith("lightning.")


def deepspeed_names(registry: Any, factory: Any) -> list[str]:
    """Point Lightning's DeepSpeed names in `registry` at `factory` (`trainer_deepspeed_name` or
    `fabric_deepspeed_name`) where DeepSpeed is not installed; returns the names that now build ds_plugin's strategy.

    Each keeps Lightning's keywords for it (`stage=3, offload_optimizer=True, ...`); names some other package
    registered, and every name where DeepSpeed is installed, are left as they are.
    """
    if _deepspeed_installed():
        return []
    taken = []
    for name, entry in list(dict.items(registry)):
        strategy = entry["strategy"]
        if _is_lightnings_deepspeed(strategy):
            params = {k: v for k, v in entry["init_params"].items() if k != "lightning_name"}
            description = f"{entry['description']} (ds_plugin's ZeRO on FSDP2: DeepSpeed is not installed)"
            registry.register(name, factory, description=description, override=True, lightning_name=name, **params)
        elif _qualname(strategy) != _qualname(factory):
            continue
        taken.append(name)
    return taken


def _qualname(obj: Any) -> str:
    # Registry entries may be any callable (a functools.partial has neither name).
    return f"{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', repr(obj))}"


def _register_names(registry: Any, factory: Any) -> None:
    for name, description in STRATEGY_NAMES.items():
        entry = dict.get(registry, name)  # the registry's own `get` would instantiate the strategy
        if entry is not None:
            if _qualname(entry["strategy"]) != _qualname(factory):
                logger.warning(
                    "strategy name %r is already registered by %s; ds_plugin leaves it",
                    name,
                    _qualname(entry["strategy"]),
                )
            continue
        registry.register(name, factory, description=description, config=name)


def register_lightning_strategies() -> list[str]:
    """Make `Trainer(strategy="zeropp")` and the other names work (and `Fabric(strategy=...)` alike), and Lightning's
    DeepSpeed names too where DeepSpeed is not installed (`deepspeed_names`).

    Safe to call any number of times. Returns the names registered for the Trainer.

    Raises:
        ImportError: Lightning is not installed.
    """
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    _register_names(StrategyRegistry, trainer_strategy)
    _register_names(STRATEGY_REGISTRY, fabric_strategy)
    deepspeed_names(StrategyRegistry, trainer_deepspeed_name)
    deepspeed_names(STRATEGY_REGISTRY, fabric_deepspeed_name)
    return list(STRATEGY_NAMES)


def _register_loaded(_module: Any) -> None:
    # Any `from lightning.pytorch import Trainer` imports the `lightning` package first, and its `__init__` loads both
    # `lightning.pytorch` and `lightning.fabric`, so the names are in place before a Trainer or Fabric can look them up.
    # This runs inside the user's `import lightning`: a failure here must not fail that import.
    try:
        register_lightning_strategies()
    except Exception as exc:  # anything Lightning's registries raise
        logger.warning(
            "ds_plugin could not register its strategy names with Lightning (%s: %s); "
            "call ds_plugin.strategies.register_lightning_strategies() to see why",
            type(exc).__name__, exc,
        )  # fmt: skip


def register_when_lightning_loads() -> None:
    """Register the names now if Lightning is imported, else as soon as it is; nothing if it is not installed."""
    if "lightning" in sys.modules or importlib.util.find_spec("lightning") is not None:
        after_import("lightning", _register_loaded)
