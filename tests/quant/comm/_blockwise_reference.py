"""Symmetric blockwise INT8 / INT4 quantization of whole tensors: the flat API of the qwZ / qgZ format.

The format (blocks, scales, rounding, special blocks, INT4 packing) and its reference maths are defined in
:mod:`ds_plugin.quant.comm.format`; read its docstring for the exact rules. Here a tensor is flattened into one run of
blocks of ``block_size`` elements (the last block may be shorter), and quantization adds one check:

* holding inf or nan: with ``check_finite=True`` (the default) quantization raises :class:`ValueError`. With
  ``check_finite=False`` (the gradient path, qgZ) such a block gets a **nan scale** and all-zero codes, so every
  element of it dequantizes to nan: an fp16 overflow survives the quantized reduce-scatter and the loss scaler
  still sees it. Inf becomes nan on the way; only "non-finite" is preserved, not the sign or kind.

So every element comes back within ``scale / 2`` (plus fp32/output-dtype rounding). bf16 works as an input dtype
here, unlike DeepSpeed's fp16-only kernel.

Which backend runs is decided by :func:`ds_plugin.quant.comm.dispatch.triton_kernels`, the same rule the ZeRO++ row
steps use: the Triton kernels for a CUDA tensor with triton importable, or any tensor when ``TRITON_INTERPRET=1``
is set (the CPU interpreter, for tests); the plain-torch reference otherwise. ``triton`` is imported lazily, so
this module imports without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ds_plugin.quant.comm.dispatch import Backend, triton_kernels
from ds_plugin.quant.comm.format import (
    DEFAULT_BLOCK_SIZE,
    FLOAT_DTYPES,
    SCALE_DTYPES,
    check_format,
    dequantize_reference,
    max_finite_scale,
    pack_int4,
    quantize_reference,
    quantized_nbytes,
    unpack_int4,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "QuantizedBlocks",
    "dequantize_blockwise",
    "dequantize_int4_blockwise",
    "dequantize_int8_blockwise",
    "max_finite_scale",
    "pack_int4",
    "quantize_blockwise",
    "quantize_int4_blockwise",
    "quantize_int8_blockwise",
    "quantized_nbytes",
    "unpack_int4",
]


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

    def dequantize(self, *, backend: Backend = "auto") -> Tensor:
        """Rebuild the tensor in its original shape and dtype.

        Args:
            backend: ``"auto"``, ``"torch"`` or ``"triton"`` (see :func:`quantize_blockwise`).
        """
        return dequantize_blockwise(self, backend=backend)


def quantize_blockwise(
    x: Tensor,
    bits: int = 8,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    check_finite: bool = True,
    backend: Backend = "auto",
    scale_dtype: torch.dtype = torch.float32,
) -> QuantizedBlocks:
    """Quantize ``x`` blockwise to symmetric INT8 or INT4 (see the module docstring for the exact rules).

    Args:
        x: fp32, bf16 or fp16 tensor of any shape (0-d and empty included).
        bits: 8 (codes in [-127, 127], one per byte) or 4 (codes in [-7, 7], two per byte).
        block_size: elements sharing one scale; must be even for 4 bits so that no byte straddles two blocks.
        check_finite: raise :class:`ValueError` if ``x`` holds inf/nan. When False, such blocks get a nan scale
            and dequantize to nan (used by the gradient path so overflows propagate). The check reads the scales
            back to the host, a device sync on GPU.
        backend: ``"auto"`` picks Triton where it runs (CUDA, or ``TRITON_INTERPRET=1``) and torch otherwise;
            ``"torch"`` / ``"triton"`` force one (forcing Triton where it cannot run raises ``RuntimeError``).
        scale_dtype: fp32 (default) or bf16. bf16 scales halve the scale bytes, which matters for small blocks;
            each scale is rounded *up* to a bf16 value before the codes are computed, so codes never clip and
            the step grows by at most 2**-7.
    """
    check_format(bits, block_size)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"blockwise quantization takes fp32, bf16 or fp16 tensors, got {x.dtype}")
    if scale_dtype not in SCALE_DTYPES:
        raise TypeError(f"scale_dtype must be torch.float32 or torch.bfloat16, got {scale_dtype}")
    kernels = triton_kernels(x, backend)
    if kernels is not None:
        data, scales = kernels.quantize_blockwise_triton(x, block_size, bits, scale_dtype)
    else:
        data, scales = quantize_reference(x, bits, block_size, scale_dtype)
    if check_finite:
        bad = int(torch.isnan(scales).sum())
        if bad:
            raise ValueError(
                f"cannot quantize a tensor holding inf/nan ({bad} of {scales.numel()} blocks of {block_size} "
                "are non-finite); pass check_finite=False to map such blocks to a nan scale instead"
            )
    return QuantizedBlocks(data, scales, block_size, x.shape, x.dtype, bits)


def dequantize_blockwise(qb: QuantizedBlocks, *, backend: Backend = "auto") -> Tensor:
    """Rebuild a tensor from :class:`QuantizedBlocks`, in its original shape and dtype.

    Args:
        qb: the quantized tensor.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (see :func:`quantize_blockwise`).
    """
    return _dequantize(qb.data, qb.scales, qb.block_size, qb.shape, qb.dtype, qb.bits, backend)


def quantize_int8_blockwise(
    x: Tensor,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    check_finite: bool = True,
    backend: Backend = "auto",
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """Symmetric INT8 blockwise quantization; returns ``(codes, scales)``.

    ``codes`` is int8 of shape ``(x.numel(),)`` in [-127, 127]; ``scales`` is fp32 of shape
    ``(ceil(x.numel() / block_size),)``.

    Args:
        x: fp32, bf16 or fp16 tensor of any shape.
        block_size: elements sharing one scale.
        check_finite: raise ``ValueError`` on inf/nan (default); when False, non-finite blocks get a nan scale.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (see :func:`quantize_blockwise`).
        scale_dtype: fp32 or bf16 scales (see :func:`quantize_blockwise`).
    """
    qb = quantize_blockwise(x, 8, block_size, check_finite=check_finite, backend=backend, scale_dtype=scale_dtype)
    return qb.data, qb.scales


def dequantize_int8_blockwise(
    q: Tensor,
    scales: Tensor,
    block_size: int,
    shape: torch.Size | tuple[int, ...],
    dtype: torch.dtype = torch.float32,
    *,
    backend: Backend = "auto",
) -> Tensor:
    """Inverse of :func:`quantize_int8_blockwise`: ``(q * scale).to(dtype)`` reshaped to ``shape``.

    Args:
        q: int8 codes of shape ``(numel,)``.
        scales: fp32 or bf16 per-block scales.
        block_size: the block size used to quantize.
        shape: shape of the result; its element count must match ``q``.
        dtype: fp32, bf16 or fp16 result dtype.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (see :func:`quantize_blockwise`).
    """
    return _dequantize(q, scales, block_size, torch.Size(shape), dtype, 8, backend)


def quantize_int4_blockwise(
    x: Tensor,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    check_finite: bool = True,
    backend: Backend = "auto",
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """Symmetric INT4 blockwise quantization; returns ``(packed, scales)``.

    ``packed`` is uint8 of shape ``(ceil(x.numel() / 2),)`` holding codes in [-7, 7] (layout: :func:`pack_int4`);
    ``scales`` is fp32 of shape ``(ceil(x.numel() / block_size),)``.

    Args:
        x: fp32, bf16 or fp16 tensor of any shape.
        block_size: elements sharing one scale; must be even.
        check_finite: raise ``ValueError`` on inf/nan (default); when False, non-finite blocks get a nan scale.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (see :func:`quantize_blockwise`).
        scale_dtype: fp32 or bf16 scales (see :func:`quantize_blockwise`).
    """
    qb = quantize_blockwise(x, 4, block_size, check_finite=check_finite, backend=backend, scale_dtype=scale_dtype)
    return qb.data, qb.scales


def dequantize_int4_blockwise(
    packed: Tensor,
    scales: Tensor,
    block_size: int,
    shape: torch.Size | tuple[int, ...],
    dtype: torch.dtype = torch.float32,
    *,
    backend: Backend = "auto",
) -> Tensor:
    """Inverse of :func:`quantize_int4_blockwise`: unpack, ``(q * scale).to(dtype)``, reshape to ``shape``.

    Args:
        packed: uint8 packed codes of shape ``(ceil(numel / 2),)``.
        scales: fp32 or bf16 per-block scales.
        block_size: the block size used to quantize.
        shape: shape of the result.
        dtype: fp32, bf16 or fp16 result dtype.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (see :func:`quantize_blockwise`).
    """
    return _dequantize(packed, scales, block_size, torch.Size(shape), dtype, 4, backend)


def _dequantize(
    data: Tensor,
    scales: Tensor,
    block_size: int,
    shape: torch.Size,
    dtype: torch.dtype,
    bits: int,
    backend: Backend,
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
    kernels = triton_kernels(data, backend)
    if kernels is not None:
        flat = kernels.dequantize_blockwise_triton(data, scales, block_size, numel, bits, dtype)
    else:
        flat = dequantize_reference(data, scales, block_size, numel, bits, dtype)
    return flat.reshape(shape)
