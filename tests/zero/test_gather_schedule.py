"""When stages 2/3 gather weights: prefetching ahead of use (`stage3_prefetch_bucket_size`) and the blocks stage 3
keeps gathered from forward to backward (`stage3_max_reuse_distance`, `stage3_max_live_parameters`).

One spawn of 2 gloo ranks trains the tiny GPT-2 under each setting and records FSDP2's prefetch lists, which blocks
are kept, and where the weights are after forwards with and without autograd; every setting must train to the same
numbers. Which blocks are kept at real sizes is checked on models built on the meta device, without ranks.
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks
from _tiny import batch, full_params, gpt2, make_optimizer, quiet, train_engine, zero_config
from torch import nn

from ds_plugin.zero.apply import _ahead, _kept_blocks
from ds_plugin.zero.plan import resolve_plan
from ds_plugin.zero.wrap import find_blocks


def _prefetch(rank: int, world: int) -> dict:
    # stage3_prefetch_bucket_size: gathers issued ahead change when weights arrive, never what is computed; nor do
    # stage3_max_reuse_distance / stage3_max_live_parameters, which say which blocks stay gathered into backward.
    from torch.distributed.fsdp import FSDPModule

    from ds_plugin.zero.setup import initialize

    def numel(m: nn.Module) -> int:
        return sum(p.numel() for p in m.parameters())

    model = gpt2()
    block = numel(model.transformer.h[-1])
    after = numel(model) - sum(numel(b) for b in model.transformer.h)  # tied embedding, final norm
    out: dict = {}
    for stage in (2, 3):
        settings = {"none": {"stage3_prefetch_bucket_size": 0}, "ahead": {"stage3_prefetch_bucket_size": 50_000_000}}
        if stage == 3:
            # DeepSpeed's rule: a block stays gathered when fewer elements than the distance run between its forward
            # and its backward (the later blocks and what follows them, twice). Just above the last block's distance,
            # only it is kept; a live cap of one block keeps one block too.
            settings["reuse"] = {**settings["ahead"], "stage3_max_reuse_distance": 2 * after + 1}
            settings["live"] = {**settings["ahead"], "stage3_max_live_parameters": block}
        runs = {}
        for name, keys in settings.items():
            cfg = zero_config(stage)
            cfg["zero_optimization"].update(keys)
            engine = initialize(gpt2(), cfg, make_optimizer("adamw"))
            units = {n or "root": m for n, m in engine.module.named_modules() if isinstance(m, FSDPModule)}
            names = {id(m._get_fsdp_state()): n for n, m in units.items()}
            states = {n: m._get_fsdp_state() for n, m in units.items()}
            runs[name] = {
                "kept": tuple(_kept(b) for b in engine.module.transformer.h),
                "forward": {n: [names[id(t)] for t in s._states_to_forward_prefetch] for n, s in states.items()},
                "backward": {n: [names[id(t)] for t in s._states_to_backward_prefetch] for n, s in states.items()},
                "async": all(g.unshard_async_op for u in units.values() for g in _param_groups(u)),
                "loss": train_engine(engine, rank, world, 3)["loss"],
                "params": full_params(engine.module),
            }
            if name == "ahead":
                runs[name]["gathered"] = _gathered_after(engine, batch(9, rank, world))
        loss, params = runs["none"]["loss"], runs["none"]["params"]
        for run in runs.values():
            mine = run.pop("params")
            run["same"] = run.pop("loss") == loss and all(torch.equal(mine[k], params[k]) for k in params)
        out["prefetch", stage] = runs
    return out


def _gathered_after(engine, x: torch.Tensor) -> dict[str, tuple[bool, ...]]:
    # Which blocks hold gathered (not DTensor) weights after a forward: with autograd (a backward follows), without
    # (evaluation: nothing follows), and without inside gathered_for_generation (held on purpose).
    from torch.distributed.tensor import DTensor

    from ds_plugin.zero.generation import gathered_for_generation

    def gathered() -> tuple[bool, ...]:
        return tuple(not isinstance(b.mlp.c_fc.weight, DTensor) for b in engine.module.transformer.h)

    out = {}
    with torch.no_grad():
        engine(input_ids=x)
    out["no_grad"] = gathered()
    loss = engine(input_ids=x, labels=x).loss
    out["grad"] = gathered()
    engine.backward(loss)
    out["after_backward"] = gathered()
    with gathered_for_generation(engine.module):
        engine(input_ids=x)
        out["generation"] = gathered()
    return out


def _kept(block) -> bool:
    # Kept gathered from forward to backward: FSDP2 has no mesh to reshard onto after forward.
    return block._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is None


def _param_groups(unit) -> list:
    # torch 2.13 lists a unit's parameter groups; torch 2.11 has one.
    state = unit._get_fsdp_state()
    return getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]


def _two_ranks(rank: int, world: int) -> dict:
    quiet()
    return _prefetch(rank, world)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_two_ranks, 2, timeout=300)


@pytest.mark.parametrize("stage", [2, 3])
def test_prefetch_budget_gathers_ahead_and_changes_no_number(two_ranks, stage):
    results = two_ranks
    units = ["root", "transformer.h.0", "transformer.h.1"]
    itself = {u: [u] for u in units}
    for r in results:
        runs = r["prefetch", stage]
        assert sorted(runs) == (["ahead", "live", "none", "reuse"] if stage == 3 else ["ahead", "none"])
        assert all(run["same"] for run in runs.values()), {k: run["same"] for k, run in runs.items()}
        none, ahead = runs["none"], runs["ahead"]
        # Budget 0: nothing ahead, gathers stay synchronous; at stage 3 no block is kept gathered into backward (a
        # kept block must fit the budget) and on a CPU each unit's backward list names only itself (FSDP2's
        # implicit prefetch off). Stage 2 keeps every block gathered anyway and gathers nothing in backward.
        assert none["forward"] == {u: [] for u in units} and not none["async"]
        assert none["kept"] == ((False, False) if stage == 3 else (True, True))
        assert none["backward"] == (itself if stage == 3 else {u: [] for u in units})
        # The tiny model fits the budget: each unit prefetches every later one (the root: all), asynchronously.
        assert ahead["forward"] == {"root": units[1:], units[1]: units[2:], units[2]: []} and ahead["async"]
        # With DeepSpeed's default reuse distance (1e9) every block stays gathered: backward fetches nothing.
        assert ahead["kept"] == (True, True)
        assert ahead["backward"] == (itself if stage == 3 else {u: [] for u in units})
        # A kept block is freed after a forward without autograd (no backward to keep it for), stays gathered after
        # one with autograd until its backward, and stays gathered inside gathered_for_generation.
        expect = {"no_grad": (False, False), "grad": (True, True), "after_backward": (False, False)}
        expect["generation"] = (True, True)
        assert ahead["gathered"] == (expect if stage == 3 else {**expect, "no_grad": (True, True)})
        if stage == 3:
            # Only the last block kept: backward (h.1, then h.0) fetches h.0 ahead from the root and from h.1.
            for name in ("reuse", "live"):
                assert runs[name]["kept"] == (False, True), name
                assert runs[name]["backward"] == {"root": [units[1]], units[2]: [units[1]], units[1]: [units[1]]}


def test_blocks_kept_gathered_follow_deepspeeds_reuse_distance():
    # Which stage-3 blocks stay gathered from forward to backward, at real sizes (built on the meta device).
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    def kept(model: nn.Module, **zero) -> list[int]:
        plan = resolve_plan({"zero_optimization": {"stage": 3, **zero}}, world_size=2)
        blocks = find_blocks(model)
        return sorted(blocks.index(b) for b in _kept_blocks(model, blocks, plan))

    with torch.device("meta"):
        llama7b = LlamaForCausalLM(
            LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, vocab_size=32000)
        )
        gpt2_124m = GPT2LMHeadModel(GPT2Config())
    # A 7B layer (202M elements) is bigger than the prefetch budget (5e7): nothing is kept, as before.
    assert kept(llama7b) == []
    # With a budget that fits it, DeepSpeed's default distance (1e9) keeps the last two layers: after layer 30's
    # forward run layer 31, the norm and the head (about 0.33B elements) twice; after layer 29's, 0.54B twice.
    assert kept(llama7b, stage3_prefetch_bucket_size=300_000_000) == [30, 31]
    assert kept(llama7b, stage3_prefetch_bucket_size=300_000_000, stage3_max_live_parameters=300_000_000) == [31]
    # GPT-2 124M: every block, within every default; a distance of 0 keeps none.
    assert kept(gpt2_124m) == list(range(12))
    assert kept(gpt2_124m, stage3_max_reuse_distance=0) == []
    # Stage 2 keeps every block gathered by itself; there is nothing to choose.
    plan2 = resolve_plan({"zero_optimization": {"stage": 2}}, world_size=2)
    assert _kept_blocks(gpt2_124m, find_blocks(gpt2_124m), plan2) == set()


def test_prefetch_takes_units_while_below_the_budget():
    # DeepSpeed's prefetch loop takes the next parameter while what it has taken is below the bucket, so the last
    # one may cross it; whole units here, and a unit larger than the bucket on its own is never taken.
    def ahead(sizes: list[int], budget: int) -> list[int]:
        units = [nn.Identity() for _ in sizes]
        taken = _ahead(units, dict(zip(units, sizes, strict=True)), budget)
        return [sizes[units.index(u)] for u in taken]

    assert ahead([33, 33, 33], 50) == [33, 33]  # 33 < 50: the second is taken and crosses the budget
    assert ahead([30, 20, 5], 50) == [30, 20]  # 50 reached: nothing more
    assert ahead([10, 60, 5], 50) == [10]  # larger than the budget on its own: neither it nor what follows
    assert ahead([5, 5], 0) == []  # budget 0: prefetching off
