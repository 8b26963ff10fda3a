"""Sharded initialisation, the role of DeepSpeed's `zero.Init`: no rank ever holds the whole model.

`init_sharded(model_fn, config)` builds the model with its parameters on the meta device (`meta_init`),
applies ZeRO to the empty model, then allocates only each rank's shards and runs the model's own
initialisation on them (`materialize_`). Random initialisers called on a sharded parameter draw the *full*
tensor from the global generator and keep this rank's rows, so the result does not depend on the world size
(DTensor's own random ops do not give that on CPU: each rank would draw the same numbers for its own shard).
One parameter's full tensor exists at a time; DeepSpeed's zero.Init holds one module's. Writes through an
index of a sharded parameter (`weight[i].zero_()`) land in a gathered copy and are lost; the one the default
schemes make, an embedding's padding row, is redone on the shard; a custom `init_fn` must avoid them.

What "the model's own initialisation" is: the `init_fn` passed in; else, for a transformers model (the root or
any outermost one inside it), its `_init_weights` on every module (children first, as `post_init` does), and
for every module outside such models its `reset_parameters()`. A plain `nn.Module` whose layers initialise
themselves in `reset_parameters` gets exactly the weights eager construction with the same seed gives. A
transformers model does not: eager construction first draws the default initialisation of every layer and
`post_init` then overwrites it, so the generator has moved on; the weights here are those of `post_init` run
on a fresh seed, identical at every world size.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.overrides import TorchFunctionMode

from ds_plugin.config import TrainingConfig
from ds_plugin.zero.apply import apply_zero
from ds_plugin.zero.mesh import ZeroSetupError, data_parallel_mesh, mesh_device
from ds_plugin.zero.plan import ZeroPlan, plan_for
from ds_plugin.zero.stage1 import shard_rows
from ds_plugin.zero.wrap import BlockTypes

__all__ = ["PENDING_LOAD", "init_sharded", "materialize_", "meta_init"]

PENDING_LOAD = "_ds_plugin_pending_load"
"""A module whose `__dict__` holds a callable under this name is filled by it, not initialised, when `materialize_`
allocates it (`ds_plugin.load_pretrained(..., defer=True)`: the checkpoint's rows, read shard by shard)."""

logger = logging.getLogger(__name__)

_INIT = torch.nn.init
_RANDOM = {
    torch.Tensor.normal_,
    torch.Tensor.uniform_,
    torch.Tensor.bernoulli_,
    torch.Tensor.exponential_,
    torch.Tensor.geometric_,
    torch.Tensor.log_normal_,
    torch.Tensor.cauchy_,
    torch.Tensor.random_,
    _INIT.normal_,
    _INIT.uniform_,
    _INIT.trunc_normal_,
    _INIT.kaiming_normal_,
    _INIT.kaiming_uniform_,
    _INIT.xavier_normal_,
    _INIT.xavier_uniform_,
    _INIT.orthogonal_,
    _INIT.sparse_,
}


@contextlib.contextmanager
def meta_init() -> Iterator[None]:
    """Parameters registered inside the block live on the meta device; buffers stay real.

    Buffers are usually small and computed in the constructor (rotary frequencies, masks), which a meta
    tensor cannot remember, so only parameters move. Patches `nn.Module.register_parameter` while active
    (as accelerate's `init_empty_weights` does); not thread-safe.
    """
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            kwargs = {**param.__dict__, "requires_grad": param.requires_grad}
            module._parameters[name] = type(param)(param.to("meta"), **kwargs)

    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def _local_part(full: torch.Tensor, target: DTensor) -> torch.Tensor:
    if target.device_mesh.ndim != 1:
        raise ZeroSetupError("sharded init supports 1-D meshes only; initialise before sharding on 2-D meshes")
    placement = target.placements[0]
    if isinstance(placement, Shard):
        mesh = target.device_mesh
        start, length = shard_rows(full.shape[placement.dim], mesh.size(), mesh.get_local_rank())
        return full.narrow(placement.dim, start, length)
    return full


class _FullThenShard(TorchFunctionMode):
    """Random in-place initialisers on a DTensor: draw the full tensor, keep the local shard."""

    def __init__(self) -> None:
        super().__init__()
        self.peak_bytes = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        if func not in _RANDOM or not isinstance(target, DTensor):
            return func(*args, **kwargs)
        local = target.to_local()
        full = torch.empty(target.shape, dtype=target.dtype, device=local.device)
        self.peak_bytes = max(self.peak_bytes, full.numel() * full.element_size())
        if args:
            func(full, *args[1:], **kwargs)
        else:
            func(**{**kwargs, "tensor": full})
        with torch.no_grad():
            local.copy_(_local_part(full, target))
        return target


def _is_hf_model(module: nn.Module) -> bool:
    return callable(getattr(module, "_init_weights", None)) and hasattr(module, "config")


def _hf_init(module: nn.Module, owner: nn.Module) -> None:
    # transformers' post_init order: children first, each sub-model with its own _init_weights.
    for child in module.children():
        _hf_init(child, child if _is_hf_model(child) else owner)
    owner._init_weights(module)


def _zero_padding_rows(model: nn.Module) -> None:
    # Both default schemes zero an embedding's padding row through `weight[padding_idx]`, which on a DTensor
    # writes into a gathered copy and is lost; zero the row in whichever local shard holds it.
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Embedding) and module.padding_idx is not None and isinstance(weight, DTensor):
            mesh = weight.device_mesh
            start, length = shard_rows(weight.shape[0], mesh.size(), mesh.get_local_rank())
            row = module.padding_idx % weight.shape[0]
            if start <= row < start + length:
                weight.to_local()[row - start].zero_()


