"""`DummyOptim` / `DummyScheduler`: Accelerate's placeholders for "the DeepSpeed JSON's optimizer and scheduler".

    from ds_plugin.accelerate import DummyOptim, DummyScheduler   # or accelerate.utils' own: both work
    optimizer = DummyOptim(model.parameters(), lr=3e-4, weight_decay=0.01)
    scheduler = DummyScheduler(optimizer, total_num_steps=1000, warmup_num_steps=100)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

`prepare` then builds the config's `optimizer` block on the engine's fp32 masters and its `scheduler` block on that
optimizer, the placeholders' values filling the blocks' "auto" params the way Accelerate's DeepSpeed integration
fills them (`auto_values`). The engine steps the schedule after every applied optimizer step, so the returned
scheduler's `step()` does nothing (as Accelerate's `DeepSpeedSchedulerWrapper`).
"""

from __future__ import annotations

import math
from typing import Any

# From accelerate.utils.deepspeed, not accelerate.utils: the latter exports them only when DeepSpeed is installed,
# and ds_plugin runs without it. The module itself imports nothing of DeepSpeed, and the classes are the same ones.
from accelerate.utils.deepspeed import DummyOptim as AccelerateDummyOptim
from accelerate.utils.deepspeed import DummyScheduler as AccelerateDummyScheduler

__all__ = ["DummyOptim", "DummyScheduler", "EngineScheduler", "auto_values"]


class DummyOptim(AccelerateDummyOptim):
    """The config's optimizer: `prepare` builds its `optimizer` block on the engine's fp32 master parameters.

    Args:
        params: the model's parameters (the engine uses its own masters; kept for Accelerate's API).
        lr: fills `optimizer.params.lr` where the config says "auto".
        weight_decay: fills `optimizer.params.weight_decay` where the config says "auto".
        kwargs: kept, as Accelerate keeps them.
    """


class DummyScheduler(AccelerateDummyScheduler):
    """The config's LR schedule: `prepare` builds its `scheduler` block on the engine's optimizer.

    Args:
        optimizer: the `DummyOptim` (or the prepared optimizer).
        total_num_steps: fills `scheduler.params.total_num_steps` where "auto" (divided by the number of processes
            unless batches are split, as Accelerate does).
        warmup_num_steps: fills `scheduler.params.warmup_num_steps` where "auto" (at least 1).
        lr_scheduler_callable: `optimizer -> scheduler`, used instead of the config's block.
        kwargs: kept, as Accelerate keeps them.
    """


def auto_values(optimizer: Any, scheduler: Any, *, num_processes: int, split_batches: bool) -> dict[str, Any]:
    """The "auto" values Accelerate's DeepSpeed integration takes from its placeholders, by dotted key.

    Args:
        optimizer: a DummyOptim, or None.
        scheduler: a DummyScheduler, or None.
        num_processes: the run's processes.
        split_batches: Accelerate's `split_batches` (then total_num_steps is global already).
    """
    values: dict[str, Any] = {}
    if isinstance(optimizer, AccelerateDummyOptim):
        values |= {"optimizer.params.lr": optimizer.lr, "optimizer.params.weight_decay": optimizer.weight_decay}
    if isinstance(scheduler, AccelerateDummyScheduler) and scheduler.lr_scheduler_callable is None:
        source = scheduler.optimizer
        defaults = getattr(source, "defaults", None)
        max_lr = defaults["lr"] if defaults is not None else getattr(source, "lr", None)
        values |= {
            "scheduler.params.warmup_min_lr": 0,
            "scheduler.params.warmup_max_lr": max_lr,
            "scheduler.params.warmup_num_steps": max(1, scheduler.warmup_num_steps),
        }
        if scheduler.total_num_steps is not None:
            total = scheduler.total_num_steps
            values["scheduler.params.total_num_steps"] = total if split_batches else math.ceil(total / num_processes)
    return values


class EngineScheduler:
    """What `prepare(DummyScheduler)` returns: the engine's schedule, which the engine steps itself.

    Args:
        engine: the engine whose `lr_scheduler` this is.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.scheduler = engine.lr_scheduler
        self.optimizer = engine.optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: `engine.step()` stepped the schedule after the optimizer step (DeepSpeed's order).

        Args:
            args: ignored.
            kwargs: ignored.
        """

    def get_last_lr(self) -> list[float]:
        """The learning rate of each param group."""
        return self.engine.get_lr()

    def get_lr(self) -> list[float]:
        """The learning rate of each param group."""
        return self.engine.get_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)
