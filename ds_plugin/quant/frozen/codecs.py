"""Storage formats for frozen Linear weights (LoRA / QLoRA base weights): INT8, INT4, NF4 and FP6, group-wise per row.

A weight ``W`` of shape ``(N, K)`` (fp32, bf16 or fp16) is cut, row by row, into consecutive groups of
``group_size`` elements along ``K``. :func:`quantize_weight` returns an ordered dict of component tensors, and the
layout contract that row-wise ZeRO-3 sharding relies on is:

* every component has leading dim ``N`` and is contiguous;
* a row's components depend on that row alone, so slicing every component by rows equals quantizing the row slice
  (bit for bit), and concatenating row slices gives the whole;
* codes are always ``torch.uint8``; 4-bit codes are packed two per byte with element ``2i`` in the **high** nibble
  and ``2i + 1`` in the low one (bitsandbytes' order, used for both 4-bit formats so one unpacking serves both).

The formats (``g`` the group size; bytes relative to bf16 at the default group size):

* ``int8`` (g = 128): ``codes`` (N, K) int8 viewed as uint8, ``scales`` (N, K/g) bf16. Symmetric absmax per group
  with the scale rounded **up** to bf16 before the codes are computed, the qwZ rule of
  :mod:`ds_plugin.quant.comm.format` (so codes never clip). 0.5078x.
* ``int4`` (g = 64): ``codes`` (N, K/2) packed unsigned 4-bit, ``scales`` (N, K/g) bf16 and ``zeros`` (N, K/g)
  uint8 holding the zero point in 1/16 of a code step: ``x = scale * (q - zero / 16)``. ``method="search"`` (the
  default) picks each group's scale and zero to minimise its squared error; ``method="absmax"`` is plain symmetric
  absmax (zero point 8, codes 1..15). 0.2734x.
* ``nf4`` (g = 64): ``codes`` (N, K/2) packed indices into :data:`NF4_CODEBOOK`, computed exactly as bitsandbytes'
  ``quantize_4bit(..., quant_type="nf4")`` does. The default double-quantizes the per-group absmax values per row
  (``absmax_codes`` (N, K/g) int8 as uint8 around ``absmax_offset`` (N, 1) fp32, the row's mean, with step
  ``absmax_scale`` (N, 1) fp32); ``method="no_double_quant"`` keeps them as ``absmax`` (N, K/g) fp32, the
  bitsandbytes-exact form. 0.2578x + 4/K with double quant, 0.2813x without.
* ``fp6`` (g = 128): ``codes`` (N, 3K/4) e3m2 codes in two bit planes (:mod:`ds_plugin.quant.frozen.fp6`: 3 bytes per 4
  weights, the group a multiple of 16), ``scales`` (N, K/g) bf16. Per group ``scale = amax / 28`` rounded **up** to
  bf16 (so no code clips) and each ``x / scale`` rounded to the nearest e3m2 value, ties to even. 0.3828x.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import torch
from torch import Tensor

from ds_plugin.quant.comm.format import FLOAT_DTYPES, QMAX, round_up_to_bf16, scale_cap
from ds_plugin.quant.frozen import fp6
from ds_plugin.quant.frozen.fused import dequantize_into
from ds_plugin.quant.frozen.int4_search import ZERO_STEPS as _ZERO_STEPS
from ds_plugin.quant.frozen.int4_search import Chunks, int4_search

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "FORMATS",
    "METHODS",
    "NF4_CODEBOOK",
    "check_weight",
    "dequantize_weight",
    "logical_cols",
    "quantize_weight",
    "weight_nbytes",
]

FORMATS: tuple[str, ...] = ("int8", "int4", "nf4", "fp6")
# Smaller groups track local magnitude better but pay more scale bytes per weight:
# * int8, 128: 1 byte + 2/128 bytes of bf16 scale per element = 0.508x bf16 (<= 0.52x); the same bytes as 256 with
#   fp32 scales, with half the group length. 64 (0.516x) would leave no headroom, and INT8 is near-lossless here.
# * int4, 64: 0.5 byte + 3/64 bytes (bf16 scale + uint8 zero) = 0.273x (<= 0.28x). Measured on Gaussian and
#   Student-t weights, 128-element groups lose to NF4 at 64 even with the search; 64 beats it.
# * nf4, 64: QLoRA's and bitsandbytes' block size, which the bitsandbytes-exact form must share.
# * fp6, 128: 0.75 byte + 2/128 = 0.383x (<= 0.40x). A float grid tracks magnitude by itself, so groups matter less
#   than for the integer formats: measured relative error 5.1% at 128 vs 5.3% per row on Gaussian weights, 4.4% vs
#   5.1% on Student-t(3), 3.1% vs 5.0% with 1% outlier columns; the kernels cost the same for any group >= 16.
DEFAULT_GROUP_SIZE: dict[str, int] = {"int8": 128, "int4": 64, "nf4": 64, "fp6": 128}
# Per format, the methods accepted; the first is what ``method="default"`` means.
METHODS: dict[str, tuple[str, ...]] = {
    "int8": ("absmax",),
    "int4": ("search", "absmax"),
    "nf4": ("double_quant", "no_double_quant"),
    "fp6": ("absmax",),
}
# QLoRA's NormalFloat-4 levels (Dettmers et al., 2023), to the fp32 digits bitsandbytes uses; sorted, so code 7 is 0.
NF4_CODEBOOK = torch.tensor(
    [
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
    ],
    dtype=torch.float32,
)  # fmt: skip
# Decision boundaries, computed in fp32 the way bitsandbytes computes them so that every rounding matches.
_NF4_MIDPOINTS = (NF4_CODEBOOK[:-1] + NF4_CODEBOOK[1:]) / 2
_NF4_ZERO_CODE = 7
# Elements per pass. On a CPU a pass's fp32 temporaries should stay in the core's L2 cache (1-2 MB): 64K elements
# (256 KB each; the INT4 search reuses four such buffers across its candidates; measured best of 16K..256K).
# Elements per block, whose per-group steps run as one op each: 1M (its per-group values, 1/64 as many, stay in
# the cache). Codes are packed (integer ops on 8-byte words), and unpacked to a dequantized weight, 256K at a time.
# An accelerator wants large passes instead (each op is a kernel launch); those sizes bound its temporaries to ~2 GB.
_CHUNK_ELEMENTS = {"cpu": 1 << 16, "device": 1 << 26}
_BLOCK_ELEMENTS = {"cpu": 1 << 20, "device": 1 << 26}
_PACK_ELEMENTS = {"cpu": 1 << 18, "device": 1 << 26}


def check_weight(fmt: str, shape: tuple[int, ...], group_size: int) -> None:
    """Raise ``ValueError`` (one line) unless a weight of ``shape`` can be stored as ``fmt`` with ``group_size``.

    Args:
        fmt: one of :data:`FORMATS`.
        shape: the weight's shape; must be ``(N, K)`` with ``K > 0``.
        group_size: elements per group along ``K``; must divide ``K``, be even for the 4-bit formats and a multiple
            of 16 for fp6.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if len(shape) != 2 or shape[1] <= 0 or shape[0] < 0:
        raise ValueError(f"{fmt} stores 2-D (out, in) weights with in > 0, got shape {tuple(shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if fmt in ("int4", "nf4") and group_size % 2:
        raise ValueError(f"{fmt} packs two codes per byte, so group_size must be even, got {group_size}")
    if fmt == "fp6" and group_size % fp6.CHUNK:
        raise ValueError(
            f"fp6 packs codes in chunks of {fp6.CHUNK} (12 bytes), so group_size must be a multiple of {fp6.CHUNK}, "
            f"got {group_size}"
        )
    if shape[1] % group_size:
        raise ValueError(
            f"{fmt}: K={shape[1]} (in-features) is not a multiple of group_size={group_size}; "
            "pick a group_size that divides K"
        )


@torch.no_grad()
def quantize_weight(
    weight: Tensor, fmt: str, group_size: int | None = None, *, method: str = "default"
) -> dict[str, Tensor]:
    """Quantize a frozen ``(N, K)`` weight into ``fmt``'s components (see the module docstring for the layouts).

    Runs where ``weight`` is (a CUDA weight quantizes on its GPU; the components come back there) in row chunks,
    so temporaries stay small whatever N; a row slice of a weight quantizes to those rows of the whole weight's
    components, so a loader may quantize a weight a slice at a time.

    Args:
        weight: fp32, bf16 or fp16 ``(N, K)`` tensor, all finite.
        fmt: one of :data:`FORMATS`.
        group_size: elements per group along ``K``; ``None`` for :data:`DEFAULT_GROUP_SIZE`.
        method: one of ``METHODS[fmt]``, or ``"default"`` for its first.

    Returns:
        Ordered dict of contiguous components, each with leading dim ``N``.
    """
    group_size, method = _resolve(fmt, group_size, method)
    if weight.dtype not in FLOAT_DTYPES:
        raise ValueError(f"quantize_weight takes fp32, bf16 or fp16 weights, got {weight.dtype}")
    check_weight(fmt, tuple(weight.shape), group_size)
    n_rows, k = weight.shape
    where = "cpu" if weight.device.type == "cpu" else "device"
    step = max(1, _CHUNK_ELEMENTS[where] // k)
    # Blocks of many chunks: the per-group steps (many small ops, each costing microseconds on a CPU whatever its
    # size) run once per block, and packing's integer ops, which touch each code once, are cheaper per code on more.
    block = max(step, _BLOCK_ELEMENTS[where] // k // step * step)
    # Row chunks bound the temporaries; every step is per row, so chunking cannot change a result.
    blocks, finite = [], torch.ones((), dtype=torch.bool, device=weight.device)
    for start in range(0, max(n_rows, 1), block):
        parts, amax = _quantize_rows(weight[start : start + block], fmt, group_size, method, step)
        finite &= torch.isfinite(amax).all()  # a group's max magnitude is inf or nan iff the group holds one
        if fmt != "int8":
            pack = fp6.pack_fp6 if fmt == "fp6" else _pack_nibbles
            rows = max(1, _PACK_ELEMENTS[where] // k)
            parts["codes"] = (
                torch.cat([pack(c) for c in parts["codes"].split(rows)])
                if len(parts["codes"])
                else pack(parts["codes"])
            )
        blocks.append(parts)
    if not finite:
        _check_finite(weight)
    return _cat(blocks)


def _cat(chunks: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    return {name: torch.cat([c[name] for c in chunks]) if len(chunks) > 1 else chunks[0][name] for name in chunks[0]}


@torch.no_grad()
def dequantize_weight(parts: dict[str, Tensor], fmt: str, group_size: int, dtype: torch.dtype) -> Tensor:
    """The ``(N, K)`` weight that ``parts`` (from :func:`quantize_weight`) stores, in ``dtype``.

    Args:
        parts: components from :func:`quantize_weight` (or row slices / concatenations of them).
        fmt: the format they were quantized with.
        group_size: the group size they were quantized with.
        dtype: fp32, bf16 or fp16; values are computed in fp32 and rounded once to ``dtype``.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dequantize_weight returns fp32, bf16 or fp16, got {dtype}")
    codes = parts.get("codes")
    if codes is None or codes.dtype != torch.uint8 or codes.dim() != 2:
        raise ValueError(f"{fmt} parts need 2-D uint8 'codes', got {None if codes is None else codes.dtype}")
    n_rows = codes.shape[0]
    k = logical_cols(fmt, codes.shape[1])
    check_weight(fmt, (n_rows, k), group_size)
    per_group = (n_rows, k // group_size)
    # Per-group factors for every row first (a few bytes per group), then the elements in blocks of rows written
    # straight into the result: a whole-weight pass would hold its fp32 values and one or two fp32 intermediates at
    # once (at a 7B MLP weight, 11008 x 4096, about 500 MB beside the 86 MB bf16 result, at every frozen Linear's
    # forward and backward). Each element's arithmetic is the same either way, so the result is too, bit for bit.
    if fmt == "nf4":
        factors = (_nf4_absmax(parts, per_group),)
    elif fmt == "int4":
        zeros = _part(parts, "zeros", per_group).float() / _ZERO_STEPS
        factors = (_part(parts, "scales", per_group).float(), zeros)
    else:
        factors = (_part(parts, "scales", per_group).float(),)
    out = torch.empty((n_rows, k), dtype=dtype, device=codes.device)
    if dequantize_into(out, codes, factors, fmt, group_size, NF4_CODEBOOK if fmt == "nf4" else None):
        return out  # on a CPU, compiled: one pass, the same bits (`ds_plugin.quant.frozen.fused`; not FP6)
    step = max(1, _PACK_ELEMENTS["cpu" if codes.device.type == "cpu" else "device"] // k)
    for start in range(0, n_rows, step):
        end = min(n_rows, start + step)
        rows = (end - start, k // group_size, group_size)
        block = [f[start:end, :, None] for f in factors]
        if fmt == "int8":
            values = codes[start:end].view(torch.int8).float().reshape(rows) * block[0]
        elif fmt == "int4":
            values = (_unpack_nibbles(codes[start:end]).float().reshape(rows) - block[1]) * block[0]
        elif fmt == "fp6":
            values = fp6.decode_e3m2(fp6.unpack_fp6(codes[start:end])).reshape(rows) * block[0]
        else:
            codebook = NF4_CODEBOOK.to(codes.device)
            values = codebook[_unpack_nibbles(codes[start:end]).long()].reshape(rows) * block[0]
        out[start:end] = values.view(end - start, k)
    return out


def weight_nbytes(shape: tuple[int, int], fmt: str, group_size: int | None = None, *, method: str = "default") -> int:
    """Bytes of all of :func:`quantize_weight`'s components for a weight of ``shape``, exactly.

    Args:
        shape: ``(N, K)``.
        fmt: one of :data:`FORMATS`.
        group_size: elements per group; ``None`` for :data:`DEFAULT_GROUP_SIZE`.
        method: as for :func:`quantize_weight` (only NF4's double quantization changes the bytes).
    """
    group_size, method = _resolve(fmt, group_size, method)
    check_weight(fmt, tuple(shape), group_size)
    n_rows, k = shape
    groups = k // group_size
    if fmt == "int8":
        per_row = k + 2 * groups
    elif fmt == "int4":
        per_row = k // 2 + 3 * groups
    elif fmt == "fp6":
        per_row = fp6.packed_cols(k) + 2 * groups
    elif method == "no_double_quant":
        per_row = k // 2 + 4 * groups
    else:
        per_row = k // 2 + groups + 8
    return n_rows * per_row


def logical_cols(fmt: str, code_cols: int) -> int:
    """Columns of the weight whose `fmt` codes have `code_cols` bytes per row (INT4/NF4 pack two, FP6 four in 3)."""
    if fmt == "int8":
        return code_cols
    if fmt == "fp6":
        if code_cols % 3:
            raise ValueError(f"fp6 'codes' hold 3 bytes per 4 weights, got {code_cols} bytes per row")
        return code_cols * 4 // 3
    return code_cols * 2


def _resolve(fmt: str, group_size: int | None, method: str) -> tuple[int, str]:
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if method == "default":
        method = METHODS[fmt][0]
    if method not in METHODS[fmt]:
        raise ValueError(f"{fmt} has no method {method!r}; choose one of default, {', '.join(METHODS[fmt])}")
    return (DEFAULT_GROUP_SIZE[fmt] if group_size is None else group_size), method


def _check_finite(weight: Tensor) -> None:
    bad = ~torch.isfinite(weight)
    if bad.any():
        row, col = (int(i) for i in bad.nonzero()[0])
        kind = "nan" if torch.isnan(weight[row, col]) else "inf"
        raise ValueError(
            f"weight holds {int(bad.sum())} inf/nan values (first: {kind} at [{row}, {col}]); "
            "a frozen weight must be finite, so fix the checkpoint before quantizing it"
        )


def _part(parts: dict[str, Tensor], name: str, shape: tuple[int, ...]) -> Tensor:
    tensor = parts.get(name)
    if tensor is None or tuple(tensor.shape) != shape:
        got = "nothing" if tensor is None else tuple(tensor.shape)
        raise ValueError(f"part {name!r} should have shape {shape}, got {got}; pass quantize_weight's parts unchanged")
    return tensor


def _quantize_rows(rows: Tensor, fmt: str, group_size: int, method: str, step: int) -> tuple[dict[str, Tensor], Tensor]:
    # The parts of a block of rows, and each group's largest magnitude (nan or inf where the group holds either).
    # Passes over the elements run on chunks of ``step`` rows (on a CPU, from the core's cache); the per-group and
    # per-row arithmetic between them runs once per block (on a CPU each small op costs microseconds, whatever its
    # size, so per chunk those would cost as much as the passes).
    n_rows, k = rows.shape
    grouped = rows.reshape(n_rows, k // group_size, group_size)
    spans = [(a, min(a + step, n_rows)) for a in range(0, n_rows, step)]
    # Each pass copies a chunk to fp32 (exact from bf16 / fp16; ops on fp32 run ~2x faster than on bf16) into one
    # reused buffer, which the steps may then work on in place: a chunk is read from memory once per pass, as bf16.
    buf = torch.empty((min(step, n_rows), *grouped.shape[1:]), dtype=torch.float32, device=rows.device)

    def chunks() -> Iterator[tuple[slice, Tensor]]:
        for a, b in spans:
            yield slice(a, b), buf[: b - a].copy_(grouped[a:b])

    if fmt == "int4" and method == "search":
        codes, scales, zeros, amax = int4_search(grouped.shape, step, chunks, rows.device)
        return {"codes": codes.view(n_rows, k), "scales": scales, "zeros": zeros}, amax
    amax = torch.empty((*grouped.shape[:2], 1), dtype=torch.float32, device=rows.device)
    for where, x in chunks():
        torch.amax(x.abs_(), dim=-1, keepdim=True, out=amax[where])
    shape = grouped.shape
    if fmt == "int8":
        parts = _quantize_int8(shape, amax, chunks)
    elif fmt == "int4":
        parts = _int4_absmax(shape, amax, chunks)
    elif fmt == "fp6":
        parts = _quantize_fp6(shape, amax, chunks)
    else:
        parts = _quantize_nf4(shape, amax, method == "double_quant", chunks)
    parts["codes"] = parts["codes"].view(n_rows, k)
    return parts, amax


# The steps below divide, multiply and round exactly as ``quantize_blocks`` and the first version of each format did,
# so their codes are those codes bit for bit; they only skip passes: no per-element handling of inf/nan
# (``quantize_weight`` refuses those), table lookups where there were searches, and fp32 -> int8 conversions (codes
# of 0..127 are the same bytes as uint8, and the conversion is several times faster).


def _integer_codes(shape: torch.Size, scales: Tensor, qmax: int, shift: int, chunks: Chunks) -> Tensor:
    # round(x / scale) clamped to -qmax..qmax, plus ``shift``, as int8 (the same bytes as uint8 for 0..127).
    codes = torch.empty(shape, dtype=torch.int8, device=scales.device)
    for rows, x in chunks():
        q = x.div_(scales[rows]).round_().clamp_(-qmax, qmax)
        codes[rows] = q.add_(shift) if shift else q
    return codes


def _quantize_int8(shape: torch.Size, amax: Tensor, chunks: Chunks) -> dict[str, Tensor]:
    # quantize_blocks' rule: amax / 127 (a tensor division), 1 for an all-zero group, capped, rounded up to bf16.
    scales = amax / torch.full_like(amax, float(QMAX[8]))
    scales = round_up_to_bf16(torch.where(scales == 0, 1.0, scales).clamp(max=scale_cap(8, torch.bfloat16)))
    codes = _integer_codes(shape, scales, QMAX[8], 0, chunks)
    return {"codes": codes.view(torch.uint8), "scales": scales.squeeze(-1).to(torch.bfloat16)}


def _int4_absmax(shape: torch.Size, amax: Tensor, chunks: Chunks) -> dict[str, Tensor]:
    # Symmetric: scale = amax / 7 rounded up to bf16, so round(x / scale) stays in -7..7 and code = that + 8. A
    # tensor division, as int8's: CUDA divides by a Python scalar as a multiply by its reciprocal, which rounds
    # differently, so a GPU would pick other scales and codes than a CPU for the same weight.
    qmax = QMAX[4]
    scales = amax / torch.full_like(amax, float(qmax))
    scales = round_up_to_bf16(torch.where(amax == 0, 1.0, scales).clamp(max=scale_cap(4, torch.bfloat16)))
    codes = _integer_codes(shape, scales, qmax, qmax + 1, chunks)
    scales = scales.squeeze(-1).to(torch.bfloat16)
    zeros = torch.full_like(scales, (qmax + 1) * _ZERO_STEPS, dtype=torch.uint8)
    return {"codes": codes.view(torch.uint8), "scales": scales, "zeros": zeros}


def _quantize_fp6(shape: torch.Size, amax: Tensor, chunks: Chunks) -> dict[str, Tensor]:
    # Absmax onto e3m2's largest value, rounded up to bf16 (the int8 rule): x / scale <= 28, so nothing clips.
    raw = amax / torch.full_like(amax, fp6.E3M2_MAX)  # a tensor division, as int4's
    # A group whose amax / 28 is 0 (all zeros, or underflow) gets scale 1: its codes are then zeros.
    scales = round_up_to_bf16(torch.where(raw == 0, 1.0, raw))
    # fp6.encode_e3m2 without its clamp (nothing exceeds 28 here): e5m2 bytes of x / scale * 2^-12.
    e5m2 = torch.empty(shape, dtype=torch.float8_e5m2, device=amax.device)
    for rows, x in chunks():
        e5m2[rows] = x.div_(scales[rows]).mul_(2.0**-12)
    return {"codes": fp6.e5m2_to_e3m2(e5m2.view(torch.uint8)), "scales": scales.squeeze(-1).to(torch.bfloat16)}


def _quantize_nf4(shape: torch.Size, amax: Tensor, double_quant: bool, chunks: Chunks) -> dict[str, Tensor]:
    n_rows, n_groups = shape[:2]
    absmax = amax.view(n_rows, n_groups)
    if not double_quant:
        # bitsandbytes' arithmetic exactly: multiply by the reciprocal (not divide), then the level below or at
        # each value (a value equal to a midpoint goes to the lower code, as bucketize's right=False does).
        return {"codes": _nf4_chunks(shape, 1.0 / amax.clamp(min=1e-38), chunks), "absmax": absmax}
    # Rows' group absmaxes as int8 around the row's mean (a per-row analogue of bitsandbytes' nested quantization,
    # so the row contract holds). The codes are then chosen against the absmax the dequantizer will rebuild, which
    # makes each element the nearest level of the grid it is actually stored on.
    # The mean in fp64: an fp32 sum of huge absmaxes could overflow.
    offset = absmax.double().mean(dim=-1, keepdim=True).float()
    # quantize_blocks' INT8 rule with fp32 scales, one block per row, op for op (absmax - offset is finite here, so
    # its inf/nan handling has nothing to do), then _nf4_absmax's rebuild.
    centred = absmax - offset
    step = centred.abs().amax(dim=-1, keepdim=True)
    step = step / torch.full_like(step, float(QMAX[8]))
    step = torch.where(step == 0, 1.0, step).clamp(max=scale_cap(8, torch.float32))
    absmax_codes = torch.round(centred / step).clamp_(-QMAX[8], QMAX[8]).to(torch.int8)
    parts = {"absmax_codes": absmax_codes.view(torch.uint8), "absmax_scale": step, "absmax_offset": offset}
    stored = absmax_codes.float() * step + offset
    # A group whose rebuilt absmax is <= 0 (tiny next to its row's spread) is stored as zeros (its true absmax is
    # within half an absmax step of 0 anyway): a zero reciprocal scales it to 0, whose level is the zero code.
    recip = torch.where(stored > 0, 1.0 / stored.clamp(min=1e-38), 0.0)
    return {"codes": _nf4_chunks(shape, recip[..., None], chunks), **parts}


def _nf4_chunks(shape: torch.Size, recip: Tensor, chunks: Chunks) -> Tensor:
    # The NF4 codes of x * recip (``recip`` per group, (rows, groups, 1)), chunk by chunk.
    codes = torch.empty(shape, dtype=torch.uint8, device=recip.device)
    for rows, x in chunks():
        codes[rows] = _nf4_codes(x.mul_(recip[rows]))
    return codes


def _nf4_codes(scaled: Tensor) -> Tensor:
    """The number of NF4 midpoints below each fp32 value (``bucketize(scaled.clamp(-1, 1), midpoints)``), as uint8.

    A lookup on the value's bits instead of a search: the top 16 bits (sign, exponent, 7 mantissa bits) pick an
    entry of ``_nf4_table``, which holds the code at the bin's low-magnitude end in bits 16 and up and, for the 15
    bins that hold a midpoint, a bias that makes the low 16 bits carry into the code exactly when the value is past
    the midpoint. The low bits are flipped for negative values, whose magnitude order is reversed.
    """
    bits = scaled.view(torch.int32)
    table = _nf4_table(scaled.device)
    # index_select takes int32 indices (torch.take wants int64: a wider copy, and a slower lookup).
    entry = table.index_select(0, ((bits >> 16) & 0xFFFF).flatten()).view(bits.shape)
    low = (bits ^ (bits >> 31)) & 0xFFFF
    return ((entry + low) >> 16).to(torch.uint8)


_NF4_TABLES: dict[torch.device, Tensor] = {}


def _nf4_table(device: torch.device) -> Tensor:
    table = _NF4_TABLES.get(device)
    if table is None:
        table = _NF4_TABLES[device] = _build_nf4_table().to(device)
    return table


def _build_nf4_table() -> Tensor:
    # Entry i covers the 65536 fp32 values whose top 16 bits are i: from low = 0 to low = 0xFFFF in increasing
    # magnitude, after the flip (negative values) in increasing value.
    top = torch.arange(1 << 16, dtype=torch.int64)
    low_end = (top << 16).to(torch.int32)  # bits of the bin's smallest magnitude
    high_end = low_end | 0xFFFF
    first = torch.where(top >= 0x8000, high_end, low_end).view(torch.float32)  # the bin's lowest value
    # -inf's bin holds -inf and nans: its lowest value is -inf (a huge value over a tiny double-quantized absmax).
    first = torch.where(first.isnan(), low_end.view(torch.float32), first).nan_to_num(0.0)
    base = torch.bucketize(first.clamp(-1, 1), _NF4_MIDPOINTS, out_int32=True)
    entry = base.to(torch.int32) << 16
    for mid in _NF4_MIDPOINTS:
        bits = int(mid.view(torch.int32))
        i, low = (bits >> 16) & 0xFFFF, bits & 0xFFFF
        # Past the midpoint once low > mid's low bits (positive), or low < mid's low bits (negative, flipped low).
        entry[i] += 0xFFFF - low if i < 0x8000 else low
    return entry


def _nf4_absmax(parts: dict[str, Tensor], shape: tuple[int, int]) -> Tensor:
    if "absmax" in parts:
        return _part(parts, "absmax", shape).float()
    codes = _part(parts, "absmax_codes", shape).view(torch.int8).float()
    scale = _part(parts, "absmax_scale", (shape[0], 1)).float()
    return codes * scale + _part(parts, "absmax_offset", (shape[0], 1)).float()


def _pack_nibbles(codes: Tensor) -> Tensor:
    # Element 2i in the high nibble, 2i + 1 in the low one: bitsandbytes' order (checked against quantize_4bit).
    if sys.byteorder == "little":
        # Each pair read as one int16 (element 2i its low byte): a contiguous pass instead of two strided ones.
        pairs = codes.contiguous().view(torch.int16)
        return (((pairs << 4) | (pairs >> 8)) & 0xFF).to(torch.uint8)
    pairs = codes.unflatten(-1, (-1, 2))
    return ((pairs[..., 0] << 4) | pairs[..., 1]).contiguous()


def _unpack_nibbles(packed: Tensor) -> Tensor:
    return torch.stack((packed >> 4, packed & 0xF), dim=-1).flatten(-2)
