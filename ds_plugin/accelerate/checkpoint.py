"""The engine's part of `accelerator.save_state` / `load_state` / `get_state_dict`: a sharded DCP directory inside
Accelerate's folder, and whole weights gathered on the main process.

Accelerate's own `save_state` writes whole model and optimizer state dicts from one process, which a ZeRO model
does not have (its weights and optimizer state are shards). So the engine's model, optimizer and step counters go
to `<output_dir>/ds_plugin_engine/`, written by every rank through `ds_plugin.checkpoint` (atomic, resharding,
loads at any stage or world size); everything else (LR schedulers, dataloader positions, RNG states, `step`,
registered objects) stays Accelerate's, in Accelerate's files beside it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ds_plugin.accelerate.optimizer import ZeroAcceleratedOptimizer
from ds_plugin.checkpoint import MARKER, CheckpointError, load_engine_checkpoint, save_engine_checkpoint
from ds_plugin.peft_adapters import full_state_dict, saved_weights_dtype
from ds_plugin.zero.engine import ZeroEngine

__all__ = ["ENGINE_DIR", "EngineCheckpointing", "has_engine_state", "load_engine_state", "save_engine_state"]

logger = logging.getLogger(__name__)

ENGINE_DIR = "ds_plugin_engine"
"""The engine's sub-directory of an `accelerator.save_state` folder (and of an HF Trainer checkpoint)."""


def save_engine_state(
    output_dir: str | os.PathLike, engine: ZeroEngine, *, optimizer: bool = True, exclude_frozen: bool = False
) -> Path:
    """Write the engine's weights, optimizer state and counters under `output_dir`; every rank must call it.

    Args:
        output_dir: the `save_state` folder (the same path on every rank).
        engine: the engine training the prepared model.
        optimizer: include the optimizer state (when the engine has an optimizer).
        exclude_frozen: leave out the weights that do not require grad (a peft model's base), as the HF Trainer
            does with DeepSpeed for peft models; loading keeps the model's own.
    """
    path = Path(output_dir) / ENGINE_DIR
    save_engine_checkpoint(path, engine, optimizer=optimizer, exclude_frozen=exclude_frozen)
    return path


def has_engine_state(input_dir: str | os.PathLike) -> bool:
    """Whether `input_dir` holds an engine checkpoint written by `save_engine_state`.

    Args:
        input_dir: a `save_state` folder or an HF Trainer checkpoint folder.
    """
    return (Path(input_dir) / ENGINE_DIR / MARKER).is_file()


def load_engine_state(input_dir: str | os.PathLike, engine: ZeroEngine, *, optimizer: bool = True) -> None:
    """Load what `save_engine_state` wrote (at any stage or world size) into the engine; every rank must call it.

    Args:
        input_dir: the `save_state` folder.
        engine: the engine of the prepared model.
        optimizer: also load the optimizer state and loss scaler (the step counters come back either way, see
            `ds_plugin.checkpoint.engine_state`).

    Raises:
        CheckpointError: the folder holds no engine checkpoint, or another model's (one line).
    """
    if not has_engine_state(input_dir):
        raise CheckpointError(
            f"{input_dir} has no {ENGINE_DIR}/ checkpoint: it was not saved by a ds_plugin Accelerator; load a "
            "folder written by accelerator.save_state under ds_plugin"
        )
    load_engine_checkpoint(Path(input_dir) / ENGINE_DIR, engine, optimizer=optimizer)
    logger.info("loaded the engine state from %s", Path(input_dir) / ENGINE_DIR)


class EngineCheckpointing:
    """`save_state`, `load_state` and `get_state_dict` of `ds_plugin.accelerate.Accelerator` (a mixin before
    `accelerate.Accelerator`): the engine's model and optimizer go through the functions above, the rest is
    Accelerate's own code, which runs with the engine's objects hidden from it."""

    _engine: ZeroEngine | None
    _models: list[Any]
    _optimizers: list[Any]

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full weights as CPU tensors on the main process (empty elsewhere); every process must call it.

        Trainable weights are the fp32 masters, or, when the config sets
        `stage3_gather_16bit_weights_on_model_save` (Accelerate's `zero3_save_16bit_model`), the weights in the
        compute dtype, each cast as it is gathered (DeepSpeed's 16-bit weights). A frozen weight stored quantized
        (`frozen_format`) appears as its components (`<name>.codes`, ...).

        Args:
            model: the prepared model.
            unwrap: ignored for the engine's model (it is not wrapped).
        """
        if self._engine is None or self.unwrap_model(model) is not self._engine.module:
            return super().get_state_dict(model, unwrap=unwrap)
        return full_state_dict(self._engine, dtype=saved_weights_dtype(self._engine))

    def _without_engine_objects(self) -> contextlib.AbstractContextManager[None]:
        # Accelerate's save/load would write or read whole state dicts of these from one process.
        engine = self._engine
        models, optimizers = self._models, self._optimizers

        @contextlib.contextmanager
        def hidden() -> Iterator[None]:
            self._models = [m for m in models if m is not engine.module]
            self._optimizers = [o for o in optimizers if not isinstance(o, ZeroAcceleratedOptimizer)]
            try:
                yield
            finally:
                self._models, self._optimizers = models, optimizers

        return hidden()

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        """Accelerate's `save_state`, with the engine's model, optimizer and counters in a sharded
        `ds_plugin_engine/` sub-directory; every process must call it.

        Args:
            output_dir: the folder (or None with automatic checkpoint naming).
            safe_serialization: for Accelerate's own files.
            kwargs: Accelerate's `save_model_func_kwargs`; `exclude_frozen_parameters=True` (which Accelerate hands on
                to DeepSpeed's `save_checkpoint`) leaves the weights that do not require grad out of the engine's
                checkpoint (a LoRA run's base; `load_state` keeps the model's own).
        """
        engine = self._engine
        if engine is None:
            return super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        exclude = bool(kwargs.pop("exclude_frozen_parameters", False))
        handle = self.register_save_state_pre_hook(
            lambda _models, _weights, out: save_engine_state(out, engine, exclude_frozen=exclude)
        )
        try:
            with self._without_engine_objects():
                return super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        finally:
            handle.remove()

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any) -> None:
        """Accelerate's `load_state`, loading the engine's part from `ds_plugin_engine/` (saved at any stage or
        world size); every process must call it.

        Args:
            input_dir: the folder `save_state` wrote (or None with automatic checkpoint naming).
            load_kwargs: Accelerate's.
            kwargs: Accelerate's `load_model_func_kwargs`.
        """
        engine = self._engine
        if engine is None:
            return super().load_state(input_dir, load_kwargs=load_kwargs, **kwargs)
        handle = self.register_load_state_pre_hook(lambda _models, folder: load_engine_state(folder, engine))
        try:
            with self._without_engine_objects():
                return super().load_state(input_dir, load_kwargs=load_kwargs, **kwargs)
        finally:
            handle.remove()
