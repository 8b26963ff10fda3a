"""DeepSpeed's five learning-rate schedules (`scheduler.type` in a DeepSpeed JSON), step for step.

`WarmupLR`, `WarmupDecayLR`, `WarmupCosineLR`, `OneCycle` and `LRRangeTest` give the learning rate of every step that
DeepSpeed 0.19.8's classes of the same names give (`tests/zero/test_config_optimizer.py` compares them value for
value), written here so that nothing imports DeepSpeed. Like DeepSpeed's, they are plain objects, not torch
`LRScheduler`s: the engine steps them once after every applied optimizer step (`ZeroEngine.step`), and each counts
optimizer steps in `last_batch_iteration` (-1 before the first). Construction already writes the first learning rate
into the optimizer, as DeepSpeed's do.

Two of DeepSpeed's rules that surprise, kept because a config must train the same:
- the warmups have at least 2 steps (`warmup_num_steps` 1 acts as 2), and "log" warmup is the default;
- `OneCycle` with `cycle_momentum` (the default) sets an Adam-style optimizer's betas to `(momentum, 0.99)`: beta2 is
  0.99 from then on, whatever the optimizer said.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["SCHEDULERS", "LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]


def _per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list[Any]:
    """One value per param group: a scalar for all of them, or a list with one per group."""
    groups = len(optimizer.param_groups)
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != groups:
            raise ValueError(f"{name}: {len(value)} values for {groups} param groups; give one value or one per group")
        return list(value)
    return [value] * groups


def _set_lrs(optimizer: torch.optim.Optimizer, lrs: list[float]) -> list[float]:
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    return [group["lr"] for group in optimizer.param_groups]


def _warmup_fraction(step: int, steps: int, kind: str) -> float:
    """How far through the warmup `step` is, 0 -> 1: log(step + 1) / log(steps), or step / steps."""
    if kind == "linear":
        return step / steps
    return (1.0 / math.log(steps)) * math.log(step + 1)


def _check_warmup(steps: Any, kind: str) -> None:
    if not isinstance(steps, int) or isinstance(steps, bool) or steps <= 0:
        raise ValueError(f"warmup_num_steps: must be a positive integer, got {steps!r}")
    if kind not in ("log", "linear"):
        raise ValueError(f'warmup_type: {kind!r} is not "log" or "linear"')


class _Schedule:
    """What the five share: the step counter, `step`, `get_last_lr` and the state dict."""

    optimizer: torch.optim.Optimizer
    last_batch_iteration: int
    _last_lr: list[float]

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one optimizer step (or jump to `last_batch_iteration`) and write the new learning rates.

        Args:
            last_batch_iteration: the step to go to; default the next one.
        """
        self.last_batch_iteration = (
            self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        )
        self._last_lr = _set_lrs(self.optimizer, self.get_lr())

    def get_last_lr(self) -> list[float]:
        """The learning rates last written, one per param group."""
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self._last_lr = _set_lrs(self.optimizer, self.get_lr())


