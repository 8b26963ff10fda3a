"""`initialize` and `add_config_arguments`: the entry of a DeepSpeed script (`ds_plugin.deepspeed` re-exports them)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ds_plugin.config import ConfigError, TrainingConfig, from_deepspeed
from ds_plugin.deepspeed import zero
from ds_plugin.deepspeed.comm import init_distributed
from ds_plugin.deepspeed.engine import DeepSpeedEngine
from ds_plugin.optimizer_config import build_optimizer, refuse_auto
from ds_plugin.zero.mesh import data_parallel_mesh
from ds_plugin.zero.plan import refuse_framework_auto, resolve_plan
from ds_plugin.zero.setup import FROM_CONFIG, attach_config_scheduler, repoint_scheduler, setup_zero

__all__ = ["add_config_arguments", "initialize"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's command-line flags: `--deepspeed`, `--deepspeed_config` (and the old `--deepscale*`).

    Args:
        parser: the script's parser.

    Returns:
        The same parser.
    """
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed", default=False, action="store_true", help="enable DeepSpeed (a flag for the script)"
    )
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def _read_config(args: Any, config: Any, config_params: Any) -> TrainingConfig:
    """The one config, from the call or from `args`; one-line errors before any process group starts."""
    if config is not None and config_params is not None:
        raise ConfigError("initialize: config and config_params are both given; pass one")
    config = config if config is not None else config_params
    from_args = None
    if args is not None:
        from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is not None and from_args is not None:
        raise ConfigError(
            f"initialize: a config is passed and args.deepspeed_config={from_args!r} too; keep one of them"
        )
    config = config if config is not None else from_args
    if config is None:
        raise ConfigError("initialize: no DeepSpeed config; pass config=... or run the script with --deepspeed_config")
    return from_deepspeed(config)


def _local_rank(args: Any) -> int:
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    value = getattr(args, "local_rank", None) if args is not None else None
    return int(value) if value is not None and int(value) >= 0 else 0


def _optimizer_spec(optimizer: Any, model_parameters: Any, cfg: TrainingConfig, model: nn.Module) -> Any:
    """What `setup_zero` builds the optimizer from: the code's optimizer (or callable) wins over the JSON's."""
    if optimizer is not None:
        return optimizer  # a DeepSpeed callable is called with the trainable fp32 master parameters
    if cfg.optimizer is None:
        return None
    if model_parameters is None:
        return FROM_CONFIG
    # The JSON's optimizer on the caller's parameters and param groups (weight decay per group, a frozen part left
    # out), built before setup and rebuilt on the masters with the same groups.
    params = list(model_parameters)
    own = {id(p) for p in model.parameters()}
    loose = [p for p in params if isinstance(p, torch.Tensor)]
    if any(id(p) not in own for p in loose):
        raise ValueError("initialize: model_parameters holds parameters that are not the model's; pass its parameters")
    return FROM_CONFIG if not params else ("groups", params)


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None = None,
    model_parameters: Any = None,
    training_data: torch.utils.data.Dataset | None = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[..., Any] | None = None,
    config: str | os.PathLike | dict[str, Any] | None = None,
    mesh_param: Any = None,
    config_params: str | dict[str, Any] | None = None,
) -> tuple[DeepSpeedEngine, Any, Any, Any]:
    """DeepSpeed's `initialize`: returns `(engine, optimizer, training_dataloader, lr_scheduler)`.

    Args:
        args: the script's arguments: `deepspeed_config` (the config's path) and `local_rank` are read.
        model: the model (built inside `zero.Init()` or not).
        optimizer: a torch optimizer (on the model's parameters, rebuilt on the fp32 masters), a callable
            `params -> optimizer` (called with the masters), or None for the JSON's `optimizer` block.
        model_parameters: the parameters (or param groups) the JSON's optimizer steps; default all trainable ones.
        training_data: a Dataset: a DataLoader over this rank's part of it is returned (DistributedSampler, the
            config's micro batch).
        lr_scheduler: a scheduler on `optimizer`, a callable `optimizer -> scheduler`, or None for the JSON's
            `scheduler` block; the engine steps it after every applied optimizer step.
        distributed_port: `MASTER_PORT` when the launcher set none.
        mpu: model parallelism: not supported (must be None).
        dist_init_required: False: the process group must already exist.
        collate_fn: the DataLoader's collate function.
        config: the DeepSpeed config: a path or a dict.
        mesh_param: DeepSpeed's sequence/data-parallel mesh: not supported (must be None).
        config_params: the old name of `config`.

    Raises:
        ConfigError: a missing or invalid config, one line, before any process group starts.
    """
    if model is None:
        raise ValueError("initialize: model is required")
    if mpu is not None or mesh_param is not None:
        raise ValueError("initialize: mpu / mesh_param (model or sequence parallelism) are not part of ds_plugin")
    cfg = _read_config(args, config, config_params)
    # Nothing fills "auto" here (DeepSpeed refuses it too): say so before the process group starts.
    refuse_framework_auto(cfg)
    if optimizer is None and cfg.optimizer is not None:
        refuse_auto(cfg.optimizer.params, "optimizer")
    if lr_scheduler is None and cfg.scheduler is not None:
        refuse_auto(cfg.scheduler.params, "scheduler")
    spec = _optimizer_spec(optimizer, model_parameters, cfg, model)
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    mesh = data_parallel_mesh()
    plan = resolve_plan(cfg, world_size=mesh.size(), device_type=mesh.device_type)
    source = None
    if isinstance(spec, tuple):  # the JSON's optimizer on the caller's param groups
        spec = source = build_optimizer(plan.optimizer, spec[1])
    elif isinstance(spec, torch.optim.Optimizer):
        source = spec
    engine = setup_zero(model, plan, spec, mesh=mesh)
    zero.register_engine(engine)
    if lr_scheduler is not None:
        if not hasattr(lr_scheduler, "step") and callable(lr_scheduler):
            lr_scheduler = lr_scheduler(engine.optimizer)
        elif source is not None:
            repoint_scheduler(lr_scheduler, engine.optimizer)
        engine.set_lr_scheduler(lr_scheduler)
    else:
        attach_config_scheduler(engine)
    loader = None
    if training_data is not None:
        micro = plan.config.train_micro_batch_size_per_gpu
        if micro is None:
            raise ConfigError(
                "train_micro_batch_size_per_gpu: needed to batch training_data; set it (or train_batch_size)"
            )
        sampler = torch.utils.data.DistributedSampler(training_data, num_replicas=mesh.size(), rank=mesh.get_rank())
        loader = torch.utils.data.DataLoader(
            training_data, batch_size=int(micro), sampler=sampler, collate_fn=collate_fn
        )
    wrapped = DeepSpeedEngine(engine, loader, _local_rank(args))
    return wrapped, engine.optimizer, loader, engine.lr_scheduler
