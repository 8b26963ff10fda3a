"""A whole-tensor API over the blockwise format's reference, for tests: what `ds_plugin.quant.blockwise` was.

The library quantizes bucket rows (:mod:`ds_plugin.quant.comm.dispatch`); nothing in it quantizes a whole tensor of
any shape, so this flat form lives with the tests that pin the format down through it. It is a thin shell over
:func:`ds_plugin.quant.comm.format.quantize_reference` / :func:`~ds_plugin.quant.comm.format.dequantize_reference`
(torch only) that adds what a caller of the format must check: argument dtypes and sizes, the original shape, and
an inf/nan check. With ``check_finite=False`` (the gradient path, qgZ) a block holding inf or nan gets a **nan
scale** and all-zero codes, so every element of it dequantizes to nan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ds_plugin.quant.comm.format import (
    DEFAULT_BLOCK_SIZE,
    FLOAT_DTYPES,
    SCALE_DTYPES,
    check_format,
    dequantize_reference,
    quantize_reference,
)


@dataclass(frozen=True, eq=False)
class QuantizedBlocks:
    """One blockwise-quantized tensor: codes, per-block scales and what is needed to rebuild the original.

    Args:
        data: int8 codes of shape ``(numel,)`` for 8 bits; uint8 packed codes of shape ``(ceil(numel / 2),)`` for 4.
        scales: fp32 or bf16 scales of shape ``(ceil(numel / block_size),)``; nan marks a block that held inf/nan.
        block_size: elements per block.
        shape: shape of the original tensor.
        dtype: dtype of the original tensor (and of :meth:`dequantize`'s result).
        bits: 8 or 4.
    """

    data: Tensor
    scales: Tensor
    block_size: int
    shape: torch.Size
    dtype: torch.dtype
    bits: int

    @property
    def numel(self) -> int:
        """Number of elements of the original tensor."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes held by codes plus scales (what a collective moves)."""
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()

    def dequantize(self) -> Tensor:
        """Rebuild the tensor in its original shape and dtype."""
        return dequantize_blockwise(self)


def quantize_blockwise(
    x: Tensor,
    bits: int = 8,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    check_finite: bool = True,
    scale_dtype: torch.dtype = torch.float32,
) -> QuantizedBlocks:
    """Quantize ``x`` (any shape, flattened into one run of blocks) with the format's reference.

    Args:
        x: fp32, bf16 or fp16 tensor of any shape (0-d and empty included).
        bits: 8 or 4.
        block_size: elements sharing one scale; even for 4 bits.
        check_finite: raise ``ValueError`` if ``x`` holds inf/nan; when False, such blocks get a nan scale.
        scale_dtype: fp32 or bf16 (rounded up) scales.
    """
    check_format(bits, block_size)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"blockwise quantization takes fp32, bf16 or fp16 tensors, got {x.dtype}")
    if scale_dtype not in SCALE_DTYPES:
        raise TypeError(f"scale_dtype must be torch.float32 or torch.bfloat16, got {scale_dtype}")
    data, scales = quantize_reference(x, bits, block_size, scale_dtype)
    if check_finite:
        bad = int(torch.isnan(scales).sum())
        if bad:
            raise ValueError(
                f"cannot quantize a tensor holding inf/nan ({bad} of {scales.numel()} blocks of {block_size} "
                "are non-finite); pass check_finite=False to map such blocks to a nan scale instead"
            )
    return QuantizedBlocks(data, scales, block_size, x.shape, x.dtype, bits)


def dequantize_blockwise(qb: QuantizedBlocks) -> Tensor:
    """Rebuild a tensor from :class:`QuantizedBlocks`, in its original shape and dtype."""
    return _dequantize(qb.data, qb.scales, qb.block_size, qb.shape, qb.dtype, qb.bits)


def quantize_int8_blockwise(
    x: Tensor, block_size: int = DEFAULT_BLOCK_SIZE, *, check_finite: bool = True
) -> tuple[Tensor, Tensor]:
    """INT8 :func:`quantize_blockwise` as ``(codes, scales)``: int8 ``(numel,)``, fp32 ``(ceil(numel / block),)``."""
    qb = quantize_blockwise(x, 8, block_size, check_finite=check_finite)
    return qb.data, qb.scales


def dequantize_int8_blockwise(
    q: Tensor, scales: Tensor, block_size: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> Tensor:
    """Inverse of :func:`quantize_int8_blockwise`, reshaped to ``shape``."""
    return _dequantize(q, scales, block_size, torch.Size(shape), dtype, 8)


def quantize_int4_blockwise(
    x: Tensor, block_size: int = DEFAULT_BLOCK_SIZE, *, check_finite: bool = True
) -> tuple[Tensor, Tensor]:
    """INT4 :func:`quantize_blockwise` as ``(packed, scales)``: uint8 ``(ceil(numel / 2),)``, fp32 scales."""
    qb = quantize_blockwise(x, 4, block_size, check_finite=check_finite)
    return qb.data, qb.scales


def dequantize_int4_blockwise(
    packed: Tensor, scales: Tensor, block_size: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> Tensor:
    """Inverse of :func:`quantize_int4_blockwise`, reshaped to ``shape``."""
    return _dequantize(packed, scales, block_size, torch.Size(shape), dtype, 4)


def _dequantize(
    data: Tensor, scales: Tensor, block_size: int, shape: torch.Size, dtype: torch.dtype, bits: int
) -> Tensor:
    check_format(bits, block_size)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"blockwise dequantization produces fp32, bf16 or fp16, got {dtype}")
    numel = math.prod(shape)
    expected_data = (numel, torch.int8) if bits == 8 else (-(-numel // 2), torch.uint8)
    if (data.numel(), data.dtype) != expected_data:
        raise ValueError(
            f"INT{bits} data for shape {tuple(shape)} must be {expected_data[1]} with {expected_data[0]} elements, "
            f"got {data.dtype} with {data.numel()}"
        )
    if scales.dtype not in SCALE_DTYPES or scales.numel() != -(-numel // block_size):
        raise ValueError(
            f"expected {-(-numel // block_size)} fp32 or bf16 scales for {numel} elements in blocks of {block_size}, "
            f"got {scales.numel()} of {scales.dtype}"
        )
    return dequantize_reference(data, scales, block_size, numel, bits, dtype).reshape(shape)
