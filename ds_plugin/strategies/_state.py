"""What the Trainer and Fabric adapters both hold: the config, the engine once set up, and the setup options.

`ZeroStrategy` and `ZeroFabricStrategy` derive from two different Lightning base classes, so they share this as
a mixin rather than a base class.
"""

from __future__ import annotations

from typing import Any

from ds_plugin.config import TrainingConfig
from ds_plugin.zero.engine import ZeroEngine

__all__ = ["ZeroStrategyState"]


class ZeroStrategyState:
    """The engine-facing state of a ZeRO strategy; subclasses set `_not_set_up` to say how to set one up."""

    _not_set_up = "the model is not set up yet"
    _config: TrainingConfig

    def _init_zero_state(self, block_types: Any, sync_module_states: bool) -> None:
        self._block_types = block_types
        self._sync_module_states = sync_module_states
        self._mesh: Any = None
        self._engine: ZeroEngine | None = None
        self._accumulating = False

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
