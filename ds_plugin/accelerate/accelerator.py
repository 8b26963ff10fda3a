"""`ds_plugin.accelerate.Accelerator`: Accelerate's `Accelerator` with its model trained by a `ZeroEngine`.

    from ds_plugin.accelerate import Accelerator, ZeroPlugin
    accelerator = Accelerator(zero_plugin=ZeroPlugin("zeropp.json"), mixed_precision="bf16")
    model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)

Processes, the process group, dataloaders, RNG, trackers and `gather_for_metrics` stay Accelerate's (its DDP
setup: `MULTI_GPU`, `MULTI_CPU` or one process). What changes is the trained model: `prepare` resolves the config's
"auto" values from Accelerate's arguments (`FrameworkSettings`) and hands the model and optimizer to `setup_zero`,
so stage, ZeRO++, precision (FP8 included) and frozen-weight storage are the core's. The methods below map
Accelerate's calls onto the engine; there is no algorithm here.

Mixed precision is DeepSpeed's, not autocast: the engine runs the whole forward and backward in the compute dtype
over fp32 master shards, so Accelerate's autocast wrapper and GradScaler are switched off (`autocast()` is a no-op)
and fp16 uses the engine's dynamic loss scaler. `mixed_precision="fp8"` means the config's `fp8` block with bf16
compute (Accelerate's own FP8 backends are not used).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from accelerate.accelerator import Accelerator as AccelerateAccelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs
from torch import nn
from torch.utils.data import DataLoader

from ds_plugin.accelerate.checkpoint import EngineCheckpointing
from ds_plugin.accelerate.dummy import AccelerateDummyOptim, AccelerateDummyScheduler, EngineScheduler, auto_values
from ds_plugin.accelerate.optimizer import ZeroAcceleratedOptimizer
from ds_plugin.accelerate.plugin import ZeroPlugin
from ds_plugin.accelerate.settings import describe_plan, framework_settings, refuse_other_engines
from ds_plugin.config import ConfigError
from ds_plugin.optimizer_config import fill_auto
from ds_plugin.runtime.faults import default_timeout
from ds_plugin.zero.apply import is_zero_applied
from ds_plugin.zero.engine import ZeroEngine
from ds_plugin.zero.mesh import data_parallel_mesh
from ds_plugin.zero.plan import FrameworkSettings, ZeroPlan, dataloader_batch_size, resolve_plan
from ds_plugin.zero.setup import FROM_CONFIG, attach_config_scheduler, has_meta, repoint_scheduler, setup_zero

__all__ = ["Accelerator"]

logger = logging.getLogger(__name__)

_SUPPORTED_TYPES = {DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU}
_SUPPORTED_TYPES |= {
    getattr(DistributedType, n) for n in ("MULTI_XPU", "MULTI_NPU", "MULTI_HPU") if hasattr(DistributedType, n)
}
_BASE_INIT = inspect.signature(AccelerateAccelerator.__init__)


class Accelerator(EngineCheckpointing, AccelerateAccelerator):
    """`accelerate.Accelerator` whose prepared model is trained by ds_plugin's ZeRO engine.

    Args:
        args: `accelerate.Accelerator`'s positional arguments.
        zero_plugin: the DeepSpeed config and overrides; default `ZeroPlugin.from_env()` (`DS_PLUGIN_CONFIG`).
        kwargs: `accelerate.Accelerator`'s arguments, except `deepspeed_plugin(s)` and `fsdp_plugin`.

    Raises:
        ConfigError: no or an invalid config, or an Accelerate DeepSpeed/FSDP plugin; before any process group starts.
    """

    def __init__(self, *args: Any, zero_plugin: ZeroPlugin | None = None, **kwargs: Any) -> None:
        bound = _BASE_INIT.bind(None, *args, **kwargs)
        kwargs = dict(bound.arguments)
        kwargs.pop("self")
        refuse_other_engines(kwargs)
        # Read and check the config now, before Accelerate starts the process group.
        self.zero_plugin = zero_plugin if zero_plugin is not None else ZeroPlugin.from_env()
        mixed = kwargs.get("mixed_precision") or os.environ.get("ACCELERATE_MIXED_PRECISION")
        self._fp8 = str(getattr(mixed, "value", mixed)) == "fp8"  # a string or Accelerate's PrecisionType
        if self._fp8:
            # Accelerate's fp8 needs torchao/TE/MS-AMP; here it is the config's fp8 block on bf16 compute.
            kwargs["mixed_precision"] = "bf16"
        json_steps = self._json_accumulation(kwargs)
        handlers = list(kwargs.get("kwargs_handlers") or [])
        if not any(isinstance(h, InitProcessGroupKwargs) for h in handlers):
            # A dead or frozen rank should end the job in minutes, not torch's 30 (see ds_plugin.runtime.faults).
            kwargs["kwargs_handlers"] = [*handlers, InitProcessGroupKwargs(timeout=default_timeout())]
        super().__init__(**kwargs)
        if self.distributed_type not in _SUPPORTED_TYPES:
            raise ConfigError(
                f"distributed_type {self.distributed_type.value} is not supported by ds_plugin; launch with MULTI_GPU "
                "(also on CPU), MULTI_CPU or one process"
            )
        if json_steps is not None:
            self.gradient_accumulation_steps = json_steps  # Accelerate's DeepSpeed rule: the JSON's, when not given
        # DeepSpeed's mixed precision: the engine computes in the config's dtype; no autocast, no GradScaler.
        self.native_amp = False
        self.scaler = None
        self._engine: ZeroEngine | None = None
        self._plan: ZeroPlan | None = None
        self._micro_batch: int | None = None
        self._source_optimizers: list[torch.optim.Optimizer] = []
        self._auto_values: dict[str, Any] = {}  # "auto" params of the JSON's optimizer/scheduler, from DummyOptim/...

    def _json_accumulation(self, kwargs: dict[str, Any]) -> int | None:
        """The JSON's `gradient_accumulation_steps` when the Accelerator was given none (Accelerate's DeepSpeed rule);
        a different value given to the Accelerator is a one-line error, before the process group starts."""
        config = self.zero_plugin.training_config
        steps = config.gradient_accumulation_steps
        if not isinstance(steps, int) or "gradient_accumulation_steps" not in config.explicit_keys:
            return None
        plugin = kwargs.get("gradient_accumulation_plugin")
        given = kwargs.get("gradient_accumulation_steps")
        given = plugin.num_steps if plugin is not None else given
        env = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
        given = int(env) if given is None and env else given
        if given is None or (plugin is None and given == 1 and "gradient_accumulation_steps" not in kwargs):
            return steps if self.zero_plugin.gradient_accumulation_steps is None else None
        if int(given) != steps:
            raise ConfigError(
                f"gradient_accumulation_steps: the config says {steps} but Accelerator(gradient_accumulation_steps="
                f'{given}); set it in one place (or write "auto" in the config)'
            )
        return None

    # ------------------------------------------------------------------ the engine

    @property
    def engine(self) -> ZeroEngine | None:
        """The `ZeroEngine` training the prepared model; None before `prepare`."""
        return self._engine

    def _framework(self) -> FrameworkSettings:
        settings = framework_settings(
            self.zero_plugin,
            mixed_precision="fp8" if self._fp8 else self.state.mixed_precision,
            accumulation=self.gradient_accumulation_steps,
            micro_batch_size=self._micro_batch,
        )
        return dataclasses.replace(settings, auto_values=dict(self._auto_values))

    def _mesh(self) -> Any:
        if not dist.is_initialized():
            # One process: Accelerate starts no process group, the engine still shards over a 1-rank mesh.
            backend = "gloo" if self.device.type == "cpu" else None
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return data_parallel_mesh()

    def _setup_engine(self, model: nn.Module, optimizer: torch.optim.Optimizer | str | None) -> ZeroEngine:
        if self._engine is not None and self._engine.module is not model:
            raise ValueError(
                "ds_plugin.accelerate.Accelerator trains one model (as DeepSpeed); prepare other models frozen, or "
                "create a second Accelerator for a second trained model"
            )
        mesh = self._mesh()
        if self._plan is None:
            self._plan = resolve_plan(
                self.zero_plugin.training_config,
                world_size=mesh.size(),
                device_type=mesh.device_type,
                framework=self._framework(),
            )
            if self.is_main_process:
                logger.info("%s", describe_plan(self._plan))
                ignored = self._plan.config.ignored_keys()
                if ignored:
                    logger.info("config keys without effect here: %s", ", ".join(ignored))
        if self.device_placement and not has_meta(model) and not is_zero_applied(model):
            model.to(self.device)  # in place: an optimizer built on its parameters still maps across
        self._engine = setup_zero(
            model,
            self._plan,
            optimizer,
            mesh=mesh,
            block_types=None if is_zero_applied(model) else self.zero_plugin.block_types,
            sync_module_states=self.zero_plugin.sync_module_states,
            device=self.device,
        )
        self._engine.resume_hint = "accelerator.load_state(dir) of the last save_state resumes the run"
        if model not in self._models:
            self._models.append(model)
        model._is_accelerate_prepared = True
        return self._engine

    def _wrapped_optimizer(self) -> ZeroAcceleratedOptimizer:
        engine = self._engine
        assert engine is not None and engine.optimizer is not None
        for opt in self._optimizers:
            if isinstance(opt, ZeroAcceleratedOptimizer) and opt.optimizer is engine.optimizer:
                return opt
        self._optimizers = [o for o in self._optimizers if not isinstance(o, ZeroAcceleratedOptimizer)]
        wrapped = ZeroAcceleratedOptimizer(engine)
        wrapped._is_accelerate_prepared = True
        self._optimizers.append(wrapped)
        return wrapped

    # ------------------------------------------------------------------ prepare

    @staticmethod
    def _trains(model: nn.Module) -> bool:
        return any(p.requires_grad for p in model.parameters())

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Prepare dataloaders (first: their batch size fills "auto"), then the trained model with its optimizer
        (one engine), then LR schedulers; other models are prepared frozen, anything else is returned as is.

        Args:
            args: DataLoaders, models, one optimizer, LR schedulers, in any order.
            device_placement: per-object device placement, as in Accelerate (the engine places its model).
        """
        placement = list(device_placement) if device_placement is not None else [None] * len(args)
        if len(placement) != len(args):
            raise ValueError(f"device_placement should be a list with {len(args)} elements (one per object)")
        out = list(args)
        for i, obj in enumerate(args):
            if isinstance(obj, DataLoader):
                out[i] = self.prepare_data_loader(obj, device_placement=placement[i])
        optimizers = [i for i, obj in enumerate(args) if isinstance(obj, torch.optim.Optimizer | AccelerateDummyOptim)]
        dummy_scheduler = next((obj for obj in args if isinstance(obj, AccelerateDummyScheduler)), None)
        if len(optimizers) > 1:
            raise ValueError(f"ds_plugin's Accelerator trains one optimizer (as DeepSpeed); got {len(optimizers)}")
        trained = [i for i, obj in enumerate(args) if isinstance(obj, nn.Module) and self._trains(obj)]
        for i, obj in enumerate(args):
            if isinstance(obj, nn.Module) and i not in trained:
                out[i] = super().prepare_model(obj, device_placement=placement[i], evaluation_mode=True)
        if len(trained) > 1:
            raise ValueError(
                f"ds_plugin.accelerate.Accelerator trains one model (as DeepSpeed); {len(trained)} models with "
                "trainable parameters were passed"
            )
        optimizer = args[optimizers[0]] if optimizers else None
        self._take_auto_values(optimizer, dummy_scheduler)
        if isinstance(optimizer, AccelerateDummyOptim):
            optimizer = FROM_CONFIG
        if trained:
            self._prepare_trained(args[trained[0]], optimizer)
        if optimizers:
            out[optimizers[0]] = self.prepare_optimizer(optimizer)
        for i, obj in enumerate(args):
            if isinstance(obj, torch.optim.lr_scheduler.LRScheduler | AccelerateDummyScheduler):
                out[i] = self.prepare_scheduler(obj)
        return tuple(out) if len(out) > 1 else out[0]

    def _take_auto_values(self, optimizer: Any, scheduler: Any) -> None:
        """Record what DummyOptim / DummyScheduler say for the JSON's "auto" params (Accelerate's rule)."""
        values = auto_values(optimizer, scheduler, num_processes=self.num_processes, split_batches=self.split_batches)
        if values:
            self.fill_config_auto(values)

    def fill_config_auto(self, values: dict[str, Any]) -> None:
        """Values for "auto" params of the config's `optimizer` / `scheduler` blocks (what the HF Trainer's arguments
        or `DummyOptim` / `DummyScheduler` say); only "auto" is replaced.

        Args:
            values: dotted key -> value, e.g. {"optimizer.params.lr": 3e-4, "scheduler.params.total_num_steps": 100}.
        """
        self._auto_values.update(values)
        if self._plan is not None:  # the model was prepared first: fill the plan it was resolved into
            opt, sched = fill_auto(self._plan.optimizer, self._plan.scheduler, self._auto_values)
            self._plan = dataclasses.replace(self._plan, optimizer=opt, scheduler=sched)

    def _prepare_trained(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        engine = self._engine
        if engine is not None and engine.module is model:
            if optimizer is not None and engine.optimizer is None:
                self._setup_with_optimizer(model, optimizer)  # the delayed-optimizer route
            return
        if isinstance(optimizer, ZeroAcceleratedOptimizer):
            raise ValueError("this optimizer was prepared for another model; build a new one on this model")
        if optimizer is None:
            self._setup_engine(model, None)
        else:
            self._setup_with_optimizer(model, optimizer)

    def _setup_with_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer | str) -> None:
        if optimizer == FROM_CONFIG:
            block = self._plan.optimizer if self._plan is not None else self.zero_plugin.training_config.optimizer
            if block is None:
                raise ValueError(
                    'DummyOptim: the DeepSpeed config has no optimizer block; add one ("optimizer": {"type": "AdamW", '
                    "...}) or pass a torch optimizer"
                )
            self._setup_engine(model, FROM_CONFIG)
            return
        source = self._unwrap_optimizer(optimizer)
        engine = self._setup_engine(model, source)
        if source is not engine.optimizer:
            # Rebuilt on the master shards: LR schedulers built on the user's optimizer are re-pointed to the new one.
            self._source_optimizers.append(source)

    @staticmethod
    def _unwrap_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        while hasattr(optimizer, "optimizer") and isinstance(optimizer.optimizer, torch.optim.Optimizer):
            optimizer = optimizer.optimizer
        return optimizer

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        """A model with trainable parameters goes to the engine (its optimizer may follow in a later `prepare`);
        `evaluation_mode=True` or a frozen model is placed as Accelerate does, without DDP.

        Args:
            model: the model.
            device_placement: for a frozen model: place it on the device (default the Accelerator's setting).
            evaluation_mode: prepare for inference only.
        """
        if evaluation_mode or not self._trains(model):
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)
        self._prepare_trained(model, None)
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        """The engine's optimizer (rebuilt on the fp32 master shards from `optimizer`), wrapped for Accelerate.

        Args:
            optimizer: an optimizer built on the model's parameters (before or after `prepare(model)`).
            device_placement: ignored: the engine keeps optimizer state beside the master shards.
        """
        if isinstance(optimizer, ZeroAcceleratedOptimizer) and optimizer.engine is self._engine:
            return optimizer
        if isinstance(optimizer, AccelerateDummyOptim):
            self._take_auto_values(optimizer, None)
            optimizer = FROM_CONFIG
        if optimizer == FROM_CONFIG and self._engine is not None and self._engine.optimizer is not None:
            return self._wrapped_optimizer()
        if self._engine is None:
            raise ValueError(
                "prepare the model before (or together with) its optimizer: the engine rebuilds the optimizer on the "
                "model's ZeRO parameters"
            )
        if self._engine.optimizer is None:
            self._setup_with_optimizer(self._engine.module, optimizer)
        elif self._unwrap_optimizer(optimizer) not in (self._engine.optimizer, *self._source_optimizers):
            raise ValueError("ds_plugin's Accelerator trains one optimizer (as DeepSpeed); one is prepared already")
        return self._wrapped_optimizer()

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """Accelerate's scheduler wrapper, re-pointed at the engine's optimizer if it was built on the original one.

        Args:
            scheduler: an LR scheduler, or a `DummyScheduler`: the config's `scheduler` block (or its
                `lr_scheduler_callable`) on the engine's optimizer, stepped by the engine.
        """
        if isinstance(scheduler, AccelerateDummyScheduler):
            return self._prepare_config_scheduler(scheduler)
        if self._engine is not None and self._engine.optimizer is not None:
            if any(getattr(scheduler, "optimizer", None) is opt for opt in self._source_optimizers):
                repoint_scheduler(scheduler, self._engine.optimizer)
        return super().prepare_scheduler(scheduler)

    def _prepare_config_scheduler(self, scheduler: Any) -> EngineScheduler:
        engine = self._engine
        if engine is None or engine.optimizer is None:
            raise ValueError("DummyScheduler: prepare the model and its optimizer (or DummyOptim) first, or together")
        if engine.lr_scheduler is None:
            self._take_auto_values(None, scheduler)
            if scheduler.lr_scheduler_callable is not None:
                engine.set_lr_scheduler(scheduler.lr_scheduler_callable(engine.optimizer))
            else:  # the plan's block, filled with this DummyScheduler's values above
                attach_config_scheduler(engine, self._plan.scheduler)
            if engine.lr_scheduler is None:
                raise ValueError(
                    'DummyScheduler: the DeepSpeed config has no scheduler block; add one ("scheduler": {"type": '
                    '"WarmupLR", ...}) or pass a torch LR scheduler'
                )
        return EngineScheduler(engine)

    def prepare_data_loader(self, data_loader: DataLoader, device_placement: bool | None = None, **kwargs: Any) -> Any:
        """Accelerate's dataloader; the first one's per-process batch size fills an "auto" micro batch size.

        Args:
            data_loader: a DataLoader.
            device_placement: put batches on the device (default the Accelerator's setting).
            kwargs: passed to Accelerate (`slice_fn_for_dispatch`).
        """
        if self._micro_batch is None and not getattr(data_loader, "_is_accelerate_prepared", False):
            size = dataloader_batch_size(data_loader)
            if size:
                self._micro_batch = max(1, size // self.num_processes) if self.split_batches else size
                micro = self.zero_plugin.training_config.train_micro_batch_size_per_gpu
                if isinstance(micro, int) and micro != self._micro_batch:
                    raise ConfigError(
                        f"train_micro_batch_size_per_gpu: the config says {micro} but the DataLoader gives "
                        f'{self._micro_batch} per process; make them agree (or write "auto" in the config)'
                    )
        return super().prepare_data_loader(data_loader, device_placement=device_placement, **kwargs)

    # ------------------------------------------------------------------ steps

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """The engine's backward of `loss / gradient_accumulation_steps` (as Accelerate scales it); gradients are
        reduced only at the accumulation boundary (`sync_gradients`).

        Args:
            loss: this micro-batch's loss.
            kwargs: `retain_graph`.
        """
        engine = self._engine
        if engine is None:
            return super().backward(loss, **kwargs)
        if kwargs.get("learning_rate") is not None:
            raise ValueError("backward(learning_rate=...) is LOMO's fused step, which the ZeRO engine does not run")
        engine.set_gradient_accumulation_boundary(self.sync_gradients)
        engine.backward(
            loss / self.gradient_accumulation_steps, retain_graph=bool(kwargs.get("retain_graph")), scale_wrt_gas=False
        )
        if not self.sync_gradients:
            engine.step()  # counts the micro-step; the optimizer steps at the boundary
        return None

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Keep this model's gradients local (the engine's `no_sync`); other models as Accelerate does.

        Args:
            model: a prepared model.
        """
        if self._engine is not None and model is self._engine.module:
            with self._engine.no_sync():
                yield
        else:
            with super().no_sync(model):
                yield

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        """Clip the engine's gradients to a global L2 norm now (averaged, fp16: unscaled); returns the norm before.

        Args:
            parameters: the model's parameters (the engine clips all of its trainable gradients, as DeepSpeed).
            max_norm: the largest allowed norm (inf: only measure it).
            norm_type: 2 only.
        """
        if self._engine is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        if norm_type != 2:
            raise ValueError(f"the ZeRO engine clips by the global L2 norm; norm_type={norm_type} is not supported")
        return self._engine.clip_grad_norm_(float(max_norm))

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Clamp the engine's gradients to [-clip_value, clip_value] (fp16: unscaled), before the step.

        Args:
            parameters: the model's parameters (the engine clamps all of its trainable gradients).
            clip_value: the largest allowed magnitude.
        """
        if self._engine is None:
            return super().clip_grad_value_(parameters, clip_value)
        self._engine.clip_grad_value_(float(clip_value))
        return None

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Nothing with the engine: it unscales fp16 gradients itself before clipping and stepping.

        Args:
            optimizer: ignored.
        """
        if self._engine is None:
            super().unscale_gradients(optimizer)

    # ------------------------------------------------------------------ state (save_state / load_state /
    # get_state_dict: EngineCheckpointing)

    def free_memory(self, *objects: Any) -> Any:
        """Accelerate's `free_memory`, dropping the engine too.

        Args:
            objects: as in Accelerate.
        """
        self._engine = None
        self._plan = None
        self._source_optimizers = []
        self._auto_values = {}
        return super().free_memory(*objects)
