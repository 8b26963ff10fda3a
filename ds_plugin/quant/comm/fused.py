"""The torch backend of the ZeRO++ row steps: whole-row blockwise quantize / dequantize, fused on CPU by
``torch.compile``.

qwZ and qgZ do the same few things on every collective: quantize rows of a bucket blockwise (padding each row to
whole blocks), and after the exchange either dequantize rows into FSDP2's output buffer or dequantize and sum
them in fp32. Written as chains of plain torch ops, each step makes eight or so passes over memory, about 8-15 ns
per element on one CPU core: on a 1 Gbit/s link that is more time than the bytes it saves. ``torch.compile`` turns
each step into one vectorized loop, 10-15x faster on one core (0.7-3 G elements/s); ``ds-plugin bench slow-link``
went from 0.54x to 1.9x ZeRO-3's speed with it.

This module is one backend behind :mod:`ds_plugin.quant.comm.dispatch`, which the collectives call: CUDA tensors go to
the Triton kernels (:mod:`ds_plugin.kernels.quant_triton`) where triton is importable, everything else comes here.
On CUDA without triton the eager form runs: inductor's Triton code may divide approximately, which would break
bit-identity with the reference.

The maths is not written here: the quantize and dequantize steps call
:func:`ds_plugin.quant.comm.format.quantize_blocks` and :func:`~ds_plugin.quant.comm.format.dequantize_blocks`, the
format's reference, so the eager form *is* the reference and the compiled form is the same function compiled (tests
check that they agree bit for bit). The qgZ sum step decodes INT4 with
:func:`~ds_plugin.quant.comm.format.int4_nibbles` and adds in peer order. Compiled, INT4 reads and writes its element
pairs as machine words (see ``_as_words``), through the format's own scale, code and nibble steps; on AVX2-only
CPUs its quantizing keeps the block form, there the faster (``_quantize_in_words``).

When to compile (``DS_PLUGIN_QUANT_COMPILE``, the size rule) and how a failed compile falls back to the eager form
is :mod:`ds_plugin.quant.cpu_compile`'s, shared with the frozen-weight decode.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
from torch import Tensor

from ds_plugin.quant.comm.format import (
    as_blocks,
    block_codes,
    block_scales,
    dequantize_blocks,
    int4_nibbles,
    pack_nibbles,
    quantize_blocks,
    scale_cap,
    sent_scales,
)
from ds_plugin.quant.cpu_compile import COMPILE_MIN_NUMEL, compile_report, compiled_step, use_compiled
from ds_plugin.quant.cpu_compile import bf16_bits as _bf16_bits

__all__ = [
    "COMPILE_MIN_NUMEL",
    "compile_report",
    "dequantize_rows_into",
    "dequantize_sum_rows",
    "quantize_rows",
    "use_compiled",
]


def quantize_rows(rows: Tensor, block: int, bits: int, *, compiled: bool | None = None) -> tuple[Tensor, Tensor]:
    """Quantize the rows (last dim) of a float tensor blockwise with bf16 scales; blocks never straddle rows.

    Args:
        rows: ``(..., numel)`` fp32, bf16 or fp16; any strides along the leading dims (a transposed view is
            read in place, and its codes come out contiguous in the view's order).
        block: elements per scale; even for 4 bits. Each row is zero-padded to whole blocks for quantizing.
        bits: 8 (int8 codes, ``(..., numel)``) or 4 (uint8, two codes per byte, ``(..., ceil(numel / 2))``).
        compiled: force the compiled (True) or eager (False) form; None decides by size and environment.

    Returns:
        ``(codes, scales)``: codes of the real elements only (padding is never returned; the result is a view
        that may need ``.contiguous()``), and bf16 scales, ``ceil(numel / block)`` per row, row after row.
    """
    numel = rows.shape[-1]
    compiled = use_compiled(rows) if compiled is None else compiled
    # The cap is computed here, outside the compiled graph (it searches fp32 values with a loop).
    cap = scale_cap(bits, torch.bfloat16)
    parts = [_quantize_piece(as_blocks(piece, block), bits, cap, compiled) for piece in _contiguous_pieces(rows)]
    if len(parts) == 1:
        codes, scales = parts[0]
    else:  # only the (small) results are copied together
        codes = torch.cat([c.reshape(-1) for c, _ in parts]).view(*rows.shape[:-1], *parts[0][0].shape[-2:])
        scales = torch.cat([sc for _, sc in parts])
    width = numel if bits == 8 else (numel + 1) // 2
    return codes.flatten(-2)[..., :width], scales


def _quantize_piece(blocks: Tensor, bits: int, cap: float, compiled: bool) -> tuple[Tensor, Tensor]:
    words = _as_words(blocks) if compiled and bits == 4 and _quantize_in_words() else None
    if words is not None:
        return _compiled(_quantize_int4_words)(words, cap)
    return _pick(_quantize_blocks, blocks, compiled)(blocks, bits, cap)


def dequantize_rows_into(out: Tensor, codes: Tensor, scales: Tensor, block: int, *, compiled: bool | None = None):
    """Write ``codes * scale`` (INT8 rows from :func:`quantize_rows`) into ``out``, in ``out``'s dtype.

    Args:
        out: ``(..., numel)`` fp32, bf16 or fp16 destination; any strides along the leading dims (qwZ's
            two-level gather writes through a transposed view of FSDP2's buffer).
        codes: int8 codes of the rows in ``out``'s index order, contiguous, ``out.numel()`` of them.
        scales: bf16 scales in the same order, ``ceil(numel / block)`` per row.
        block: the block size used to quantize.
        compiled: as for :func:`quantize_rows`.
    """
    numel = out.shape[-1]
    per_row = -(-numel // block)
    fn = _pick(_dequantize_blocks, out, compiled)
    done = 0
    for piece in _contiguous_pieces(out):
        rows = piece.numel() // numel
        piece_codes = codes.view(-1)[done * numel : (done + rows) * numel].view(piece.shape)
        piece_scales = scales[done * per_row : (done + rows) * per_row]
        if numel % block == 0:
            fn(piece.unflatten(-1, (-1, block)), piece_codes.unflatten(-1, (-1, block)), piece_scales)
        else:
            blocks = as_blocks(piece_codes, block)
            values = torch.empty(blocks.shape, dtype=out.dtype, device=out.device)
            fn(values, blocks, piece_scales)
            piece.copy_(values.flatten(-2)[..., :numel])
        done += rows


def dequantize_sum_rows(
    packed: Tensor,
    scales: Tensor,
    own: Tensor,
    me: int,
    block: int,
    *,
    compiled: bool | None = None,
    out: Tensor | None = None,
    divide: int = 1,
    round_to: torch.dtype = torch.float32,
) -> Tensor:
    """fp32 sum of the INT4 rows of every peer, with peer ``me``'s replaced by this rank's exact values.

    With `divide` and `round_to`, the result is ``(sum / divide)`` rounded to `round_to` (then widened back to
    fp32): an averaged reduction's output in its dtype, as ``total.div_(divide).to(round_to)`` gives it, in the same
    pass that decodes (the compiled word form), not in two more over the whole result.

    Args:
        packed: uint8, ``(peers, ..., ceil(numel / 2))``, as :func:`quantize_rows` packs ``(..., numel)`` rows.
        scales: their bf16 scales, as :func:`quantize_rows` returned them.
        own: this rank's unquantized rows, ``(..., numel)``: they never crossed the wire, so they are summed exact.
        me: this rank's index among the peers.
        block: the block size used to quantize (even).
        compiled: as for :func:`quantize_rows`.
        out: fp32, ``own``'s shape: written and returned (else a new tensor is returned, possibly a view).
        divide: divide the sum by this (1: the sum itself).
        round_to: round the (divided) sum to this dtype: fp32 (as is), bf16 or fp16.

    Returns:
        fp32, ``(..., numel)``.
    """
    numel = own.shape[-1]
    compiled = use_compiled(own) if compiled is None else compiled
    grid = as_blocks(packed, block // 2)
    own_blocks = as_blocks(own, block)
    own_words = _as_words(own_blocks) if compiled and numel % block == 0 else None
    if own_words is not None and round_to in (torch.float32, torch.bfloat16):
        result = torch.empty(own.shape, dtype=torch.float32, device=own.device) if out is None else out
        out_words = _as_words(result.unflatten(-1, (-1, block)))
        if out_words is not None:
            bf16 = round_to == torch.bfloat16
            _compiled(_dequantize_sum_words)(out_words, grid, scales, own_words, me, divide, bf16)
            return result
    total = _pick(_dequantize_sum_blocks, own, compiled)(grid, scales, own_blocks, me).flatten(-2)[..., :numel]
    if divide != 1:
        total = total / divide
    if round_to != torch.float32:
        total = total.to(round_to)
    return total.float() if out is None else out.copy_(total)


def _contiguous_pieces(t: Tensor) -> list[Tensor]:
    """`t` as contiguous sub-views along its leading dims, in row-major order (`[t]` itself when contiguous).

    Compiled code reads and writes a strided view (a transposed gather buffer, qgZ's by-local-rank chunks) 4x
    slower than contiguous memory; a few contiguous pieces cost only a few more calls.
    """
    if t.is_contiguous() or t.dim() == 1:
        return [t]
    return [piece for sub in t.unbind(0) for piece in _contiguous_pieces(sub)]


# The three steps below take whole blocks along the last dim: the block is the inner, fixed-size loop, and only
# the number of blocks varies between buckets. Compiled with a symbolic pad or row length instead, inductor
# emitted scalar code 5x slower, so the block (and the peer count) are marked static: (argument, dims) per step.
_STATIC_DIMS = {
    "_quantize_blocks": ((0, (-1,)),),
    "_quantize_int4_words": ((0, (-1,)),),
    "_dequantize_blocks": ((0, (-1,)), (1, (-1,))),
    "_dequantize_sum_blocks": ((0, (0, -1)), (2, (-1,))),
    "_dequantize_sum_words": ((0, (-1,)), (1, (0, -1)), (3, (-1,))),
}


def _quantize_blocks(blocks: Tensor, bits: int, cap: float) -> tuple[Tensor, Tensor]:
    # Scales travel as bf16 (rounded up, so codes never clip): with the small qgZ blocks that INT4 needs to train
    # like ZeRO-3, fp32 scales would add 12.5% to the gradient bytes; bf16 scales add 6%.
    return quantize_blocks(blocks, bits, cap, torch.bfloat16)


def _dequantize_blocks(out: Tensor, codes: Tensor, scales: Tensor) -> None:
    # out, codes: (..., blocks, block); scales: one per block, in order.
    out.copy_(dequantize_blocks(codes, scales, out.dtype))


def _dequantize_sum_blocks(packed: Tensor, scales: Tensor, own: Tensor, me: int) -> Tensor:
    # packed: (peers, ..., blocks, block / 2) uint8; scales: one per block, in order; own: (..., blocks, block).
    peers, half = packed.shape[0], packed.shape[-1]
    scale = scales.float().view(*packed.shape[:-1], 1)
    own_pairs = own.float().unflatten(-1, (half, 2))
    even = odd = None
    # Peers are added in order with the own rows in their place, as stack-and-sum would. The own rows are never
    # decoded (they were not quantized). Even and odd elements are summed apart and interleaved once at the end,
    # half the cost of interleaving every peer's codes.
    for i in range(peers):
        if i == me:
            e, o = own_pairs[..., 0], own_pairs[..., 1]
        else:
            low, high = int4_nibbles(packed[i])
            e, o = low.float() * scale[i], high.float() * scale[i]
        even, odd = (e, o) if even is None else (even + e, odd + o)
    return torch.stack((even, odd), dim=-1).flatten(-2)


# INT4 pairs as machine words. Compiled, the steps above read (quantize) or write (sum) INT4's element pairs with
# stride-2 accesses, which inductor's CPU code does one element at a time. Read as one int32 (two bf16) or int64
# (two fp32) per pair, every access is contiguous and vectorized: on one core, 2M bf16 elements quantize in
# 0.6-0.7 ms instead of 1.8, and two peers' sum in 0.3 ms instead of 2.0, written straight into the caller's buffer
# (which had cost another 2 ms copy).
# Bit for bit the same: bf16 and fp32 are the top 16 / all 32 bits of the fp32 value, so widening is a shift or a
# mask, and every element goes through the same fp32 operations in the same order. Little-endian machines only
# (element 2i in a word's low half); fp16 (no bit-level widening) and views whose pairs do not line up with words
# take the steps above.
_WORD_OF = {torch.bfloat16: torch.int32, torch.float32: torch.int64}


@functools.cache
def _quantize_in_words() -> bool:
    """Whether INT4 quantizing takes the word form on this CPU (decoding-and-summing takes it everywhere).

    Measured on one core, both forms compiled, qgZ's 64-element blocks: on an AVX-512 x86 CPU the word form quantized
    2M bf16 elements in 0.6-0.7 ms against the block form's 1.8 ms. On an AVX2-only one inductor's code for the word
    form moves each word's halves through scalar loops (AVX2 has no 64-to-32-bit narrowing), and 1M elements took
    5.2 ms against 1.9 ms in fp32, 4.0 against 2.8 ms in bf16; its decode-and-sum is as fast or faster there too.
    Other CPUs keep the word form. Both forms give the same bits.
    """
    return torch.backends.cpu.get_cpu_capability() != "AVX2"


def _as_words(blocks: Tensor) -> Tensor | None:
    """``(..., n_blocks, block)`` bf16 / fp32 as ``(..., n_blocks, block / 2)`` words of element pairs, else None."""
    word = _WORD_OF.get(blocks.dtype)
    if word is None or sys.byteorder != "little" or blocks.stride(-1) != 1 or blocks.shape[-1] % 2:
        return None
    if blocks.storage_offset() % 2 or any(stride % 2 for stride in blocks.stride()[:-1]):
        return None
    return blocks.view(word)


def _pair_values(words: Tensor) -> tuple[Tensor, Tensor]:
    # fp32 values of each word's elements 2i (low half) and 2i + 1 (high half).
    if words.dtype == torch.int32:
        return (words << 16).view(torch.float32), (words & -65536).view(torch.float32)
    return (words & 0xFFFFFFFF).to(torch.int32).view(torch.float32), (words >> 32).to(torch.int32).view(torch.float32)


def _quantize_int4_words(words: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    # `_quantize_blocks` at 4 bits on element pairs: the format's scale and code rules on the even and odd halves.
    even, odd = _pair_values(words)
    amax = torch.maximum(even.abs().amax(dim=-1, keepdim=True), odd.abs().amax(dim=-1, keepdim=True))
    scales, nonfinite = block_scales(amax, 4, cap, torch.bfloat16)
    low, high = block_codes(even, scales, nonfinite, 4), block_codes(odd, scales, nonfinite, 4)
    return pack_nibbles(low, high), sent_scales(scales, nonfinite, torch.bfloat16)


def _dequantize_sum_words(
    out: Tensor, packed: Tensor, scales: Tensor, own: Tensor, me: int, divide: int, bf16: bool
) -> None:
    # `_dequantize_sum_blocks` on element pairs, written into `out`'s int64 words (two fp32 each); divided by
    # `divide` and rounded to bf16 on the way when asked (`dequantize_sum_rows`). Inductor keeps CPU division a
    # division (no reciprocal: torch/_inductor/lowering.py `div_prim`, torch 2.11 and 2.13), so the bits are eager's.
    scale = scales.float().view(*packed.shape[:-1], 1)
    even = odd = None
    for i in range(packed.shape[0]):
        if i == me:
            e, o = _pair_values(own)
        else:
            low, high = int4_nibbles(packed[i])
            e, o = low.float() * scale[i], high.float() * scale[i]
        even, odd = (e, o) if even is None else (even + e, odd + o)
    if divide != 1:
        even, odd = even / divide, odd / divide
    even_bits, odd_bits = (
        (_bf16_bits(even), _bf16_bits(odd)) if bf16 else (even.view(torch.int32), odd.view(torch.int32))
    )
    low_bits = even_bits.to(torch.int64) & 0xFFFFFFFF
    out.copy_(low_bits | (odd_bits.to(torch.int64) << 32))


def _pick(fn: Callable, t: Tensor, compiled: bool | None) -> Callable:
    """`fn` itself, or its compiled form when `compiled` (None: by `t`'s size and device and the environment)."""
    if compiled is None:
        compiled = use_compiled(t)
    return _compiled(fn) if compiled else fn


def _compiled(fn: Callable) -> Callable:
    return compiled_step(fn, _STATIC_DIMS[fn.__name__])
