"""Gradient reductions and weight gathers on gloo (`ds_plugin.zero.gloo_comm`), in one 2-rank spawn.

Stages 2/3: each unit's reduction lands while the next unit's backward runs, and no run changes a number against
landing at once (fp32; bf16, whose reduced chunk FSDP2 casts to the fp32 master's dtype; two backwards per step;
fp16, which FSDP2 divides itself and so is never parked). On one host large all-gathers are OR all-reduces, bit for
bit gloo's own (in place as FSDP2 calls it, -0.0 and NaN payloads); ranks "on two hosts" take gloo's own
collectives with the same numbers.
"""

from __future__ import annotations

import os

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

    def run(stage: str, dtype: str, backwards: int, *, overlap: bool) -> tuple:
        engine = initialize(gpt2(), zero_config(stage, dtype=dtype), make_optimizer("adamw"))
        comms = _reduce_scatters(engine.module)
        for comm in comms if not overlap else ():
            comm._in_flight = None  # every reduction lands before FSDP2 goes on
        losses, x = [], batch(0, rank, world)  # one batch, so the loss must fall
        for _ in range(3):
            for _ in range(backwards):
                loss = engine(input_ids=x, labels=x).loss
                engine.backward(loss)
                seen["left"] += sum(len(c._in_flight._pending) for c in comms if c._in_flight is not None)
            engine.step()
            losses.append(loss.item())
        return losses, full_params(engine.module)

    out: dict = {}
    for stage, dtype, backwards in (
        (2, "fp32", 1),
        (3, "fp32", 1),
        (2, "bf16", 1),
        (3, "bf16", 1),
        (3, "fp32", 2),
        (3, "fp16", 1),
    ):
        gloo_comm.InFlightReductions.add = counting_add
        seen.update(adds=0, early=0, left=0)
        try:
            (loss_a, params_a), counts = run(stage, dtype, backwards, overlap=True), dict(seen)
        finally:
            gloo_comm.InFlightReductions.add = real_add
        loss_b, params_b = run(stage, dtype, backwards, overlap=False)
        same = loss_a == loss_b and all(torch.equal(params_a[k], params_b[k]) for k in params_a)
        out["overlap", stage, dtype, backwards] = (same, counts, loss_a)
        if backwards == 1 and dtype == "fp32":
            # The same run as if each rank were on its own host: gloo's reduce-scatter instead of the all-reduce.
            os.environ["LOCAL_WORLD_SIZE"] = "1"
            try:
                loss_c, params_c = run(stage, dtype, backwards, overlap=True)
            finally:
                del os.environ["LOCAL_WORLD_SIZE"]
            out["hosts", stage] = loss_c == loss_a and all(torch.equal(params_c[k], params_a[k]) for k in params_a)
    # Stage 1 (no FSDP2): its buckets' reduce-scatter and all-gather, on one host and "on two".
    one = run(1, "fp32", 1, overlap=True)
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    try:
        two = run(1, "fp32", 1, overlap=True)
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]
    out["hosts", 1] = one[0] == two[0] and all(torch.equal(one[1][k], two[1][k]) for k in one[1])
    # Every all-gather as an OR all-reduce (the tiny model's are below the size where it pays): the same numbers
    # through FSDP2's in-place gathers (stages 2/3, bf16 too) and stage 1's buckets.
    sizes = gloo_comm._OR_GATHER_MIN_BYTES, gloo_comm._OR_GATHER_MIN_BYTES_OTHER
    for stage, dtype in ((1, "fp32"), (2, "fp32"), (3, "fp32"), (3, "bf16")):
        plain = run(stage, dtype, 1, overlap=True)
        gloo_comm._OR_GATHER_MIN_BYTES, gloo_comm._OR_GATHER_MIN_BYTES_OTHER = {}, 0
        try:
            ored = run(stage, dtype, 1, overlap=True)
        finally:
            gloo_comm._OR_GATHER_MIN_BYTES, gloo_comm._OR_GATHER_MIN_BYTES_OTHER = sizes
        out["or_everywhere", stage, dtype] = plain[0] == ored[0] and all(
            torch.equal(plain[1][k], ored[1][k]) for k in plain[1]
        )
    out["or_gather"] = _or_gather(rank, world)
    return out


def _or_gather(rank: int, world: int) -> tuple:
    # An all-gather as an OR all-reduce gives gloo's all-gather bit for bit (-0.0, NaN payloads, infinities),
    # from the size where it pays (16 MiB of fp32).
    import torch.distributed as dist

    from ds_plugin.zero.gloo_comm import all_gather_by_or, or_gather_pays

    chunk = torch.randn(1 << 21, generator=torch.Generator().manual_seed(rank))
    chunk[:4] = torch.tensor([-0.0, float("inf"), float("-inf"), 0.0])
    chunk.view(torch.int32)[4] = 0x7FC01234 + rank  # a NaN with a payload
    ours, theirs = torch.empty(world * chunk.numel()), torch.empty(world * chunk.numel())
    all_gather_by_or(ours, chunk, dist.group.WORLD)
    dist.all_gather_into_tensor(theirs, chunk)
    exact = torch.equal(ours.view(torch.int32), theirs.view(torch.int32))
    # In place, as FSDP2 calls it: the input is the output's own row, and stale values fill the others.
    in_place = torch.full_like(ours, float("nan"))
    own = in_place.view(world, -1)[rank]
    own.copy_(chunk)
    all_gather_by_or(in_place, own, dist.group.WORLD)
    exact_in_place = torch.equal(in_place.view(torch.int32), theirs.view(torch.int32))
    small = torch.empty(1 << 20)  # 4 MiB of fp32: gloo's own all-gather is faster there
    return exact, exact_in_place, or_gather_pays(ours), or_gather_pays(small)


def _reduce_scatters(module) -> list:
    from torch.distributed.fsdp import FSDPModule

    units = [u for u in module.modules() if isinstance(u, FSDPModule)]
    return [u._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm for u in units]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_overlap, 2, timeout=400)


def test_gradient_reductions_overlap_backward_and_change_no_number(two_ranks):
    for r in two_ranks:
        assert r["or_gather"] == (True, True, True, False)
        assert (
            all(v for k, v in r.items() if k[0] == "or_everywhere")
            and len([k for k in r if k[0] == "or_everywhere"]) == 4
        )
        # Ranks on separate hosts take gloo's reduce-scatter and all-gather: the same numbers.
        assert r["hosts", 1] and r["hosts", 2] and r["hosts", 3]
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
