"""The DeepSpeed JSON's `optimizer` and `scheduler` blocks: their schema, their "auto" fill, and what they build.

    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}}

As in `deepspeed.initialize` with no optimizer passed: the optimizer is built on the engine's trainable fp32 master
parameters, and the scheduler right after it, stepped once after every applied optimizer step. DeepSpeed's rules:
- `Adam` and `AdamW` (any case) are torch's `AdamW` (decoupled weight decay) unless `"adam_w_mode": false` turns
  `Adam` into torch's `Adam` (L2 penalty added to the gradient); DeepSpeed's FusedAdam defaults apply (lr 1e-3,
  weight_decay 0, not torch AdamW's 0.01). `torch_adam` and `fp32_optimizer_states` choose among DeepSpeed's Adam
  kernels, which compute the same update: here it is always torch's kernel.
- `Adagrad`, and any other name of a `torch.optim` class (`SGD`, `RMSprop`, ...), is that class with the params as
  its keyword arguments.
- Types that need DeepSpeed's own ops (`OneBitAdam`, `ZeroOneAdam`, `OneBitLamb`, `Lamb`, `Lion`, `Muon`, mup's) are
  refused in one line naming the closest type that is available.
- `scheduler.type` is one of DeepSpeed's five (`ds_plugin.lr_schedules`) or a `torch.optim.lr_scheduler` class.

Both blocks are checked when the config is read: type, parameter names (with the closest valid one) and, when no
value is "auto", the values themselves (the optimizer or scheduler is built once on a stand-in parameter). "auto"
values are filled from the framework (`fill_auto`): what Accelerate's `DummyOptim` / `DummyScheduler` and the HF
Trainer's arguments say.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from ds_plugin._schema import AUTO, ConfigError, option

__all__ = ["OptimizerConfig", "SchedulerConfig", "build_optimizer", "build_scheduler", "fill_auto", "refuse_auto"]

# DeepSpeed's optimizer types that need its compiled ops or other packages: lower-cased name -> (its spelling, the
# closest type built here, why it is not built).
_NOT_BUILT = {
    "lamb": ("Lamb", "AdamW", "DeepSpeed's FusedLamb CUDA op"),
    "onebitadam": ("OneBitAdam", "Adam", "DeepSpeed's compressed-communication CUDA ops"),
    "zerooneadam": ("ZeroOneAdam", "Adam", "DeepSpeed's compressed-communication CUDA ops"),
    "onebitlamb": ("OneBitLamb", "AdamW", "DeepSpeed's compressed-communication CUDA ops"),
    "lion": ("Lion", "AdamW", "DeepSpeed's FusedLion op (torch has no Lion)"),
    "muon": (
        "Muon",
        "AdamW",
        "DeepSpeed's MuonWithAuxAdam, which orthogonalises whole matrices that ZeRO shards here (pass "
        "torch.optim.Muon in code for stages 0/1)",
    ),
    "muadam": ("MuAdam", "Adam", "the mup package"),
    "muadamw": ("MuAdamW", "AdamW", "the mup package"),
    "musgd": ("MuSGD", "SGD", "the mup package"),
}
_ADAM = ("adam", "adamw")
# DeepSpeed's Adam params beyond torch's: which of its kernels runs (all compute the same update).
_ADAM_EXTRA = ("adam_w_mode", "torch_adam", "bias_correction", "fp32_optimizer_states")
# Those of them that change nothing here, with the reason `check-config` reports.
_ADAM_KERNEL_CHOICE = {
    "torch_adam": "DeepSpeed's choice of Adam kernel (the same update); torch's fused or foreach kernel runs here",
    "fp32_optimizer_states": "optimizer states are fp32 here, as the fp32 master weights they follow",
}
_ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}  # DeepSpeed's FusedAdam


def _torch_optimizer(name: str) -> type | None:
    import torch

    cls = getattr(torch.optim, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and name != "Optimizer" else None


def _optimizer_class(type_name: str, params: Mapping[str, Any]) -> type:
    """The torch class a type name builds (after DeepSpeed's Adam rule), or a one-line `ConfigError`."""
    import torch

    low = type_name.lower()
    if low in _ADAM:
        adam_w = low == "adamw" or params.get("adam_w_mode", True) is not False
        return torch.optim.AdamW if adam_w else torch.optim.Adam
    if low == "adagrad":
        return torch.optim.Adagrad
    if low in _NOT_BUILT:
        spelling, closest, why = _NOT_BUILT[low]
        raise ConfigError(
            f'type: "{spelling}" needs {why}, not built here; use "{closest}" (the closest available type)'
        )
    cls = _torch_optimizer(type_name)
    if cls is None:
        import torch

        known = {n.lower(): n for n in dir(torch.optim) if _torch_optimizer(n)}
        close = difflib.get_close_matches(type_name.lower(), list(known), n=1, cutoff=0.5)
        hint = (
            f"did you mean {known[close[0]]!r}?"
            if close
            else 'use "AdamW", "Adam", "Adagrad", "SGD" or a torch.optim class'
        )
        raise ConfigError(f"type: {type_name!r} is not an optimizer type; {hint}")
    return cls


def _accepted(cls: type, extra: tuple[str, ...] = ()) -> list[str]:
    names = [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "params", "optimizer")]
    return [n for n in (*names, *extra) if n not in ("args", "kwargs")]


