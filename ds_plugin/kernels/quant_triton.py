"""Triton kernels for symmetric blockwise INT8 / INT4 quantization (qwZ weights, qgZ gradients).

The format and its plain-torch reference live in :mod:`ds_plugin.quant.blockwise`; these kernels reproduce that
reference bit for bit (codes and scales), so the rules are written to leave the compiler no freedom:

* all arithmetic is fp32; divisions use ``tl.math.div_rn`` because Triton's ``/`` lowers to an approximate
  division on NVIDIA GPUs while torch divides with correct rounding;
* rounding is half to even, like ``torch.round``, built from ``floor`` so it does not depend on a libdevice path
  (which moved between Triton releases) and no multiply feeds an add that could be contracted into an FMA;
* ``amax`` is taken over the finite elements only and non-finite blocks are flagged separately, because a GPU
  ``max`` drops nan where torch propagates it.

Each program handles ``ROWS`` consecutive blocks as a ``[ROWS, WIDTH]`` tile (``WIDTH`` the block size rounded up to
a power of two), so small blocks still give every program a few thousand elements and a block's scale is a row
reduction. INT4 codes are paired into bytes with a reshape/split of that tile, so loads and stores stay contiguous.

``triton.jit`` decides between compiled and interpreted kernels (``TRITON_INTERPRET``) when it decorates a function,
so the kernels here are plain functions jitted on first use and cached per mode: a test can switch the interpreter
on for CPU tensors and a GPU test in the same process still gets compiled kernels.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from ds_plugin.quant.blockwise import max_finite_scale

__all__ = ["dequantize_blockwise_triton", "interpreter_enabled", "quantize_blockwise_triton"]

# Elements per program tile; enough work per program on GPU and few Python-level programs in the interpreter.
_TILE = 4096
# Largest finite fp32: `|x| <= _FP32_MAX` is false exactly for inf and nan. A jitted function may only read
# globals declared constexpr.
_FP32_MAX = tl.constexpr(3.4028234663852886e38)
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_QMAX = {8: 127.0, 4: 7.0}
_jitted: dict[tuple[str, bool], Any] = {}


def interpreter_enabled() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``), as triton itself reads it."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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
    numel,
    n_blocks,
    block_size,
    BITS: tl.constexpr,
    QMAX: tl.constexpr,
    SCALE_MAX: tl.constexpr,
    ROWS: tl.constexpr,
    WIDTH: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, WIDTH)
    row_ok = rows < n_blocks
    offs = rows.to(tl.int64)[:, None] * block_size + cols[None, :]
    mask = row_ok[:, None] & (cols[None, :] < block_size) & (offs < numel)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)

    finite = tl.abs(x) <= _FP32_MAX
    bad = tl.reduce(tl.where(finite, 0, 1), 1, _max_combine) > 0
    # Zeroing non-finite elements keeps nan out of the arithmetic below; their block's codes are zeroed anyway.
    x = tl.where(finite, x, 0.0)
    scale = tl.math.div_rn(tl.reduce(tl.abs(x), 1, _max_combine), QMAX)
    scale = tl.where(scale == 0.0, 1.0, scale)
    # Near fp32's max, QMAX * scale could overflow; the reference clamps the same way (max_finite_scale).
    scale = tl.minimum(scale, SCALE_MAX)

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
        tl.store(out_ptr + offs, q.to(tl.int8), mask=mask)
    else:
        # Byte j of a block packs elements 2j (low nibble) and 2j + 1 (high nibble); block_size is even, so a
        # block's bytes are its own. Padding columns hold code 0, which is what an odd tail's high nibble needs.
        lo, hi = tl.split(tl.reshape(q & 15, [ROWS, WIDTH // 2, 2]))
        pairs = tl.arange(0, WIDTH // 2)
        byte_offs = rows.to(tl.int64)[:, None] * (block_size // 2) + pairs[None, :]
        byte_mask = row_ok[:, None] & (pairs[None, :] < block_size // 2) & (byte_offs * 2 < numel)
        tl.store(out_ptr + byte_offs, (lo | (hi << 4)).to(tl.uint8), mask=byte_mask)
    tl.store(scale_ptr + rows, tl.where(bad, float("nan"), scale), mask=row_ok)


def _dequantize_kernel(
    in_ptr, scale_ptr, out_ptr, numel, n_blocks, block_size, BITS: tl.constexpr, ROWS: tl.constexpr, WIDTH: tl.constexpr
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, WIDTH)
    row_ok = rows < n_blocks
    offs = rows.to(tl.int64)[:, None] * block_size + cols[None, :]
    mask = row_ok[:, None] & (cols[None, :] < block_size) & (offs < numel)
    if BITS == 8:
        q = tl.load(in_ptr + offs, mask=mask, other=0).to(tl.float32)
    else:
        pairs = tl.arange(0, WIDTH // 2)
        byte_offs = rows.to(tl.int64)[:, None] * (block_size // 2) + pairs[None, :]
        byte_mask = row_ok[:, None] & (pairs[None, :] < block_size // 2) & (byte_offs * 2 < numel)
        packed = tl.load(in_ptr + byte_offs, mask=byte_mask, other=0).to(tl.int32)
        # Sign-extend each 4-bit two's complement nibble: 0..7 stay, 8..15 map to -8..-1.
        lo = ((packed & 15) ^ 8) - 8
        hi = (((packed >> 4) & 15) ^ 8) - 8
        q = tl.reshape(tl.join(lo, hi), [ROWS, WIDTH]).to(tl.float32)
    scale = tl.load(scale_ptr + rows, mask=row_ok, other=1.0)
    tl.store(out_ptr + offs, (q * scale[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


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


def _check(bits: int, block_size: int, dtype: torch.dtype) -> None:
    if bits not in _QMAX:
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    if bits == 4 and block_size % 2:
        raise ValueError(f"INT4 needs an even block_size, got {block_size}")
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"blockwise quantization works on fp32, bf16 or fp16 tensors, got {dtype}")


def quantize_blockwise_triton(x: Tensor, block_size: int, bits: int) -> tuple[Tensor, Tensor]:
    """Quantize ``x`` with the Triton kernel; same contract as the torch reference in ``ds_plugin.quant.blockwise``.

    Args:
        x: fp32, bf16 or fp16 tensor on a CUDA device (or any device under ``TRITON_INTERPRET=1``).
        block_size: elements per block (even for 4 bits).
        bits: 8 or 4.

    Returns:
        ``(data, scales)``: int8 codes ``(numel,)`` or uint8 packed codes ``(ceil(numel / 2),)``, and fp32 scales
        ``(ceil(numel / block_size),)`` with nan for blocks that held inf/nan.
    """
    _check(bits, block_size, x.dtype)
    flat = x.contiguous().view(-1)
    numel = flat.numel()
    n_blocks = triton.cdiv(numel, block_size)
    scales = torch.empty(n_blocks, dtype=torch.float32, device=x.device)
    if bits == 8:
        data = torch.empty(numel, dtype=torch.int8, device=x.device)
    else:
        data = torch.empty(triton.cdiv(numel, 2), dtype=torch.uint8, device=x.device)
    args = (flat, data, scales, numel, n_blocks, block_size)
    constexprs = {"BITS": bits, "QMAX": _QMAX[bits], "SCALE_MAX": max_finite_scale(bits)}
    _launch(_quantize_kernel, n_blocks, block_size, *args, **constexprs)
    return data, scales


def dequantize_blockwise_triton(
    data: Tensor, scales: Tensor, block_size: int, numel: int, bits: int, dtype: torch.dtype
) -> Tensor:
    """Dequantize with the Triton kernel into a flat tensor of ``numel`` elements of ``dtype``.

    Args:
        data: int8 codes (8 bits) or uint8 packed codes (4 bits), as from :func:`quantize_blockwise_triton`.
        scales: fp32 per-block scales.
        block_size: the block size used to quantize.
        numel: number of elements to produce.
        bits: 8 or 4.
        dtype: fp32, bf16 or fp16.
    """
    _check(bits, block_size, dtype)
    out = torch.empty(numel, dtype=dtype, device=data.device)
    n_blocks = triton.cdiv(numel, block_size)
    args = (data.contiguous(), scales.contiguous(), out, numel, n_blocks, block_size)
    _launch(_dequantize_kernel, n_blocks, block_size, *args, BITS=bits)
    return out
