"""FP8 weight all-gather under ZeRO-3: each rank casts its shard to E4M3 before FSDP2 gathers it.

Without it, stage 3 gathers every :class:`~ds_plugin.precision.fp8_linear.Fp8Linear` weight in bf16 (2 bytes an
element) and the layer then quantizes the gathered weight to fp8. With it, each rank quantizes its own row shard
(1 byte an element, plus fp32 scales), FSDP2 gathers the codes, and the layer multiplies with the gathered codes
as they arrive. torchao's float8 all-gather works the same way.

Mechanism: FSDP2's all-gather extension. :func:`enable_fp8_all_gather` (called by ``apply_zero`` before
``fully_shard``) wraps each eligible fp32 master weight in :class:`Fp8AllGatherWeight`, a thin tensor subclass
that FSDP2 shards like a plain tensor and that defines

- ``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)``: cast the shard to the
  mixed-precision dtype exactly as FSDP2 would, then quantize it with the layer's recipe; returns the codes and
  the per-row / per-block scales as the all-gather inputs. The five-argument form is the one torch has called
  since 2.5 (``_fsdp_param.py`` accepts it and the old one-argument form); 2.11 and 2.13 both take it.
- ``fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None)``: wrap the gathered codes and scales in
  :class:`Fp8GatheredWeight`, the unsharded parameter the layer reads. On a re-gather FSDP2 passes the
  previous one as ``out``; its buffers are refilled in place, only the attributes are refreshed here.

The alternative, FSDP2's per-module ``set_custom_all_gather``, sees one flat bf16 buffer per block, must fill a
bf16 output and is already taken by qwZ; a per-parameter extension keeps layer shapes and composes with qwZ
(which leaves the mixed-dtype byte bucket of an FP8 block to the plain all-gather).

Scales on a row shard (``Shard(0)``): a rowwise scale belongs to one row and a 128×128 block scale to one
block, so both are computed locally when the shard boundaries fall on rows (always) or on 128-row blocks
(blockwise needs ``rows / world`` to be a multiple of 128). Tensorwise needs the amax of the whole weight: each
gather all-reduces one fp32 amax (MAX) per weight before quantizing. That is 4 bytes next to a gather of
``rows × cols / world`` bytes, keeps the scale right whenever the weight changes (any optimizer, any loading), and
needs no hook in the training loop; torchao's per-step precompute batches these all-reduces into one, which
matters for latency only at many layers. Layers that cannot take the FP8 gather (rows that do not split evenly,
blockwise shards that are not whole 128-row blocks) keep the ordinary bf16 gather and are listed, with the
reason, in :func:`fp8_all_gather_stats`. hpZ is refused by the config: FSDP2 re-gathers its secondary shard
without the extension hooks.

Checkpoints: state dicts hold the master shards; pickling one (``torch.save``, DCP) writes the plain fp32 tensor,
so a checkpoint reads back with or without this option.

Numerics: the codes and scales are bit-identical to what the layer computes from the bf16-gathered weight
(same bf16 values, same amax, same division), so the forward GEMM is unchanged for every recipe, and so is
dgrad for tensorwise and blockwise (one quantization of W serves both). Rowwise dgrad contracts over the output
rows, along which W's row scales vary; instead of re-quantizing W per column (it is no longer there in bf16), the
row scales are folded into grad_out: ``dx = (dy · diag(s)) · Q``, with Q's codes taken exactly. dx then differs
from the bf16-gather run by fp8 rounding of a differently scaled dy, not by a second rounding of W. The weight
gradient (``dyᵀ · x``) never reads W, so the fp32 masters get their gradients as before.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

# The gathered-weight type lives below Fp8Linear (which reads it), so this module imports the layer and not the
# other way round; it is re-exported here, where it has always been importable from.
from ds_plugin.precision.fp8 import BLOCK, quantize_blocks
from ds_plugin.precision.fp8_gathered import Fp8GatheredWeight, gathered_fp8, weight_block
from ds_plugin.precision.fp8_linear import Fp8Linear

__all__ = [
    "Fp8AllGatherStats",
    "Fp8AllGatherWeight",
    "Fp8GatheredWeight",
    "enable_fp8_all_gather",
    "fp8_all_gather_stats",
    "gathered_fp8",
]

logger = logging.getLogger(__name__)

aten = torch.ops.aten

# The ops FSDP2 runs on a parameter while sharding it, padding it, moving or offloading it, and materializing it
# from the meta device (empty_like): their results keep the subclass, or the extension would be lost. Every
# other op (the optimizer's arithmetic, norms, state-dict copies) sees the plain fp32 tensor.
_KEEP_SUBCLASS = {
    aten._pin_memory,
    aten._to_copy,
    aten.alias,
    aten.as_strided,
    aten.clone,
    aten.copy_,
    aten.detach,
    aten.empty_like,
    aten.new_empty,
    aten.new_zeros,
    aten.slice,
    aten.split,
    aten.view,
}


@dataclasses.dataclass
class Fp8AllGatherStats:
    """What the FP8 all-gather did: which layers take it, which keep bf16 and why, and how often it ran.

    Args:
        fp8_layers: names of the weights gathered as fp8.
        bf16_layers: name -> reason, for the FP8 layers whose weights keep the bf16 gather.
        fp8_gathers: shards quantized for an all-gather (one per eligible weight per gather).
        amax_all_reduces: tensorwise amax all-reduces (one per tensorwise weight per gather).
    """

    fp8_layers: list[str] = dataclasses.field(default_factory=list)
    bf16_layers: dict[str, str] = dataclasses.field(default_factory=dict)
    fp8_gathers: int = 0
    amax_all_reduces: int = 0

    def summary(self) -> str:
        """One line for the log."""
        line = f"fp8 all-gather: {len(self.fp8_layers)} weights gather as fp8"
        if self.bf16_layers:
            shown = "; ".join(f"{name}: {why}" for name, why in list(self.bf16_layers.items())[:3])
            more = f" (+{len(self.bf16_layers) - 3} more)" if len(self.bf16_layers) > 3 else ""
            line += f", {len(self.bf16_layers)} keep the bf16 gather ({shown}{more})"
        return line


class Fp8AllGatherWeight(torch.Tensor):
    """A high-precision (fp32 master) weight that FSDP2 all-gathers as fp8 codes and scales.

    Everything but the all-gather sees the wrapped tensor: FSDP2's sharding ops keep the wrapper around the
    shard, the optimizer and norms compute on the plain tensor inside.

    Args:
        tensor: the weight, (N, K).
        recipe: the layer's fp8 recipe.
        stats: counters shared by the model's FP8 weights.
    """

    _tensor: torch.Tensor
    recipe: str
    stats: Fp8AllGatherStats

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, recipe: str, stats: Fp8AllGatherStats) -> Fp8AllGatherWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, recipe: str, stats: Fp8AllGatherStats) -> None:
        self._tensor, self.recipe, self.stats = tensor, recipe, stats

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"Fp8AllGatherWeight({self._tensor!r}, recipe={self.recipe})"

    def __reduce_ex__(self, protocol: int) -> Any:
        # torch.save of a state dict writes the plain weight: a checkpoint does not depend on this option.
        return self._tensor.__reduce_ex__(protocol)

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_tensor"], (self.recipe, self.stats)

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: Any, outer_size: Any, outer_stride: Any) -> Fp8AllGatherWeight:
        return Fp8AllGatherWeight(inner["_tensor"], *meta)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        ref = _first_instance(cls, (args, kwargs))
        args, kwargs = tree_map_only(cls, lambda t: t._tensor, (args, kwargs))
        out = func(*args, **kwargs)
        if func.overloadpacket not in _KEEP_SUBCLASS:
            return out
        return tree_map_only(torch.Tensor, lambda t: cls(t, ref.recipe, ref.stats), out)

    @torch.no_grad()
    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: nn.Module, mp_policy: Any
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        # FSDP2 leaves the mixed-precision cast to an extension: cast first, so the fp8 codes are those of the very
        # bf16 values the plain gather would have delivered.
        shard = self._tensor.to(mp_policy.param_dtype or self.dtype)
        rows, cols = shard.shape
        self.stats.fp8_gathers += 1
        if self.recipe == "tensorwise":
            amax = torch.linalg.vector_norm(shard.float(), float("inf")).reshape(1, 1)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
            self.stats.amax_all_reduces += 1
            q = quantize_blocks(shard, (rows, cols), amax=amax)
            # One scale for every shard: it travels as metadata, not through the all-gather.
            return (q.data.view(torch.uint8),), q.scale
        q = quantize_blocks(shard, weight_block(self.recipe, rows, cols))
        # Codes travel as bytes: an all-gather only moves them, and gloo (unlike NCCL) has no fp8 type.
        return (q.data.view(torch.uint8), q.scale), None

    @torch.no_grad()
    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        if self.recipe == "tensorwise":
            (codes,), scale = all_gather_outputs, metadata
        else:
            codes, scale = all_gather_outputs
        data = codes.view(torch.float8_e4m3fn)
        if out is not None:
            # A re-gather: FSDP2 refilled the buffers `out` views; the tensorwise scale is new each time.
            out._data, out._scale = data, scale
            return None
        inner = (codes,) if self.recipe == "tensorwise" else (codes, scale)
        return Fp8GatheredWeight(data, scale, self.recipe, param_dtype), inner


def _first_instance(cls: type, tree: Any) -> Any:
    # The subclass instance among an op's arguments whose attributes the results inherit.
    found: list[Any] = []
    tree_map_only(cls, found.append, tree)
    return found[0]


def _bf16_reason(recipe: str, rows: int, world_size: int) -> str | None:
    if rows % world_size:
        return f"{rows} rows do not split evenly over {world_size} ranks"
    if recipe == "blockwise" and (rows // world_size) % BLOCK:
        return f"a {rows // world_size}-row shard is not whole {BLOCK}-row blocks"
    return None


_STATS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fp8_all_gather_stats(model: nn.Module) -> Fp8AllGatherStats | None:
    """The FP8 all-gather counters of a model :func:`enable_fp8_all_gather` went over, else None.

    Args:
        model: the model passed to ``apply_zero``.
    """
    return _STATS.get(model)


def enable_fp8_all_gather(model: nn.Module, world_size: int) -> Fp8AllGatherStats:
    """Make FSDP2 gather the weights of ``model``'s :class:`Fp8Linear` layers as fp8. Call before ``fully_shard``.

    A weight whose rows do not split evenly over the ranks, or (blockwise) whose row shard is not whole 128-row
    blocks, keeps the plain bf16 gather; the stats list it with the reason.

    Args:
        model: a model ``convert_to_fp8_training`` went over, not yet sharded.
        world_size: ranks the weights are sharded over.

    Raises:
        ValueError: the model has no :class:`Fp8Linear` layer.
    """
    stats = Fp8AllGatherStats()
    wrapped: dict[int, nn.Parameter] = {}
    for name, module in model.named_modules():
        if not isinstance(module, Fp8Linear):
            continue
        weight = module.weight
        key = f"{name}.weight" if name else "weight"
        if id(weight) not in wrapped:
            reason = _bf16_reason(module.recipe, weight.shape[0], world_size)
            if reason is not None:
                logger.debug("fp8 all-gather: %s keeps the bf16 gather: %s", key, reason)
                stats.bf16_layers[key] = reason
                continue
            tensor = Fp8AllGatherWeight(weight.detach(), module.recipe, stats)
            wrapped[id(weight)] = nn.Parameter(tensor, requires_grad=weight.requires_grad)
            stats.fp8_layers.append(key)
        # A weight shared by two layers stays shared.
        module.weight = wrapped[id(weight)]
    if not stats.fp8_layers and not stats.bf16_layers:
        raise ValueError(
            f"fp8.all_gather: {type(model).__name__} has no Fp8Linear layer to gather as fp8; call "
            "convert_to_fp8_training(model, config.fp8) before apply_zero, or turn fp8.all_gather off"
        )
    _STATS[model] = stats
    return stats
