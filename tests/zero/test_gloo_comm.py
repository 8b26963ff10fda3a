"""Gradient reductions and weight gathers on gloo (`ds_plugin.zero.gloo_comm`), in one 2-rank spawn.

Stages 2/3: each unit's reduction lands while the next unit's backward runs, and no run changes a number against
landing at once (fp32; bf16, whose reduced chunk FSDP2 casts to the fp32 master's dtype; two backwards per step;
fp16, which FSDP2 divides itself and so is never parked; qgZ's quantized reduction, which lands the same way). On
one host reductions and gathers go round a ring of sends and receives, and a landed reduction's input buffer is taken
again by a later one (same numbers as new buffers): gathers bit for bit gloo's own (in place as
FSDP2 calls it, -0.0 and NaN payloads), sums equal to gloo's, on 2 ranks (one step) and on 3 (two steps, several
rings in flight at once); and the engine trains to the same numbers with gloo's own collectives in the rings'
place (stages 1-3).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from _dist import run_ranks
from _tiny import batch, full_params, gpt2, make_optimizer, quiet, zero_config


def _overlap(rank: int, world: int) -> dict:
    # Stages 2/3 on gloo: each unit's gradient reduction lands while the next unit's backward runs. Against the same
    # runs with every reduction landed at once: equal losses and weights (fp32; bf16, whose reduced chunk FSDP2
    # casts to the fp32 master's dtype; and a second backward in one step, whose gradients accumulate).
    from ds_plugin.zero import gloo_comm
    from ds_plugin.zero.setup import initialize

    quiet()
    real_add, seen = gloo_comm.InFlightReductions.add, {"adds": 0, "early": 0, "left": 0}

    def counting_add(self, land):
        seen["adds"] += 1
        seen["early"] += len(self._pending) >= self.depth  # the previous unit's reduction lands here
        real_add(self, land)

    real_take, kept = gloo_comm.BufferPool.take, {"taken": 0}

    def counting_take(self, size, dtype, device):
        kept["taken"] += bool(self._free.get((size, dtype, torch.device(device))))
        return real_take(self, size, dtype, device)

    gloo_comm.BufferPool.take = counting_take

    def run(stage: int, dtype: str, backwards: int = 1, *, overlap: bool = True, pool: bool = True, **zero) -> tuple:
        engine = initialize(gpt2(), zero_config(stage, dtype=dtype, **zero), make_optimizer("adamw"))
        comms = _reduce_scatters(engine.module)
        for comm in comms if not overlap else ():
            comm._in_flight = None  # every reduction lands before FSDP2 goes on
        for comm in comms if not pool else ():
            comm.pool = None  # every reduction input a new buffer
        losses, x = [], batch(0, rank, world)  # one batch, so the loss must fall
        for _ in range(3):
            for _ in range(backwards):
                loss = engine(input_ids=x, labels=x).loss
                engine.backward(loss)
                seen["left"] += sum(len(c._in_flight._pending) for c in comms if c._in_flight is not None)
            engine.step()
            losses.append(loss.item())
        return losses, full_params(engine.module), sorted({type(c).__name__ for c in comms})

    out: dict = {}
    overlapped = {}  # (stage, dtype) -> the run with one backward per step, reductions overlapped, on one host
    # qgZ (stage 3, "qgz") replaces the ring's sum with its quantized one and lands the same way.
    qgz = {"zero_quantized_gradients": True}
    for stage, dtype, backwards in (
        (2, "fp32", 1),
        (3, "fp32", 1),
        (2, "bf16", 1),
        (3, "bf16", 1),
        (3, "fp32", 2),
        (3, "fp16", 1),
        ("qgz", "bf16", 1),
    ):
        zero = qgz if stage == "qgz" else {}
        number = 3 if stage == "qgz" else stage
        gloo_comm.InFlightReductions.add = counting_add
        seen.update(adds=0, early=0, left=0)
        try:
            ran, counts = run(number, dtype, backwards, **zero), dict(seen)
        finally:
            gloo_comm.InFlightReductions.add = real_add
        if backwards == 1:
            overlapped[stage, dtype] = ran
        out["overlap", stage, dtype, backwards] = (
            _same(ran, run(number, dtype, backwards, overlap=False, **zero)),
            counts,
            ran[0],
        )
    out["qgz collectives"] = overlapped["qgz", "bf16"][2]
    # Reduction inputs handed back once landed and taken again by later reductions (host memory reuse is on by
    # default on CPU): the same numbers as with a new buffer for every reduction.
    kept["taken"] = 0
    again = run(3, "bf16")
    out["pool reused"] = kept["taken"]
    out["pool same"] = _same(again, run(3, "bf16", pool=False)) and _same(
        overlapped["qgz", "bf16"], run(3, "bf16", pool=False, **qgz)
    )
    gloo_comm.BufferPool.take = real_take
    # gloo's own reduce-scatter and all-gather in the rings' place: stages 2/3, and stage 1's buckets (no FSDP2).
    overlapped[1, "fp32"] = run(1, "fp32")
    with _gloos_own_collectives():
        for stage in (1, 2, 3):
            out["gloo", stage] = _same(overlapped[stage, "fp32"], run(stage, "fp32"))
    out["ring"] = _ring_collectives(rank, world)
    return out


@contextlib.contextmanager
def _gloos_own_collectives():
    # The rings' callers (FSDP2's comm objects, stage 1's buckets) get gloo's reduce-scatter and all-gather instead.
    import torch.distributed as dist

    from ds_plugin.zero import gloo_comm, stage1

    def reduce_scatter(input_tensor, group, async_op=False):
        out = torch.empty_like(input_tensor.view(dist.get_world_size(group), -1)[0])
        return out, dist.reduce_scatter_tensor(out, input_tensor, group=group, async_op=async_op)

    def all_gather(output, input_tensor, group, async_op=False):
        return dist.all_gather_into_tensor(output, input_tensor, group=group, async_op=async_op)

    saved = [(m, n, getattr(m, n)) for m in (gloo_comm, stage1) for n in ("ring_reduce_scatter", "ring_all_gather")]
    for m, n, _ in saved:
        setattr(m, n, reduce_scatter if n == "ring_reduce_scatter" else all_gather)
    try:
        yield
    finally:
        for m, n, f in saved:
            setattr(m, n, f)


def _same(a: tuple, b: tuple) -> bool:
    # Two runs' (losses, weights) are equal, bit for bit.
    return a[0] == b[0] and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def _ring_collectives(rank: int, world: int) -> dict:
    # The ring against gloo's own collectives, over both transports: reads from the peers' memory (`cma`, the
    # default between ranks of one host) and gloo's sends (what ranks on other hosts use). Gathers bit for bit
    # (-0.0, NaN payloads, infinities; in place, as FSDP2 calls them, with stale values in the other rows), sums
    # equal to gloo's (bit for bit on 2 ranks, where both add the same two numbers; within rounding on more, where
    # the order differs). Three rings of each are in flight at once, issued before any is waited on, as FSDP2's
    # prefetch and the in-flight reductions do.
    import torch.distributed as dist

    from ds_plugin.zero import cma, gloo_comm

    group, out = dist.group.WORLD, {"cma active": cma.ring_link(dist.group.WORLD) is not None}
    for transport in ("cma", "gloo sends"):
        real = gloo_comm.ring_link
        if transport == "gloo sends":
            gloo_comm.ring_link = lambda group: None
        try:
            for dtype in (torch.float32, torch.bfloat16):
                out[transport, str(dtype)] = _rings_against_gloo(rank, world, group, dtype)
        finally:
            gloo_comm.ring_link = real
    return out


def _rings_against_gloo(rank: int, world: int, group, dtype) -> tuple[bool, bool]:
    import torch.distributed as dist

    from ds_plugin.zero.gloo_comm import ring_all_gather, ring_reduce_scatter

    gen = torch.Generator().manual_seed(rank)
    chunks = [torch.randn(1000 + k, generator=gen).to(dtype) for k in range(3)]
    chunks[0][:4] = torch.tensor([-0.0, float("inf"), float("-inf"), 0.0])
    chunks[0].view(torch.int16)[4] = 0x7FC1 + rank  # a NaN with a payload (bf16) / half of one (fp32)
    gathers, works = [], []
    for c in chunks:
        into = torch.full((world * c.numel(),), float("nan"), dtype=dtype)
        own = into.view(world, -1)[rank]
        own.copy_(c)
        gathers.append(into)
        works.append(ring_all_gather(into, own, group, async_op=True))
    # The last rows are over 1 MiB, so a sum read from a peer's memory goes a MiB at a time (more than one piece).
    sums = [torch.randn(world * n, generator=gen).to(dtype) for n in (64, 65, 600_007)]
    reduced = [ring_reduce_scatter(x.clone(), group, async_op=True) for x in sums]
    exact, close = True, True
    for c, into, work, x, (mine, rs_work) in zip(chunks, gathers, works, sums, reduced, strict=True):
        assert isinstance(work, dist.Work) and isinstance(rs_work, dist.Work)  # what FSDP2 waits on
        work.wait()
        rs_work.wait()
        theirs = torch.empty_like(into)
        dist.all_gather_into_tensor(theirs, c)
        exact &= torch.equal(into.view(torch.int16), theirs.view(torch.int16))
        want = torch.empty_like(mine)
        dist.reduce_scatter_tensor(want, x)
        # (more ranks: the order of the sums differs, so the roundings may, by up to one bf16 spacing, 2**-8)
        close &= (
            torch.equal(mine, want) if world == 2 else torch.allclose(mine.float(), want.float(), atol=0.05, rtol=2**-7)
        )
    return exact, close


def _three_ranks(rank: int, world: int) -> dict:
    # Rings of two steps, over both transports; then what happens when a read from a peer's memory fails, and when
    # the ranks of a group disagree about sharing a host or about using it.
    import os

    import torch.distributed as dist

    from ds_plugin.zero import cma
    from ds_plugin.zero.gloo_comm import ring_all_gather

    rows = torch.arange(world * 5, dtype=torch.float32).view(world, 5)

    def gathered(group) -> bool:  # a ring all-gather of `rows` on `group` gives every rank all of them
        got = torch.zeros_like(rows)
        got[rank] = rows[rank]
        ring_all_gather(got, got[rank], group)
        return torch.equal(got, rows)

    out = _ring_collectives(rank, world)
    if out["cma active"]:
        # Rank 0's read fails mid-ring: it raises one line with the fix, the others finish the ring, and the next
        # ring on every rank goes through (no message was left unsent or unmatched).
        real = cma.read_from

        def failing(pid, address, into):
            raise OSError(1, "Operation not permitted")

        cma.read_from = failing if rank == 0 else real
        try:
            gathered(dist.group.WORLD)
            out["failed read"] = "no error"
        except RuntimeError as e:
            out["failed read"] = str(e)
        finally:
            cma.read_from = real
        out["ring after the failure"] = gathered(dist.group.WORLD)
    # A group whose ranks do not all share a host (rank 1 says it is elsewhere) sends over gloo on every rank; so does
    # one where a rank turned it off (DS_PLUGIN_CMA=0 in its environment only), and no rank hangs in the probe.
    real_key = cma._host_key
    cma._host_key = (lambda: ("elsewhere",)) if rank == 1 else real_key
    try:
        apart = dist.new_group(list(range(world)))
        out["apart"] = cma.ring_link(apart) is not None, gathered(apart)
    finally:
        cma._host_key = real_key
    os.environ[cma.ENV] = "0" if rank == 2 else "1"
    try:
        mixed = dist.new_group(list(range(world)))
        out["mixed"] = cma.ring_link(mixed) is not None, gathered(mixed)
    finally:
        os.environ.pop(cma.ENV)
    return out


def _cma_expected() -> bool:
    # Whether this machine lets one process read another's memory (checked on this process itself): then the rings
    # between the test's ranks must use it.
    from ds_plugin.zero import cma

    return cma.availability()[0]


def _reduce_scatters(module) -> list:
    from torch.distributed.fsdp import FSDPModule

    units = [u for u in module.modules() if isinstance(u, FSDPModule)]
    return [u._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm for u in units]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_overlap, 2, timeout=400)


def test_gradient_reductions_overlap_backward_and_change_no_number(two_ranks):
    for r in two_ranks:
        ring = r["ring"]
        assert ring["cma active"] == _cma_expected()
        for transport in ("cma", "gloo sends"):
            for dtype in ("torch.float32", "torch.bfloat16"):
                assert ring[transport, dtype] == (True, True), (transport, dtype)
        assert r["qgz collectives"] == ["QuantizedReduceScatter"]  # qgZ kept its place, and overlapped (below)
        # 3 steps x 3 units: every reduction after the first step's first two took a handed-back input.
        assert r["pool reused"] >= 3 * 3 - 3 and r["pool same"], (r["pool reused"], r["pool same"])
        # gloo's reduce-scatter and all-gather in the rings' place: the same numbers.
        assert r["gloo", 1] and r["gloo", 2] and r["gloo", 3]
        for (stage, dtype, backwards), (same, counts, losses) in (
            (k[1:], v) for k, v in r.items() if k[0] == "overlap"
        ):
            what = f"stage {stage} {dtype}, {backwards} backward(s) per step"
            assert same, what
            assert losses[-1] < losses[0] - 0.01, (what, losses)  # it trained
            if dtype == "fp16":  # FSDP2 divides fp16 gradients itself right after the reduction: never parked
                assert counts == {"adds": 0, "early": 0, "left": 0}, (what, counts)
                continue
            # 3 steps x 3 units (2 blocks, then the root); a second backward accumulates into existing gradients,
            # so its reductions land at once and are not parked.
            assert counts["adds"] == 3 * 3, (what, counts)
            # Each block's reduction landed while a later unit's backward ran, and none was left in flight when
            # backward returned.
            assert counts["early"] == 3 * 2 and counts["left"] == 0, (what, counts)


def test_rings_of_three_ranks():
    # Three ranks: each ring takes two steps, the second issued when the first has landed.
    expected = _cma_expected()
    for rank, r in enumerate(run_ranks(_three_ranks, 3, timeout=120)):
        assert r["cma active"] == expected, r
        for transport in ("cma", "gloo sends"):
            for dtype in ("torch.float32", "torch.bfloat16"):
                assert r[transport, dtype] == (True, True), (transport, dtype)
        if expected:
            if rank == 0:
                assert r["failed read"].startswith("ds_plugin: reading a ring row from rank 2's memory failed")
                assert "Operation not permitted" in r["failed read"] and "DS_PLUGIN_CMA=0" in r["failed read"]
            else:
                assert r["failed read"] == "no error"
            assert r["ring after the failure"]
        assert r["apart"] == (False, True) and r["mixed"] == (False, True)  # (uses cma, gathered right)
