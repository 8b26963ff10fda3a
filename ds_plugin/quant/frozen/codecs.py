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

import torch
from torch import Tensor

from ds_plugin.quant.comm.format import FLOAT_DTYPES, QMAX, quantize_blocks, round_up_to_bf16, scale_cap
from ds_plugin.quant.frozen import fp6

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "FORMATS",
    "METHODS",
    "NF4_CODEBOOK",
    "check_weight",
    "dequantize_weight",
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
_ZERO_STEPS = 16  # int4 zero points are stored in 1/16 of a code step: 255/16 covers the whole 0..15 code range
_INT4_TOP = 15
# Clipping ratios tried for each end of a group's range (81 pairs, 1.0 down to 0.6): a 2-D grid finds skewed optima
# that one shared ratio misses. Measured on Gaussian and Student-t(3) weights at g = 64: 6-8% lower MSE than a 1-D
# grid of 7, 1.5-2% lower than a 5 x 5 grid. ~15 s per 100M weights on one core, ~9 s on two.
_CLIP_RATIOS = tuple(1.0 - 0.05 * i for i in range(9))
_LSQ_STEPS = 3  # least-squares refits of (scale, offset) after the grid; later steps gain < 0.5% MSE
_SCALE_REFITS = 2  # refits of the scale alone once the zero point is rounded to its 8-bit grid
# Rows per pass: ~1 MB of fp32 per temporary (the grid search's two reused buffers hold 9 candidates each). Measured,
# allocating a fresh 1 MB temporary per op (mapped and page-faulted anew each time) made the search ~10x slower.
_CHUNK_ELEMENTS = 1 << 18


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
    _check_finite(weight)
    n_rows, k = weight.shape
    step = max(1, _CHUNK_ELEMENTS // k)
    # Row chunks bound the fp32 temporaries; every step below is per row, so chunking cannot change a result.
    chunks = [_quantize_rows(weight[i : i + step], fmt, group_size, method) for i in range(0, max(n_rows, 1), step)]
    return {name: torch.cat([c[name] for c in chunks]).contiguous() for name in chunks[0]}


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
    k = _logical_cols(fmt, codes.shape[1])
    check_weight(fmt, (n_rows, k), group_size)
    groups = (n_rows, k // group_size, group_size)
    if fmt == "int8":
        values = codes.view(torch.int8).float().reshape(groups) * _part(parts, "scales", groups[:2]).float()[..., None]
    elif fmt == "int4":
        scales = _part(parts, "scales", groups[:2]).float()[..., None]
        zeros = _part(parts, "zeros", groups[:2]).float()[..., None] / _ZERO_STEPS
        values = (_unpack_nibbles(codes).float().reshape(groups) - zeros) * scales
    elif fmt == "fp6":
        scales = _part(parts, "scales", groups[:2]).float()[..., None]
        values = fp6.decode_e3m2(fp6.unpack_fp6(codes)).reshape(groups) * scales
    else:
        absmax = _nf4_absmax(parts, groups[:2])
        codebook = NF4_CODEBOOK.to(codes.device)
        values = codebook[_unpack_nibbles(codes).long()].reshape(groups) * absmax[..., None]
    return values.view(n_rows, k).to(dtype)


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


def _logical_cols(fmt: str, code_cols: int) -> int:
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


def _quantize_rows(rows: Tensor, fmt: str, group_size: int, method: str) -> dict[str, Tensor]:
    n_rows, k = rows.shape
    blocks = rows.reshape(n_rows, k // group_size, group_size)
    if fmt == "int8":
        codes, scales = quantize_blocks(blocks, 8, scale_cap(8, torch.bfloat16), torch.bfloat16)
        return {"codes": codes.view(torch.uint8).reshape(n_rows, k), "scales": scales.view(blocks.shape[:2])}
    if fmt == "int4":
        codes, scales, zeros = (_int4_search if method == "search" else _int4_absmax)(blocks.float())
        return {"codes": _pack_nibbles(codes.reshape(n_rows, k)), "scales": scales, "zeros": zeros}
    if fmt == "fp6":
        return _quantize_fp6(blocks)
    return _quantize_nf4(blocks, double_quant=method == "double_quant")


def _int4_absmax(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    # Symmetric: scale = amax / 7 rounded up to bf16, so round(x / scale) stays in -7..7 and code = that + 8.
    qmax = QMAX[4]
    amax = blocks.abs().amax(dim=-1)
    scales = round_up_to_bf16(torch.where(amax == 0, 1.0, amax / qmax).clamp(max=scale_cap(4, torch.bfloat16)))
    codes = torch.round(blocks / scales[..., None]).clamp(-qmax, qmax) + (qmax + 1)
    zeros = torch.full_like(scales, (qmax + 1) * _ZERO_STEPS, dtype=torch.uint8)
    return codes.to(torch.uint8), scales.to(torch.bfloat16), zeros


def _int4_search(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per group, the (scale, zero) that minimise the squared error, by grid search then least squares.

    1. Try every pair of clipping ratios for the group's negative and positive ends (the range always holds 0,
       so the zero point lands in 0..15), keeping the pair with the smallest squared error.
    2. Refine ``x ~ s * q + m`` by alternating nearest codes with the closed-form least-squares fit of (s, m) to
       those codes; each half-step can only lower the error (Lloyd's iteration, restricted to uniform grids).
    3. Round the zero point to its 8-bit grid and the scale to bf16, refit the scale for that zero point, and
       compute the final codes against the stored values, so dequantization sees exactly what was optimised.
    """
    tiny = torch.finfo(torch.float32).tiny
    lo = blocks.amin(dim=-1, keepdim=True).clamp(max=0)
    hi = blocks.amax(dim=-1, keepdim=True).clamp(min=0)
    # All high-end ratios at once, one low-end ratio per pass: a leading candidate dim makes each op 9x larger, so
    # there are 9x fewer parallel regions, whose barriers dominate when other processes share the cores.
    r_hi = torch.tensor(_CLIP_RATIOS, dtype=blocks.dtype, device=blocks.device).view(-1, 1, 1, 1) / _INT4_TOP
    t = torch.empty((len(_CLIP_RATIOS), *blocks.shape), dtype=blocks.dtype, device=blocks.device)
    r = torch.empty_like(t)
    best_err = best_s = best_m = None
    for r_lo in _CLIP_RATIOS:
        # Divide each end before subtracting so the span cannot overflow near fp32's max.
        s = (hi * r_hi - lo * (r_lo / _INT4_TOP)).clamp(min=tiny)
        m = (lo * r_lo).expand_as(s)
        inv = 1.0 / s
        # x / s - m / s as one fused pass into reused buffers: five passes per 9 candidates, no large allocation.
        torch.addcmul(-m * inv, blocks, inv, out=t)
        t.sub_(torch.round(t, out=r).clamp_(0, _INT4_TOP))
        # The root of the squared error (in x units), so huge weights cannot overflow the comparison.
        err, pick = (torch.linalg.vector_norm(t, dim=-1, keepdim=True) * s).min(dim=0)
        s, m = s.gather(0, pick[None]).squeeze(0), m.gather(0, pick[None]).squeeze(0)
        if best_err is None:
            best_err, best_s, best_m = err, s, m
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_s, best_m = torch.where(better, s, best_s), torch.where(better, m, best_m)
    s, m = best_s, best_m
    n = blocks.shape[-1]
    sum_x = blocks.sum(dim=-1, keepdim=True)
    for _ in range(_LSQ_STEPS):
        q = ((blocks - m) / s).round_().clamp_(0, _INT4_TOP)
        sum_q, sum_qq = q.sum(dim=-1, keepdim=True), q.square().sum(dim=-1, keepdim=True)
        sum_qx = (q * blocks).sum(dim=-1, keepdim=True)
        det = n * sum_qq - sum_q.square()
        fit_s = (n * sum_qx - sum_q * sum_x) / torch.where(det > 0, det, 1.0)
        # det == 0: all codes equal (a constant group), the fit is undetermined; keep the grid's choice.
        fit_m = (sum_x - fit_s * sum_q) / n
        ok = (det > 0) & (fit_s >= tiny) & torch.isfinite(fit_s) & torch.isfinite(fit_m)
        s, m = torch.where(ok, fit_s, s), torch.where(ok, fit_m, m)
    zeros = (-m / s * _ZERO_STEPS).round().clamp(0, 255)
    z = zeros / _ZERO_STEPS
    s = _to_bf16(s)
    for _ in range(_SCALE_REFITS):
        d = (blocks / s + z).round_().clamp_(0, _INT4_TOP) - z
        fit_s = _to_bf16((d * blocks).sum(dim=-1, keepdim=True) / d.square().sum(dim=-1, keepdim=True))
        s = torch.where((fit_s >= tiny) & torch.isfinite(fit_s), fit_s, s)
    codes = (blocks / s + z).round_().clamp_(0, _INT4_TOP)
    return codes.to(torch.uint8), s.squeeze(-1).to(torch.bfloat16), zeros.squeeze(-1).to(torch.uint8)


def _quantize_fp6(blocks: Tensor) -> dict[str, Tensor]:
    # Absmax onto e3m2's largest value, rounded up to bf16 (the int8 rule): x / scale <= 28, so nothing clips.
    n_rows = blocks.shape[0]
    values = blocks.float()
    raw = values.abs().amax(dim=-1) / fp6.E3M2_MAX
    # A group whose amax / 28 is 0 (all zeros, or underflow) gets scale 1: its codes are then zeros.
    scales = round_up_to_bf16(torch.where(raw == 0, 1.0, raw))
    codes = fp6.encode_e3m2(values / scales[..., None])
    return {
        "codes": fp6.pack_fp6(codes.view(n_rows, values.shape[1] * values.shape[2])),
        "scales": scales.to(torch.bfloat16),
    }


def _to_bf16(x: Tensor) -> Tensor:
    return x.to(torch.bfloat16).float()


def _quantize_nf4(blocks: Tensor, double_quant: bool) -> dict[str, Tensor]:
    n_rows, n_groups = blocks.shape[:2]
    values = blocks.float()
    absmax = values.abs().amax(dim=-1)
    if not double_quant:
        # bitsandbytes' arithmetic exactly: multiply by the reciprocal (not divide), clamp, then bucketize, whose
        # right=False puts a value equal to a midpoint in the lower code.
        scaled = values * (1.0 / absmax.clamp(min=1e-38))[..., None]
        codes = torch.bucketize(scaled.clamp_(-1, 1), _NF4_MIDPOINTS.to(values.device), out_int32=True)
        return {"codes": _pack_nibbles(codes.flatten(1)), "absmax": absmax}
    # Rows' group absmaxes as int8 around the row's mean (a per-row analogue of bitsandbytes' nested quantization,
    # so the row contract holds). The codes are then chosen against the absmax the dequantizer will rebuild, which
    # makes each element the nearest level of the grid it is actually stored on.
    # The mean in fp64: an fp32 sum of huge absmaxes could overflow.
    offset = absmax.double().mean(dim=-1, keepdim=True).float()
    absmax_codes, absmax_scale = quantize_blocks(
        (absmax - offset)[:, None, :], 8, scale_cap(8, torch.float32), torch.float32
    )
    parts = {
        "absmax_codes": absmax_codes.view(torch.uint8).view(n_rows, n_groups),
        "absmax_scale": absmax_scale.view(n_rows, 1),
        "absmax_offset": offset,
    }
    stored = _nf4_absmax(parts, (n_rows, n_groups))
    scaled = values * (1.0 / stored.clamp(min=1e-38))[..., None]
    codes = torch.bucketize(scaled.clamp_(-1, 1), _NF4_MIDPOINTS.to(values.device), out_int32=True)
    # A group whose rebuilt absmax is <= 0 (tiny next to its row's spread) is stored as zeros: its true absmax is
    # within half an absmax step of 0 anyway.
    codes = torch.where((stored > 0)[..., None], codes, _NF4_ZERO_CODE)
    return {"codes": _pack_nibbles(codes.flatten(1)), **parts}


def _nf4_absmax(parts: dict[str, Tensor], shape: tuple[int, int]) -> Tensor:
    if "absmax" in parts:
        return _part(parts, "absmax", shape).float()
    codes = _part(parts, "absmax_codes", shape).view(torch.int8).float()
    scale = _part(parts, "absmax_scale", (shape[0], 1)).float()
    return codes * scale + _part(parts, "absmax_offset", (shape[0], 1)).float()


def _pack_nibbles(codes: Tensor) -> Tensor:
    # Element 2i in the high nibble, 2i + 1 in the low one: bitsandbytes' order (checked against quantize_4bit).
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return ((pairs[..., 0] << 4) | pairs[..., 1]).contiguous()


def _unpack_nibbles(packed: Tensor) -> Tensor:
    return torch.stack((packed >> 4, packed & 0xF), dim=-1).flatten(-2)
