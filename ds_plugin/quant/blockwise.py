"""Symmetric blockwise INT8 / INT4 quantization: the format behind qwZ and qgZ.

A tensor is flattened and cut into consecutive blocks of ``block_size`` elements (the last block may be shorter).
Each block gets one fp32 scale and integer codes:

* ``scale = amax(|block|) / qmax`` with ``qmax = 127`` (INT8) or ``7`` (INT4), computed in fp32 whatever the input
  dtype (fp32, bf16 or fp16; bf16 works here, unlike DeepSpeed's fp16-only kernel);
* ``q = clamp(round(x / scale), -qmax, qmax)``, rounding **half to even** (``torch.round``'s rule; the Triton kernels
  in :mod:`ds_plugin.kernels.quant_triton` implement the same rule so both paths agree bit for bit);
* dequantization is ``(q * scale).to(dtype)``, one fp32 multiply then a round-to-nearest-even cast.

So every element comes back within ``scale / 2`` (plus fp32/output-dtype rounding).

Special blocks:

* all zeros (or so tiny that ``amax / qmax`` underflows to 0): the scale is set to ``1.0`` instead of 0, so it never
  divides by zero, the codes are 0 and dequantization gives exact zeros;
* within an ulp of fp32's max: the scale is clamped to :func:`max_finite_scale` so ``qmax * scale`` stays finite;
* holding inf or nan: with ``check_finite=True`` (the default) quantization raises :class:`ValueError`. With
  ``check_finite=False`` (the gradient path, qgZ) such a block gets a **nan scale** and all-zero codes, so every
  element of it dequantizes to nan: an fp16 overflow survives the quantized reduce-scatter and the loss scaler
  still sees it. Inf becomes nan on the way; only "non-finite" is preserved, not the sign or kind.

INT4 codes are packed two per byte (:func:`pack_int4`): element ``2i`` in the low nibble, ``2i + 1`` in the high
nibble, each as a 4-bit two's complement number; an odd count leaves a zero high nibble in the last byte.

The functions here dispatch between the plain-torch reference (always available) and the Triton kernels, which are
used only where they can run: a CUDA tensor with triton importable, or any tensor when ``TRITON_INTERPRET=1`` is set
(the CPU interpreter, for tests). ``triton`` is imported lazily, so this module imports without it.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

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

Backend = Literal["auto", "torch", "triton"]

DEFAULT_BLOCK_SIZE = 2048
# Symmetric ranges: -128 / -8 are left unused so that negating a block never overflows its code range.
_QMAX = {8: 127, 4: 7}
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SCALE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True, eq=False)
class QuantizedBlocks:
    """One blockwise-quantized tensor: codes, per-block scales and what is needed to rebuild the original.

    Args:
        data: int8 codes of shape ``(numel,)`` for 8 bits; uint8 packed codes of shape ``(ceil(numel / 2),)`` for 4.
        scales: fp32 scales of shape ``(ceil(numel / block_size),)``; nan marks a block that held inf/nan.
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


def quantized_nbytes(numel: int, bits: int, block_size: int = DEFAULT_BLOCK_SIZE, scale_bytes: int = 4) -> int:
    """Bytes of the quantized form of ``numel`` elements: packed codes plus one scale per block.

    Args:
        numel: number of elements.
        bits: 8 or 4.
        block_size: elements per block.
        scale_bytes: 4 for fp32 scales, 2 for bf16.
    """
    _check_format(bits, block_size)
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
    qmax = float(_QMAX[bits])
    scale = torch.tensor(torch.finfo(torch.float32).max / qmax, dtype=torch.float32)
    while torch.isinf(scale * qmax):
        scale = torch.nextafter(scale, torch.zeros_like(scale))
    return scale.item()


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
            the step grows by at most 2**-7. The Triton kernels produce fp32 scales only; bf16 runs in torch.
    """
    _check_format(bits, block_size)
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"blockwise quantization takes fp32, bf16 or fp16 tensors, got {x.dtype}")
    if scale_dtype not in _SCALE_DTYPES:
        raise TypeError(f"scale_dtype must be torch.float32 or torch.bfloat16, got {scale_dtype}")
    kernels = _triton_kernels(x, backend) if scale_dtype == torch.float32 else None
    if kernels is not None:
        data, scales = kernels.quantize_blockwise_triton(x, block_size, bits)
    else:
        codes, scales = _quantize_reference(x, block_size, bits, scale_dtype)
        data = codes if bits == 8 else pack_int4(codes)
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
        scales: fp32 per-block scales.
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
        scales: fp32 per-block scales.
        block_size: the block size used to quantize.
        shape: shape of the result.
        dtype: fp32, bf16 or fp16 result dtype.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (see :func:`quantize_blockwise`).
    """
    return _dequantize(packed, scales, block_size, torch.Size(shape), dtype, 4, backend)


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
    nibbles = codes.reshape(-1).view(torch.uint8) & 0xF
    if nibbles.numel() % 2:
        nibbles = F.pad(nibbles, (0, 1))
    return nibbles[0::2] | (nibbles[1::2] << 4)


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
    flat = packed.reshape(-1)
    nibbles = torch.stack((flat & 0xF, flat >> 4), dim=1).reshape(-1)[:numel].view(torch.int8)
    # Sign-extend a 4-bit two's complement value without branches: 0..7 stay, 8..15 map to -8..-1.
    return (nibbles ^ 8) - 8


