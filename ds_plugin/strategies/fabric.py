"""`ZeroFabricStrategy`: DeepSpeed's ZeRO for Lightning Fabric, on ds_plugin's FSDP2 engine.

    import ds_plugin
    fabric = Fabric(strategy="zero3", accelerator="cpu", devices=2, precision="bf16-mixed")
    fabric.launch()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    with fabric.no_backward_sync(model, enabled=accumulating):
        fabric.backward(model(x).loss / accumulation)
    if not accumulating:
        optimizer.step()

`fabric.setup(model, optimizer)` applies ZeRO to the model in place and returns the optimizer the engine
built on the ZeRO parameters (an LR scheduler passed as `scheduler=` is re-pointed at it).
`fabric.backward` and `optimizer.step()` go to the engine: fp16 loss scaling, the overflow check and
clipping by the config's `gradient_clipping` happen inside the step. `fabric.clip_gradients(model, optimizer,
max_norm=... | clip_val=...)` between backward and the step clips the averaged (fp16: unscaled) gradients by the
global norm or by value, as the Trainer strategy's `gradient_clip_val` does.
The loss is not divided by the accumulation steps (the script does it, as with any Fabric strategy).
`fabric.save`/`fabric.load` write and read one sharded DCP directory per checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.strategies.ddp import DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from ds_plugin.checkpoint import load_engine_checkpoint, save_engine_checkpoint
from ds_plugin.peft_adapters import full_state_dict
from ds_plugin.presets import ConfigSource
from ds_plugin.strategies._state import ZeroStrategyState, zero_precision_property
from ds_plugin.strategies.lightning_precision import ZeroPrecision
from ds_plugin.zero.engine import ZeroEngine
from ds_plugin.zero.mesh import data_parallel_mesh
from ds_plugin.zero.setup import has_meta, repoint_scheduler

__all__ = ["ZeroFabricStrategy"]


class ZeroFabricStrategy(ZeroStrategyState, DDPStrategy, _BackwardSyncControl):
    """DeepSpeed ZeRO stages 0-3 and ZeRO++ for `Fabric`; one trained model per strategy.

    Processes, the process group, the sampler and the collectives are Fabric's DDP ones.

    Args:
        config: a preset name, a DeepSpeed .json/.yaml path, a dict, or a `TrainingConfig`.
        block_types: module classes or names to shard separately; default the transformers models' blocks.
        sync_module_states: start every rank from rank 0's weights, as DDP does.
        exclude_frozen_parameters: checkpoints leave out the weights that do not require grad (a LoRA run's base),
            as Lightning's DeepSpeed strategy does; resuming keeps the model's own, so build it from the same base.
        kwargs: Lightning's strategy arguments (`process_group_backend`: default "gloo" on CPU, "nccl" on CUDA;
            `timeout`: the process group's collective timeout, default 10 minutes (`DS_PLUGIN_TIMEOUT`
            seconds), not torch's 30; `accelerator`, `parallel_devices`, `cluster_environment`,
            `checkpoint_io`, `precision`: Fabric sets them), and top-level DeepSpeed keys merged over `config`.
    """

    _not_set_up = "call fabric.setup(model, optimizer) first"
    _resume_hint = "fabric.load(path, state) of the last checkpoint fabric.save wrote resumes the run"

    _FRAMEWORK_ARGS = (
        "accelerator",
        "parallel_devices",
        "cluster_environment",
        "checkpoint_io",
        "precision",
        "process_group_backend",
        "timeout",
    )

    def __init__(
        self,
        config: ConfigSource = "zero3",
        *,
        block_types: Any = None,
        sync_module_states: bool = True,
        exclude_frozen_parameters: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**self._init_zero_state(config, kwargs, block_types, sync_module_states))
        self._exclude_frozen = bool(exclude_frozen_parameters)
        self._backward_sync_control = self

    precision = zero_precision_property("_precision")

    @override
    def _zero_precision(self) -> ZeroPrecision:
        return self.precision

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # DDP's: reset the seed, set the ranks, init the process group
        self._mesh = data_parallel_mesh()

    # ------------------------------------------------------------------ the model

    def _engine_for(self, module: nn.Module, optimizer: Optimizer | None) -> ZeroEngine:
        if self._engine is not None and self._engine.module is not module:
            raise RuntimeError("ZeroFabricStrategy sets up one model; create another Fabric for a second one")
        # A user optimizer was built on the unsharded parameters: the setup applies ZeRO and maps it across.
        # Fabric has no accumulation or clipping setting of its own: the script decides both.
        return self._setup_engine(module, optimizer)

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        if len(optimizers) != 1:
            raise ValueError(f"ZeroFabricStrategy trains with one optimizer (as DeepSpeed); got {len(optimizers)}")
        engine = self._engine_for(module, optimizers[0])
        if scheduler is not None:
            repoint_scheduler(scheduler, engine.optimizer)
        return module, [engine.optimizer], scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        self._engine_for(module, None)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        # After `fabric.setup_module(model)`: an optimizer built on the ZeRO parameters (the meta-device route).
        if self._engine is None:
            raise RuntimeError(self._err_msg_joint_setup_required())
        return self._engine_for(self._engine.module, optimizer).optimizer

    @override
    def module_to_device(self, module: nn.Module) -> None:
        if not has_meta(module):  # `init_module(empty_init=True)`: materialised after sharding
            module.to(self.root_device)

    @override
    def module_init_context(self, empty_init: bool | None = None) -> Any:
        # Meta-device parameters are materialised after sharding, so each rank allocates only its shards.
        return torch.device("meta") if empty_init else self.root_device

    def full_state_dict(self, module: nn.Module | None = None, *, trainable_only: bool = False) -> dict[str, Tensor]:
        """The full weights as CPU tensors on rank 0 (empty dict elsewhere); every rank must call it.

        Args:
            module: a submodule of the model; keys are then relative to it.
            trainable_only: only parameters that require grad.
        """
        return full_state_dict(self.engine, module, trainable_only=trainable_only)

    # ------------------------------------------------------------------ steps

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> Any:
        return self._no_sync(enabled)

    @contextmanager
    def _no_sync(self, enabled: bool) -> Generator[None, None, None]:
        previous, self._accumulating = self._accumulating, enabled
        try:
            yield
        finally:
            self._accumulating = previous

    @override
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        engine = self.engine
        engine.set_gradient_accumulation_boundary(not self._accumulating)
        engine.backward(tensor, retain_graph=bool(kwargs.get("retain_graph")), scale_wrt_gas=False)
        if self._accumulating:
            engine.step()  # counts the micro-step; the optimizer steps at the boundary

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        closure: Callable[[], Any] | None = kwargs.get("closure")
        result = closure() if closure is not None else None
        self.engine.step()
        return result

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        # `fabric.clip_gradients(model, optimizer, max_norm=...)` between backward and `optimizer.step()`: the engine
        # reduces (stages 0/1) and unscales (fp16) first, so the norm is the unsharded model's true one.
        if norm_type != 2:
            raise ValueError(f"ZeroFabricStrategy clips by the global L2 norm; norm_type={norm_type} is not supported")
        norm = self.engine.clip_grad_norm_(max_norm)
        if error_if_nonfinite and not torch.isfinite(norm) and self.engine.loss_scaler is None:
            raise RuntimeError(
                f"the total gradient norm is {norm.item()}; pass error_if_nonfinite=False to clip anyway"
            )
        return norm

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self.engine.clip_grad_value_(clip_val)

    # ------------------------------------------------------------------ checkpoints

    def _split(self, state: dict[str, Any]) -> tuple[dict[str, Any], list[str], list[str]]:
        engine = self.engine
        plain: dict[str, Any] = {}
        models, optims = [], []
        for key, obj in state.items():
            if obj is engine.module:
                models.append(key)
            elif obj is engine.optimizer and obj is not None:
                optims.append(key)
            else:
                plain[key] = obj
        return plain, models, optims

    @override
    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any = None, filter: dict[str, Any] | None = None
    ) -> None:
        if storage_options is not None or filter is not None:
            raise TypeError("ZeroFabricStrategy.save_checkpoint: storage_options and filter are not supported")
        plain, models, optims = self._split(state)
        stateful = {k: v.state_dict() if callable(getattr(v, "state_dict", None)) else v for k, v in plain.items()}
        save_engine_checkpoint(
            self.broadcast(str(path)),
            self.engine,
            optimizer=bool(optims),
            exclude_frozen=self._exclude_frozen,
            framework_state={"state": stateful, "model_keys": models, "optimizer_keys": optims},
        )

    @override
    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if isinstance(state, nn.Module):
            state = {"model": state}
        if not isinstance(state, dict) or not state:
            raise ValueError(
                "ZeroFabricStrategy.load_checkpoint: pass the objects to load into, e.g. "
                "fabric.load(path, {'model': model, 'optimizer': optimizer}); the checkpoint is sharded"
            )
        plain, _, optims = self._split(state)
        saved = load_engine_checkpoint(self.broadcast(str(path)), self.engine, optimizer=bool(optims)).framework_state
        entries = dict(saved.get("state", {}))
        missing = [k for k in plain if k not in entries]
        if strict and missing:
            raise KeyError(f"ZeroFabricStrategy.load_checkpoint: {missing[0]!r} is not in checkpoint {path}")
        for key in plain:
            if key not in entries:
                continue
            value = entries.pop(key)
            if callable(getattr(state[key], "load_state_dict", None)):
                state[key].load_state_dict(value)
            else:
                state[key] = value
        return entries
