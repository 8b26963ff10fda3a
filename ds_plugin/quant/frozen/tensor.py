"""`QuantizedWeight`: a frozen Linear weight stored as INT8, INT4, NF4 or FP6 codes, sharded and gathered as codes.

A format is a tensor type, as in torchao: the weight parameter of a frozen ``nn.Linear`` becomes a
``QuantizedWeight`` whose logical shape and dtype are the original weight's (N, K) and compute dtype, and whose
storage is the format's components (:mod:`ds_plugin.quant.frozen.codecs`): uint8 codes and their scales, every
component with N leading rows, so that a row slice of every component is the row slice of the weight.

What that buys, stage by stage:

- ZeRO-3 (FSDP2): FSDP2 shards the parameter by rows through the ops below (split, slice, new_zeros, copy_), so
  each rank keeps only its rows' codes and scales. Its all-gather extension, ``fsdp_pre_all_gather`` /
  ``fsdp_post_all_gather``, sends each row's components as raw bytes in one uint8 tensor (never packed into a
  float dtype, which FSDP2 would then canonicalise) and rebuilds a full ``QuantizedWeight`` whose components are
  views into the gathered bytes.
- Stages 0-2: the weight is stored replicated, quantized.
- Compute: ``F.linear`` on a ``QuantizedWeight`` runs :class:`_QuantizedLinear`, which calls the custom op
  ``ds_plugin::quantized_linear`` (:mod:`ds_plugin.quant.frozen.linear_op`) on the components: on CUDA, Triton kernels
  with the dequantization fused into the GEMM (fp6, int4, int8); elsewhere, and for nf4, the reference dequantizes
  into the compute dtype for the product and drops the result. Backward does the same for ``dx = dy · W``
  (``ds_plugin::quantized_linear_grad_input``). At most one layer's full-precision weight exists at a time (none
  with the kernels), and no gradient is ever made for W.

Any other op sees the dequantized weight (a correct, plain result), and an in-place op (peft's merge / unmerge:
``weight.data += delta``; ``load_state_dict`` copying a full-precision weight in) is applied to the dequantized
values and requantized in place, with the relative error of that requantization logged and kept in
``last_requantization_error``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.utils._pytree import tree_map_only

from ds_plugin.quant.frozen.codecs import dequantize_weight, quantize_weight
from ds_plugin.quant.frozen.linear_op import parts_list, quantized_linear, quantized_linear_grad_input

__all__ = ["FrozenStorageStats", "QuantizedWeight"]

logger = logging.getLogger(__name__)

aten = torch.ops.aten


@dataclasses.dataclass
class FrozenStorageStats:
    """Counters shared by one model's quantized weights.

    Args:
        gathers: ZeRO-3 all-gathers of a quantized weight (one per weight per gather).
        gathered_bytes: bytes those all-gathers delivered to this rank (codes and scales of every rank's rows).
    """

    gathers: int = 0
    gathered_bytes: int = 0


class QuantizedWeight(Tensor):
    """A frozen (N, K) weight held as a storage format's components.

    Args:
        parts: the components, each with N leading rows (``quantize_weight``'s output).
        fmt: "int8", "int4", "nf4" or "fp6".
        group_size: elements per scale along K.
        shape: the logical shape, (N, K) (or (N*K,) for FSDP2's flat view of a shard).
        dtype: the dtype the weight dequantizes into (the compute dtype).
        stats: counters shared by the model's quantized weights.
    """

    parts: dict[str, Tensor]
    fmt: str
    group_size: int
    stats: FrozenStorageStats
    _shared: dict[str, Any]  # shared by a weight's aliases (`.data`, `.detach()`): what an in-place update left

    @staticmethod
    def __new__(
        cls,
        parts: dict[str, Tensor],
        fmt: str,
        group_size: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        stats: FrozenStorageStats | None = None,
        shared: dict[str, Any] | None = None,
    ) -> QuantizedWeight:
        first = next(iter(parts.values()))
        return Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=first.device, requires_grad=False)

    def __init__(
        self,
        parts: dict[str, Tensor],
        fmt: str,
        group_size: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        stats: FrozenStorageStats | None = None,
        shared: dict[str, Any] | None = None,
    ) -> None:
        self.parts, self.fmt, self.group_size = dict(parts), fmt, group_size
        self.stats = stats if stats is not None else FrozenStorageStats()
        self._shared = shared if shared is not None else {}

    @property
    def last_requantization_error(self) -> float | None:
        """Relative Frobenius error of the last in-place update's requantization (peft merge), else None."""
        return self._shared.get("requantization_error")

    # ------------------------------------------------------------------ construction and views

    @classmethod
    def from_float(
        cls,
        weight: Tensor,
        fmt: str,
        group_size: int,
        *,
        method: str = "default",
        stats: FrozenStorageStats | None = None,
        process_group: Any = None,
    ) -> QuantizedWeight:
        """Quantize a plain (N, K) weight.

        Args:
            weight: the weight (fp32, bf16 or fp16); its dtype becomes the dequantization dtype.
            fmt: "int8", "int4", "nf4" or "fp6".
            group_size: elements per scale along K.
            method: the format's quantization method (see ``quantize_weight``).
            stats: counters to share with the model's other quantized weights.
            process_group: ranks holding the same weight; each quantizes its share of the rows and the ranks
                exchange the results (INT4's scale search then costs 1/world as much per rank). None: all here.
        """
        w = weight.detach()
        if process_group is None or dist.get_world_size(process_group) == 1:
            parts = quantize_weight(w, fmt, group_size, method=method)
        else:
            parts = _quantize_split(w, fmt, group_size, method, process_group)
        return cls(parts, fmt, group_size, tuple(weight.shape), weight.dtype, stats)

    def _like(self, parts: dict[str, Tensor], *, rows: int | None = None, dtype: torch.dtype | None = None) -> Any:
        k = self.logical_cols
        shape = (rows if rows is not None else self.logical_rows, k)
        return QuantizedWeight(parts, self.fmt, self.group_size, shape, dtype or self.dtype, self.stats)

    @property
    def logical_rows(self) -> int:
        """N, the weight's output rows (every component's leading dim)."""
        return next(iter(self.parts.values())).shape[0]

    @property
    def logical_cols(self) -> int:
        """K, the weight's input columns."""
        return self.numel() // max(1, self.logical_rows) if self.dim() == 1 else self.shape[1]

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """The weight as a plain (N, K) tensor (a new one each call).

        Args:
            dtype: the result's dtype; default the weight's dtype.
        """
        w = dequantize_weight(self.parts, self.fmt, self.group_size, dtype or self.dtype)
        return w.reshape(self.shape)

    def nbytes_stored(self) -> int:
        """Bytes of every component on this rank (this rank's rows only, once sharded)."""
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    def __repr__(self) -> str:
        return (
            f"QuantizedWeight(fmt={self.fmt}, group_size={self.group_size}, shape={tuple(self.shape)}, "
            f"dtype={self.dtype}, device={self.device})"
        )

    def __reduce_ex__(self, protocol: int) -> Any:
        # A plain torch.save of a state dict holding this writes the dequantized weight: readable anywhere.
        return self.dequantize().__reduce_ex__(protocol)

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        names = list(self.parts)
        return [f"_part_{n}" for n in names], (names, self.fmt, self.group_size, self.stats, self.dtype)

    def __getattr__(self, name: str) -> Any:
        # `__tensor_unflatten__` and torch's subclass utilities read the inner tensors as attributes.
        if name.startswith("_part_"):
            return self.__dict__["parts"][name[len("_part_") :]]
        raise AttributeError(name)

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: Any, outer_size: Any, outer_stride: Any) -> QuantizedWeight:
        names, fmt, group_size, stats, dtype = meta
        parts = {n: inner[f"_part_{n}"] for n in names}
        # The logical dtype travels in the metadata: the first part is uint8 codes, not what W dequantizes into.
        return QuantizedWeight(parts, fmt, group_size, tuple(outer_size), dtype, stats)

    # ------------------------------------------------------------------ torch function / dispatch

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, bias = _linear_args(args, kwargs)
            if isinstance(weight, QuantizedWeight) and not isinstance(x, QuantizedWeight):
                return _QuantizedLinear.apply(x, weight, bias)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func.overloadpacket)
        if handler is not None:
            return handler(func, args, kwargs)
        if func._schema.is_mutable and args and isinstance(args[0], QuantizedWeight):
            return _update_in_place(func, args, kwargs)
        # Anything else computes on the dequantized weight and returns plain tensors.
        args, kwargs = tree_map_only(QuantizedWeight, lambda t: t.dequantize(), (args, kwargs))
        return func(*args, **kwargs)

    # ------------------------------------------------------------------ FSDP2's all-gather extension

    @torch.no_grad()
    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: Any, mp_policy: Any
    ) -> tuple[tuple[Tensor, ...], Any]:
        # One uint8 input per weight: each row's components side by side as bytes (codes stay bytes, scales keep
        # their bits). One input rather than one per component because FSDP2's single-rank path copies only the
        # first input; and the bytes are the same. Wider components come first so every one starts aligned.
        rows = self.logical_rows
        names = sorted(self.parts, key=lambda n: -self.parts[n].element_size())
        columns = [self.parts[n].reshape(rows, -1).contiguous().view(torch.uint8) for n in names]
        width = sum(c.shape[1] for c in columns)
        if width % 4:
            columns.append(columns[0].new_zeros(rows, 4 - width % 4))
        packed = torch.cat(columns, dim=1)
        layout = tuple((n, self.parts[n].dtype, self.parts[n].shape[1:]) for n in names)
        self.stats.gathers += 1
        self.stats.gathered_bytes += mesh.size() * packed.numel()
        return (packed,), (layout, int(outer_size[1]))

    @torch.no_grad()
    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: Tensor | None = None,
    ) -> tuple[Tensor, tuple[Tensor, ...]] | None:
        layout, cols = metadata
        (packed,) = all_gather_outputs
        rows = packed.shape[0]
        parts, offset = {}, 0
        for name, dtype, tail in layout:
            nbytes = math.prod(tail) * dtype.itemsize
            # A view into the gathered buffer: FSDP2 frees and refills that buffer, the views stay valid.
            parts[name] = packed[:, offset : offset + nbytes].view(dtype).view(rows, *tail)
            offset += nbytes
        if out is not None:
            # A re-gather: FSDP2 refilled the buffer; point the unsharded weight at it again.
            out.parts = parts
            return None
        full = QuantizedWeight(parts, self.fmt, self.group_size, (rows, cols), param_dtype, self.stats)
        return full, (packed,)


