"""INT4 with searched scales: per group, the (scale, zero point) that minimise the squared error.

The search half of :mod:`ds_plugin.quant.frozen.codecs`' ``int4`` format (``method="search"``, the default): a
candidate search over clipping ratios of each group's range, then least-squares refits (see :func:`int4_search`).
Its layout is the codecs' ``int4`` layout: codes 0..15, bf16 scales, uint8 zero points in 1/16 of a code step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from ds_plugin.quant.comm.format import FP32_MAX

__all__ = ["ZERO_STEPS", "Chunks", "int4_search"]

# Yields (rows, that chunk of the block in fp32) for each chunk in turn, in a buffer the caller may overwrite.
Chunks = Callable[[], Iterator[tuple[slice, Tensor]]]

ZERO_STEPS = 16  # int4 zero points are stored in 1/16 of a code step: 255/16 covers the whole 0..15 code range
_INT4_TOP = 15
# Clipping-ratio pairs (low end, high end) tried for each group's range, sorted by the low end. Chosen greedily from
# 117 pairs (1.0 .. 0.82 for both ends, and one end down to 0.4 with the other at 1.0 or 0.95) on Gaussian,
# Student-t(3) and Llama-like (outlier input columns) weights at g = 64, to minimise the error after the
# least-squares steps. With 3 least-squares steps these 20 end at a lower error than the full 9 x 9 grid over
# 1.0 .. 0.6 they replaced (summed squared error over three weights, 4 seed sets, tests/quant/frozen/
# test_quantize_fast.py: -0.02% to -0.16%) for a quarter of the work: mostly both ends near whole, plus one end clipped
# hard (a group around one outlier). The first 18 alone were above that grid's error on some seeds (up to +0.03%);
# a fourth least-squares step lowered the error by a further 0.03% for ~8% more time.
_CLIP_PAIRS = tuple(
    sorted(
        (
            (0.96, 0.96), (0.9, 1.0), (1.0, 0.92), (0.95, 0.65), (0.7, 1.0), (0.94, 1.0), (1.0, 0.96), (0.5, 1.0),
            (1.0, 0.88), (0.92, 0.96), (1.0, 0.5), (0.94, 0.9), (0.82, 1.0), (0.96, 1.0), (1.0, 0.8), (1.0, 1.0),
            (0.92, 1.0), (0.92, 0.92), (0.88, 1.0), (0.96, 0.94),
        ),
        reverse=True,
    )
)  # fmt: skip


def _clip_runs(pairs: tuple[tuple[float, float], ...]) -> tuple[tuple[int, int, float], ...]:
    # (first, end, low-end ratio) of each run of pairs sharing a low-end ratio.
    starts = [i for i, p in enumerate(pairs) if i == 0 or p[0] != pairs[i - 1][0]]
    return tuple((a, b, pairs[a][0]) for a, b in zip(starts, [*starts[1:], len(pairs)], strict=True))


_CLIP_RUNS = _clip_runs(_CLIP_PAIRS)
assert len(_CLIP_PAIRS) <= 32  # the search keeps a candidate's index in 5 bits
# After the search: least-squares refits of (scale, offset), then of the scale alone once the zero point is on its
# 8-bit grid.
_LSQ_STEPS = 3
_SCALE_REFITS = 1


def int4_search(
    shape: torch.Size, step: int, chunks: Chunks, device: torch.device
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per group, the (scale, zero) that minimise the squared error, by a candidate search then least squares.

    1. Try each pair of clipping ratios in ``_CLIP_PAIRS`` for the group's negative and positive ends (the range
       always holds 0, so the zero point lands in 0..15), keeping the pair with the smallest squared error.
    2. Refine ``x ~ s * q + m`` by alternating nearest codes with the closed-form least-squares fit of (s, m) to
       those codes; each half-step can only lower the error (Lloyd's iteration, restricted to uniform grids).
    3. Round the zero point to its 8-bit grid and the scale to bf16, refit the scale for that zero point, and
       compute the final codes against the stored values, so dequantization sees exactly what was optimised.

    Every pass runs chunk by chunk into four chunk-sized buffers made here; the per-group arithmetic between the
    passes runs once for the whole block.

    Args:
        shape: the block's ``(rows, groups, group_size)``.
        step: rows per chunk.
        chunks: the block's chunks in fp32, in order (see :data:`Chunks`).
        device: where the block is.

    Returns:
        codes (int8 viewed as uint8, ``shape``), scales (bf16) and zeros (uint8), each ``(rows, groups)``, and
        each group's largest magnitude ``(rows, groups, 1)``.
    """
    tiny = torch.finfo(torch.float32).tiny
    n = shape[-1]
    lo, hi, sum_x = (torch.empty((*shape[:2], 1), device=device) for _ in range(3))
    # The candidates' x / s, codes and (x - m); then the least-squares steps' q, q q and q x.
    buf = torch.empty((4, min(step, shape[0]), *shape[1:]), device=device)
    for rows, x in chunks():
        torch.amin(x, dim=-1, keepdim=True, out=lo[rows])
        torch.amax(x, dim=-1, keepdim=True, out=hi[rows])
        torch.sum(x, dim=-1, keepdim=True, out=sum_x[rows])
    amax = torch.maximum(hi, -lo)
    lo, hi = lo.clamp_(max=0), hi.clamp_(min=0)
    r_lo, r_hi, ids, run_ratios = _search_tables(lo.device)
    # Every candidate's scale, (candidates, rows, groups, 1). Divide each end before subtracting so the span
    # cannot overflow near fp32's max.
    s = torch.mul(hi, r_hi).sub_(lo * (r_lo / _INT4_TOP)).clamp_(min=tiny)
    inv, err, offsets = s.reciprocal(), torch.empty_like(s), torch.mul(lo, run_ratios)
    for rows, x in chunks():
        t, r, shifted, _ = buf[:, : len(x)].unbind(0)
        invs, errs = inv[:, rows].unbind(0), err[:, rows].unbind(0)
        for (first, end, _), offset in zip(_CLIP_RUNS, offsets[:, rows].unbind(0), strict=True):
            # Candidates sharing a low-end ratio share the offset m = lo * ratio: x - m once, then (x - m) / s each.
            torch.sub(x, offset, out=shifted)
            for c in range(first, end):
                torch.mul(shifted, invs[c], out=t)
                torch.round(t, out=r).clamp_(0, _INT4_TOP)
                # The root of the squared error, in code units (times s below, so huge weights cannot overflow it).
                torch.linalg.vector_norm(t.sub_(r), dim=-1, keepdim=True, out=errs[c])
    # The first candidate with the smallest error, as one amin (argmin over a leading dim is slow on CPUs): the
    # candidate's index replaces the low 5 mantissa bits of its (non-negative) error, a 4e-6 relative change.
    key = err.mul_(s).clamp_(max=FP32_MAX).view(torch.int32).bitwise_and_(~31).bitwise_or_(ids)
    pick = (key.view(torch.float32).amin(dim=0).view(torch.int32) & 31).flatten()
    r_lo, r_hi = r_lo.flatten().index_select(0, pick).view_as(lo), r_hi.flatten().index_select(0, pick).view_as(hi)
    s, m = torch.mul(hi, r_hi).sub_(lo * (r_lo / _INT4_TOP)).clamp_(min=tiny), lo * r_lo
    for _ in range(_LSQ_STEPS):
        # Codes q = round((x - m) / s); then the least-squares (s, m) for them.
        sum_q, sum_qq, sum_qx = _code_sums(chunks, buf, m, s.reciprocal(), stored=False)
        # Codes are integers 0..15 and n <= 2^16 / 15^2, so det is exact: 0 only when all codes are equal (a
        # constant group), where the fit is undetermined and fit_s is nan or inf, which the checks below refuse.
        det = torch.addcmul(sum_qq * n, sum_q, sum_q, value=-1)
        fit_s = torch.addcmul(sum_qx * n, sum_q, sum_x, value=-1).div_(det)
        fit_m = torch.addcmul(sum_x, fit_s, sum_q, value=-1).div_(n)
        ok = (fit_s >= tiny).logical_and_(fit_s < math.inf).logical_and_(fit_m.abs() < math.inf)
        s, m = torch.where(ok, fit_s, s), torch.where(ok, fit_m, m)
    zeros = torch.div(m, s).mul_(-ZERO_STEPS).round_().clamp_(0, 255)
    z = zeros / ZERO_STEPS
    s = _to_bf16(s)
    for _ in range(_SCALE_REFITS):
        # The best scale for the stored zero point: d = q - z, s = sum(d x) / sum(d d), from the same three sums.
        sum_q, sum_qq, sum_qx = _code_sums(chunks, buf, z, s, stored=True)
        dx = torch.addcmul(sum_qx, z, sum_x, value=-1)
        dd = torch.addcmul(sum_qq, z, torch.mul(z, n * 0.5).sub_(sum_q), value=2)
        fit_s = _to_bf16(dx.div_(dd))
        s = torch.where((fit_s >= tiny).logical_and_(fit_s < math.inf), fit_s, s)
    codes = torch.empty(shape, dtype=torch.int8, device=lo.device)
    _code_sums(chunks, buf, z, s, stored=True, codes=codes)
    return codes.view(torch.uint8), s.squeeze(-1).to(torch.bfloat16), zeros.squeeze(-1).to(torch.uint8), amax


