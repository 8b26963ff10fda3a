"""The compiled CPU form of the frozen-weight decode: `codecs.dequantize_weight`'s pass over the elements.

LoRA and QLoRA on a CPU decode every frozen weight for each matmul that uses it, forward and backward (and once
more per layer under activation checkpointing). Eagerly the INT4 decode is six passes over memory with fp32
temporaries, ~1.9 ns per element on one core (NF4's codebook lookup ~4 ns): at a 7B Llama shape on 2 CPU ranks that
was ~60% of a training step. Compiled by `torch.compile` it is one vectorized loop that reads the codes and writes
the weight.

Bit for bit the eager decode: each element goes through the same fp32 operations in the same order (INT4
``(q - zero) * scale``, NF4 ``codebook[q] * absmax``, INT8 ``q * scale``) and is rounded to bf16 to nearest, ties
to even, as a cast does. The 4-bit formats write their element pairs as one machine word (two bf16 in an int32, two
fp32 in an int64), the way `ds_plugin.quant.comm.fused` reads INT4 pairs: inductor's CPU code handles an interleave
of two halves one element at a time, a word store vectorized. Little-endian CPUs, bf16 or fp32 results, and
weights of at least `COMPILE_MIN_NUMEL` elements (``DS_PLUGIN_QUANT_COMPILE`` as for the ZeRO++ steps: ``1`` always,
``0`` never); anything else, or a failed compile, takes the eager decode.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
from torch import Tensor

from ds_plugin.quant.cpu_compile import bf16_bits, compiled_step, use_compiled

_WORD_OF = {torch.bfloat16: torch.int32, torch.float32: torch.int64}


def _pair_word(even: Tensor, odd: Tensor, word: torch.dtype) -> Tensor:
    # Elements 2i (low half on a little-endian machine) and 2i + 1 of the result as one word.
    if word == torch.int32:
        return ((bf16_bits(even) >> 16) & 0xFFFF) | (bf16_bits(odd) & -65536)
    return (even.view(torch.int32).to(torch.int64) & 0xFFFFFFFF) | (odd.view(torch.int32).to(torch.int64) << 32)


def _decode_int4_pairs(words: Tensor, codes: Tensor, scales: Tensor, zeros: Tensor) -> None:
    # words: (rows, groups, group / 2); codes: (rows, groups, group / 2) uint8, element 2i in the high nibble;
    # scales, zeros: (rows, groups, 1) fp32 (the zero point already in code steps).
    c = codes.to(torch.int32)
    even = ((c >> 4).float() - zeros) * scales
    odd = ((c & 0xF).float() - zeros) * scales
    words.copy_(_pair_word(even, odd, words.dtype))


def _lookup16(q: Tensor, codebook: Tensor) -> Tensor:
    # codebook[q] for 4-bit q as a tree of selects on q's bits, picking the entries themselves (so the same bits):
    # inductor's CPU code gathers from a tensor one element at a time, and selects vectorize (an 11008 x 4096 NF4
    # weight into a mapped bf16 buffer: 27 ms against 55 ms).
    level = [codebook[i] for i in range(16)]
    for bit in range(4):
        high = ((q >> bit) & 1) == 1
        level = [torch.where(high, level[2 * i + 1], level[2 * i]) for i in range(len(level) // 2)]
    return level[0]


def _decode_nf4_pairs(words: Tensor, codes: Tensor, absmax: Tensor, codebook: Tensor) -> None:
    # As above with NF4's codebook: codebook[q] * absmax.
    c = codes.to(torch.int32)
    even = _lookup16(c >> 4, codebook) * absmax
    odd = _lookup16(c & 0xF, codebook) * absmax
    words.copy_(_pair_word(even, odd, words.dtype))


def _decode_int8(out: Tensor, codes: Tensor, scales: Tensor) -> None:
    # out: (rows, groups, group); codes the same shape, int8; scales: (rows, groups, 1) fp32.
    out.copy_((codes.float() * scales).to(out.dtype))


# The group (and the scales' 1) are static, so the inner loop has a fixed length and vectorizes; rows and groups
# vary from weight to weight.
_STATIC = ((0, (-1,)), (1, (-1,)), (2, (-1,)))
_STEPS = {
    "int4": (_decode_int4_pairs, (*_STATIC, (3, (-1,)))),
    "nf4": (_decode_nf4_pairs, (*_STATIC, (3, (0,)))),
    "int8": (_decode_int8, _STATIC),
}


@functools.cache
def _step(fmt: str) -> Callable:
    # Wrapped on first use: `torch.compile` imports dynamo, which a process that never decodes need not pay for.
    return compiled_step(*_STEPS[fmt])


def dequantize_into(
    out: Tensor, codes: Tensor, factors: tuple[Tensor, ...], fmt: str, group_size: int, codebook: Tensor | None = None
) -> bool:
    """Decode ``codes`` into ``out`` (``(N, K)``) compiled, when this form applies; False to take the eager decode.

    Args:
        out: the result, bf16 or fp32, contiguous.
        codes: the weight's uint8 codes, each row contiguous.
        factors: per-group fp32 ``(N, K / group_size)`` tensors: INT4 (scales, zeros in code steps), NF4 (absmax,),
            INT8 (scales,).
        fmt: "int4", "nf4" or "int8" (FP6 stays eager).
        group_size: elements per group.
        codebook: NF4's codebook (fp32), for "nf4".
    """
    if fmt not in _STEPS or sys.byteorder != "little":
        return False
    # Gathered codes may be rows of a larger buffer (a row stride over their width): fine, as long as each row is
    # contiguous and splits into groups.
    if not out.is_contiguous() or codes.dim() != 2 or codes.stride(-1) != 1:
        return False
    word = _WORD_OF.get(out.dtype)
    if word is None or group_size % 2 or not use_compiled(out):  # use_compiled: CPU tensors only
        return False
    n, k = out.shape
    per_group = [f.reshape(n, k // group_size, 1) for f in factors]
    groups = (n, k // group_size, group_size if fmt == "int8" else group_size // 2)
    try:
        grouped = (codes.view(torch.int8) if fmt == "int8" else codes).view(groups)
    except RuntimeError:  # strides that no grouped view can express
        return False
    if fmt == "int8":
        _step(fmt)(out.view(groups), grouped, *per_group)
    else:
        extra = (codebook.float(),) if fmt == "nf4" else ()
        _step(fmt)(out.view(word).view(groups), grouped, *per_group, *extra)
    return True