def _quantize_split(w: Tensor, fmt: str, group_size: int, method: str, group: Any) -> dict[str, Tensor]:
    # A row's components depend on that row alone, so rows quantized on different ranks and concatenated are
    # the whole weight quantized, bit for bit. Equal row counts per rank (zero rows pad the last) for the gather.
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = w.shape[0]
    per = -(-rows // world)
    local = w.new_zeros((per, w.shape[1]))
    mine = w[rank * per : (rank + 1) * per]
    local[: mine.shape[0]].copy_(mine)
    parts = quantize_weight(local, fmt, group_size, method=method)
    # gloo and NCCL both move the components as they are; NCCL wants them on the rank's device.
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else w.device
    out = {}
    for name, part in parts.items():
        gathered = part.new_empty((world * per, *part.shape[1:]), device=device)
        dist.all_gather_into_tensor(gathered, part.to(device).contiguous(), group=group)
        out[name] = gathered[:rows].to(w.device).contiguous()
    return out


def _linear_args(args: tuple, kwargs: dict) -> tuple[Any, Any, Any]:
    x = args[0] if args else kwargs["input"]
    weight = args[1] if len(args) > 1 else kwargs["weight"]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    return x, weight, bias


class _QuantizedLinear(torch.autograd.Function):
    """y = x · dequant(W)ᵀ + b through ``ds_plugin::quantized_linear``; backward reads W's codes again."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: QuantizedWeight, bias: Tensor | None) -> Tensor:
        # The QuantizedWeight itself is kept, not its components (nor a dequantized copy): under ZeRO-3 FSDP2 frees
        # its gathered codes after forward and gathers them into the same object again before this layer's
        # backward, so backward must read `weight.parts` then. (The op's own autograd formula saves the components,
        # which is right for a caller holding plain tensors.)
        ctx.weight = weight
        ctx.bias_shape = None if bias is None else bias.shape
        with torch._C.DisableTorchFunctionSubclass():
            return quantized_linear(x, parts_list(weight.fmt, weight.parts), weight.fmt, weight.group_size, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, None, Tensor | None]:
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            w = ctx.weight
            with torch._C.DisableTorchFunctionSubclass():
                grad_x = quantized_linear_grad_input(
                    grad_out, parts_list(w.fmt, w.parts), w.fmt, w.group_size, w.logical_cols
                )
        if ctx.needs_input_grad[2]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, None, grad_bias


# ---------------------------------------------------------------------- ops that keep the format


def _map_parts(t: QuantizedWeight, fn: Any) -> dict[str, Tensor]:
    return {name: fn(p) for name, p in t.parts.items()}


def _same(func: Any, args: tuple, kwargs: dict) -> QuantizedWeight:
    # detach / alias: a new wrapper over the same components.
    t = args[0]
    return QuantizedWeight(t.parts, t.fmt, t.group_size, tuple(t.shape), t.dtype, t.stats, t._shared)


def _to_copy(func: Any, args: tuple, kwargs: dict) -> QuantizedWeight:
    # A dtype change only changes what the weight dequantizes into; a device change moves the components.
    t = args[0]
    dtype = kwargs.get("dtype") or t.dtype
    device = kwargs.get("device")
    parts = _map_parts(t, lambda p: p.to(device=device, copy=True)) if device is not None else dict(t.parts)
    if not dtype.is_floating_point:
        raise TypeError(f"a {t.fmt} weight dequantizes to a floating dtype, not {dtype}")
    return QuantizedWeight(parts, t.fmt, t.group_size, tuple(t.shape), dtype, t.stats)


def _clone(func: Any, args: tuple, kwargs: dict) -> QuantizedWeight:
    t = args[0]
    return QuantizedWeight(_map_parts(t, Tensor.clone), t.fmt, t.group_size, tuple(t.shape), t.dtype, t.stats)


def _pin(func: Any, args: tuple, kwargs: dict) -> QuantizedWeight:
    t = args[0]
    return QuantizedWeight(_map_parts(t, Tensor.pin_memory), t.fmt, t.group_size, tuple(t.shape), t.dtype, t.stats)


def _is_pinned(func: Any, args: tuple, kwargs: dict) -> bool:
    return all(p.is_pinned() for p in args[0].parts.values())


def _empty_like(func: Any, args: tuple, kwargs: dict) -> QuantizedWeight:
    t = args[0]
    device = kwargs.get("device") or t.device
    parts = _map_parts(t, lambda p: torch.empty_like(p, device=device))
    return QuantizedWeight(parts, t.fmt, t.group_size, tuple(t.shape), kwargs.get("dtype") or t.dtype, t.stats)


def _rows_of(t: QuantizedWeight, size: Any, what: str) -> int:
    size = tuple(size)
    if len(size) != 2 or size[1] != t.logical_cols:
        raise NotImplementedError(f"{what} of a {t.fmt} weight to shape {size}: only whole rows can be made")
    return size[0]


def _new_zeros(func: Any, args: tuple, kwargs: dict) -> QuantizedWeight:
    # FSDP2's padded shard: zero codes (the rows are overwritten by copy_ or never read).
    t, size = args[0], args[1]
    rows = _rows_of(t, size, "new_zeros")
    device = kwargs.get("device") or t.device
    parts = _map_parts(t, lambda p: p.new_zeros((rows, *p.shape[1:]), device=device))
    return t._like(parts, rows=rows, dtype=kwargs.get("dtype"))


def _check_dim0(t: QuantizedWeight, dim: int, what: str) -> None:
    if dim not in (0, -t.dim()):
        raise NotImplementedError(f"{what} of a {t.fmt} weight along dim {dim}: it is stored and sharded by rows")


def _slice(func: Any, args: tuple, kwargs: dict) -> QuantizedWeight:
    t = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    start = args[2] if len(args) > 2 else kwargs.get("start")
    end = args[3] if len(args) > 3 else kwargs.get("end")
    step = args[4] if len(args) > 4 else kwargs.get("step", 1)
    _check_dim0(t, dim, "slice")
    parts = _map_parts(t, lambda p: p[start:end:step])
    return t._like(parts, rows=next(iter(parts.values())).shape[0])


def _split(func: Any, args: tuple, kwargs: dict) -> list[QuantizedWeight]:
    t, sizes = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    _check_dim0(t, dim, "split")
    pieces = {name: torch.split(p, sizes, 0) for name, p in t.parts.items()}
    count = len(next(iter(pieces.values())))
    out = []
    for i in range(count):
        parts = {name: ps[i] for name, ps in pieces.items()}
        out.append(t._like(parts, rows=next(iter(parts.values())).shape[0]))
    return out


def _view(func: Any, args: tuple, kwargs: dict) -> QuantizedWeight:
    # FSDP2 keeps a flat view of the padded shard; nothing computes with it, so it only changes the shape.
    t, size = args[0], tuple(args[1])
    numel = t.logical_rows * t.logical_cols
    if size in ((-1,), (numel,)):
        shape: tuple[int, ...] = (numel,)
    elif size == (t.logical_rows, t.logical_cols) or size == (-1, t.logical_cols):
        shape = (t.logical_rows, t.logical_cols)
    else:
        raise NotImplementedError(f"view of a {t.fmt} weight as {size}: only its own shape or a flat view")
    return QuantizedWeight(t.parts, t.fmt, t.group_size, shape, t.dtype, t.stats)


def _as_strided(func: Any, args: tuple, kwargs: dict) -> QuantizedWeight:
    # FSDP2 re-strides the post-all-gather tensor to the original size: for a contiguous (N, K) it is itself.
    t, size = args[0], tuple(args[1])
    if size != (t.logical_rows, t.logical_cols):
        raise NotImplementedError(f"as_strided of a {t.fmt} weight to {size}")
    return QuantizedWeight(t.parts, t.fmt, t.group_size, size, t.dtype, t.stats)


def _copy(func: Any, args: tuple, kwargs: dict) -> Tensor:
    dst, src = args[0], args[1]
    if isinstance(dst, QuantizedWeight) and isinstance(src, QuantizedWeight) and _same_format(dst, src):
        for name, p in dst.parts.items():
            p.copy_(src.parts[name])
        return dst
    if isinstance(dst, QuantizedWeight):
        return _update_in_place(func, args, kwargs)
    return dst.copy_(src.dequantize(dst.dtype))


def _same_format(a: QuantizedWeight, b: QuantizedWeight) -> bool:
    return (a.fmt, a.group_size, list(a.parts)) == (b.fmt, b.group_size, list(b.parts)) and all(
        a.parts[n].shape == b.parts[n].shape for n in a.parts
    )


def _update_in_place(func: Any, args: tuple, kwargs: dict) -> QuantizedWeight:
    # dequantize -> apply the op -> requantize into the same components (peft's merge / unmerge, loading a
    # full-precision state dict into a quantized model).
    t: QuantizedWeight = args[0]
    if t.dim() != 2:
        raise NotImplementedError(f"in-place {func} on a flat view of a {t.fmt} weight")
    plain = t.dequantize(torch.float32)
    rest = tree_map_only(QuantizedWeight, lambda q: q.dequantize(torch.float32), (args[1:], kwargs))
    func(plain, *rest[0], **rest[1])
    parts = quantize_weight(plain.to(t.dtype), t.fmt, t.group_size)
    for name, p in t.parts.items():
        p.copy_(parts[name])
    err = (t.dequantize(torch.float32) - plain).norm() / plain.norm().clamp_min(1e-30)
    t._shared["requantization_error"] = float(err)
    logger.info("%s weight %s updated in place and requantized: relative error %.3g", t.fmt, tuple(t.shape), err)
    return t


_HANDLERS: dict[Any, Any] = {
    aten.detach: _same,
    aten.alias: _same,
    aten._to_copy: _to_copy,
    aten.clone: _clone,
    aten._pin_memory: _pin,
    aten.is_pinned: _is_pinned,
    aten.empty_like: _empty_like,
    aten.new_zeros: _new_zeros,
    aten.slice: _slice,
    aten.split: _split,
    aten.split_with_sizes: _split,
    aten.view: _view,
    aten._unsafe_view: _view,
    aten.as_strided: _as_strided,
    aten.copy_: _copy,
}