def _check_names(params: Mapping[str, Any], valid: list[str]) -> None:
    for key in params:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else f"valid: {', '.join(valid)}"
            raise ConfigError(f"params.{key}: unknown parameter; {hint}")


def _has_auto(params: Mapping[str, Any]) -> bool:
    return any(v == AUTO for v in params.values())


def _stand_in() -> Any:
    import torch

    return torch.nn.Parameter(torch.zeros(2))


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """`optimizer`: the optimizer `initialize` builds when none is passed in code."""

    type: str | None = option(None, doc="Adam, AdamW, Adagrad, SGD or another torch.optim class name")
    params: dict[str, Any] = option(
        doc="the optimizer's keyword arguments (lr, betas, eps, weight_decay, ...)", factory=dict
    )

    def __post_init__(self) -> None:
        if self.type is None:
            raise ConfigError('type: missing; name the optimizer, e.g. "type": "AdamW"')
        if "max_grad_norm" in self.params:
            raise ConfigError('params.max_grad_norm: not an optimizer parameter; set the top-level "gradient_clipping"')
        cls = _optimizer_class(self.type, self.params)
        adam = self.type.lower() in _ADAM
        _check_names(self.params, _accepted(cls, _ADAM_EXTRA if adam else ()))
        if adam and self.params.get("bias_correction", True) is not True:
            raise ConfigError("params.bias_correction: torch's Adam always corrects the bias; remove the key")
        if not _has_auto(self.params):
            try:
                build_optimizer(self, [_stand_in()])
            except ConfigError:
                raise
            except Exception as exc:  # torch's own check of a value (a negative lr, betas of the wrong length)
                raise ConfigError(f"params: {str(exc).splitlines()[0][:160]}") from None

    def ignored_params(self) -> dict[str, str]:
        """The params accepted without effect (DeepSpeed's Adam kernel switches), each with the reason."""
        if self.type is None or self.type.lower() not in _ADAM:
            return {}
        return {k: _ADAM_KERNEL_CHOICE[k] for k in self.params if k in _ADAM_KERNEL_CHOICE}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """`scheduler`: the learning-rate schedule stepped after every optimizer step."""

    type: str | None = option(None, doc="WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest")
    params: dict[str, Any] = option(doc="the schedule's keyword arguments", factory=dict)

    def __post_init__(self) -> None:
        if self.type is None:
            raise ConfigError('type: missing; name the schedule, e.g. "type": "WarmupLR"')
        cls = _scheduler_class(self.type)
        _check_names(self.params, _accepted(cls))
        for name, p in inspect.signature(cls.__init__).parameters.items():
            if name not in ("self", "optimizer") and p.default is inspect.Parameter.empty and name not in self.params:
                raise ConfigError(f"params.{name}: {self.type} needs it; add it to the scheduler's params")
        if not _has_auto(self.params):
            import torch

            try:
                build_scheduler(self, torch.optim.SGD([_stand_in()], lr=1e-3, momentum=0.9))
            except Exception as exc:
                raise ConfigError(f"params: {str(exc).splitlines()[0][:160]}") from None


