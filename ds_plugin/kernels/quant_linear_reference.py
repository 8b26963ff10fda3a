"""Plain-torch references of the kernels in :mod:`ds_plugin.kernels.quant_linear_triton`, by the same bit operations.

:func:`dequantize_reference` rebuilds the weight exactly as the kernels' per-element path does (decode the 32-bit
code words into 16-bit float patterns, subtract the offset and multiply by the scale in fp32, round once), on whole
tensors; :func:`linear_reference` and :func:`linear_backward_reference` are the two GEMMs on that weight. The tests
hold the kernels to these, and these to the format's own ``codecs.dequantize_weight``, bit for bit: two
independent readings of the layouts that must agree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["dequantize_reference", "linear_backward_reference", "linear_reference"]

_FP6_UNSCALE = 4096.0  # the kernels decode fp6 codes as fp16 values 2^-12 of e3m2's


def _le_words(data: Tensor) -> Tensor:
    b = data.long().unflatten(-1, (data.shape[-1] // 4, 4))
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _shift_ref(x: Tensor, n: int) -> Tensor:
    return x << n if n >= 0 else x >> -n


def _raw_reference(fmt: str, codes: Tensor, k: int, dtype: torch.dtype) -> Tensor:
    """The kernels' ``_raw_tile`` over the whole weight, by the same bit operations on int64 words."""
    n = codes.shape[0]
    if fmt == "int8":
        return codes.view(torch.int8).to(dtype)
    words = _le_words(codes)
    halves = torch.empty((n, k // 2, 2), dtype=torch.int64, device=codes.device)
    if fmt == "int4":
        fp16 = dtype == torch.float16
        slots = halves.view(n, k // 8, 4, 2)  # per word: pair index 2a + b, then half h -> code 4h + 2a + b
        for pair, s in enumerate((4, 0, 12, 8)):
            o = (_shift_ref(words, 3 - s) & 0x00780078) | 0x58005800 if fp16 else (words >> s) & 0x000F000F | 0x43004300
            slots[:, :, pair] = torch.stack([o & 0xFFFF, o >> 16], dim=-1)
        bits = slots.transpose(-1, -2).reshape(n, k)
        view = torch.float16 if fp16 else torch.bfloat16
    else:
        nib, top = words[:, : k // 8].view(n, k // 16, 2), words[:, k // 8 :]
        chunk = halves.view(n, k // 16, 2, 4, 2)  # [u, t, h] -> code 8u + 2t + h
        for u in range(2):
            for t in range(4):
                p = 4 * u + t
                o = (_shift_ref(nib[..., u], 8 - 4 * t) & 0x0F000F00) | (top << (12 - p)) & 0x10001000
                o |= (top << (7 - p)) & 0x80008000
                chunk[:, :, u, t] = torch.stack([o & 0xFFFF, o >> 16], dim=-1)
        bits, view = chunk.reshape(n, k), torch.float16
    signed = torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16)
    return signed.view(view).to(dtype)


def dequantize_reference(
    fmt: str, codes: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int, k: int, dtype: torch.dtype
) -> Tensor:
    """The ``(N, K)`` weight exactly as the kernels' per-element path builds it: ``((raw - offset) * scale)`` in
    fp32, rounded once to ``dtype`` (equal, bit for bit, to ``codecs.dequantize_weight``).

    Args:
        fmt: "int8", "int4" or "fp6".
        codes: the ``codes`` component.
        scales: bf16 ``scales``.
        zeros: int4's ``zeros`` (None otherwise).
        group_size: elements per scale.
        k: the weight's K.
        dtype: bf16 or fp16 (the raw decode is exact in both; any float dtype works for the result).
    """
    raw_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    raw = _raw_reference(fmt, codes, k, raw_dtype).float()
    s = scales.float().repeat_interleave(group_size, dim=1)
    if fmt == "int4":
        raw = raw - (128.0 + zeros.float().repeat_interleave(group_size, dim=1) * 0.0625)
    elif fmt == "fp6":
        raw = raw * _FP6_UNSCALE  # exact: the e3m2 values; the kernels apply it apart from the scale too
    return (raw * s).to(dtype)


def linear_reference(
    x: Tensor, fmt: str, codes: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int, bias: Tensor | None
) -> Tensor:
    """What ``quant_linear_triton.linear_forward`` computes, in plain torch (args as there)."""
    w = dequantize_reference(fmt, codes, scales, zeros, group_size, x.shape[-1], x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def linear_backward_reference(
    grad_out: Tensor, fmt: str, codes: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int, k: int
) -> Tensor:
    """What ``quant_linear_triton.linear_backward`` computes, in plain torch (args as there)."""
    return grad_out @ dequantize_reference(fmt, codes, scales, zeros, group_size, k, grad_out.dtype)