def _code_sums(
    chunks: Chunks, buf: Tensor, shift: Tensor, scale: Tensor, *, stored: bool, codes: Tensor | None = None
) -> list[Tensor]:
    """Per group, sum(q), sum(q q) and sum(q x) over the INT4 search's codes q of every chunk ``x`` (or the codes).

    q = round((x - m) * inv) for ``shift`` m and ``scale`` inv (the least-squares steps), or with ``stored``
    q = round(x / s + z) for ``scale`` s and ``shift`` z (the stored scale and zero point), clamped to 0..15. With
    ``codes``, q is written there instead and nothing is summed.
    """
    sums = torch.empty((3, *shift.shape), dtype=shift.dtype, device=shift.device) if codes is None else None
    for rows, x in chunks():
        q, qq, qx, _ = buf[:, : len(x)].unbind(0)
        if stored:
            torch.div(x, scale[rows], out=q).add_(shift[rows]).round_().clamp_(0, _INT4_TOP)
        else:
            torch.sub(x, shift[rows], out=q).mul_(scale[rows]).round_().clamp_(0, _INT4_TOP)
        if sums is None:
            codes[rows] = q
            continue
        torch.mul(q, q, out=qq)
        torch.mul(q, x, out=qx)
        torch.sum(buf[:3, : len(x)], dim=-1, keepdim=True, out=sums[:, rows])
    return [] if sums is None else list(sums.unbind(0))


_SEARCH_TABLES: dict[tuple[torch.device, tuple], tuple[Tensor, Tensor, Tensor, Tensor]] = {}


def _search_tables(device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # Per candidate, on the weight's device (made once): the low-end ratio and the high-end ratio / 15, each
    # (candidates, 1, 1, 1), and the candidate's index (int32, same shape); then each run's low-end ratio (runs,
    # 1, 1, 1).
    key = (device, _CLIP_PAIRS)
    tables = _SEARCH_TABLES.get(key)
    if tables is None:
        pairs = torch.tensor(_CLIP_PAIRS, dtype=torch.float32)
        ids = torch.arange(len(_CLIP_PAIRS), dtype=torch.int32)
        runs = torch.tensor([ratio for _, _, ratio in _CLIP_RUNS], dtype=torch.float32)
        tables = tuple(t.view(-1, 1, 1, 1).to(device) for t in (pairs[:, 0], pairs[:, 1] / _INT4_TOP, ids, runs))
        _SEARCH_TABLES[key] = tables
    return tables


def _to_bf16(x: Tensor) -> Tensor:
    return x.to(torch.bfloat16).float()
