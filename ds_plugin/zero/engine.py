"""`ZeroEngine`: one training step of a ZeRO model, the way DeepSpeed's engine runs it.

`initialize(model, config, optimizer)` applies ZeRO, rebuilds the optimizer on the fp32 master shards and
returns the engine; the Lightning/Accelerate adapters drive it through `backward`, `step`, `no_sync` and the
state-dict methods. One optimizer step: `backward(loss)` per micro-step (loss divided by the accumulation
steps, scaled by the fp16 loss scaler; gradients synchronised only on the last micro-step), then `step()`:
reduce (stages 0/1), fp16 overflow check and unscale, clip by the global norm, optimizer step, copy the
masters back (stages 0/1), zero the gradients.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ds_plugin.config import AUTO, ConfigError, TrainingConfig
from ds_plugin.precision.loss_scaler import DynamicLossScaler, found_overflow
from ds_plugin.presets import load_config
from ds_plugin.zero.apply import apply_zero, is_zero_applied
from ds_plugin.zero.mesh import ZeroSetupError, data_parallel_mesh, torch_dtype
from ds_plugin.zero.optimizer import (
    LocalShards,
    OptimizerSpec,
    build_optimizer,
    clip_grad_norm_,
    load_named_optimizer_state_dict,
    named_optimizer_state_dict,
    needs_local_shards,
)
from ds_plugin.zero.stage1 import replicated_state
from ds_plugin.zero.wrap import BlockTypes

__all__ = ["ZeroEngine", "initialize"]

logger = logging.getLogger(__name__)


def _loss_scaler(config: TrainingConfig) -> DynamicLossScaler | None:
    if config.compute_dtype != "fp16":
        return None
    f = config.fp16
    return DynamicLossScaler(
        initial_scale_power=f.initial_scale_power,
        loss_scale_window=f.loss_scale_window,
        hysteresis=f.hysteresis,
        consecutive_hysteresis=f.consecutive_hysteresis,
        min_loss_scale=f.min_loss_scale,
        raise_error_at_min_scale=f.raise_error_at_min_scale,
        loss_scale=f.loss_scale,
    )


def _resolved(value: Any, key: str, default: Any) -> Any:
    if value == AUTO:
        raise ConfigError(f'{key}: "auto" is not resolved; call config.resolve(...) with the framework\'s value')
    return default if value is None else value


class ZeroEngine:
    """Runs training steps on a model returned by `apply_zero`.

    Args:
        module: the ZeRO model (`apply_zero`'s result); call the engine or `.module` for forward.
        config: the training config the model was built with.
        optimizer: an optimizer over the ZeRO parameters, a factory `params -> optimizer`, or (stages 0/1)
            one built on the model's own parameters; None for an engine that only runs forward/backward.
        mesh: the data-parallel mesh; default the one the model was sharded over.
    """

    def __init__(
        self,
        module: nn.Module,
        config: TrainingConfig | dict[str, Any],
        optimizer: OptimizerSpec | None = None,
        *,
        mesh: DeviceMesh | None = None,
    ) -> None:
        if not is_zero_applied(module):
            raise ZeroSetupError("ZeroEngine: the model has not been through apply_zero; use initialize(model, config)")
        self.module = module
        self.config = config = load_config(config)
        self.stage = config.stage
        self._replicated = replicated_state(module)
        # Walking an FSDP2 module's parameters costs ~0.3 ms; the objects stay the same, so walk once.
        self._params = self._replicated.masters if self._replicated else list(module.parameters())
        self.mesh = mesh or self._model_mesh()
        self.group = self.mesh.get_group()
        self.gradient_accumulation_steps = int(
            _resolved(config.gradient_accumulation_steps, "gradient_accumulation_steps", 1)
        )
        self.gradient_clipping = float(_resolved(config.gradient_clipping, "gradient_clipping", 0.0))
        self.loss_scaler = _loss_scaler(config)
        self.micro_steps = 0
        self.global_steps = 0
        self.skipped_steps = 0
        self.last_grad_norm: torch.Tensor | None = None
        self._boundary: bool | None = None
        self._no_sync_depth = 0
        self._fsdp_sync = True
        # FSDP2 accumulates skipped-sync gradients in the reduce dtype; a wider grad_accum_dtype is honoured by
        # reducing every micro-step into the fp32 sharded gradients instead (DeepSpeed's ZeRO-2/3 behaviour).
        wider = torch_dtype(config.grad_accum_dtype).itemsize > torch_dtype(config.reduce_dtype).itemsize
        self._sync_every_micro_step = self._replicated is None and wider
        self.optimizer: torch.optim.Optimizer | None = None
        self._local_shards: LocalShards | None = None
        self._creating_state = False
        if optimizer is not None:
            own = {id(p): p for p in self.module.parameters()}
            self._set_optimizer(optimizer, self._replicated.master_of() if self._replicated else own)

    # ------------------------------------------------------------------ what the engine holds

    def _model_mesh(self) -> DeviceMesh:
        if self._replicated is not None:
            return self._replicated.mesh
        p = next(p for p in self.module.parameters() if isinstance(p, DTensor))
        return p.device_mesh

    def _set_optimizer(self, spec: OptimizerSpec, replacement: dict[int, nn.Parameter]) -> None:
        params = self.trainable_parameters()
        optimizer = build_optimizer(spec, params, replacement)
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
        if self._replicated is not None and not self._creating_state:
            self._replicated.sync_params()

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The fp32 master parameters the optimizer steps (DTensors), in the model's parameter order."""
        return [p for p in self._params if p.requires_grad]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
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

    def _set_fsdp_sync(self, sync: bool) -> None:
        if self._replicated is None and sync != self._fsdp_sync:
            self.module.set_requires_gradient_sync(sync)
            self._fsdp_sync = sync

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally without communicating."""
        self._no_sync_depth += 1
        self._set_fsdp_sync(False)
        try:
            yield
        finally:
            self._no_sync_depth -= 1
            if not self._no_sync_depth:
                self._set_fsdp_sync(True)

    def backward(self, loss: torch.Tensor, *, retain_graph: bool = False, scale_wrt_gas: bool = True) -> None:
        """Backward of one micro-step's loss.

        Args:
            loss: the scalar loss of this micro-batch.
            retain_graph: keep the autograd graph (as in `Tensor.backward`).
            scale_wrt_gas: divide the loss by `gradient_accumulation_steps` (DeepSpeed's default); pass False
                when the caller already normalised it (Lightning does).
        """
        if scale_wrt_gas and self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        if self.loss_scaler is not None:
            loss = self.loss_scaler.scale_loss(loss)
        sync = self._no_sync_depth == 0 and (self._sync_every_micro_step or self.is_gradient_accumulation_boundary())
        self._set_fsdp_sync(sync)
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
        stepped = self._optimizer_step()
        self.skipped_steps += not stepped
        return stepped

    @torch.no_grad()
    def _optimizer_step(self) -> bool:
        if self.optimizer is None:
            raise ZeroSetupError("step: the engine has no optimizer; pass one to initialize(..., optimizer=...)")
        if self._replicated is not None and self._replicated.has_gradients():
            self._replicated.reduce_gradients()
        params = self.trainable_parameters()
        if self.loss_scaler is not None:
            used_scale = self.loss_scaler.scale
            overflow = found_overflow((p.grad for p in params), group=self.group)
            if self.loss_scaler.update(overflow):
                logger.info(
                    "fp16 overflow: step %d skipped, loss scale now %g", self.global_steps, self.loss_scaler.scale
                )
                self.zero_grad()
                return False
            for p in params:
                if p.grad is not None:
                    (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).mul_(1.0 / used_scale)
        if self.gradient_clipping > 0:
            self.last_grad_norm = clip_grad_norm_(params, self.gradient_clipping, group=self.group)
        self.optimizer.step()
        self.zero_grad()
        return True

    def zero_grad(self) -> None:
        """Drop every gradient: the optimizer's, the model's and any accumulation buffer."""
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)  # local stand-ins too, when there are any
        for p in self.trainable_parameters():
            p.grad = None
        if self._replicated is not None:
            self._replicated.zero_compute_grads()

    # ------------------------------------------------------------------ state dicts

    def _names(self) -> dict[int, str]:
        return {id(m): name for m, name in zip(self._replicated.masters, self._replicated.fqns, strict=True)}

    def _to_layout(self, value: Any, master: nn.Parameter) -> DTensor:
        local = self._replicated.localize(value, master).to(master.to_local().device)
        return DTensor.from_local(
            local, self.mesh, master.placements, run_check=False, shape=master.shape, stride=master.stride()
        )

    def model_state_dict(self) -> dict[str, Any]:
        """The model's weights keyed by its own parameter names: fp32 `Shard(0)` DTensors, buffers as tensors."""
        if self._replicated is not None:
            return self._replicated.model_state_dict()
        return get_model_state_dict(self.module)

    def load_model_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load weights saved by `model_state_dict` at any stage or world size.

        Args:
            state_dict: name -> DTensor (any placement) or full tensor.
        """
        if self._replicated is not None:
            self._replicated.load_model_state_dict(state_dict)
        else:
            set_model_state_dict(self.module, state_dict)

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The optimizer state keyed by parameter names, `Shard(0)` DTensors (creates the state if needed)."""
        if self.optimizer is None:
            raise ZeroSetupError("optimizer_state_dict: the engine has no optimizer")
        if self._local_shards is not None:
            raise ZeroSetupError(
                f"optimizer_state_dict: {type(self.optimizer).__name__} quantizes its state per local shard, which "
                "cannot be resharded; checkpoint the model weights only, or use a torch.optim optimizer"
            )
        if self._replicated is None:
            return get_optimizer_state_dict(self.module, self.optimizer)
        # Creating missing state steps with zero gradients: keep pending gradients out of it.
        self._creating_state = True
        try:
            return named_optimizer_state_dict(self.optimizer, self._names(), self._replicated.export)
        finally:
            self._creating_state = False

    def load_optimizer_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load optimizer state saved by `optimizer_state_dict` at any stage or world size.

        Args:
            state_dict: {"state": {name: {...}}, "param_groups": [...]} as `optimizer_state_dict` returns it.
        """
        if self.optimizer is None:
            raise ZeroSetupError("load_optimizer_state_dict: the engine has no optimizer")
        if self._replicated is not None:
            load_named_optimizer_state_dict(self.optimizer, state_dict, self._names(), self._to_layout)
        else:
            set_optimizer_state_dict(self.module, self.optimizer, state_dict)

    def engine_state_dict(self) -> dict[str, Any]:
        """Step counters and the loss scaler: the plain-Python rest of a checkpoint."""
        return {
            "global_steps": self.global_steps,
            "micro_steps": self.micro_steps,
            "skipped_steps": self.skipped_steps,
            "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
        }

    def load_engine_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `engine_state_dict` returned.

        Args:
            state: the dict `engine_state_dict` returned.
        """
        self.global_steps = int(state["global_steps"])
        self.micro_steps = int(state["micro_steps"])
        self.skipped_steps = int(state["skipped_steps"])
        if self.loss_scaler is not None and state.get("loss_scaler"):
            self.loss_scaler.load_state_dict(state["loss_scaler"])


def initialize(
    model: nn.Module,
    config: TrainingConfig | dict[str, Any] | str,
    optimizer: OptimizerSpec | None = None,
    *,
    mesh: DeviceMesh | None = None,
    block_types: BlockTypes | None = None,
    sync_module_states: bool = True,
) -> ZeroEngine:
    """DeepSpeed's `initialize`: apply ZeRO to the model, put the optimizer on its master shards.

    Args:
        model: the model (or one `apply_zero` already returned).
        config: a `TrainingConfig`, a DeepSpeed config dict or the path to one.
        optimizer: a factory `params -> optimizer` (called with the trainable master parameters), or an
            optimizer built on `model.parameters()` that has not stepped (rebuilt with the same class and
            param-group hyper-parameters; build LR schedulers on `engine.optimizer`).
        mesh: the 1-D data-parallel mesh; default all ranks.
        block_types: blocks to shard separately (see `apply_zero`).
        sync_module_states: start every rank from the first rank's weights (see `apply_zero`).
    """
    config = load_config(config)
    originals = {id(p): name for name, p in model.named_parameters()}
    if not is_zero_applied(model):
        mesh = data_parallel_mesh(mesh)
        model = apply_zero(model, config, mesh=mesh, block_types=block_types, sync_module_states=sync_module_states)
    engine = ZeroEngine(model, config, mesh=mesh)
    if optimizer is not None:
        if engine._replicated is not None:
            replacement = engine._replicated.master_of()
        else:
            new = dict(model.named_parameters())
            replacement = {id(p): p for p in new.values()}
            replacement.update({pid: new[name] for pid, name in originals.items() if name in new})
        engine._set_optimizer(optimizer, replacement)
    return engine
