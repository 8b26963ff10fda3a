"""What the Trainer and Fabric adapters share: the config, the engine once set up, and the one setup call.

`ZeroStrategy` and `ZeroFabricStrategy` derive from two different Lightning base classes, so they share this as
a mixin rather than a base class. Each adapter turns its framework's arguments into `FrameworkSettings`; the
plan and the setup itself are the core's (`ds_plugin.zero.plan`, `ds_plugin.zero.setup`), the same path
`ds_plugin.initialize` takes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import nn

from ds_plugin.config import TrainingConfig
from ds_plugin.presets import ConfigSource, load_config
from ds_plugin.runtime.faults import default_timeout, peer_failure_guard
from ds_plugin.strategies._deepspeed_kwargs import translate
from ds_plugin.strategies.lightning_precision import ZeroPrecision, to_zero_precision
from ds_plugin.zero.apply import is_zero_applied
from ds_plugin.zero.engine import ZeroEngine
from ds_plugin.zero.optimizer import OptimizerSpec
from ds_plugin.zero.plan import FrameworkSettings, ZeroPlan, resolve_plan
from ds_plugin.zero.setup import setup_zero

__all__ = ["ZeroStrategyState", "zero_precision_property"]

logger = logging.getLogger(__name__)


def zero_precision_property(attr: str) -> property:
    """The adapter's precision plugin property (Lightning's `precision_plugin`, Fabric's `precision`): always a
    `ZeroPrecision`, the standard plugins the framework builds from `precision=...` converted, others refused.

    Args:
        attr: the attribute the framework's base class stores the plugin in.
    """

    def get(self: Any) -> ZeroPrecision:
        if getattr(self, attr) is None:
            setattr(self, attr, ZeroPrecision())
        return getattr(self, attr)

    def set_(self: Any, plugin: Any) -> None:
        setattr(self, attr, None if plugin is None else to_zero_precision(plugin, type(self).__name__))

    return property(get, set_)


class ZeroStrategyState:
    """The engine-facing state of a ZeRO strategy; subclasses set `_not_set_up` to say how to set one up."""

    _not_set_up = "the model is not set up yet"
    _resume_hint = "load the newest complete checkpoint to resume"
    _config: TrainingConfig

    # The Lightning strategy arguments each adapter passes to its base class (the framework sets them); every other
    # keyword is a top-level DeepSpeed key merged over the config.
    _FRAMEWORK_ARGS: tuple[str, ...] = ()

    def _init_zero_state(
        self, config: ConfigSource, kwargs: Mapping[str, Any], block_types: Any, sync_module_states: bool
    ) -> dict[str, Any]:
        """Read the config once; returns the keywords that belong to the Lightning base class.

        Args:
            config: a preset name, a DeepSpeed .json/.yaml path, a dict, or a `TrainingConfig`.
            kwargs: the constructor's other keywords: Lightning's strategy arguments and DeepSpeed overrides.
            block_types: blocks to shard separately.
            sync_module_states: start every rank from rank 0's weights.
        """
        framework = {k: v for k, v in kwargs.items() if k in self._FRAMEWORK_ARGS}
        # Lightning's default is torch's 30 minutes; a dead or frozen rank should end the job sooner.
        framework.setdefault("timeout", default_timeout())
        # Lightning's own DeepSpeedStrategy keywords (stage=3, offload_optimizer=True, ...) as DeepSpeed overrides.
        overrides = translate({k: v for k, v in kwargs.items() if k not in self._FRAMEWORK_ARGS}, type(self).__name__)
        options = ("config", "block_types", "sync_module_states", "exclude_frozen_parameters", *self._FRAMEWORK_ARGS)
        self._config = load_config(config, overrides, owner=type(self).__name__, options=options)
        self._block_types = block_types
        self._sync_module_states = sync_module_states
        self._mesh: Any = None
        self._engine: ZeroEngine | None = None
        self._accumulating = False
        return framework

    @property
    def config(self) -> TrainingConfig:
        """The config: as given until setup, resolved (against the Trainer or Fabric) after."""
        return self._engine.config if self._engine is not None else self._config

    @property
    def engine(self) -> ZeroEngine:
        """The `ZeroEngine` driving the model, once it is set up."""
        if self._engine is None:
            raise RuntimeError(f"{type(self).__name__}.engine: {self._not_set_up}")
        return self._engine

    def _peer_guard(self, what: str) -> Any:
        """A collective that fails because another rank died becomes one-line `RankFailureError` with the step."""
        step = self._engine.global_steps + 1 if self._engine is not None else None
        return peer_failure_guard(what, step, self._resume_hint)

    def _zero_precision(self) -> ZeroPrecision:
        """The strategy's `ZeroPrecision` (Lightning calls it `precision_plugin`, Fabric `precision`)."""
        raise NotImplementedError

    def resolve_plan(self, **framework: Any) -> ZeroPlan:
        """The plan this strategy's config resolves to against the framework (no model is touched).

        Args:
            framework: `FrameworkSettings` fields the framework knows (micro_batch_size, accumulation, clip, ...).
        """
        if self._mesh is None:
            raise RuntimeError(f"{type(self).__name__}.resolve_plan: no processes yet; {self._not_set_up}")
        precision = self._zero_precision()
        settings = FrameworkSettings(
            owner=type(self).__name__,
            precision=precision.compute_dtype,
            precision_label=precision.precision,
            config_overrides=precision.config_overrides(),
            **framework,
        )
        return resolve_plan(
            self._config,
            world_size=self.world_size,
            ranks_per_node=self.num_processes,
            device_type=self._mesh.device_type,
            framework=settings,
        )

    def _setup_engine(self, module: nn.Module, optimizer: OptimizerSpec | None, **framework: Any) -> ZeroEngine:
        # A model sharded in `configure_model` (or by an earlier fit) keeps its blocks; nothing is re-wrapped.
        block_types = None if is_zero_applied(module) else self._block_types
        self._engine = setup_zero(
            module,
            self.resolve_plan(**framework),
            optimizer,
            mesh=self._mesh,
            block_types=block_types,
            sync_module_states=self._sync_module_states,
            device=self.root_device,
        )
        self._engine.resume_hint = self._resume_hint
        blocks = [name for name in ("optimizer", "scheduler") if getattr(self._engine.plan, name) is not None]
        if blocks and (not dist.is_initialized() or dist.get_rank() == 0):
            # Lightning's configure_optimizers (Fabric: the script) builds both; DeepSpeed's Lightning strategy also
            # takes them from there when the module returns any.
            logger.info(
                "config blocks without effect under %s: %s (configure_optimizers builds the optimizer and scheduler)",
                type(self).__name__,
                ", ".join(blocks),
            )
        return self._engine