def _scheduler_class(type_name: str) -> type:
    import torch

    from ds_plugin.lr_schedules import SCHEDULERS

    if type_name in SCHEDULERS:
        return SCHEDULERS[type_name]
    cls = getattr(torch.optim.lr_scheduler, type_name, None)
    if isinstance(cls, type) and issubclass(cls, torch.optim.lr_scheduler.LRScheduler) and type_name != "LRScheduler":
        return cls
    close = difflib.get_close_matches(type_name, list(SCHEDULERS), n=1, cutoff=0.5)
    hint = (
        f"did you mean {close[0]!r}?" if close else f"use one of {', '.join(SCHEDULERS)} or a torch.optim.lr_scheduler"
    )
    raise ConfigError(f"type: {type_name!r} is not a scheduler type; {hint}")


def build_optimizer(config: OptimizerConfig, params: list[Any]) -> Any:
    """The optimizer the block describes, on `params` (the engine's trainable fp32 master parameters).

    Args:
        config: the `optimizer` block, with no "auto" left (`fill_auto`).
        params: the parameters (or param groups) to optimize.

    Raises:
        ConfigError: an "auto" value was not filled.
    """
    refuse_auto(config.params, "optimizer")
    cls = _optimizer_class(config.type, config.params)
    kwargs = dict(config.params)
    if config.type.lower() in _ADAM:
        for key in _ADAM_EXTRA:
            kwargs.pop(key, None)
        kwargs = {**_ADAM_DEFAULTS, **kwargs}
    if "betas" in kwargs and isinstance(kwargs["betas"], list):
        kwargs["betas"] = tuple(kwargs["betas"])
    return cls(params, **kwargs)


def build_scheduler(config: SchedulerConfig, optimizer: Any) -> Any:
    """The schedule the block describes, on `optimizer`; construction writes the first learning rate, as DeepSpeed's.

    Args:
        config: the `scheduler` block, with no "auto" left (`fill_auto`).
        optimizer: the engine's optimizer.

    Raises:
        ConfigError: an "auto" value was not filled.
    """
    refuse_auto(config.params, "scheduler")
    return _scheduler_class(config.type)(optimizer, **config.params)


def refuse_auto(params: Mapping[str, Any], block: str) -> None:
    """Raise the one-line `ConfigError` for the first "auto" param that nothing filled.

    Args:
        params: the block's params.
        block: "optimizer" or "scheduler", for the message.
    """
    for key, value in params.items():
        if value == AUTO:
            raise ConfigError(
                f'{block}.params.{key}: "auto" is not resolved here (the HF Trainer and Accelerate\'s DummyOptim / '
                "DummyScheduler fill it); write the value"
            )


def fill_auto(
    optimizer: OptimizerConfig | None, scheduler: SchedulerConfig | None, values: Mapping[str, Any]
) -> tuple[OptimizerConfig | None, SchedulerConfig | None]:
    """The two blocks with their "auto" params filled from `values`; only "auto" is replaced (as Accelerate does).

    Args:
        optimizer: the `optimizer` block, or None.
        scheduler: the `scheduler` block, or None.
        values: dotted key -> value, e.g. {"optimizer.params.lr": 3e-4, "scheduler.params.warmup_num_steps": 10}.
    """

    def fill(block: Any, name: str, make: Callable[..., Any]) -> Any:
        if block is None or not _has_auto(block.params):
            return block
        params = {k: values.get(f"{name}.params.{k}", v) if v == AUTO else v for k, v in block.params.items()}
        try:
            return make(type=block.type, params=params)
        except ConfigError as exc:
            raise ConfigError(f"{name}.{exc}") from None

    return fill(optimizer, "optimizer", OptimizerConfig), fill(scheduler, "scheduler", SchedulerConfig)
