"""`setup_zero`: apply a `ZeroPlan` to a model and an optimizer, in one fixed order, for every entry point.

`initialize` (DeepSpeed's verb), the Lightning Trainer and Fabric strategies and the Accelerate adapter all end here
(as any new adapter should); each resolves its inputs into a plan first (`plan.py`) and keeps only what is
framework-specific. From here down the code takes the `ZeroPlan` (and torch dtypes), never a raw config. The order,
and why:

1. materialise a meta-device model at stages 0/1 (they keep whole weights on every rank anyway);
2. `apply_plan`: rank 0's weights to every rank → FP8 layers → fp32 masters → shard or replicate → ZeRO++
   collectives (see `apply.py` for the reasons inside that step);
3. materialise a meta-device model at stages 2/3, now that each rank allocates only its own shards;
4. the engine, with the comms logger switched on when the config asks for it;
5. its optimizer, rebuilt on the fp32 master parameters by `engine.set_optimizer` (an optimizer built on the
   model's parameters before setup is mapped across by parameter name; `repoint_scheduler` moves an LR scheduler
   built on it to the rebuilt one). With `optimizer="config"` it is the config's `optimizer` block, built on the
   masters; `initialize` then builds the config's `scheduler` block on it (`attach_config_scheduler`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ds_plugin.optimizer_config import SchedulerConfig, build_optimizer, build_scheduler
from ds_plugin.presets import ConfigSource
from ds_plugin.runtime.comms_logger import comms_logger_from_config
from ds_plugin.runtime.cpu_bf16 import warn_slow_bf16
from ds_plugin.zero.apply import apply_plan, has_fp8_layers, is_zero_applied
from ds_plugin.zero.engine import ZeroEngine
from ds_plugin.zero.init import materialize_
from ds_plugin.zero.mesh import ZeroSetupError, data_parallel_mesh, mesh_device
from ds_plugin.zero.optimizer import OptimizerSpec
from ds_plugin.zero.plan import ZeroPlan, plan_for
from ds_plugin.zero.wrap import BlockTypes

__all__ = ["FROM_CONFIG", "attach_config_scheduler", "has_meta", "initialize", "repoint_scheduler", "setup_zero"]

FROM_CONFIG = "config"
"""`setup_zero(optimizer=FROM_CONFIG)`: build the optimizer from the config's `optimizer` block."""

