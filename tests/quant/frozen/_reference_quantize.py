"""The frozen-weight quantizer as it was before the fast rewrite (issue 24), kept as the tests' reference.

``quantize_weight`` here is the old ``ds_plugin.quant.frozen.codecs.quantize_weight`` op for op: the fast one must
give the same components for INT8, INT4 absmax, NF4 and FP6, and for INT4's searched scales (a different, cheaper
search) an error no larger on the same weights.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ds_plugin.quant.comm.format import QMAX, quantize_blocks, round_up_to_bf16, scale_cap
from ds_plugin.quant.frozen import fp6
from ds_plugin.quant.frozen.codecs import NF4_CODEBOOK, _nf4_absmax, _resolve

_NF4_MIDPOINTS = (NF4_CODEBOOK[:-1] + NF4_CODEBOOK[1:]) / 2
_NF4_ZERO_CODE = 7
_ZERO_STEPS = 16
_INT4_TOP = 15
_CLIP_RATIOS = tuple(1.0 - 0.05 * i for i in range(9))
_LSQ_STEPS = 3
_SCALE_REFITS = 2
_CHUNK_ELEMENTS = 1 << 18


def encode_e3m2(values: Tensor) -> Tensor:
    """The nearest e3m2 code (ties to even) of each value, as uint8 in 0..63.

    Args:
        values: finite values of any float dtype (computed in fp32); magnitudes above 28 clamp to 28.
    """
    y = values.float()
    a = y.abs().clamp(max=fp6.E3M2_MAX)
    # frexp is exact: a = f * 2^e with f in [0.5, 1), so floor(log2 a) = e - 1. Below 0.25 the step is that of the
    # first binade (1/16), which the subnormals share, hence the clamp from below.
    _, e = torch.frexp(a)
    binade = torch.where(a < fp6.E3M2_MIN_NORMAL, -2, (e - 1).clamp(max=4))
    # a / step is exact (a power-of-two scaling); round() is half to even. A carry to 8 steps is the next binade's
    # first code, which the sum below lands on: code = 4 * (binade + 2) + steps.
    steps = torch.round(torch.ldexp(a, 2 - binade))
    magnitude = (4 * (binade + 2) + steps.to(binade.dtype)).to(torch.uint8)
    return magnitude | (torch.signbit(y).to(torch.uint8) << fp6._SIGN_BIT)


def _words_to_bytes(words: Tensor) -> Tensor:
    # Little-endian, spelled out (byte j = bits 8j..8j+7) rather than left to the host's byte order.
    return torch.stack([(words >> (8 * j)) & 0xFF for j in range(4)], dim=-1).to(torch.uint8).flatten(-2)


def pack_fp6(codes: Tensor) -> Tensor:
    """Pack ``(N, K)`` e3m2 codes into ``(N, 3K/4)`` bytes: the nibble plane, then the top plane, per row.

    Args:
        codes: uint8 codes (0..63), ``K`` a multiple of :data:`fp6.CHUNK`.
    """
    n_rows, k = codes.shape
    if k % fp6.CHUNK:
        raise ValueError(f"fp6 packs codes in chunks of {fp6.CHUNK}, got a row of {k}")
    c = codes.long().view(n_rows, k // fp6.CHUNK, fp6.CHUNK)
    dev = codes.device
    nibble_words = ((c & 15).view(n_rows, k // fp6.CHUNK, 2, 8) << fp6._NIBBLE_SHIFT.to(dev)).sum(
        -1
    )  # disjoint bits: sum == or
    top_words = ((((c >> 4) & 1) << fp6._E2_SHIFT.to(dev)) | ((c >> fp6._SIGN_BIT) << fp6._SIGN_SHIFT.to(dev))).sum(-1)
    nibbles = _words_to_bytes(nibble_words.view(n_rows, k // 8))
    tops = _words_to_bytes(top_words)
    return torch.cat([nibbles, tops], dim=1).contiguous()


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
    n_rows, k = weight.shape
    step = max(1, _CHUNK_ELEMENTS // k)
    # Row chunks bound the fp32 temporaries; every step below is per row, so chunking cannot change a result.
    chunks = [_quantize_rows(weight[i : i + step], fmt, group_size, method) for i in range(0, max(n_rows, 1), step)]
    return {name: torch.cat([c[name] for c in chunks]).contiguous() for name in chunks[0]}


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
    codes = encode_e3m2(values / scales[..., None])
    return {
        "codes": pack_fp6(codes.view(n_rows, values.shape[1] * values.shape[2])),
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


def _pack_nibbles(codes: Tensor) -> Tensor:
    # Element 2i in the high nibble, 2i + 1 in the low one: bitsandbytes' order (checked against quantize_4bit).
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return ((pairs[..., 0] << 4) | pairs[..., 1]).contiguous()
