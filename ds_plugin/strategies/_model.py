"""The strategies' model preparation around `apply_zero`: FP8 layers, rank 0's weights,
meta-device materialisation, and LR schedulers that follow a rebuilt optimizer.

Shared by the Lightning Trainer and Fabric adapters; each function maps a framework situation onto the engine.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from ds_plugin.config import TrainingConfig

__all__ = ["has_meta", "hf_models", "materialize", "prepare_model", "repoint_scheduler"]


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer is still on the meta device.

    Args:
        module: any module.
    """
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def hf_models(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, model) of the outermost transformers models inside `module`; empty if transformers is not imported.

    Args:
        module: e.g. a LightningModule holding a `PreTrainedModel` (or a peft model around one).
    """
    if "transformers" not in sys.modules:
        return []
    from transformers import PreTrainedModel

    found: list[tuple[str, nn.Module]] = []
    for name, m in module.named_modules():
        if isinstance(m, PreTrainedModel) and not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, m))
    return found


def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate and initialise a meta-device model (only the local shards once it is sharded).

    Args:
        module: the model built under `ds_plugin.zero.init.meta_init` (or on the meta device).
        device: this rank's device.
    """
    from ds_plugin.zero.init import materialize_

    materialize_(module, device=device)


def prepare_model(module: nn.Module, config: TrainingConfig, *, device: torch.device) -> bool:
    """Before `apply_zero`: FP8 layers (`apply_zero` then copies rank 0's weights). Returns whether the model is still
    on the meta device (built under `ds_plugin.zero.init.meta_init`): then `materialize` it after sharding,
    so each rank allocates and initialises only its shards.

    Args:
        module: the model (a LightningModule or the module Fabric sets up).
        config: the resolved config.
        device: this rank's device.

    Raises:
        ValueError: FP8 was asked for but no layer is eligible, or the model was sharded before FP8 was applied.
    """
    from ds_plugin.zero.apply import is_zero_applied

    already_sharded = is_zero_applied(module)
    if already_sharded:  # configure_model applied ZeRO itself: nothing to prepare, but FP8 cannot come after it
        if config.fp8.enabled and not any(type(m).__name__ == "Fp8Linear" for m in module.modules()):
            raise ValueError(
                "Fp8Precision: the model was sharded in configure_model before FP8 layers were swapped in; call "
                "ds_plugin.precision.fp8_linear.convert_to_fp8_training(model, config.fp8) before apply_zero"
            )
        return False
    if config.fp8.enabled and not already_sharded:
        from ds_plugin.precision.fp8_linear import convert_to_fp8_training

        try:
            convert_to_fp8_training(module, config.fp8)  # keeps the parameter objects, so optimizers stay valid
        except ValueError as e:
            raise ValueError(f"Fp8Precision: {e}") from None
    meta = has_meta(module)
    if meta and config.stage < 2:
        materialize(module, device)  # stages 0/1 keep whole weights on every rank anyway
        meta = False
    return meta


def repoint_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Point an LR scheduler built on the user's optimizer at the one the engine rebuilt (stages 0/1).

    Args:
        scheduler: a torch LR scheduler (or any object with an `optimizer` attribute).
        optimizer: the engine's optimizer.
    """
    old = getattr(scheduler, "optimizer", None)
    if old is None or old is optimizer:
        return
    scheduler.optimizer = optimizer
    # torch's LRScheduler wraps `optimizer.step` at construction to warn when it is stepped out of order;
    # the rebuilt optimizer needs the same marker or the first scheduler step warns spuriously.
    if getattr(old.step, "_wrapped_by_lr_sched", False) and not hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        step = optimizer.step

        def tracked_step(*args: Any, **kwargs: Any) -> Any:
            optimizer._opt_called = True
            return step(*args, **kwargs)

        tracked_step._wrapped_by_lr_sched = True
        optimizer.step = tracked_step