def _default_init(model: nn.Module, skip: frozenset[int] = frozenset()) -> None:
    # Each outermost transformers model, the root or one a wrapper holds (a LightningModule, a peft model),
    # initialises as its post_init would; every module outside them resets itself. `skip`: modules a checkpoint
    # filled.
    inside: set[int] = set(skip)
    for module in model.modules():  # outer before inner
        if id(module) not in inside and _is_hf_model(module):
            _hf_init(module, module)
            inside.update(id(m) for m in module.modules())
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        if id(module) not in inside and callable(reset):
            reset()
    _zero_padding_rows(model)


def _retie(model: nn.Module, groups: list[list[str]]) -> None:
    # to_empty gives every module its own new Parameter when leaving the meta device, which unties shared
    # weights (an LM head tied to its embedding); FSDP2 keeps them, plain modules need them put back.
    for names in groups:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, leaf = name.rpartition(".")
            module = model.get_submodule(owner)
            if module._parameters[leaf] is not first:
                setattr(module, leaf, first)


def _agreed_seed(seed: int | None) -> int:
    if seed is not None:
        return int(seed)
    chosen = [torch.initial_seed() % (1 << 63)]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(chosen, src=0)  # one seed for all ranks, so the shards fit together
    return int(chosen[0])


def materialize_(
    model: nn.Module,
    *,
    device: torch.device | str | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
    seed: int | None = None,
) -> int:
    """Allocate a meta-device model's parameters (only the local shards of sharded ones) and initialise them.

    Args:
        model: a model built under `meta_init`, sharded by `apply_zero` or not.
        device: where the parameters go; default the device of the first DTensor's mesh, else CPU.
        init_fn: called once with the model to initialise it; default the model's own scheme (module doc).
        seed: seed of the initialisation (the caller's generator is left untouched); None takes rank 0's
            current seed, shared with every rank.

    Returns:
        The largest temporary full tensor held at once, in bytes (0 when nothing was sharded).
    """
    if device is None:
        dt = next((p for p in model.parameters() if isinstance(p, DTensor)), None)
        device = mesh_device(dt.device_mesh) if dt is not None else torch.device("cpu")
    device = torch.device(device)
    seed = _agreed_seed(seed)
    saved = {name: b for name, b in model.named_buffers() if b.device.type != "meta"}
    tied: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(p), []).append(name)
    model.to_empty(device=device)
    _retie(model, [names for names in tied.values() if len(names) > 1])
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in saved:
                b.copy_(saved[name])
    # Modules a checkpoint fills (`load_pretrained(..., defer=True)`) are read, not initialised.
    pending = [(m, m.__dict__.pop(PENDING_LOAD)) for m in model.modules() if PENDING_LOAD in m.__dict__]
    for module, load in pending:
        load(module)
    loaded = frozenset(id(x) for m, _ in pending for x in m.modules())
    if init_fn is None and all(id(m) in loaded for m in model.modules() if next(m.parameters(False), None) is not None):
        return 0
    devices = [device.index or 0] if device.type == "cuda" else []
    mode = _FullThenShard()
    with torch.random.fork_rng(devices=devices), torch.no_grad(), mode:
        torch.manual_seed(seed)
        if init_fn is not None:
            init_fn(model)
        else:
            _default_init(model, loaded)
    return mode.peak_bytes


def init_sharded(
    model_fn: Callable[[], nn.Module],
    config: ZeroPlan | TrainingConfig | dict[str, Any] | str,
    *,
    mesh: DeviceMesh | None = None,
    block_types: BlockTypes | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
    seed: int | None = None,
) -> nn.Module:
    """Build a ZeRO model without any rank materialising the full parameter set (stages 2 and 3).

    Stages 0 and 1 keep whole parameters on every rank by definition, so there the model is initialised
    whole (the same way, the same values) and then handed to `apply_zero`.

    Args:
        model_fn: builds the model, e.g. `lambda: GPT2LMHeadModel(cfg)`; run under `meta_init`.
        config: a `ZeroPlan`, a `TrainingConfig`, a preset name, a DeepSpeed config dict or the path to one.
        mesh: the 1-D data-parallel mesh; default all ranks.
        block_types: blocks to shard separately (see `apply_zero`).
        init_fn: the initialisation, called once with the model (default: see the module doc).
        seed: initialisation seed; the same seed gives the same weights at every world size and stage.
    """
    mesh = data_parallel_mesh(mesh)
    plan = plan_for(config, mesh)
    with meta_init():
        model = model_fn()
    if plan.stage >= 2:
        model = apply_zero(model, plan, mesh=mesh, block_types=block_types)
        peak = materialize_(model, device=mesh_device(mesh), init_fn=init_fn, seed=seed)
        logger.debug("sharded init: largest temporary tensor %d bytes", peak)
        return model
    materialize_(model, device=mesh_device(mesh), init_fn=init_fn, seed=seed)
    return apply_zero(model, plan, mesh=mesh, block_types=block_types)
