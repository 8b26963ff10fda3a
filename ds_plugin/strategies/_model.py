"""What the adapters need to know about a framework's schedulers: LR schedulers that must follow the optimizer the
engine rebuilt. (The transformers models inside a LightningModule, for exports: `ds_plugin.checkpoint.metadata`.)

Shared by the Lightning Trainer and Fabric adapters; each function maps a framework situation onto the engine.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["repoint_scheduler"]


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
