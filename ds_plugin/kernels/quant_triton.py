"""Triton kernels for the blockwise INT8 / INT4 format (qwZ weights, qgZ gradients): the CUDA backend.

The format, its constants and its plain-torch reference live in :mod:`ds_plugin.quant.comm.format`, the only module of
``ds_plugin.quant`` imported here; :mod:`ds_plugin.quant.comm.dispatch` picks these kernels for CUDA tensors (or any
tensor under ``TRITON_INTERPRET=1``) and imports this module lazily. The kernels reproduce the reference bit for bit
(codes and scales), so the rules are written to leave the compiler no freedom:

* all arithmetic is fp32; divisions use ``tl.math.div_rn`` because Triton's ``/`` lowers to an approximate
  division on NVIDIA GPUs while torch divides with correct rounding;
* rounding is half to even, like ``torch.round``, built from ``floor`` so it does not depend on a libdevice path
  (which moved between Triton releases) and no multiply feeds an add that could be contracted into an FMA;
* ``amax`` is taken over the finite elements only and non-finite blocks are flagged separately, because a GPU
  ``max`` drops nan where torch propagates it;
* bf16 scales are rounded up and moved as integer bit patterns (never through a float cast), because the
  interpreter casts fp32 to bf16 by truncation; the bits are what the reference's ``round_up_to_bf16`` produces.

Both kernels work on rows: each row of ``(..., row_len)`` is cut into blocks of its own (zero-padded at its end,
never straddling two rows), which is the layout :mod:`ds_plugin.quant.comm.fused` uses for the ZeRO++ collectives; a
flat tensor is one row. Leading dims are addressed through up to two strides, so the transposed views qwZ and qgZ
pass are read and written in place. Each program handles ``ROWS`` consecutive blocks as a ``[ROWS, WIDTH]`` tile
(``WIDTH`` the block size rounded up to a power of two), so small blocks still give every program a few thousand
elements and a block's scale is a row reduction. INT4 codes are paired into bytes with a reshape/split of that
tile, so loads and stores stay contiguous.

``triton.jit`` decides between compiled and interpreted kernels (``TRITON_INTERPRET``) when it decorates a function,
so the kernels here are plain functions jitted on first use and cached per mode: a test can switch the interpreter
on for CPU tensors and a GPU test in the same process still gets compiled kernels.

Only the interpreter has run these kernels on this project's CI machines; the GPU tests in
``tests/kernels/test_quant_triton.py`` hold the compiled kernels to the same bit-for-bit comparison.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from ds_plugin.kernels.quant_linear_tilings import interpreter_enabled
from ds_plugin.quant.comm.format import FLOAT_DTYPES, FP32_MAX, QMAX, SCALE_DTYPES, check_format, scale_cap

__all__ = [
    "dequantize_blockwise_triton",
    "dequantize_rows_into_triton",
    "interpreter_enabled",
    "launch_counts",
    "quantize_blockwise_triton",
    "quantize_rows_triton",
]

# Elements per program tile; enough work per program on GPU and few Python-level programs in the interpreter.
_TILE = 4096
# `|x| <= _FP32_MAX` is false exactly for inf and nan. A jitted function may only read globals declared constexpr.
_FP32_MAX = tl.constexpr(FP32_MAX)
# bf16 bit patterns: the canonical quiet nan (the nan scale of a non-finite block; torch's own nan payload differs
# between devices and code paths, CPU writes 0xFFFF, and only "is nan" is part of the format) and 1.0.
_BF16_NAN_BITS = tl.constexpr(0x7FC0)
_BF16_ONE_BITS = tl.constexpr(0x3F80)
_jitted: dict[tuple[str, bool], Any] = {}
_launched: collections.Counter[tuple[str, int]] = collections.Counter()


@triton.jit
def _max_combine(a, b):
    # Reductions go through tl.reduce with this combiner rather than tl.max: tl.max is itself a jitted function,
    # fixed in compiled mode when triton was imported without TRITON_INTERPRET, and the interpreter cannot call it;
    # it does run tl.reduce's combiner, whichever way the combiner was jitted.
    return tl.maximum(a, b)


def _jit(fn: Callable[..., None]) -> Any:
    interpret = interpreter_enabled()
    key = (fn.__name__, interpret)
    if key not in _jitted:
        _jitted[key] = triton.jit(fn)
    return _jitted[key]


def _quantize_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    n_blocks,
    per_row,
    row_len,
    inner,
    stride_outer,
    stride_inner,
    block_size,
    BITS: tl.constexpr,
    QMAX: tl.constexpr,
    SCALE_MAX: tl.constexpr,
    BF16_SCALES: tl.constexpr,
    ROWS: tl.constexpr,
    WIDTH: tl.constexpr,
):
    blk = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, WIDTH)
    blk_ok = blk < n_blocks
    # Block -> (row, first element within the row); row -> (outer, inner) index of a (up to) two-level row layout.
    b = blk.to(tl.int64)
    row = b // per_row
    start = (b - row * per_row) * block_size
    outer = row // inner
    x_base = outer * stride_outer + (row - outer * inner) * stride_inner + start
    pos = start[:, None] + cols[None, :]
    mask = blk_ok[:, None] & (cols[None, :] < block_size) & (pos < row_len)
    x = tl.load(x_ptr + x_base[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)

    finite = tl.abs(x) <= _FP32_MAX
    bad = tl.reduce(tl.where(finite, 0, 1), 1, _max_combine) > 0
    # Zeroing non-finite elements keeps nan out of the arithmetic below; their block's codes are zeroed anyway.
    x = tl.where(finite, x, 0.0)
    scale = tl.math.div_rn(tl.reduce(tl.abs(x), 1, _max_combine), QMAX)
    scale = tl.where(scale == 0.0, 1.0, scale)
    # Near fp32's max, QMAX * scale could overflow (halved for bf16 so rounding up stays finite): format.scale_cap.
    scale = tl.minimum(scale, SCALE_MAX)
    if BF16_SCALES:
        # round_up_to_bf16 on the bits: the scale is positive and finite here, so the shifts are exact.
        scale = (((scale.to(tl.int32, bitcast=True) + 0xFFFF) >> 16) << 16).to(tl.float32, bitcast=True)

    # Round half to even. floor may flush a subnormal y to zero on GPU (libdevice ftz), but such a y rounds to 0
    # either way, so the codes do not change.
    y = tl.math.div_rn(x, scale[:, None])
    r = tl.floor(y)
    frac = y - r
    r_half = r * 0.5
    odd = tl.floor(r_half) != r_half
    q = tl.where((frac > 0.5) | ((frac == 0.5) & odd), r + 1.0, r)
    q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
    q = tl.where(bad[:, None], 0.0, q).to(tl.int32)

    if BITS == 8:
        tl.store(out_ptr + row[:, None] * row_len + pos, q.to(tl.int8), mask=mask)
    else:
        # Byte j of a block packs elements 2j (low nibble) and 2j + 1 (high nibble); block_size is even, so a
        # block's bytes are its own. Padding columns hold code 0, which is what an odd tail's high nibble needs.
        lo, hi = tl.split(tl.reshape(q & 15, [ROWS, WIDTH // 2, 2]))
        pairs = tl.arange(0, WIDTH // 2)
        byte_pos = start[:, None] // 2 + pairs[None, :]
        byte_mask = blk_ok[:, None] & (pairs[None, :] < block_size // 2) & (byte_pos * 2 < row_len)
        row_bytes = (row_len + 1) // 2
        tl.store(out_ptr + row[:, None] * row_bytes + byte_pos, (lo | (hi << 4)).to(tl.uint8), mask=byte_mask)
    if BF16_SCALES:
        # scale_ptr is the bf16 scale buffer viewed as int16: its top 16 bits are the bf16 value exactly.
        top = scale.to(tl.int32, bitcast=True) >> 16
        tl.store(scale_ptr + blk, tl.where(bad, _BF16_NAN_BITS, top).to(tl.int16), mask=blk_ok)
    else:
        tl.store(scale_ptr + blk, tl.where(bad, float("nan"), scale), mask=blk_ok)


def _dequantize_kernel(
    in_ptr,
    scale_ptr,
    out_ptr,
    n_blocks,
    per_row,
    row_len,
    inner,
    stride_outer,
    stride_inner,
    block_size,
    BITS: tl.constexpr,
    BF16_SCALES: tl.constexpr,
    ROWS: tl.constexpr,
    WIDTH: tl.constexpr,
):
    blk = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, WIDTH)
    blk_ok = blk < n_blocks
    b = blk.to(tl.int64)
    row = b // per_row
    start = (b - row * per_row) * block_size
    pos = start[:, None] + cols[None, :]
    mask = blk_ok[:, None] & (cols[None, :] < block_size) & (pos < row_len)
    if BITS == 8:
        q = tl.load(in_ptr + row[:, None] * row_len + pos, mask=mask, other=0).to(tl.float32)
    else:
        pairs = tl.arange(0, WIDTH // 2)
        byte_pos = start[:, None] // 2 + pairs[None, :]
        byte_mask = blk_ok[:, None] & (pairs[None, :] < block_size // 2) & (byte_pos * 2 < row_len)
        row_bytes = (row_len + 1) // 2
        packed = tl.load(in_ptr + row[:, None] * row_bytes + byte_pos, mask=byte_mask, other=0).to(tl.int32)
        # Sign-extend each 4-bit two's complement nibble: 0..7 stay, 8..15 map to -8..-1.
        lo = ((packed & 15) ^ 8) - 8
        hi = (((packed >> 4) & 15) ^ 8) - 8
        q = tl.reshape(tl.join(lo, hi), [ROWS, WIDTH]).to(tl.float32)
    if BF16_SCALES:
        # bf16 bits (read as int16) to fp32 by a shift: exact, nan included, in compiled and interpreted kernels.
        bits = tl.load(scale_ptr + blk, mask=blk_ok, other=_BF16_ONE_BITS).to(tl.int32)
        scale = (bits << 16).to(tl.float32, bitcast=True)
    else:
        scale = tl.load(scale_ptr + blk, mask=blk_ok, other=1.0)
    outer = row // inner
    out_base = outer * stride_outer + (row - outer * inner) * stride_inner + start
    tl.store(out_ptr + out_base[:, None] + cols[None, :], (q * scale[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


def launch_counts() -> dict[tuple[str, int], int]:
    """Launches of these kernels that returned, per (kernel, bits): ``("quantize", 8)``, ``("dequantize", 4)``, ...

    Counted after Triton's launch call returned (a kernel that failed to compile or launch is not counted),
    interpreted launches (``TRITON_INTERPRET=1``) included.
    """
    return dict(_launched)


def _launch(fn: Callable[..., None], n_blocks: int, block_size: int, *args: Any, **constexprs: Any) -> None:
    """Run ``fn`` over ``n_blocks`` blocks of ``block_size`` elements, several blocks per program."""
    if n_blocks == 0:
        return
    width = triton.next_power_of_2(block_size)
    rows = max(1, _TILE // width)
    grid = (triton.cdiv(n_blocks, rows),)
    # FMA contraction would round differently from torch; disabling it explicitly (rather than relying on the
    # code having no contractible pattern) also keeps Triton >= 3.9 from warning that its default will change.
    _jit(fn)[grid](
        *args, ROWS=rows, WIDTH=width, num_warps=8 if rows * width >= 4096 else 4, enable_fp_fusion=False, **constexprs
    )
    _launched[(fn.__name__.strip("_").removesuffix("_kernel"), constexprs["BITS"])] += 1


def _check(bits: int, block_size: int, dtype: torch.dtype, scale_dtype: torch.dtype) -> None:
    check_format(bits, block_size)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"blockwise quantization works on fp32, bf16 or fp16 tensors, got {dtype}")
    if scale_dtype not in SCALE_DTYPES:
        raise TypeError(f"scales must be torch.float32 or torch.bfloat16, got {scale_dtype}")


def _row_layout(t: Tensor) -> tuple[Tensor, int, int, int, int] | None:
    """``(t', outer, inner, outer stride, inner stride)`` addressing the rows of ``t`` in place, else None.

    ``t'`` is ``t`` or a view of it whose leading dims collapse to at most two strided ones; None when the last dim
    is not unit-stride or more than two leading dims cannot be collapsed without a copy.
    """
    if t.dim() == 0:
        return t, 1, 1, 0, 0
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        return None
    if t.dim() == 1:
        return t, 1, 1, 0, 0
    if t.dim() == 2:
        return t, 1, t.shape[0], 0, t.stride(0)
    if t.dim() > 3:
        try:
            t = t.view(-1, *t.shape[-2:])
        except RuntimeError:
            return None
    return t, t.shape[0], t.shape[1], t.stride(0), t.stride(1)


def _quantize(
    rows: Tensor, block_size: int, bits: int, scale_dtype: torch.dtype, codes: Tensor, scales: Tensor
) -> None:
    """Run the quantize kernel over every row of ``rows`` (a flat tensor is one row), into ``codes`` and ``scales``."""
    layout = _row_layout(rows)
    if layout is None:
        layout = _row_layout(rows.contiguous())
    x, outer, inner, stride_outer, stride_inner = layout
    row_len = rows.shape[-1]
    per_row = triton.cdiv(row_len, block_size)
    n_blocks = outer * inner * per_row
    bf16 = scale_dtype == torch.bfloat16
    scale_out = scales.view(torch.int16) if bf16 else scales
    args = (x, codes, scale_out, n_blocks, per_row, row_len, inner, stride_outer, stride_inner, block_size)
    constexprs = {"BITS": bits, "QMAX": float(QMAX[bits]), "SCALE_MAX": scale_cap(bits, scale_dtype)}
    _launch(_quantize_kernel, n_blocks, block_size, *args, BF16_SCALES=bf16, **constexprs)


def quantize_blockwise_triton(
    x: Tensor, block_size: int, bits: int, scale_dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """Quantize ``x`` as one flat run of blocks; the contract of the reference in :mod:`ds_plugin.quant.comm.format`.

    Args:
        x: fp32, bf16 or fp16 tensor on a CUDA device (or any device under ``TRITON_INTERPRET=1``).
        block_size: elements per block (even for 4 bits).
        bits: 8 or 4.
        scale_dtype: fp32 or bf16 (rounded up) scales.

    Returns:
        ``(data, scales)``: int8 codes ``(numel,)`` or uint8 packed codes ``(ceil(numel / 2),)``, and scales
        ``(ceil(numel / block_size),)`` with nan for blocks that held inf/nan.
    """
    _check(bits, block_size, x.dtype, scale_dtype)
    flat = x.reshape(-1)
    numel = flat.numel()
    width = numel if bits == 8 else triton.cdiv(numel, 2)
    codes = torch.empty(width, dtype=torch.int8 if bits == 8 else torch.uint8, device=x.device)
    scales = torch.empty(triton.cdiv(numel, block_size), dtype=scale_dtype, device=x.device)
    _quantize(flat, block_size, bits, scale_dtype, codes, scales)
    return codes, scales


def quantize_rows_triton(rows: Tensor, block: int, bits: int) -> tuple[Tensor, Tensor]:
    """Quantize each row (last dim) of ``rows`` into blocks of its own, with bf16 scales rounded up.

    The contract of :func:`ds_plugin.quant.comm.fused.quantize_rows`, bit for bit.

    Args:
        rows: ``(..., numel)`` fp32, bf16 or fp16, on a CUDA device (or any under ``TRITON_INTERPRET=1``); any
            strides along the leading dims.
        block: elements per scale; even for 4 bits.
        bits: 8 or 4.

    Returns:
        ``(codes, scales)``: contiguous int8 ``(..., numel)`` or uint8 ``(..., ceil(numel / 2))`` codes in the
        view's order, and bf16 scales, ``ceil(numel / block)`` per row, row after row.
    """
    _check(bits, block, rows.dtype, torch.bfloat16)
    numel = rows.shape[-1]
    width = numel if bits == 8 else triton.cdiv(numel, 2)
    codes = torch.empty((*rows.shape[:-1], width), dtype=torch.int8 if bits == 8 else torch.uint8, device=rows.device)
    n_rows = rows.numel() // numel if numel else 0
    scales = torch.empty(n_rows * triton.cdiv(numel, block), dtype=torch.bfloat16, device=rows.device)
    if n_rows:
        _quantize(rows, block, bits, torch.bfloat16, codes, scales)
    return codes, scales


def _dequantize(data: Tensor, scales: Tensor, block_size: int, bits: int, out: Tensor) -> None:
    """Run the dequantize kernel over every row of ``out`` (a flat tensor is one row)."""
    layout = _row_layout(out)
    if layout is None:
        # An out the kernel cannot address in place: decode into contiguous memory and copy (same values).
        staged = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        _dequantize(data, scales, block_size, bits, staged)
        out.copy_(staged)
        return
    y, outer, inner, stride_outer, stride_inner = layout
    row_len = out.shape[-1]
    per_row = triton.cdiv(row_len, block_size)
    n_blocks = outer * inner * per_row
    bf16 = scales.dtype == torch.bfloat16
    scales = scales.contiguous()
    scale_in = scales.view(torch.int16) if bf16 else scales
    args = (data.contiguous(), scale_in, y, n_blocks, per_row, row_len, inner, stride_outer, stride_inner, block_size)
    _launch(_dequantize_kernel, n_blocks, block_size, *args, BITS=bits, BF16_SCALES=bf16)


def dequantize_blockwise_triton(
    data: Tensor, scales: Tensor, block_size: int, numel: int, bits: int, dtype: torch.dtype
) -> Tensor:
    """Dequantize one flat run of blocks into a flat tensor of ``numel`` elements of ``dtype``.

    Args:
        data: int8 codes (8 bits) or uint8 packed codes (4 bits), as from :func:`quantize_blockwise_triton`.
        scales: fp32 or bf16 per-block scales.
        block_size: the block size used to quantize.
        numel: number of elements to produce.
        bits: 8 or 4.
        dtype: fp32, bf16 or fp16.
    """
    _check(bits, block_size, dtype, scales.dtype)
    out = torch.empty(numel, dtype=dtype, device=data.device)
    if numel:
        _dequantize(data, scales, block_size, bits, out)
    return out


def dequantize_rows_into_triton(out: Tensor, codes: Tensor, scales: Tensor, block: int) -> None:
    """Write ``codes * scale`` (INT8 rows from :func:`quantize_rows_triton`) into ``out``, in ``out``'s dtype.

    The contract of :func:`ds_plugin.quant.comm.fused.dequantize_rows_into`, bit for bit (the interpreter excepted: it
    casts fp32 to bf16 by truncation, where compiled kernels and torch round to nearest even).

    Args:
        out: ``(..., numel)`` fp32, bf16 or fp16 destination; any strides along the leading dims.
        codes: int8 codes of the rows in ``out``'s index order, contiguous, ``out.numel()`` of them.
        scales: bf16 scales in the same order, ``ceil(numel / block)`` per row.
        block: the block size used to quantize.
    """
    _check(8, block, out.dtype, scales.dtype)
    if out.numel():
        _dequantize(codes, scales, block, 8, out)
