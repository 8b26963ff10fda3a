"""`ZeroStrategy`: DeepSpeed's ZeRO for the Lightning Trainer, on ds_plugin's FSDP2 engine.

    import ds_plugin  # registers "zero0".."zero3", "zero3_offload", "zeropp"
    Trainer(strategy="zeropp", accelerator="cpu", devices=2)
    Trainer(strategy=ZeroStrategy("ds_config.json", gradient_clipping="auto"), precision="bf16-mixed")

Processes, process group, sampler and collectives are DDP's (as for Lightning's DeepSpeed strategy); the rest
maps Lightning's calls onto `ZeroEngine`. `setup` resolves the config's "auto" values from the Trainer, swaps in
FP8 layers and shards the LightningModule with `apply_zero` (a meta-device model is then materialised shard by
shard); `configure_optimizers` runs on the ZeRO parameters and the engine builds the optimizer it steps (LR
schedulers follow). Steps run through the module's own call, so FSDP2's root hooks fire; backward and the step
are the engine's (`ZeroPrecision`). A checkpoint is one sharded DCP directory with Lightning's state inside.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from ds_plugin.checkpoint import load_engine_checkpoint, remove_checkpoint, save_engine_checkpoint
from ds_plugin.config import AUTO
from ds_plugin.peft_adapters import full_state_dict
from ds_plugin.presets import ConfigSource
from ds_plugin.strategies._state import ZeroStrategyState, zero_precision_property
from ds_plugin.strategies.lightning_precision import ZeroPrecision
from ds_plugin.zero.mesh import data_parallel_mesh
from ds_plugin.zero.plan import dataloader_batch_size
from ds_plugin.zero.setup import repoint_scheduler

__all__ = ["ZeroStrategy"]


class ZeroStrategy(ZeroStrategyState, DDPStrategy):
    """DeepSpeed ZeRO stages 0-3 and ZeRO++ for `Trainer`, configured by a DeepSpeed config.

    Args:
        config: a preset name ("zero3", "zeropp", ...), a DeepSpeed .json/.yaml path, a dict, or a
            `TrainingConfig`; its "auto" values are resolved from the Trainer.
        block_types: module classes or names to shard as separate units; default the transformers models'
            `_no_split_modules`, else the repeated children of `nn.ModuleList`s.
        sync_module_states: start every rank from rank 0's weights, as DDP does.
        exclude_frozen_parameters: checkpoints leave out the weights that do not require grad (a LoRA run's base),
            as Lightning's DeepSpeed strategy does; resuming keeps the model's own, so build it from the same base.
        kwargs: Lightning's strategy arguments (`process_group_backend`: default "gloo" on CPU, "nccl" on CUDA;
            `timeout`: the process group's collective timeout, default 10 minutes (`DS_PLUGIN_TIMEOUT`
            seconds), not torch's 30; `accelerator`, `parallel_devices`, `cluster_environment`,
            `checkpoint_io`, `precision_plugin`: the Trainer sets them), and top-level DeepSpeed keys merged over
            `config`, e.g. `gradient_clipping=0.5`, `zero_optimization={"offload_optimizer": {"device": "cpu"}}`.
    """

    strategy_name = "zero"

    _not_set_up = "the model is not set up yet; the Trainer sets it up in fit()"
    _resume_hint = 'Trainer.fit(..., ckpt_path="last") resumes from the newest complete checkpoint'

    _FRAMEWORK_ARGS = (
        "accelerator",
        "parallel_devices",
        "cluster_environment",
        "checkpoint_io",
        "precision_plugin",
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

    precision_plugin = zero_precision_property("_precision_plugin")

    @override
    def _zero_precision(self) -> ZeroPrecision:
        return self.precision_plugin

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the checkpoint loads into the sharded model and the engine's optimizer

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint already restored it

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # DDP's: reset the seed, set the ranks, init the process group
        self._mesh = data_parallel_mesh()
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._mesh  # `self.device_mesh` in configure_model

    def _framework(self, trainer: pl.Trainer) -> dict[str, Any]:
        config, micro = self._config, None
        if config.train_micro_batch_size_per_gpu == AUTO or config.train_batch_size not in (None, AUTO):
            source = trainer.fit_loop._data_source  # the train dataloader, as Lightning's DeepSpeed strategy reads it
            micro = dataloader_batch_size(source.dataloader()) if source.is_defined() else None
        return {
            "micro_batch_size": micro,
            "accumulation": trainer.accumulate_grad_batches,
            "accumulation_setting": "Trainer(accumulate_grad_batches)",
            # Clipping by norm is the config's gradient_clipping (inside the engine's step); by value, the precision
            # plugin clips through the engine before the step.
            "clip": None
            if trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE
            else trainer.gradient_clip_val,
            "clip_setting": "Trainer(gradient_clip_val)",
        }

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        self.precision_plugin.check_clipping(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        schedulers: list[Any] = []

        def configure_optimizers(_params: Any) -> Any:
            # Called by the setup once the model is sharded (and materialised), so configure_optimizers sees the
            # ZeRO parameters; the engine then rebuilds the optimizer on the fp32 masters where they differ.
            self.model_to_device()
            optimizers, lr_configs = _init_optimizers_and_lr_schedulers(module) if fitting else ([], [])
            if len(optimizers) > 1:
                raise ValueError(
                    f"ZeroStrategy trains one optimizer (as DeepSpeed); configure_optimizers gave {len(optimizers)}"
                )
            schedulers.extend(lr_configs)
            return optimizers[0] if optimizers else None

        engine = self._setup_engine(module, configure_optimizers, **self._framework(trainer))
        self.precision_plugin.engine = engine
        if engine.config.ignored_keys():
            rank_zero_info(f"ZeroStrategy: config keys without effect here: {', '.join(engine.config.ignored_keys())}")
        for scheduler_config in schedulers:
            repoint_scheduler(scheduler_config.scheduler, engine.optimizer)
        self.model = module
        self.optimizers = [engine.optimizer] if engine.optimizer is not None else []
        self.lr_scheduler_configs = schedulers
        self.setup_precision_plugin()

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        # `setup` builds the optimizer with the engine; nothing else may build one on the unsharded model.
        pass

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # Meta-device parameters are materialised after sharding, so each rank allocates only its shards.
        with torch.device("meta") if empty_init else self.root_device:
            yield

    def full_state_dict(self, module: nn.Module | None = None, *, trainable_only: bool = False) -> dict[str, Tensor]:
        """The full (unsharded) weights as CPU tensors on rank 0 (empty dict elsewhere); every rank must call it.

        Args:
            module: a submodule of the LightningModule (e.g. a peft model); keys are then relative to it.
            trainable_only: only parameters that require grad (a LoRA adapter's weights).
        """
        return full_state_dict(self.engine, module, trainable_only=trainable_only)

    def _redirect(self, context: Any, method: str, args: tuple, kwargs: dict) -> Any:
        # Through the module's own call, so FSDP2's root hooks (gather, input cast) run around the step.
        with context(), self._peer_guard(method):
            return self._forward_redirection(self.model, self.lightning_module, method, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        with self._peer_guard("the training step"):  # the closure runs training_step and backward inside
            return super().optimizer_step(optimizer, closure, model, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._redirect(self.precision_plugin.train_step_context, "training_step", args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._redirect(self.precision_plugin.val_step_context, "validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._redirect(self.precision_plugin.test_step_context, "test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._redirect(self.precision_plugin.predict_step_context, "predict_step", args, kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # Lightning enters this for accumulation micro-batches; the engine then keeps their gradients local.
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        self.engine.set_gradient_accumulation_boundary(not self._accumulating)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        if self._accumulating:
            self.engine.step()  # counts the micro-step; the optimizer steps at the boundary

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.engine.model_state_dict()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return self.engine.optimizer_state_dict()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("ZeroStrategy.save_checkpoint: storage_options is not supported (the checkpoint is DCP)")
        path = self.broadcast(str(filepath))
        model_state = checkpoint.pop("state_dict")
        optimizer_state = (checkpoint.pop("optimizer_states", None) or [None])[0]
        save_engine_checkpoint(
            path,
            self.engine,
            optimizer=optimizer_state is not None,
            model_state=model_state,
            optimizer_state=optimizer_state,
            exclude_frozen=self._exclude_frozen,
            framework_state=checkpoint,
        )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = self.broadcast(str(checkpoint_path))
        fitting = self.lightning_module is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        return load_engine_checkpoint(path, self.engine, optimizer=fitting).framework_state

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # load_checkpoint already loaded the weights

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # load_checkpoint already loaded the optimizer

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            remove_checkpoint(filepath)

    @override
    def teardown(self) -> None:
        # The sharded model stays where it is (moving DTensors to CPU would gather nothing but cost time).
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
