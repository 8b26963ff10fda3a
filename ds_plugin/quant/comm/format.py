"""The blockwise INT8 / INT4 format behind qwZ and qgZ: its constants and its plain-torch reference maths.

This is the bottom of the quantization stack. :mod:`ds_plugin.quant.comm.fused` (the row-wise torch backend, eager
or ``torch.compile``-d), :mod:`ds_plugin.kernels.quant_triton` (the Triton backend) and the frozen INT8 codec
(:mod:`ds_plugin.quant.frozen.codecs`) all take their rules from here, and this module imports nothing from them,
so there is exactly one definition of the format.

A tensor (or each row of one) is cut into consecutive blocks of ``block_size`` elements, the last one zero-padded
for quantizing. Each block gets one scale and integer codes:

* ``scale = amax(|block|) / qmax`` with ``qmax = 127`` (INT8) or ``7`` (INT4), computed in fp32 whatever the input
  dtype (fp32, bf16 or fp16);
* ``q = clamp(round(x / scale), -qmax, qmax)``, rounding **half to even** (``torch.round``'s rule);
* dequantization is ``(q * scale).to(dtype)``, one fp32 multiply then a round-to-nearest-even cast.

Special blocks:

* all zeros (or so tiny that ``amax / qmax`` underflows to 0): the scale is ``1.0``, the codes 0;
* within an ulp of fp32's max: the scale is clamped to :func:`max_finite_scale` so ``qmax * scale`` stays finite;
* holding inf or nan: a **nan scale** and all-zero codes, so the whole block dequantizes to nan.

Scales are fp32, or bf16 **rounded up** (:func:`round_up_to_bf16`) before the codes are computed, so codes never
clip and the receiver multiplies by exactly the scale the sender divided by.

INT4 codes are packed two per byte (:func:`pack_int4`): element ``2i`` in the low nibble, ``2i + 1`` in the high
nibble, each as a 4-bit two's complement number; an odd count leaves a zero high nibble in the last byte.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "FLOAT_DTYPES",
    "FP32_MAX",
    "QMAX",
    "SCALE_DTYPES",
    "as_blocks",
    "block_codes",
    "block_scales",
    "check_format",
    "dequantize_blocks",
    "dequantize_reference",
    "int4_nibbles",
    "max_finite_scale",
    "pack_int4",
    "pack_nibbles",
    "quantize_blocks",
    "quantize_reference",
    "quantized_nbytes",
    "round_up_to_bf16",
    "scale_cap",
    "sent_scales",
    "unpack_int4",
]

DEFAULT_BLOCK_SIZE = 2048
# Symmetric ranges: -128 / -8 are left unused so that negating a block never overflows its code range.
QMAX = {8: 127, 4: 7}
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALE_DTYPES = (torch.float32, torch.bfloat16)
FP32_MAX = torch.finfo(torch.float32).max


def check_format(bits: int, block_size: int) -> None:
    """Raise ``ValueError`` unless ``bits`` and ``block_size`` describe a valid format.

    Args:
        bits: 8 or 4.
        block_size: a positive int; even for 4 bits, so no packed byte spans two blocks.
    """
    if bits not in QMAX:
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if bits == 4 and block_size % 2:
        raise ValueError(f"INT4 needs an even block_size so no packed byte spans two blocks, got {block_size}")


def quantized_nbytes(numel: int, bits: int, block_size: int = DEFAULT_BLOCK_SIZE, scale_bytes: int = 4) -> int:
    """Bytes of the quantized form of ``numel`` elements: packed codes plus one scale per block.

    Args:
        numel: number of elements.
        bits: 8 or 4.
        block_size: elements per block.
        scale_bytes: 4 for fp32 scales, 2 for bf16.
    """
    check_format(bits, block_size)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    data_bytes = numel if bits == 8 else -(-numel // 2)
    return data_bytes + scale_bytes * -(-numel // block_size)


@functools.cache
def max_finite_scale(bits: int) -> float:
    """Largest fp32 scale whose product with the top code (127 or 7) is still finite in fp32.

    Scales are clamped to it: near fp32's max, ``amax / qmax`` can round up just enough for ``qmax * scale`` to
    overflow, and a finite input must never dequantize to inf.

    Args:
        bits: 8 or 4.
    """
    qmax = float(QMAX[bits])
    scale = torch.tensor(FP32_MAX / qmax, dtype=torch.float32)
    while torch.isinf(scale * qmax):
        scale = torch.nextafter(scale, torch.zeros_like(scale))
    return scale.item()


def scale_cap(bits: int, scale_dtype: torch.dtype) -> float:
    """The largest scale a block may get: :func:`max_finite_scale`, halved for bf16 scales.

    Halving keeps :func:`round_up_to_bf16` below bf16's max, so rounding up never reaches inf; no finite fp32
    input comes near it (``amax`` would have to exceed half of fp32's max).

    Args:
        bits: 8 or 4.
        scale_dtype: ``torch.float32`` or ``torch.bfloat16``.
    """
    return max_finite_scale(bits) / 2 if scale_dtype == torch.bfloat16 else max_finite_scale(bits)


def round_up_to_bf16(scales: Tensor) -> Tensor:
    """The smallest bf16-representable fp32 values >= ``scales``: add just under one bf16 ulp, drop the low bits.

    Args:
        scales: positive, finite fp32 values.
    """
    return ((scales.contiguous().view(torch.int32) + 0xFFFF) & ~0xFFFF).view(torch.float32)


def as_blocks(rows: Tensor, block: int) -> Tensor:
    """``rows`` as ``(..., blocks, block)``, each row zero-padded to whole blocks (a view when none is needed).

    Zero padding cannot change a block's amax, and callers cut the padding's codes off again.

    Args:
        rows: ``(..., numel)`` tensor.
        block: elements per block.
    """
    extra = -rows.shape[-1] % block
    if extra:
        rows = F.pad(rows, (0, extra))
    return rows.unflatten(-1, (-1, block))


def quantize_blocks(blocks: Tensor, bits: int, cap: float, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The reference quantizer on whole blocks (the module docstring's rules, op for op).

    Written without in-place ops or data-dependent control flow so that :mod:`ds_plugin.quant.comm.fused` can compile
    this very function; the eager and compiled forms then share one definition of the maths.

    Args:
        blocks: ``(..., n_blocks, block)`` fp32, bf16 or fp16; ``block`` even for 4 bits.
        bits: 8 or 4.
        cap: :func:`scale_cap` for ``bits`` and ``scale_dtype`` (a Python float, so a compiled graph need not
            trace the search in :func:`max_finite_scale`).
        scale_dtype: ``torch.float32``, or ``torch.bfloat16`` for scales rounded up to bf16.

    Returns:
        ``(codes, scales)``: int8 ``(..., n_blocks, block)`` for 8 bits, uint8 ``(..., n_blocks, block / 2)``
        packed for 4; scales flat, one per block in order, nan for blocks that held inf/nan.
    """
    values = blocks.float()
    # amax propagates inf/nan, so one check per block (not per element) finds the non-finite blocks.
    scales, nonfinite = block_scales(values.abs().amax(dim=-1, keepdim=True), bits, cap, scale_dtype)
    codes = block_codes(values, scales, nonfinite, bits)
    return (codes if bits == 8 else _pack_pairs(codes)), sent_scales(scales, nonfinite, scale_dtype)


def block_scales(amax: Tensor, bits: int, cap: float, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Each block's fp32 scale from its fp32 ``amax`` (``(..., n_blocks, 1)``), and which blocks are non-finite.

    The steps of :func:`quantize_blocks`, for a quantizer that reads a block's elements in another order (the
    compiled INT4 step of :mod:`ds_plugin.quant.comm.fused` reads even and odd elements apart).

    Args:
        amax: ``max(|x|)`` of each block in fp32 (inf or nan where the block holds one).
        bits, cap, scale_dtype: as for :func:`quantize_blocks`.

    Returns:
        ``(scales, nonfinite)``: the scales the codes are computed against (bf16-representable for bf16 scales),
        and a bool mask of the blocks that held inf/nan, both shaped like ``amax``.
    """
    nonfinite = ~torch.isfinite(amax)
    # Divide by a tensor, not a Python scalar: CUDA torch turns `t / scalar` into `t * (1 / scalar)`, which rounds
    # differently from the correctly rounded division the Triton kernel performs.
    scales = amax / torch.full_like(amax, float(QMAX[bits]))
    scales = torch.where(scales == 0, 1.0, scales).clamp(max=cap)
    if scale_dtype == torch.bfloat16:
        # The codes are computed against the scale the receiver will see.
        scales = round_up_to_bf16(scales)
    return scales, nonfinite


def block_codes(values: Tensor, scales: Tensor, nonfinite: Tensor, bits: int) -> Tensor:
    """int8 codes of fp32 ``values`` (``(..., n_blocks, k)``) against :func:`block_scales`' results; 0 in
    non-finite blocks."""
    qmax = QMAX[bits]
    codes = torch.round(values / scales).clamp(-qmax, qmax)
    return torch.where(nonfinite, 0.0, codes).to(torch.int8)


def sent_scales(scales: Tensor, nonfinite: Tensor, scale_dtype: torch.dtype) -> Tensor:
    """The scales as they travel: flat, in ``scale_dtype``, nan for the non-finite blocks."""
    return torch.where(nonfinite, float("nan"), scales).to(scale_dtype).reshape(-1)


def dequantize_blocks(codes: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """The reference dequantizer on whole blocks: ``(codes * scale).to(dtype)`` in fp32.

    Args:
        codes: ``(..., n_blocks, block)`` integer codes (INT4 already unpacked).
        scales: fp32 or bf16 scales, one per block in order.
        dtype: fp32, bf16 or fp16 result dtype.
    """
    return (codes.float() * scales.float().view(*codes.shape[:-1], 1)).to(dtype)


def pack_int4(codes: Tensor) -> Tensor:
    """Pack int8 codes in [-8, 7] two per byte: element ``2i`` in the low nibble, ``2i + 1`` in the high nibble.

    Each nibble is the code's 4-bit two's complement; an odd count is padded with a zero high nibble. Bits above
    the low four of each code are dropped, so out-of-range codes do not round-trip.

    Args:
        codes: int8 tensor of any shape (flattened in row-major order).

    Returns:
        uint8 tensor of shape ``(ceil(codes.numel() / 2),)``.
    """
    if codes.dtype != torch.int8:
        raise TypeError(f"pack_int4 takes int8 codes, got {codes.dtype}")
    flat = codes.reshape(-1)
    if flat.numel() % 2:
        flat = F.pad(flat, (0, 1))
    return _pack_pairs(flat)


def int4_nibbles(packed: Tensor) -> tuple[Tensor, Tensor]:
    """The sign-extended low and high nibbles of packed INT4 bytes, as int32 (elements ``2i`` and ``2i + 1``).

    Args:
        packed: uint8 tensor from :func:`pack_int4` (any shape).
    """
    wide = packed.to(torch.int32)
    # 4-bit two's complement to int without branches: 0..7 stay, 8..15 become -8..-1.
    return ((wide & 0xF) ^ 8) - 8, ((wide >> 4) ^ 8) - 8


def unpack_int4(packed: Tensor, numel: int) -> Tensor:
    """Inverse of :func:`pack_int4`: the first ``numel`` codes as an int8 tensor of shape ``(numel,)``.

    Args:
        packed: uint8 tensor from :func:`pack_int4`.
        numel: number of codes to return; ``ceil(numel / 2)`` must equal ``packed.numel()``.
    """
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_int4 takes uint8 packed codes, got {packed.dtype}")
    if packed.numel() != -(-numel // 2):
        raise ValueError(f"{packed.numel()} packed bytes cannot hold exactly {numel} int4 codes")
    low, high = int4_nibbles(packed.reshape(-1))
    return torch.stack((low, high), dim=1).reshape(-1)[:numel].to(torch.int8)


def _pack_pairs(codes: Tensor) -> Tensor:
    # Pairs along the last dim (its length is even).
    pairs = codes.unflatten(-1, (-1, 2))
    return pack_nibbles(pairs[..., 0], pairs[..., 1])


def pack_nibbles(low: Tensor, high: Tensor) -> Tensor:
    """uint8 bytes holding int8 codes ``low`` (elements ``2i``) and ``high`` (``2i + 1``): the one place the
    nibble layout is written down (:func:`int4_nibbles` reads it back)."""
    return (low.view(torch.uint8) & 0xF) | ((high.view(torch.uint8) & 0xF) << 4)


def quantize_reference(
    x: Tensor, bits: int, block_size: int, scale_dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """The reference quantizer on ``x`` flattened into one run of blocks (the last one may be shorter).

    Args:
        x: fp32, bf16 or fp16 tensor of any shape.
        bits: 8 or 4.
        block_size: elements per block; even for 4 bits.
        scale_dtype: ``torch.float32`` or ``torch.bfloat16``.

    Returns:
        ``(data, scales)``: int8 codes ``(numel,)`` or uint8 packed codes ``(ceil(numel / 2),)``, and scales
        ``(ceil(numel / block_size),)``.
    """
    flat = x.reshape(-1)
    numel = flat.numel()
    codes, scales = quantize_blocks(as_blocks(flat, block_size), bits, scale_cap(bits, scale_dtype), scale_dtype)
    width = numel if bits == 8 else -(-numel // 2)
    data = codes.reshape(-1)
    # Clone so no padding stays reachable through the returned tensor's storage.
    return (data[:width].clone() if data.numel() != width else data), scales


def dequantize_reference(
    data: Tensor, scales: Tensor, block_size: int, numel: int, bits: int, dtype: torch.dtype
) -> Tensor:
    """The reference dequantizer for :func:`quantize_reference`'s output; a flat tensor of ``numel`` elements.

    Args:
        data: int8 codes (8 bits) or uint8 packed codes (4 bits).
        scales: fp32 or bf16 scales, one per block.
        block_size: the block size used to quantize.
        numel: number of elements to produce.
        bits: 8 or 4.
        dtype: fp32, bf16 or fp16.
    """
    codes = data.reshape(-1) if bits == 8 else unpack_int4(data, numel)
    return dequantize_blocks(as_blocks(codes, block_size), scales, dtype).reshape(-1)[:numel]