def _check_format(bits: int, block_size: int) -> None:
    if bits not in _QMAX:
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if bits == 4 and block_size % 2:
        raise ValueError(f"INT4 needs an even block_size so no packed byte spans two blocks, got {block_size}")


def _interpreter_requested() -> bool:
    # Same spelling triton accepts for its boolean environment knobs.
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")


@functools.cache
def _load_triton_kernels() -> ModuleType | None:
    try:
        return importlib.import_module("ds_plugin.kernels.quant_triton")
    except ImportError:
        return None


def _triton_kernels(t: Tensor, backend: Backend) -> ModuleType | None:
    """The Triton kernel module when ``backend`` selects it for tensors like ``t``, else None (torch reference)."""
    if backend == "torch":
        return None
    if backend not in ("auto", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    # Checked before importing so the CPU path never pays for (or needs) a triton import.
    runnable = t.is_cuda or _interpreter_requested()
    kernels = _load_triton_kernels() if runnable else None
    if backend == "triton" and kernels is None:
        why = "triton is not importable" if runnable else "the tensor is on CPU and TRITON_INTERPRET=1 is not set"
        raise RuntimeError(f"backend='triton' cannot run here: {why}")
    return kernels


def _round_up_to_bf16(scales: Tensor) -> Tensor:
    """The smallest bf16-representable fp32 values >= `scales` (positive, finite): clear the low 16 bits, round up."""
    bits = scales.contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & ~0xFFFF).view(torch.float32)


def _quantize_reference(
    x: Tensor, block_size: int, bits: int, scale_dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """Plain-torch quantizer: int8 codes of shape ``(numel,)`` (unpacked, also for INT4) and the scales."""
    qmax = _QMAX[bits]
    flat = x.reshape(-1).float()
    numel = flat.numel()
    n_blocks = -(-numel // block_size)
    pad = n_blocks * block_size - numel
    # Zero padding cannot change a block's amax, and its codes are cut off below.
    blocks = F.pad(flat, (0, pad)).view(n_blocks, block_size)
    # amax propagates inf/nan, so one check per block (not per element) finds the non-finite blocks.
    amax = blocks.abs().amax(dim=1)
    nonfinite_block = ~torch.isfinite(amax)
    # Divide by a tensor, not a Python scalar: CUDA torch turns `t / scalar` into `t * (1 / scalar)`, which rounds
    # differently from the correctly rounded division the Triton kernel performs.
    scales = amax / torch.full_like(amax, float(qmax))
    scales = torch.where(scales == 0, 1.0, scales)
    scales = scales.clamp(max=max_finite_scale(bits))
    if scale_dtype == torch.bfloat16:
        # The codes are computed against the scale the receiver will see. Capped below bf16's max so that
        # rounding up never reaches inf.
        scales = _round_up_to_bf16(scales.clamp(max=max_finite_scale(bits) / 2))
    # In place: on CPU this runs once per step over every gradient, and each extra pass costs real time.
    codes = blocks / scales[:, None]
    codes.round_().clamp_(-qmax, qmax).masked_fill_(nonfinite_block[:, None], 0.0)
    codes = codes.to(torch.int8).reshape(-1)
    scales = torch.where(nonfinite_block, math.nan, scales).to(scale_dtype)
    # Clone so no padding stays reachable through the returned tensor's storage.
    return (codes[:numel].clone() if pad else codes), scales


def _dequantize_reference(codes: Tensor, scales: Tensor, block_size: int, numel: int, dtype: torch.dtype) -> Tensor:
    """Plain-torch dequantizer from unpacked int8 codes; returns a flat tensor of ``numel`` elements."""
    n_blocks = scales.numel()
    blocks = F.pad(codes.float(), (0, n_blocks * block_size - numel)).view(n_blocks, block_size)
    return (blocks * scales.float()[:, None]).to(dtype).reshape(-1)[:numel]


def _dequantize(
    data: Tensor,
    scales: Tensor,
    block_size: int,
    shape: torch.Size,
    dtype: torch.dtype,
    bits: int,
    backend: Backend,
) -> Tensor:
    _check_format(bits, block_size)
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"blockwise dequantization produces fp32, bf16 or fp16, got {dtype}")
    numel = math.prod(shape)
    expected_data = (numel, torch.int8) if bits == 8 else (-(-numel // 2), torch.uint8)
    if (data.numel(), data.dtype) != expected_data:
        raise ValueError(
            f"INT{bits} data for shape {tuple(shape)} must be {expected_data[1]} with {expected_data[0]} elements, "
            f"got {data.dtype} with {data.numel()}"
        )
    if scales.dtype not in _SCALE_DTYPES or scales.numel() != -(-numel // block_size):
        raise ValueError(
            f"expected {-(-numel // block_size)} fp32 or bf16 scales for {numel} elements in blocks of {block_size}, "
            f"got {scales.numel()} of {scales.dtype}"
        )
    kernels = _triton_kernels(data, backend) if scales.dtype == torch.float32 else None
    if kernels is not None:
        flat = kernels.dequantize_blockwise_triton(data, scales, block_size, numel, bits, dtype)
    else:
        codes = data if bits == 8 else unpack_int4(data, numel)
        flat = _dequantize_reference(codes, scales, block_size, numel, dtype)
    return flat.reshape(shape)
