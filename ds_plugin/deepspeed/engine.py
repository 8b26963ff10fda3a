"""`DeepSpeedEngine`: DeepSpeed's engine API as scripts call it, over a `ZeroEngine` (which does all the work).

Where DeepSpeed's API and `ZeroEngine`'s differ this class translates: `gradient_accumulation_steps()` and the
batch sizes are methods, `save_checkpoint` returns True, `load_checkpoint` returns `(None, None)` when there is
nothing to load, `local_rank` / `global_rank` / `device` are attributes. Every other attribute is the `ZeroEngine`'s
(`optimizer`, `lr_scheduler`, `global_steps`, `no_sync`, `plan`, ...), else the model's, as DeepSpeed's engine passes
its model's attributes through (`engine.gradient_checkpointing_enable()`, a reward model's `forward_value`). Like
DeepSpeed's engine, which is an `nn.Module` holding the model as `module`, it answers `parameters()`,
`named_parameters()`, `named_modules()` and `state_dict()` with the model's, names prefixed `module.`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ds_plugin.zero.engine import ZeroEngine
from ds_plugin.zero.mesh import mesh_device, torch_dtype

__all__ = ["DeepSpeedEngine"]


class DeepSpeedEngine:
    """DeepSpeed's engine API on a `ZeroEngine`.

    Args:
        engine: the engine `setup_zero` built.
        training_dataloader: the loader `initialize` built from `training_data`, if any.
        local_rank: this process's rank on its node.
    """

    def __init__(self, engine: ZeroEngine, training_dataloader: Any = None, local_rank: int = 0) -> None:
        self.engine = engine
        self.training_dataloader = training_dataloader
        self.local_rank = local_rank
        self.global_rank = dist.get_rank()
        self.world_size = self.dp_world_size = dist.get_world_size()
        self.device = mesh_device(engine.mesh)
        self._applied = False
        self.tput_timer = ThroughputTimer(engine.plan.config.train_batch_size)
        self.monitor = _NoMonitors()
        if engine.optimizer is not None:
            engine.optimizer.overflow = False  # DeepSpeed's optimizers say whether the last step overflowed (fp16)

    def __getattr__(self, name: str) -> Any:
        # Only called for names this class does not define: the ZeroEngine's attributes, then the model's.
        if name == "engine":
            raise AttributeError(name)
        try:
            return getattr(self.engine, name)
        except AttributeError:
            pass
        try:
            return getattr(self.engine.module, name)
        except AttributeError:
            raise AttributeError(
                f"'DeepSpeedEngine' object has no attribute {name!r} (nor has its ZeroEngine or its model)"
            ) from None

    # nn.Module's views of DeepSpeed's engine, which holds the model as its submodule `module`.

    def parameters(self, recurse: bool = True) -> Any:
        """The model's parameters (DTensor shards at stages 2/3)."""
        return self.engine.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Any:
        """The model's named parameters, names prefixed `module.` as DeepSpeed's engine gives them."""
        return self.engine.module.named_parameters(_sub(prefix), recurse, remove_duplicate)

    def modules(self) -> Any:
        """This engine, then the model's modules (DeepSpeed's engine is itself a module)."""
        return (m for _, m in self.named_modules())

    def named_modules(self, memo: set | None = None, prefix: str = "", remove_duplicate: bool = True) -> Any:
        """`(prefix, this engine)`, then the model's named modules under `module.`."""
        yield prefix, self
        yield from self.engine.module.named_modules(memo, _sub(prefix), remove_duplicate)

    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The model's `state_dict()` with keys under `module.` (sharded tensors at stages 2/3: `save_16bit_model` or
        `ds_plugin.peft_adapters.full_state_dict` give whole ones)."""
        return self.engine.module.state_dict(destination=destination, prefix=_sub(prefix) + ".", keep_vars=keep_vars)

    @property
    def global_samples(self) -> int:
        """Samples the optimizer steps have consumed: global steps x the global batch (0 when it is not known)."""
        return self.engine.global_steps * (self.train_batch_size() or 0)

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """Stage 3: the whole model's weights in the compute dtype on rank 0, an empty dict elsewhere (a collective)."""
        from ds_plugin.peft_adapters import full_state_dict

        if self.engine.stage != 3:
            raise ValueError("_consolidated_16bit_state_dict is for stage 3, where weights are partitioned")
        dtype = torch_dtype(self.engine.plan.compute_dtype)
        return full_state_dict(self.engine, trainable_only=exclude_frozen_parameters, dtype=dtype)

    def bfloat16_enabled(self) -> bool:
        """Whether forward and backward run in bf16."""
        return self.engine.plan.compute_dtype == "bf16"

    def fp16_enabled(self) -> bool:
        """Whether forward and backward run in fp16 (with loss scaling)."""
        return self.engine.plan.compute_dtype == "fp16"

    def gradient_clipping(self) -> float:
        """The global-norm clipping every step applies (0: off)."""
        return float(self.engine.gradient_clipping)

    def loss_scale(self) -> float:
        """The fp16 loss scale now (1.0 without fp16)."""
        scaler = self.engine.loss_scaler
        return 1.0 if scaler is None else float(scaler.scale)

    def get_mom(self) -> list[Any]:
        """Each param group's momentum: Adam's `betas`, else `momentum` (as DeepSpeed reports it)."""
        groups = self.engine.optimizer.param_groups if self.engine.optimizer is not None else []
        return [g["betas"] if "betas" in g else g.get("momentum") for g in groups]

    @property
    def module(self) -> nn.Module:
        """The trained model (sharded at stages 2/3); call the engine or the module for forward."""
        return self.engine.module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.tput_timer.start()
        return self.engine(*args, **kwargs)

    forward = __call__

    def train(self, mode: bool = True) -> DeepSpeedEngine:
        """Set the module's training mode.

        Args:
            mode: True for training, False for evaluation.
        """
        self.engine.train(mode)
        return self

    def eval(self) -> DeepSpeedEngine:
        """Put the module in evaluation mode."""
        return self.train(False)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of one micro-batch's loss (divided by the accumulation steps; fp16: scaled). Returns `loss`.

        Args:
            loss: the scalar loss.
            retain_graph: keep the autograd graph.
            scale_wrt_gas: divide the loss by `gradient_accumulation_steps()`.
        """
        self.engine.backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)
        return loss

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """End a micro-step; at an accumulation boundary: clip, optimizer step, LR scheduler step.

        Args:
            lr_kwargs: DeepSpeed passes these to its scheduler's `step`; not supported here (must be None).
        """
        if lr_kwargs:
            raise ValueError("step(lr_kwargs=...): the engine steps its scheduler without arguments; drop lr_kwargs")
        boundary = self.engine.is_gradient_accumulation_boundary()
        stepped = self.engine.step()
        self.tput_timer.stop(global_step=boundary)
        if boundary:
            self._applied = stepped
            if self.engine.optimizer is not None:
                self.engine.optimizer.overflow = not stepped

    def was_step_applied(self) -> bool:
        """Whether the last boundary step updated the weights (False after an fp16 overflow or a skipped step)."""
        return self._applied

    def gradient_accumulation_steps(self) -> int:
        """Micro-steps per optimizer step."""
        return self.engine.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int | None:
        """The config's micro batch per rank."""
        return self.engine.plan.config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int | None:
        """The config's global batch."""
        return self.engine.plan.config.train_batch_size

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step ends the accumulation."""
        return self.engine.is_gradient_accumulation_boundary()

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage."""
        return self.engine.stage

    def get_lr(self) -> list[float]:
        """The learning rate of each param group."""
        return self.engine.get_lr()

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last clipped step (None when clipping is off)."""
        norm = self.engine.last_grad_norm
        return None if norm is None else float(norm)

    def save_checkpoint(
        self,
        save_dir: str | os.PathLike,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Save weights, optimizer, scheduler and `client_state` to `save_dir/<tag>` (a collective). Returns True.

        Args:
            save_dir: the run's checkpoint directory.
            tag: the checkpoint's name (a step number too); default `global_step<N>`.
            client_state: the loop's own JSON-able state, returned by `load_checkpoint`.
            save_latest: point `save_dir/latest` at it.
            exclude_frozen_parameters: leave out the weights that do not require grad (LoRA's base); loading keeps
                the loading model's own (build it from the same base).
        """
        self.engine.save_checkpoint(
            save_dir,
            None if tag is None else str(tag),  # DeepSpeed names a checkpoint by str(tag): scripts pass the step
            client_state or {},
            save_latest=save_latest,
            exclude_frozen_parameters=exclude_frozen_parameters,
        )
        return True

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Load `load_dir/<tag>` (default the newest complete one); returns (its path, its client_state), or
        (None, None) when there is none.

        Args:
            load_dir: the directory `save_checkpoint` wrote into.
            tag: a checkpoint name.
            load_module_strict: accepted either way: a checkpoint saved with `exclude_frozen_parameters` loads
                without its frozen weights (this model keeps its own); any other weight it lacks is a one-line error.
            load_optimizer_states: also the optimizer state and the fp16 loss scaler.
            load_lr_scheduler_states: the LR scheduler's step comes back with the step counters either way.
            load_module_only: the weights only.
            custom_load_fn: not supported (must be None).
        """
        if custom_load_fn is not None:
            raise ValueError("load_checkpoint: custom_load_fn is not supported")
        path, client = self.engine.load_checkpoint(
            load_dir,
            None if tag is None else str(tag),
            load_optimizer_states=load_optimizer_states,
            load_module_only=load_module_only,
        )
        return (None, None) if path is None else (str(path), client)

    def save_16bit_model(
        self,
        save_dir: str | os.PathLike,
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """The whole model's weights in the compute dtype, one `torch.save` file written by rank 0 (a collective).

        Args:
            save_dir: where to write.
            save_filename: the file's name.
            exclude_frozen_parameters: leave out parameters that do not require grad.
        """
        from ds_plugin.peft_adapters import full_state_dict

        # Cast as each weight is gathered: rank 0 holds the 16-bit model only, as DeepSpeed's does.
        dtype = torch_dtype(self.engine.plan.compute_dtype)
        state = full_state_dict(self.engine, trainable_only=exclude_frozen_parameters, dtype=dtype)
        if self.global_rank == 0:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            torch.save(state, Path(save_dir) / save_filename)
        dist.barrier()
        return True


class ThroughputTimer:
    """DeepSpeed's `engine.tput_timer`: samples per second over the steps after the first `start_step`, and the
    epoch, micro-step and step counts. The engine starts it at each forward and stops it at each `step()`."""

    def __init__(self, batch_size: int | None, start_step: int = 2) -> None:
        self.batch_size = 1 if batch_size is None else int(batch_size)
        self.start_step = start_step
        self.epoch_count = self.micro_step_count = self.global_step_count = 0
        self.total_elapsed_time = self.step_elapsed_time = 0.0
        self.started = False
        self._since = 0.0

    def update_epoch_count(self) -> None:
        """A new epoch: its micro-steps count from 0."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        if not self.started:
            self.started, self._since = True, time.perf_counter()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """End a micro-step (`global_step`: an optimizer step); nothing is printed (`steps_per_print` is ignored)."""
        if not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        elapsed = time.perf_counter() - self._since
        self.step_elapsed_time += elapsed
        if global_step:
            self.global_step_count += 1
            if self.global_step_count > self.start_step:
                self.total_elapsed_time += self.step_elapsed_time
            self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """The global batch over the mean time of the optimizer steps after the first `start_step` (0 before any)."""
        steps = self.global_step_count - self.start_step
        if steps <= 0 or self.total_elapsed_time <= 0:
            return 0.0
        return self.batch_size / (self.total_elapsed_time / steps)


class _NoMonitors:
    """`engine.monitor`: the config's monitors (tensorboard, wandb, csv) are reported ignored, so none is on."""

    enabled = False

    def write_events(self, event_list: Any) -> None:
        """Nothing is written: no monitor is on (log through the framework's logger)."""


def _sub(prefix: str) -> str:
    """The names under the engine's `module` attribute, below `prefix`."""
    return f"{prefix}.module" if prefix else "module"
