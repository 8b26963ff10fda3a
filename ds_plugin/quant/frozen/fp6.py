"""FP6 e3m2 codes and their bit-plane packing: the element format behind the ``fp6`` frozen-weight format.

**e3m2.** A code is 6 bits, ``s eee mm``: sign, a 3-bit exponent with bias 3 and a 2-bit mantissa. There is no
inf and no nan, so every one of the 64 codes is a number:

* ``eee > 0``: ``(-1)^s * 2^(eee - 3) * (1 + mm / 4)``, from 0.25 (the smallest normal) up to 28.0;
* ``eee == 0``: ``(-1)^s * mm / 16`` (subnormals 0.0625, 0.125, 0.1875, and signed zeros).

:func:`encode_e3m2` rounds fp32 values to the nearest code, ties to the even mantissa (``torch.round``'s rule),
clamping magnitudes above 28 to 28; :func:`decode_e3m2` is a lookup in :data:`E3M2_VALUES`.

**Packing.** 6-bit codes do not tile bytes, and a kernel wants every load aligned and power-of-two wide. So each
row's codes (``K`` of them, a multiple of 16) are split into two planes, as FP6-LLM does (Xia et al., 2024):

* the *nibble plane*, ``K / 2`` bytes: each code's low 4 bits ``e1 e0 m1 m0``;
* the *top plane*, ``K / 4`` bytes: each code's sign and top exponent bit ``e2``;

stored one after the other, so a row is ``3K / 4`` bytes (3 bytes per 4 codes) and every 16 codes own exactly
8 bytes of the first plane and 4 of the second. Inside those bytes the bits are placed so that a kernel reading
them as little-endian 32-bit words builds two fp16 bit patterns per 32-bit operation (3 shifts and 3 masks per
pair of codes; see :mod:`ds_plugin.kernels.quant_linear_triton`). For code ``k = 8u + 2t + h`` of a 16-code chunk
(``u`` in 0..1, ``t`` in 0..3, ``h`` in 0..1):

* its nibble is bits ``4t + 16h .. 4t + 16h + 3`` of the chunk's nibble word ``u`` (bytes ``4u .. 4u + 3`` of
  the chunk's 8 nibble-plane bytes);
* its ``e2`` is bit ``4u + t + 16h`` and its sign bit ``8 + 4u + t + 16h`` of the chunk's top word (its 4
  top-plane bytes).

Byte ``j`` of a word is its bits ``8j .. 8j + 7``. Every bit of the 12 bytes belongs to exactly one code, so the
packing is a bijection between 16 codes and 12 bytes (checked over random bytes in ``tests/quant/frozen/test_fp6.py``).
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

__all__ = [
    "CHUNK",
    "E3M2_MAX",
    "E3M2_MIN_NORMAL",
    "E3M2_VALUES",
    "decode_e3m2",
    "encode_e3m2",
    "pack_fp6",
    "packed_cols",
    "unpack_fp6",
]

E3M2_MAX = 28.0
E3M2_MIN_NORMAL = 0.25
_BIAS = 3
_SIGN_BIT = 5
# Codes per packing unit: 16 nibbles fill two 32-bit words and 16 (sign, e2) pairs one more.
CHUNK = 16


def _code_values() -> Tensor:
    codes = torch.arange(64)
    exponent, mantissa = (codes >> 2) & 7, codes & 3
    normal = torch.ldexp(1 + mantissa / 4, exponent - _BIAS)
    magnitude = torch.where(exponent == 0, mantissa / 16, normal)
    return torch.where(codes >= 32, -magnitude, magnitude).float()


# Value of each code, indexed by the code: exact in fp32, bf16 and fp16 (at most 3 significant bits).
E3M2_VALUES = _code_values()

# Per position k = 8u + 2t + h of a chunk: where its nibble sits in its nibble word, and its e2 / sign bits in the
# top word (module docstring).
_K = torch.arange(CHUNK)
_U, _T, _H = _K // 8, (_K % 8) // 2, _K % 2
_NIBBLE_SHIFT = (4 * _T + 16 * _H).view(2, 8)
_E2_SHIFT = 4 * _U + _T + 16 * _H
_SIGN_SHIFT = 8 + _E2_SHIFT


def encode_e3m2(values: Tensor) -> Tensor:
    """The nearest e3m2 code (ties to even) of each value, as uint8 in 0..63.

    Args:
        values: finite values of any float dtype (computed in fp32); magnitudes above 28 clamp to 28.
    """
    # e3m2 is fp8's e5m2 with 12 less exponent bias: for |x| <= 28, x * 2^-12 lies in e5m2's range, its subnormal
    # step (2^-16) is e3m2's (1/16) scaled by 2^-12, and its exponent field equals e3m2's (15 - 12 = 3). So torch's
    # fp32 -> e5m2 conversion, round to nearest even, is the encoding; the power-of-two scaling is exact (a value
    # it would push below fp32's normals is far below half of e5m2's smallest step, so it encodes as zero either
    # way). Only the field widths differ: e5m2 is s eeeee mm, e3m2 s eee mm, with the top two exponent bits 0 here.
    scaled = values.float().clamp(-E3M2_MAX, E3M2_MAX).mul_(2.0**-12)
    return e5m2_to_e3m2(scaled.to(torch.float8_e5m2).view(torch.uint8))


def e5m2_to_e3m2(bits: Tensor) -> Tensor:
    """The e3m2 codes of fp8 e5m2 bytes whose values are e3m2's times 2^-12 (see :func:`encode_e3m2`).

    Args:
        bits: uint8 e5m2 bit patterns with exponent field <= 7.
    """
    return (bits & 0x1F) | ((bits >> 2) & 0x20)


def decode_e3m2(codes: Tensor) -> Tensor:
    """The fp32 value of each e3m2 code (uint8, 0..63).

    Args:
        codes: uint8 codes; bits above the sixth are ignored.
    """
    return E3M2_VALUES.to(codes.device)[(codes & 63).long()]


def packed_cols(k: int) -> int:
    """Bytes per packed row of ``k`` codes (``k`` a multiple of :data:`CHUNK`).

    Args:
        k: codes per row.
    """
    return 3 * k // 4


def _words_to_bytes(words: Tensor) -> Tensor:
    # Little-endian, spelled out (byte j = bits 8j..8j+7) rather than left to the host's byte order.
    return torch.stack([(words >> (8 * j)) & 0xFF for j in range(4)], dim=-1).to(torch.uint8).flatten(-2)


def _bytes_to_words(data: Tensor) -> Tensor:
    b = data.long().unflatten(-1, (data.shape[-1] // 4, 4))
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def pack_fp6(codes: Tensor) -> Tensor:
    """Pack ``(N, K)`` e3m2 codes into ``(N, 3K/4)`` bytes: the nibble plane, then the top plane, per row.

    Args:
        codes: uint8 codes (0..63), ``K`` a multiple of :data:`CHUNK`.
    """
    n_rows, k = codes.shape
    if k % CHUNK:
        raise ValueError(f"fp6 packs codes in chunks of {CHUNK}, got a row of {k}")
    if sys.byteorder != "little":
        return _pack_fp6_words(codes)
    # Code k = 8u + 2t + h of a chunk is byte i = 2t + h of the chunk's int64 word u (little-endian), so both planes
    # are bit moves inside those words: shifts, masks and ors on 1/8 as many elements, no reordering copies.
    x = codes.contiguous().view(torch.int64)  # (N, K / 8): word u of each chunk
    nibbles = x & 0x0F0F0F0F0F0F0F0F
    # Nibble word u: code 2t + h at bit 4t + 16h.
    words = _fold_nibbles(nibbles & _EVEN) | (_fold_nibbles((nibbles >> 8) & _EVEN) << 16)
    # Top word: e2 of code 8u + 2t + h at bit 4u + t + 16h, its sign 8 bits higher. Byte 2t + h of x holds e2 at
    # bit 4 and the sign at bit 5: per h, put code 2t + h's e2 at bit 16t and its sign at 16t + 8, then fold.
    both = (x >> 4) & 0x0303030303030303
    odd = both >> 8
    top = _fold_pairs((both & _EVEN_BITS) | ((both & (_EVEN_BITS << 1)) << 7)) | (
        _fold_pairs((odd & _EVEN_BITS) | ((odd & (_EVEN_BITS << 1)) << 7)) << 16
    )
    top = top.view(n_rows, k // CHUNK, 2)
    top = top[..., 0] | (top[..., 1] << 4)
    # Words hold 32 bits; as int32 (two's complement wraps bit 31) their bytes are the planes' bytes.
    return torch.cat([words.to(torch.int32).view(torch.uint8), top.to(torch.int32).view(torch.uint8)], dim=1)


_EVEN = 0x000F000F000F000F  # the low nibble of bytes 0, 2, 4, 6
_EVEN_BITS = 0x0001000100010001  # bit 0 of bytes 0, 2, 4, 6


def _fold_nibbles(x: Tensor) -> Tensor:
    # Nibbles at bits 0, 16, 32, 48 to bits 0, 4, 8, 12.
    x = x | (x >> 12)
    return (x | (x >> 24)) & 0xFFFF


def _fold_pairs(x: Tensor) -> Tensor:
    # Bits 16t and 16t + 8 (t = 0..3) to bits t and t + 8.
    x = x | (x >> 15)
    return (x | (x >> 30)) & 0x0F0F


def _pack_fp6_words(codes: Tensor) -> Tensor:
    # Any host byte order: build each 32-bit word from shifted codes, then write its bytes low to high.
    n_rows, k = codes.shape
    c = codes.long().view(n_rows, k // CHUNK, CHUNK)
    dev = codes.device
    nibble_words = ((c & 15).view(n_rows, k // CHUNK, 2, 8) << _NIBBLE_SHIFT.to(dev)).sum(-1)  # disjoint: sum == or
    top_words = ((((c >> 4) & 1) << _E2_SHIFT.to(dev)) | ((c >> _SIGN_BIT) << _SIGN_SHIFT.to(dev))).sum(-1)
    nibbles = _words_to_bytes(nibble_words.view(n_rows, k // 8))
    return torch.cat([nibbles, _words_to_bytes(top_words)], dim=1).contiguous()


def unpack_fp6(packed: Tensor) -> Tensor:
    """The ``(N, K)`` uint8 codes that :func:`pack_fp6` packed into ``(N, 3K/4)`` bytes.

    Args:
        packed: uint8, ``3K/4`` bytes per row (any row stride).
    """
    n_rows, cols = packed.shape
    k = cols * 4 // 3
    if cols % 3 or k % CHUNK:
        raise ValueError(f"an fp6 row packs a multiple of {CHUNK} codes into 3/4 as many bytes, got {cols} bytes")
    dev = packed.device
    nibble_words = _bytes_to_words(packed[:, : k // 2]).view(n_rows, k // CHUNK, 2, 1)
    top_words = _bytes_to_words(packed[:, k // 2 :]).view(n_rows, k // CHUNK, 1)
    nibbles = ((nibble_words >> _NIBBLE_SHIFT.to(dev)) & 15).flatten(2)
    e2 = (top_words >> _E2_SHIFT.to(dev)) & 1
    sign = (top_words >> _SIGN_SHIFT.to(dev)) & 1
    return ((sign << _SIGN_BIT) | (e2 << 4) | nibbles).to(torch.uint8).view(n_rows, k)