class WarmupLR(_Schedule):
    """From `warmup_min_lr` to `warmup_max_lr` over `warmup_num_steps` ("log" or "linear"), then constant.

    Args:
        optimizer: the optimizer whose param groups' "lr" it sets.
        warmup_min_lr: the first learning rate (one, or one per group).
        warmup_max_lr: the learning rate after warmup; default each group's current "lr".
        warmup_num_steps: steps of warmup (at least 2 count).
        warmup_type: "log" (DeepSpeed's default) or "linear".
        last_batch_iteration: the last step taken (-1: start).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        _check_warmup(warmup_num_steps, warmup_type)
        self.optimizer = optimizer
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [high - low for high, low in zip(self.max_lrs, self.min_lrs, strict=True)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _set_lrs(optimizer, self.get_lr()) if last_batch_iteration == -1 else self.get_lr()

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def get_lr(self) -> list[float]:
        """This step's learning rates (the minimum before the first step)."""
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [low + delta * gamma for low, delta in zip(self.min_lrs, self.delta_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """`WarmupLR`, then a linear decay to 0 at `total_num_steps`.

    Args:
        optimizer: the optimizer whose param groups' "lr" it sets.
        total_num_steps: the step at which the learning rate reaches 0.
        warmup_min_lr: the first learning rate.
        warmup_max_lr: the learning rate at the end of warmup (DeepSpeed's default 0.001).
        warmup_num_steps: steps of warmup (at least 2 count).
        warmup_type: "log" or "linear".
        last_batch_iteration: the last step taken (-1: start).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._gamma()
        remaining = float(self.total_num_steps - self.last_batch_iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_Schedule):
    """A ratio of each group's own learning rate: warmup from `warmup_min_ratio` to 1, then a cosine down to
    `cos_min_ratio` at `total_num_steps`.

    Args:
        optimizer: the optimizer; its param groups' "lr" at construction are the rates the ratio multiplies.
        total_num_steps: the step at which the cosine ends.
        warmup_min_ratio: the first ratio.
        warmup_num_steps: steps of warmup (at least 2 count).
        cos_min_ratio: the last ratio.
        warmup_type: "log" or "linear".
        last_batch_iteration: the last step taken (-1: start).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        _check_warmup(warmup_num_steps, warmup_type)
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        self.base_lrs = [
            group["lr"].clone() if isinstance(group["lr"], torch.Tensor) else group["lr"]
            for group in optimizer.param_groups
        ]
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _set_lrs(optimizer, self.get_lr()) if last_batch_iteration == -1 else self.get_lr()

    def lr_ratio(self) -> float:
        """This step's fraction of the base learning rates."""
        step = self.last_batch_iteration
        if step < 0:
            return 0.0
        if step < self.warmup_num_steps:
            fraction = _warmup_fraction(step, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + fraction * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (step - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        half_cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * half_cosine)

    def get_lr(self) -> list[float]:
        """This step's learning rates (0 before the first step)."""
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.base_lrs]
        ratio = self.lr_ratio()
        return [base * ratio for base in self.base_lrs]


class OneCycle(_Schedule):
    """One cycle up from `cycle_min_lr` to `cycle_max_lr` and back, then an optional decay; momentum (Adam's beta1,
    or SGD-style optimizers without betas: not cycled) moves the other way between `cycle_max_mom` and `cycle_min_mom`.

    Args:
        optimizer: the optimizer whose param groups' "lr" (and "betas") it sets.
        cycle_min_lr: the learning rate at the cycle's ends.
        cycle_max_lr: the learning rate at its peak.
        decay_lr_rate: after the cycle, lr = cycle_min_lr / (1 + decay_lr_rate * steps / decay_step_size).
        cycle_first_step_size: steps going up.
        cycle_second_step_size: steps coming down (default: as many as going up).
        cycle_first_stair_count: stairs going up (0: continuous).
        cycle_second_stair_count: stairs coming down (default: as many as going up).
        decay_step_size: steps per decay interval after the cycle (0: no decay).
        cycle_momentum: cycle beta1 (Adam-style optimizers only).
        cycle_min_mom: beta1 at the peak learning rate.
        cycle_max_mom: beta1 at the cycle's ends.
        decay_mom_rate: after the cycle, beta1 = cycle_max_mom * (1 + decay_mom_rate * steps / decay_step_size).
        last_batch_iteration: the last step taken (-1: start).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cycle_min_lr: float | list[float],
        cycle_max_lr: float | list[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | list[float] = 0.8,
        cycle_max_mom: float | list[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        self.optimizer = optimizer
        up = float(cycle_first_step_size)
        down = float(cycle_second_step_size) if cycle_second_step_size is not None else up
        if up <= 0:
            raise ValueError(f"cycle_first_step_size: must be positive, got {cycle_first_step_size!r}")
        if down < 0:
            raise ValueError(f"cycle_second_step_size: must not be negative, got {cycle_second_step_size!r}")
        self.first_step_size, self.second_step_size = up, down
        self.total_size = up + down
        self.step_ratio = up / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        no_decay = math.isclose(decay_step_size, 0)
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = no_decay or math.isclose(decay_lr_rate, 0)
        if last_batch_iteration == -1:
            _set_lrs(optimizer, self.min_lrs)
        # Momentum is beta1 of an optimizer with betas; others have nothing DeepSpeed would cycle.
        self.cycle_momentum = bool(cycle_momentum) and "betas" in optimizer.defaults
        self.skip_mom_decay = no_decay
        if self.cycle_momentum:
            self.decay_mom_rate = decay_mom_rate
            self.min_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_min_mom, "cycle_min_mom")]
            self.max_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_max_mom, "cycle_max_mom")]
            if last_batch_iteration == -1:
                for group, betas in zip(optimizer.param_groups, self.min_moms, strict=True):
                    group["betas"] = betas
            self.skip_mom_decay = no_decay or math.isclose(decay_mom_rate, 0)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = [group["lr"] for group in optimizer.param_groups]

    def _scale(self) -> float:
        """Where in the cycle the next step is, 0 (ends) -> 1 (peak), on stairs when they are set."""
        iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + iteration / self.total_size)
        x = 1.0 + iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            in_cycle = iteration % self.total_size
            if in_cycle <= self.first_step_size:
                position = in_cycle * stairs / self.first_step_size
            else:
                position = (self.total_size - in_cycle) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def get_lr(self) -> list[float]:
        """This step's learning rates."""
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs, strict=True)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        decayed = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return [low / (1 + self.decay_lr_rate * decayed) for low in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """This step's betas, or None when momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [
                (high[0] - (high[0] - low[0]) * scale, low[1])
                for low, high in zip(self.min_moms, self.max_moms, strict=True)
            ]
        if self.skip_mom_decay:
            return list(self.max_moms)
        decayed = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return [(b1 * (1 + self.decay_mom_rate * decayed), b2) for b1, b2 in self.max_moms]

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one optimizer step: new learning rates and, when cycled, betas.

        Args:
            last_batch_iteration: the step to go to; default the next one.
        """
        super().step(last_batch_iteration)
        moms = self.get_mom()
        if moms is not None:
            for group, betas in zip(self.optimizer.param_groups, moms, strict=True):
                group["betas"] = betas


class LRRangeTest(_Schedule):
    """The learning-rate range test: `lr_range_test_min_lr * (1 + step_rate * interval)`, where interval grows by 1
    every `lr_range_test_step_size` steps (continuously, or in stairs).

    Args:
        optimizer: the optimizer whose param groups' "lr" it sets.
        lr_range_test_min_lr: the first learning rate (one, or one per group).
        lr_range_test_step_size: steps per interval.
        lr_range_test_step_rate: growth per interval.
        lr_range_test_staircase: grow in whole intervals instead of continuously.
        last_batch_iteration: the last step taken (-1: start).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_range_test_min_lr: float | list[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        if not isinstance(lr_range_test_step_size, int) or lr_range_test_step_size <= 0:
            raise ValueError(f"lr_range_test_step_size: must be a positive integer, got {lr_range_test_step_size!r}")
        self.optimizer = optimizer
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _set_lrs(optimizer, list(self.min_lrs)) if last_batch_iteration == -1 else self.get_lr()

    def get_lr(self) -> list[float]:
        """This step's learning rates."""
        interval = float(self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [low * (1 + self.step_rate * interval) for low in self.min_lrs]


SCHEDULERS: dict[str, type[_Schedule]] = {
    cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)
}
"""`scheduler.type` -> its class."""
