"""The optimizer on the fp32 master shards: building it, clipping its gradients, naming its state.

Any `torch.optim` optimizer works because ZeRO only changes *which* tensors it steps: the sharded DTensor
parameters (stages 2/3) or the master DTensors (stages 0/1). A user's optimizer built on the original model
is rebuilt with the same class and param-group hyper-parameters over those tensors. Gradient clipping takes
the global norm across shards, which equals `clip_grad_norm_` on the unsharded model. Optimizer state dicts
for stages 0/1 use the layout `torch.distributed.checkpoint.state_dict` gives FSDP2 (parameter names as keys,
`Shard(0)` DTensors as values), so checkpoints move between stages.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ds_plugin.zero.mesh import ZeroSetupError

__all__ = [
    "LocalShards",
    "OptimizerSpec",
    "build_optimizer",
    "clip_grad_norm_",
    "init_optimizer_state",
    "load_named_optimizer_state_dict",
    "named_optimizer_state_dict",
    "needs_local_shards",
]

logger = logging.getLogger(__name__)

OptimizerSpec = torch.optim.Optimizer | Callable[[list[nn.Parameter]], torch.optim.Optimizer]


#: torch optimizers with a fused kernel for whole parameter lists (CPU and CUDA) that DTensor parameters can take
#: (DTensor has sharding rules for `_fused_adam_` / `_fused_adamw_`, not for fused SGD or Adagrad).
_FUSED = (torch.optim.Adam, torch.optim.AdamW)


def build_optimizer(spec: OptimizerSpec, params: list[nn.Parameter], replacement: dict[int, nn.Parameter]) -> Any:
    """The optimizer over the ZeRO parameters, fused where torch has a kernel and the user chose no implementation.

    torch's Adam and AdamW step one parameter at a time on CPU unless `fused=True` or `foreach=True` is passed;
    the fused kernel is 4-5x faster there (AdamW over 8M fp32 elements in 52 tensors: 46 ms per step, fused
    10 ms). DeepSpeed steps its own fused optimizers too. When every param group leaves both `fused` and `foreach`
    unset (None), `fused` is switched on; the numbers agree with the per-parameter loop to float rounding. An
    optimizer that sets either keeps what it says.

    Args:
        spec: a factory called with the trainable ZeRO parameters (its optimizer may be built on those or on the
            model's own parameters), or an optimizer built on the original model's parameters (rebuilt: same
            class, same param groups and hyper-parameters; it must not have stepped yet, and is emptied so it
            cannot keep the unsharded weights alive).
        params: the trainable ZeRO parameters (what the optimizer steps).
        replacement: id(original parameter) -> its ZeRO parameter (frozen ones included).

    Raises:
        ZeroSetupError: the optimizer holds state already, or a parameter that is not the model's.
    """
    optimizer = _build(spec, params, replacement)
    if isinstance(optimizer, _FUSED):
        _fuse_where_unset(optimizer)
    return optimizer


def _fuse_where_unset(optimizer: torch.optim.Optimizer) -> None:
    groups = optimizer.param_groups
    if any(g.get("fused") is not None or g.get("foreach") is not None or g.get("differentiable") for g in groups):
        return
    supported = set(torch.utils._foreach_utils._get_fused_kernels_supported_devices())
    tensors = [p for g in groups for p in g["params"]]
    if not tensors or any(p.device.type not in supported or not p.is_floating_point() for p in tensors):
        return
    for group in groups:
        group["fused"] = True
    optimizer.defaults["fused"] = True
    logger.info("%s steps with torch's fused kernel (fused=True)", type(optimizer).__name__)


def _build(spec: OptimizerSpec, params: list[nn.Parameter], replacement: dict[int, nn.Parameter]) -> Any:
    if not isinstance(spec, torch.optim.Optimizer):
        if not callable(spec):
            raise ZeroSetupError(f"optimizer: {type(spec).__name__} is neither a torch optimizer nor a factory")
        spec = spec(params)
        if not isinstance(spec, torch.optim.Optimizer):
            return spec
        # A factory may also build on the model's own parameters (Lightning's configure_optimizers does): then
        # it is rebuilt on the ZeRO parameters below, like an optimizer passed directly.
    own = {id(p) for p in params} | {id(p) for p in replacement.values()}
    if all(id(p) in own for g in spec.param_groups for p in g["params"]):
        return spec  # already built on the ZeRO parameters
    if spec.state:
        raise ZeroSetupError(
            f"optimizer: this {type(spec).__name__} has already stepped, so its state cannot follow the parameters; "
            "pass it before training or pass a factory (lambda params: ...)"
        )
    groups = []
    for group in spec.param_groups:
        unknown = [p for p in group["params"] if id(p) not in replacement]
        if unknown:
            raise ZeroSetupError(
                f"optimizer: a {tuple(unknown[0].shape)} parameter is not one of the model's; build the optimizer on "
                "model.parameters() before initialize, or pass a factory"
            )
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        groups.append({**hyper, "params": [replacement[id(p)] for p in group["params"]]})
    accepted = inspect.signature(type(spec).__init__).parameters
    kwargs = {k: v for k, v in spec.defaults.items() if k in accepted}
    if "args" in accepted and hasattr(spec, "args"):
        kwargs["args"] = spec.args  # bitsandbytes keeps optim_bits, min_8bit_size, ... there, not in defaults
    rebuilt = type(spec)(groups, **kwargs)
    for group in spec.param_groups:
        group["params"] = []
    logger.debug("rebuilt %s over %d ZeRO parameters", type(spec).__name__, len(params))
    return rebuilt


def needs_local_shards(optimizer: torch.optim.Optimizer) -> bool:
    """Whether an optimizer must see plain local tensors: its kernels have no DTensor rule (bitsandbytes).

    Args:
        optimizer: the optimizer built on the ZeRO parameters.
    """
    return type(optimizer).__module__.split(".")[0] == "bitsandbytes"


class LocalShards:
    """Plain-tensor stand-ins for DTensor parameters, for optimizers that cannot take DTensors.

    The stand-ins are re-pointed at the current local shards (FSDP2 may re-allocate them, e.g. at lazy init)
    and given the local gradient shards right before each step. Only element-wise optimizers give the
    unsharded result this way: the optimizer sees one shard, not the whole tensor.

    Args:
        params: the trainable ZeRO (DTensor) parameters.
    """

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.pairs = [(p, nn.Parameter(p.to_local().detach(), requires_grad=p.requires_grad)) for p in params]

    def replacement(self) -> dict[int, nn.Parameter]:
        """id(ZeRO parameter) -> its local stand-in."""
        return {id(p): local for p, local in self.pairs}

    def bind(self) -> None:
        """Point each stand-in at its parameter's local shard and local gradient."""
        for p, local in self.pairs:
            local.data = p.to_local()
            local.grad = None if p.grad is None else _local(p.grad)[0]


def _comm_device(group: dist.ProcessGroup | None) -> torch.device:
    # NCCL moves only accelerator tensors; offloaded (CPU) gradients still need their norm reduced there.
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _local(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A gradient's local tensor and whether it is one shard of a bigger tensor (so its norm is partial)."""
    if isinstance(t, DTensor):
        return t.to_local(), any(isinstance(p, Shard) for p in t.placements)
    return t, False


@torch.no_grad()
def clip_grad_norm_(
    params: Iterable[nn.Parameter], max_norm: float, *, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Clip gradients to a global L2 norm taken across all shards; returns the norm before clipping.

    Equal to `torch.nn.utils.clip_grad_norm_` on the unsharded model: squared norms of the local shards are
    summed over ranks (one all-reduce), replicated gradients count once.

    Args:
        params: parameters whose `.grad` (DTensor or plain) are clipped in place.
        max_norm: the largest allowed norm.
        group: the data-parallel process group the shards are spread over.
    """
    sharded, replicated = [], []
    for p in params:
        if p.grad is not None:
            local, is_shard = _local(p.grad)
            (sharded if is_shard else replicated).append(local)
    device = (sharded or replicated or [torch.zeros(())])[0].device
    squared = torch.nn.utils.get_total_norm(sharded).to(device, torch.float32) ** 2
    if dist.is_available() and dist.is_initialized():
        # Unconditional, so every rank joins whatever its shards hold (some are empty at small sizes).
        on_wire = squared.to(_comm_device(group))
        dist.all_reduce(on_wire, group=group)
        squared = on_wire.to(device)
    if replicated:
        squared = squared + torch.nn.utils.get_total_norm(replicated).to(device, torch.float32) ** 2
    total = squared.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if coef.device.type == "cpu" and bool(coef >= 1.0):
        # Multiplying by 1 changes no bit; on CPU the check costs no device sync, and skipping saves a pass over
        # every gradient (a few ms per step per rank on `bench slow-link`, while the link waits for the step).
        return total
    for t in sharded + replicated:
        t.mul_(coef.to(t.device, t.dtype))
    return total


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (as `torch.distributed.checkpoint` does) so a state dict has every key.

    One step with zero gradients and lr 0, the same trick torch's `get_optimizer_state_dict` uses, so a
    checkpoint template has the same keys and step counts at every stage.

    Args:
        optimizer: an optimizer that has not stepped yet (otherwise nothing happens).
    """
    if optimizer.state or any(p.grad is not None for g in optimizer.param_groups for p in g["params"]):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    lrs = []
    for group in optimizer.param_groups:
        lrs.append(group.get("lr"))
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        if lr is not None:
            group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def named_optimizer_state_dict(
    optimizer: torch.optim.Optimizer, name_of: dict[int, str], export: Callable[[DTensor], DTensor]
) -> dict[str, Any]:
    """The optimizer state dict keyed by parameter names, in `get_optimizer_state_dict`'s layout.

    Args:
        optimizer: the optimizer over master parameters.
        name_of: id(master parameter) -> the model's parameter name.
        export: maps a master-shaped DTensor to the checkpoint layout.
    """
    init_optimizer_state(optimizer)
    sd = optimizer.state_dict()
    order = [name_of[id(p)] for g in optimizer.param_groups for p in g["params"]]
    state = {
        order[i]: {k: export(v) if isinstance(v, DTensor) else v for k, v in per_param.items()}
        for i, per_param in sd["state"].items()
    }
    groups = [{**g, "params": [order[i] for i in g["params"]]} for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


def load_named_optimizer_state_dict(
    optimizer: torch.optim.Optimizer,
    state_dict: dict[str, Any],
    name_of: dict[int, str],
    to_layout: Callable[[Any, nn.Parameter], DTensor],
) -> None:
    """Load a name-keyed optimizer state dict (any stage or world size) into an optimizer over masters.

    Args:
        optimizer: the optimizer over master parameters.
        state_dict: {"state": {name: {key: tensor}}, "param_groups": [{..., "params": [name, ...]}]}.
        name_of: id(master parameter) -> the model's parameter name.
        to_layout: maps a saved tensor (DTensor or full) to a DTensor in a master's layout.
    """
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ZeroSetupError(
            f"optimizer state dict: {len(saved_groups)} param groups saved, {len(optimizer.param_groups)} now; "
            "build the optimizer with the same param groups"
        )
    params = [p for g in optimizer.param_groups for p in g["params"]]
    index_of = {name_of[id(p)]: i for i, p in enumerate(params)}
    groups = []
    for saved, current in zip(saved_groups, optimizer.param_groups, strict=True):
        names = [name_of[id(p)] for p in current["params"]]
        if set(saved["params"]) != set(names):
            missing = sorted(set(names) - set(saved["params"]))[:2]
            raise ZeroSetupError(f"optimizer state dict: param group lacks {missing}; load a checkpoint of this model")
        groups.append({**saved, "params": [index_of[n] for n in names]})
    state = {}
    for name, per_param in state_dict["state"].items():
        i = index_of[name]
        master = params[i]
        state[i] = {
            k: to_layout(v, master) if isinstance(v, torch.Tensor) and v.shape == master.shape and v.dim() else v
            for k, v in per_param.items()
        }
    optimizer.load_state_dict({"state": state, "param_groups": groups})
