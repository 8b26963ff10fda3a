"""`ZeroEngine`: one training step of a ZeRO model, the way DeepSpeed's engine runs it.

`setup_zero` (`setup.py`; `initialize` and every adapter go through it) builds the engine from a `ZeroPlan`;
the adapters drive it through `backward`, `step`, `no_sync`, the clipping methods and the state-dict methods
(`state_dicts.py`, with DeepSpeed's `save_checkpoint` / `load_checkpoint`).
One optimizer step: `backward(loss)` per micro-step (loss divided by the accumulation steps, scaled by the fp16
loss scaler; gradients reduced, during it, only on the last micro-step), then `step()`: finish the reduction
(stages 0/1), fp16 overflow check and unscale, clip by the global norm, optimizer step, copy the masters back
(stages 0/1), zero the gradients, close the comms logger's step."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ds_plugin.config import FP16Config
from ds_plugin.precision.loss_scaler import DynamicLossScaler, found_overflow
from ds_plugin.runtime.comms_logger import CommsLogger
from ds_plugin.runtime.faults import peer_failure_guard
from ds_plugin.zero.apply import is_zero_applied
from ds_plugin.zero.generation import gathered_for_generation
from ds_plugin.zero.mesh import ZeroSetupError, torch_dtype
from ds_plugin.zero.optimizer import (
    LocalShards,
    OptimizerSpec,
    build_optimizer,
    clip_grad_norm_,
    needs_local_shards,
)
from ds_plugin.zero.plan import ZeroPlan
from ds_plugin.zero.stage1 import replicated_state
from ds_plugin.zero.state_dicts import EngineStateDicts
from ds_plugin.zero.zeropp import exact_weight_gathers

__all__ = ["ZeroEngine"]

logger = logging.getLogger(__name__)


def _loss_scaler(f: FP16Config | None) -> DynamicLossScaler | None:
    if f is None:
        return None
    return DynamicLossScaler(
        initial_scale_power=f.initial_scale_power,
        loss_scale_window=f.loss_scale_window,
        hysteresis=f.hysteresis,
        consecutive_hysteresis=f.consecutive_hysteresis,
        min_loss_scale=f.min_loss_scale,
        raise_error_at_min_scale=f.raise_error_at_min_scale,
        loss_scale=f.loss_scale,
    )


class ZeroEngine(EngineStateDicts):
    """Runs training steps on a model returned by `apply_zero`.

    `setup_zero` builds it and gives it its optimizer (`set_optimizer`); without one it only runs forward/backward.

    Args:
        module: the ZeRO model (`apply_zero`'s result); call the engine or `.module` for forward.
        plan: the plan the model was built with, resolved for the mesh's world size.
        mesh: the data-parallel mesh; default the one the model was sharded over.
        comms_logger: a running `CommsLogger` to close a step on at every optimizer step.
    """

    def __init__(
        self,
        module: nn.Module,
        plan: ZeroPlan,
        *,
        mesh: DeviceMesh | None = None,
        comms_logger: CommsLogger | None = None,
    ) -> None:
        if not is_zero_applied(module):
            raise ZeroSetupError("ZeroEngine: the model has not been through apply_zero; use initialize(model, config)")
        self.module = module
        self._replicated = replicated_state(module)
        # Walking an FSDP2 module's parameters costs ~0.3 ms; the objects stay the same, so walk once.
        self._params = self._replicated.masters if self._replicated else list(module.parameters())
        self.mesh = mesh or self._model_mesh()
        self.group = self.mesh.get_group()
        plan.check_world(self.mesh.size())
        self.plan = plan
        self.config = plan.config
        self.stage = plan.stage
        self.gradient_accumulation_steps = plan.gradient_accumulation_steps
        self.gradient_clipping = plan.gradient_clipping
        self.loss_scaler = _loss_scaler(plan.loss_scaling)
        self.comms_logger = comms_logger
        self.micro_steps = 0
        self.global_steps = 0
        self.skipped_steps = 0
        self.last_grad_norm: torch.Tensor | None = None
        # How the framework driving this engine resumes a run, for the error a dead peer causes (None: this API's).
        self.resume_hint: str | None = None
        self._boundary: bool | None = None
        self._no_sync_depth = 0
        self._fsdp_sync = True
        # FSDP2 accumulates skipped-sync gradients in the reduce dtype; a wider grad_accum_dtype is honoured by
        # reducing every micro-step into the fp32 sharded gradients instead (DeepSpeed's ZeRO-2/3 behaviour).
        wider = torch_dtype(plan.grad_accum_dtype).itemsize > torch_dtype(plan.reduce_dtype).itemsize
        self._sync_every_micro_step = self._replicated is None and wider
        self.optimizer: torch.optim.Optimizer | None = None
        # Stepped once after every applied optimizer step, as DeepSpeed's engine steps its `lr_scheduler`.
        self.lr_scheduler: Any = None
        self._local_shards: LocalShards | None = None
        self._creating_state = False
        self._overflow: bool | None = None  # this step's gradients reduced and unscaled (see _gradients_ready)
        # The norm this step's gradients were last clipped to by `clip_grad_norm_` (None: not clipped since they came).
        self._clipped_to: float | None = None

    # ------------------------------------------------------------------ what the engine holds

    def _model_mesh(self) -> DeviceMesh:
        if self._replicated is not None:
            return self._replicated.mesh
        p = next(p for p in self.module.parameters() if isinstance(p, DTensor))
        return p.device_mesh

    def set_optimizer(self, optimizer: OptimizerSpec, *, names: Mapping[int, str] | None = None) -> None:
        """Give the engine its optimizer, on the trainable fp32 master parameters (the one way it gets one).

        Args:
            optimizer: a factory `params -> optimizer` (called with the trainable master parameters), or an
                optimizer that has not stepped, built on the model's parameters before or after setup (rebuilt with
                the same class and param groups).
            names: id -> name of the parameters the optimizer may have been built on before setup replaced them
                (stages 2/3: `fully_shard` swaps in DTensor parameters under the same names).
        """
        if self._replicated is not None:
            replacement = self._replicated.master_of()
        else:
            new = dict(self.module.named_parameters())
            replacement = {id(p): p for p in new.values()}
            replacement.update({pid: new[name] for pid, name in (names or {}).items() if name in new})
        params = self.trainable_parameters()
        optimizer = build_optimizer(optimizer, params, replacement)
        if optimizer is None:  # a factory with nothing to build (a Trainer that is not fitting)
            return
        if needs_local_shards(optimizer):
            # Its kernels take no DTensors: rebuild it (same class, groups, settings) on plain local shards.
            self._local_shards = LocalShards(params)
            optimizer = build_optimizer(
                optimizer, [local for _, local in self._local_shards.pairs], self._local_shards.replacement()
            )
            logger.info("%s steps the local shards as plain tensors", type(optimizer).__name__)
        optimizer.register_step_pre_hook(self._before_optimizer_step)
        optimizer.register_step_post_hook(self._after_optimizer_step)
        self.optimizer = optimizer

    def set_lr_scheduler(self, scheduler: Any) -> None:
        """Give the engine an LR scheduler to step after every applied optimizer step (skipped steps do not count).

        Args:
            scheduler: a scheduler on `engine.optimizer` (one of `ds_plugin.lr_schedules` or a torch LR scheduler);
                None to step none.
        """
        if scheduler is not None and getattr(scheduler, "optimizer", self.optimizer) is not self.optimizer:
            raise ZeroSetupError("lr_scheduler: it is built on another optimizer; build it on engine.optimizer")
        self.lr_scheduler = scheduler

    def get_lr(self) -> list[float]:
        """The learning rate of each of the optimizer's param groups (DeepSpeed's `engine.get_lr()`)."""
        if self.optimizer is None:
            raise ZeroSetupError("get_lr: the engine has no optimizer")
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    # Hooks rather than code in step(), so a framework calling `engine.optimizer.step()` itself still gets the
    # stage 0/1 reduction and parameter sync (FSDP2 needs neither: its hooks already reduced the gradients).
    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._creating_state:
            return
        if self._replicated is not None and self._replicated.has_gradients():
            self._replicated.reduce_gradients()
        if self._local_shards is not None:
            self._local_shards.bind()

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._creating_state:
            return
        self._new_gradients()  # the next step's are new
        if self._replicated is not None:
            self._replicated.sync_params()

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The fp32 master parameters the optimizer steps (DTensors), in the model's parameter order."""
        return [p for p in self._params if p.requires_grad]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with peer_failure_guard("forward", self.global_steps + 1, self.resume_hint):
            return self.module(*args, **kwargs)

    def train(self, mode: bool = True) -> ZeroEngine:
        """Set the module's training mode.

        Args:
            mode: True for training, False for evaluation.
        """
        self.module.train(mode)
        return self

    def eval(self) -> ZeroEngine:
        """Put the module in evaluation mode."""
        return self.train(False)

    def gathered_for_generation(self) -> contextlib.AbstractContextManager[nn.Module]:
        """A block in which the ZeRO-3 model is gathered once and stays gathered (see `gathered_for_generation`)."""
        return gathered_for_generation(self.module)

    def exact_weight_gathers(self) -> contextlib.AbstractContextManager[nn.Module]:
        """A block with qwZ off, so forwards use the shards' exact weights (`zeropp.exact_weight_gathers`)."""
        return exact_weight_gathers(self.module)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The module's `generate(...)` (Hugging Face's, with its KV cache) with the model gathered once for the
        whole call instead of once per token, then resharded; call it on every rank, each with its own prompts.
        Training continues unchanged after it."""
        generate = getattr(self.module, "generate", None)
        if not callable(generate):
            raise ZeroSetupError(
                f"generate: {type(self.module).__name__} has no generate method; use `with "
                "engine.gathered_for_generation():` around your own decoding loop"
            )
        with peer_failure_guard("generate", self.global_steps, self.resume_hint), self.gathered_for_generation():
            return generate(*args, **kwargs)

    # ------------------------------------------------------------------ micro-steps

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step is the last before an optimizer step."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the boundary for the current micro-step (frameworks that count micro-steps themselves).

        Args:
            is_boundary: whether this micro-step ends the accumulation; cleared by the next `step()`.
        """
        self._boundary = bool(is_boundary)

    def _set_sync(self, sync: bool) -> None:
        if self._replicated is not None:  # stages 0/1: whether the next backward launches bucket reductions
            self._replicated.begin_backward(sync)
        elif sync != self._fsdp_sync:
            self.module.set_requires_gradient_sync(sync)
            self._fsdp_sync = sync

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally without communicating."""
        self._no_sync_depth += 1
        self._set_sync(False)
        try:
            yield
        finally:
            self._no_sync_depth -= 1
            if not self._no_sync_depth:
                self._set_sync(True)

    def backward(self, loss: torch.Tensor, *, retain_graph: bool = False, scale_wrt_gas: bool = True) -> None:
        """Backward of one micro-step's loss.

        Args:
            loss: the scalar loss of this micro-batch.
            retain_graph: keep the autograd graph (as in `Tensor.backward`).
            scale_wrt_gas: divide the loss by `gradient_accumulation_steps` (DeepSpeed's default); pass False
                when the caller already normalised it (Lightning does).
        """
        self._new_gradients()
        if scale_wrt_gas and self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        if self.loss_scaler is not None:
            loss = self.loss_scaler.scale_loss(loss)
        sync = self._no_sync_depth == 0 and (self._sync_every_micro_step or self.is_gradient_accumulation_boundary())
        self._set_sync(sync)
        with peer_failure_guard("backward", self.global_steps + 1, self.resume_hint):
            loss.backward(retain_graph=retain_graph)

    def step(self) -> bool:
        """End a micro-step; at an accumulation boundary run the optimizer step. Returns whether it stepped.

        Returns False on non-boundary micro-steps and when fp16 gradients overflowed (the step is skipped on
        every rank and the loss scale adjusted).
        """
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        self._boundary = None
        if not boundary:
            return False
        self.global_steps += 1
        with peer_failure_guard("the optimizer step", self.global_steps, self.resume_hint):
            stepped = self._optimizer_step()
        self.skipped_steps += not stepped
        if stepped and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        if self.comms_logger is not None:
            self.comms_logger.step()
        return stepped

    @torch.no_grad()
    def _gradients_ready(self) -> bool:
        """Reduce (stages 0/1) and unscale (fp16) this step's gradients, once per step; False on an fp16 overflow.

        Runs inside `step()`, or earlier when the caller clips gradients itself (`clip_grad_norm_`), so the
        clipping sees the averaged, unscaled gradients the optimizer will step with.
        """
        if self._overflow is not None:
            return not self._overflow
        if self._replicated is not None and self._replicated.has_gradients():
            self._replicated.reduce_gradients()
        self._overflow = False
        if self.loss_scaler is not None:
            params = self.trainable_parameters()
            self._overflow = found_overflow((p.grad for p in params), group=self.group)
            if not self._overflow:
                inverse = 1.0 / self.loss_scaler.scale
                for p in params:
                    if p.grad is not None:
                        (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).mul_(inverse)
        return not self._overflow

    def _new_gradients(self) -> None:
        """Forget what was found out about the previous gradients (overflow, an explicit clip): they are gone."""
        self._overflow = None
        self._clipped_to = None

    def _check_clip_point(self, what: str) -> None:
        if not self.is_gradient_accumulation_boundary():
            raise ZeroSetupError(
                f"{what}: gradients are still accumulating (micro-step {self.micro_steps + 1} of "
                f"{self.gradient_accumulation_steps}); clip after the last micro-step's backward, before the step"
            )

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip this step's gradients to a global L2 norm now, between the last backward and `step()`.

        The norm is the unsharded model's (fp16: of the unscaled gradients). `step()` still clips by the config's
        `gradient_clipping` as well, when that is set, unless this call already clipped to that norm or less (then
        clipping again would only cost a pass over the gradients).

        Args:
            max_norm: the largest allowed norm.

        Returns:
            The norm before clipping; inf after an fp16 overflow (nothing is clipped; the step will be skipped).
        """
        self._check_clip_point("clip_grad_norm_")
        if not self._gradients_ready():
            return torch.tensor(float("inf"))
        self.last_grad_norm = clip_grad_norm_(self.trainable_parameters(), float(max_norm), group=self.group)
        self._clipped_to = float(max_norm)
        return self.last_grad_norm

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every element of this step's gradients to [-clip_value, clip_value], before `step()`.

        Elementwise, so each rank clamps its own shards (fp16: the unscaled gradients); nothing is clamped after
        an fp16 overflow (the step will be skipped).

        Args:
            clip_value: the largest allowed magnitude.
        """
        self._check_clip_point("clip_grad_value_")
        if not self._gradients_ready():
            return
        for p in self.trainable_parameters():
            if p.grad is not None:
                (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clamp_(-clip_value, clip_value)

    def _first_non_finite(self) -> str:
        """The name of the first parameter whose gradient holds an inf/nan, on any rank (a collective)."""
        names = self._replicated.fqns if self._replicated else [n for n, _ in self.module.named_parameters()]
        local = next(
            (
                name
                for name, p in zip(names, self._params, strict=True)
                if p.grad is not None
                and not torch.isfinite(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).all()
            ),
            None,
        )
        found: list[str | None] = [None] * self.mesh.size()
        dist.all_gather_object(found, local, group=self.group)
        return next((name for name in found if name is not None), "an unnamed parameter")

    def _finite_or_handled(self, norm: torch.Tensor | None) -> bool:
        """Without a loss scaler: whether this step's gradients are finite; acts on the config when they are not.

        Every rank takes the same decision (the flag is all-reduced), so none waits on a collective the others
        skipped. "error" raises before the optimizer touches the weights; "skip" drops the step and counts it.

        Args:
            norm: this step's global gradient norm when clipping computed it (then no extra pass is needed).
        """
        if norm is not None:
            bad = not bool(torch.isfinite(norm))  # the global norm: every rank holds the same value
        else:
            bad = found_overflow((p.grad for p in self.trainable_parameters()), group=self.group)
        if not bad:
            return True
        name = self._first_non_finite()
        if self.plan.non_finite_gradients == "skip":
            logger.warning(
                "optimizer step %d: non-finite gradient (first in %s); step skipped (%d skipped so far)",
                self.global_steps,
                name,
                self.skipped_steps + 1,
            )
            self.zero_grad()
            return False
        self.zero_grad()
        raise FloatingPointError(
            f"optimizer step {self.global_steps}: non-finite gradient, first in {name}; the weights are untouched. "
            'Lower the learning rate or check the data, or set "non_finite_gradients": "skip" to skip such steps'
        )

    @torch.no_grad()
    def _optimizer_step(self) -> bool:
        if self.optimizer is None:
            raise ZeroSetupError("step: the engine has no optimizer; pass one to initialize(..., optimizer=...)")
        ready = self._gradients_ready()
        if self.loss_scaler is not None and self.loss_scaler.update(not ready):
            logger.info("fp16 overflow: step %d skipped, loss scale now %g", self.global_steps, self.loss_scaler.scale)
            self.zero_grad()
            return False
        norm = None
        clipped_already = self._clipped_to is not None and self._clipped_to <= self.gradient_clipping
        if clipped_already:
            norm = self.last_grad_norm  # these gradients' norm, taken by that clip_grad_norm_
        elif self.gradient_clipping > 0:
            norm = self.last_grad_norm = clip_grad_norm_(
                self.trainable_parameters(), self.gradient_clipping, group=self.group
            )
        if self.loss_scaler is None and not self._finite_or_handled(norm):
            return False
        self.optimizer.step()
        self.zero_grad()
        return True

    def zero_grad(self) -> None:
        """Drop every gradient: the optimizer's, the model's and any accumulation buffer."""
        self._new_gradients()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)  # local stand-ins too, when there are any
        for p in self.trainable_parameters():
            p.grad = None
        if self._replicated is not None:
            self._replicated.zero_compute_grads()