logger = logging.getLogger(__name__)


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer is still on the meta device.

    Args:
        module: any module.
    """
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def setup_zero(
    model: nn.Module,
    plan: ZeroPlan,
    optimizer: OptimizerSpec | str | None = None,
    *,
    mesh: DeviceMesh,
    block_types: BlockTypes | None = None,
    sync_module_states: bool = True,
    device: torch.device | None = None,
) -> ZeroEngine:
    """Apply `plan` to `model` (and the optimizer) and return the engine that trains it.

    A model that already went through `apply_zero` (a Lightning `configure_model`, or an earlier setup) is not
    sharded again; a new engine is built on it.

    Args:
        model: the model, on CPU, its accelerator or the meta device.
        plan: the resolved plan (`resolve_plan`), for `mesh`'s world size.
        optimizer: a factory `params -> optimizer` (called with the trainable fp32 master parameters; it may also
            build on the model's own parameters), or an optimizer built on `model.parameters()` that has not
            stepped (rebuilt with the same class and param groups); `FROM_CONFIG` ("config") for the config's
            `optimizer` block (and its `scheduler` block); None for an engine without one.
        mesh: the 1-D data-parallel mesh.
        block_types: blocks to shard separately (see `apply_zero`).
        sync_module_states: start every rank from the first rank's weights (see `apply_zero`).
        device: where a meta-device model is materialised; default this rank's mesh device.

    Raises:
        ZeroSetupError: a model or optimizer the plan cannot be applied to (one line).
    """
    plan.check_world(mesh.size())
    warn_slow_bf16(plan.device_type, plan.compute_dtype)
    from_config = isinstance(optimizer, str)
    if from_config:
        if optimizer != FROM_CONFIG or plan.optimizer is None:
            raise ZeroSetupError(
                "optimizer: no optimizer passed and the config has no optimizer block; pass one in code or add "
                '"optimizer": {"type": "AdamW", "params": {...}} to the config'
            )
        block = plan.optimizer
        optimizer = lambda params: build_optimizer(block, params)  # noqa: E731
    device = device or mesh_device(mesh)
    originals = {id(p): name for name, p in model.named_parameters()}
    if is_zero_applied(model):
        if plan.fp8 is not None and not has_fp8_layers(model):
            raise ZeroSetupError(
                "fp8: the model was sharded before FP8 layers were swapped in (e.g. in configure_model); call "
                "ds_plugin.precision.fp8_linear.convert_to_fp8_training(model, config.fp8) before apply_zero"
            )
    else:
        meta = has_meta(model)
        if meta and plan.stage < 2:
            materialize_(model, device=device)
            meta = False
        apply_plan(model, plan, mesh=mesh, block_types=block_types, sync_module_states=sync_module_states)
        if meta:
            materialize_(model, device=device)
    engine = ZeroEngine(model, plan, mesh=mesh, comms_logger=_comms_logger(plan, mesh))
    if optimizer is not None:
        engine.set_optimizer(optimizer, names=originals)
    return engine


def attach_config_scheduler(engine: ZeroEngine, block: SchedulerConfig | None = None) -> None:
    """Build the config's `scheduler` block on the engine's optimizer and let the engine step it (DeepSpeed's rule:
    the JSON's scheduler applies when none is passed in code, whichever built the optimizer).

    Args:
        engine: an engine with an optimizer; nothing happens without a `scheduler` block.
        block: the block to build; default the engine's plan's (an adapter passes the one it filled "auto" in since).
    """
    block = block if block is not None else engine.plan.scheduler
    if block is not None and engine.optimizer is not None:
        engine.set_lr_scheduler(build_scheduler(block, engine.optimizer))


def _comms_logger(plan: ZeroPlan, mesh: DeviceMesh) -> Any:
    if plan.comms_logger is None:
        return None
    log = comms_logger_from_config(plan.comms_logger)
    log.label_mesh(mesh)
    return log


def initialize(
    model: nn.Module,
    config: ZeroPlan | ConfigSource,
    optimizer: OptimizerSpec | None = None,
    *,
    mesh: DeviceMesh | None = None,
    block_types: BlockTypes | None = None,
    sync_module_states: bool = True,
) -> ZeroEngine:
    """DeepSpeed's `initialize`: apply ZeRO to the model, put the optimizer on its master shards.

    Args:
        model: the model (or one `apply_zero` already returned); a meta-device model is materialised.
        config: a preset name, a DeepSpeed config dict or the path to one, a `TrainingConfig`, or a `ZeroPlan`.
            Its `fp8` block swaps in FP8 layers and its `comms_logger` block starts the comms logger
            (`engine.comms_logger`).
        optimizer: a factory `params -> optimizer` (called with the trainable master parameters), or an
            optimizer built on `model.parameters()` that has not stepped (rebuilt with the same class and
            param-group hyper-parameters; build LR schedulers on `engine.optimizer`). None: the config's `optimizer`
            block when it has one, else no optimizer. Either way the config's `scheduler` block, when it has one, is
            built on the engine's optimizer and stepped by `engine.step()` (DeepSpeed's rule).
        mesh: the 1-D data-parallel mesh; default all ranks.
        block_types: blocks to shard separately (see `apply_zero`).
        sync_module_states: start every rank from the first rank's weights (see `apply_zero`).
    """
    mesh = data_parallel_mesh(mesh)
    plan = plan_for(config, mesh)
    if optimizer is None and plan.optimizer is not None:
        optimizer = FROM_CONFIG
    engine = setup_zero(
        model,
        plan,
        optimizer,
        mesh=mesh,
        block_types=block_types,
        sync_module_states=sync_module_states,
    )
    attach_config_scheduler(engine)
    return engine


def repoint_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Point an LR scheduler built on the user's optimizer at the one setup rebuilt on the masters (step 5).

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
