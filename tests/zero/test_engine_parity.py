"""Numerics of ZeRO stages 0-3 against plain DDP on gloo at world sizes 1, 2 and 4 (1 and 4 in the `long` tier).

One spawn per world size trains everything (the process start, not the steps, is what costs on two cores);
the tests then check the recorded numbers:

- per-step losses of every stage (and hpZ at 4 ranks) equal DDP's over 15 steps of a tiny GPT-2 and a tiny Llama
  on a batch they can fit (`learnable_batch`), where DDP's loss must fall by more than a nat: fp32 within 1e-5
  relative, bf16 within 2**-8;
- 2 accumulation micro-steps equal one step on the concatenated batch, with no gradient communication
  before the last micro-step, and the weights moved;
- gradient clipping by the global norm across shards equals `clip_grad_norm_` on the DDP model.

Every engine's output layer computes its logits and its weight's gradient in column blocks (config
`blocked_logits`), as a wide vocabulary does on CPU: blocks are made 32 columns narrow so the 128-word vocabulary
spans four, and the first-call measurement is pinned to blocks.

A run whose optimizer never steps fails these (`DS_PLUGIN_TEST_NOOP_STEP=1`, see tests/_break.py).
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks
from _tiny import BATCH, MODELS, SEQ, full_params, max_rel, quiet, train_ddp, train_engine, zero_config
from torch import nn

pytestmark = pytest.mark.slow

STEPS = 15
STAGES = (0, 1, 2, 3)
BF16_STAGES = (1, 2, 3)
LR = 1e-3  # make_optimizer's default
CYCLE = 16  # tokens the learnable batch uses, of the 128 in the vocabulary
# The learnable batch repeats every step, so a run that never steps repeats its first loss exactly; one that learns
# only which 16 of the 128 tokens occur already gains ln(128 / 16) = 2.1 nats. Demand half of that in 15 steps.
MIN_FALL = 1.0
# bf16 keeps 8 significant bits: one rounding moves a value by at most 2**-9 of it. The loss is an average over the
# batch's 62 predicted tokens, so rounding the weights and activations to bf16 keeps it within one bf16 spacing
# (2**-8 relative) of the fp32 loss; updates lost to bf16 rounding (no fp32 master: a 1e-3 step on a weight near 1
# is under half its spacing, 2**-8) or a step that did not happen change it by a good part of the fall instead.
BF16_REL = 2**-8


def learnable_batch(rank: int, world: int, per_rank: int = BATCH) -> torch.Tensor:
    """This rank's rows of one fixed global batch a tiny LM can fit in a few steps.

    Every row walks one fixed cycle through 16 of the 128 tokens from its own starting point (distinct across
    rows, so every rank sees different tokens): each token has one successor.
    """
    cycle = torch.randperm(CYCLE, generator=torch.Generator().manual_seed(7))
    starts = torch.randperm(CYCLE, generator=torch.Generator().manual_seed(8))[: world * per_rank, None]
    tokens = cycle[(starts + torch.arange(SEQ)) % CYCLE]
    return tokens[rank * per_rank : (rank + 1) * per_rank]


def _fit_ddp(model: nn.Module, rank: int, world: int) -> list[float]:
    """Plain DistributedDataParallel + AdamW on `learnable_batch`: the reference every run is compared with."""
    from _tiny import make_optimizer

    ddp = nn.parallel.DistributedDataParallel(model)
    opt = make_optimizer("adamw", LR)(ddp.parameters())
    x = learnable_batch(rank, world)
    losses = []
    for _ in range(STEPS):
        loss = ddp(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _fit_engine(engine, rank: int, world: int) -> list[float]:
    x = learnable_batch(rank, world)
    losses = []
    for _ in range(STEPS):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _max_moved(module: nn.Module, initial: dict[str, torch.Tensor]) -> float:
    now = full_params(module)
    return max((now[k] - initial[k]).abs().max().item() for k in initial)


def _parity_worker(rank: int, world: int) -> dict:
    import _break  # a fresh (spawned) process: the no-op step switch must be applied here too

    _break.install()
    quiet()
    from _tiny import make_optimizer

    from ds_plugin.zero.setup import initialize

    out: dict = {"blocked_logits": _blocks_everywhere()}
    for name, build in MODELS.items():
        out["ddp", name] = _fit_ddp(build(), rank, world)
        runs = [(s, "fp32", {}) for s in STAGES] + [(s, "bf16", {}) for s in BF16_STAGES]
        if world == 4:
            runs.append((3, "fp32", {"zero_hpz_partition_size": 2}))
        for stage, dtype, zero in runs:
            engine = initialize(build(), zero_config(stage, dtype=dtype, **zero), make_optimizer("adamw", LR))
            key = ("hpz", name) if zero else (name, stage, dtype)
            out[key] = _fit_engine(engine, rank, world)
    _accumulation(rank, world, out)
    _clipping(rank, world, out)
    return out


def _blocks_everywhere() -> list[str]:
    """Switch the tiny models' 128-column output layers to blocks of 32, always taken; the passes that took them."""
    from ds_plugin.kernels import blocked_logits

    blocked_logits.BLOCK_COLUMNS, blocked_logits.MIN_COLUMNS = 32, 64
    taken: list[str] = []
    blocked_logits._faster_in_blocks = lambda key, whole, blocks: taken.append(key[0]) is None
    return taken


def _accumulation(rank: int, world: int, out: dict) -> None:
    from _tiny import batch, gpt2, make_optimizer

    from ds_plugin.zero.setup import initialize

    initial = full_params(gpt2())  # every engine starts from these weights (seed 0)
    for stage in STAGES:
        whole = initialize(gpt2(), zero_config(stage), make_optimizer("adamw"))
        split = initialize(gpt2(), zero_config(stage, gas=2), make_optimizer("adamw"))
        a = train_engine(whole, rank, world, 3, per_rank=4)["loss"]
        b = train_engine(split, rank, world, 3, per_rank=4)["loss"]
        pa, pb = full_params(whole.module), full_params(split.module)
        diff = max((pa[k] - pb[k]).abs().max().item() for k in pa)
        # After a first micro-step nothing may have reached the master/sharded gradients: no communication.
        probe = initialize(gpt2(), zero_config(stage, gas=2), make_optimizer("adamw"))
        x = batch(0, rank, world)
        probe.backward(probe(input_ids=x, labels=x).loss)
        silent = all(p.grad is None for p in probe.trainable_parameters())
        moved = _max_moved(whole.module, initial)
        out["accum", stage] = {"whole": a, "split": b, "param_diff": diff, "silent": silent, "moved": moved}


def _clipping(rank: int, world: int, out: dict) -> None:
    from _tiny import gpt2, make_optimizer

    from ds_plugin.zero.setup import initialize

    clip = 0.05
    initial = full_params(gpt2())
    out["clip", "ddp"] = train_ddp(gpt2(), rank, world, 5, clip=clip)
    for stage in STAGES:
        engine = initialize(gpt2(), zero_config(stage, clip=clip), make_optimizer("adamw"))
        out["clip", stage] = train_engine(engine, rank, world, 5)
        out["clip", stage]["moved"] = _max_moved(engine.module, initial)
    # A script that clips itself before step() (Accelerate's clip_grad_norm_ with the config's "auto" clipping of
    # 1.0): the step clips again only to a tighter norm. SGD, whose steps scale with the gradient, so a clip left
    # out shows in the losses.
    import ds_plugin.zero.engine as engine_module

    out["clip", "ddp_sgd"] = train_ddp(gpt2(), rank, world, 5, clip=clip, optim="sgd")
    real, calls = engine_module.clip_grad_norm_, []
    engine_module.clip_grad_norm_ = lambda params, max_norm, **kw: (
        calls.append(max_norm) or real(params, max_norm, **kw)
    )
    try:
        for name, first, in_step in (("tight_first", clip, 1.0), ("loose_first", 10.0, clip)):
            engine = initialize(gpt2(), zero_config(2, clip=in_step), make_optimizer("sgd"))
            calls.clear()
            out["clip", name] = {**train_engine(engine, rank, world, 5, clip_first=first), "calls": list(calls)}
    finally:
        engine_module.clip_grad_norm_ = real


# World 2 runs in every bare `pytest`; 1 (no sharding) and 4 (hpZ's only world, the costliest spawn) in the `long`
# tier.
LONG = pytest.mark.long


@pytest.fixture(
    scope="module", params=[pytest.param(1, marks=LONG), 2, pytest.param(4, marks=LONG)], ids=lambda w: f"world{w}"
)
def parity(request) -> tuple[int, list[dict]]:
    world = request.param
    return world, run_ranks(_parity_worker, world, timeout=400)


def assert_learns(losses: list[float], what: str) -> None:
    """The loss on the repeated learnable batch fell by MIN_FALL nats: the optimizer stepped, and usefully."""
    assert losses[-1] < losses[0] - MIN_FALL, (
        f"{what} did not learn the learnable batch: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps"
    )


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("stage", STAGES)
def test_fp32_losses_match_ddp(parity, model, stage):
    _, results = parity
    for rank, r in enumerate(results):
        assert_learns(r["ddp", model], f"rank {rank}: DDP {model}")  # equal to a reference that learns
        # fp32 throughout: only the order of the reductions differs from DDP's.
        rel = max_rel(r[model, stage, "fp32"], r["ddp", model])
        assert rel < 1e-5, f"rank {rank}: stage {stage} {model} fp32 differs from DDP by {rel:.2e} relative"


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("stage", BF16_STAGES)
def test_bf16_losses_match_ddp(parity, model, stage):
    _, results = parity
    for rank, r in enumerate(results):
        losses = r[model, stage, "bf16"]
        assert all(torch.isfinite(torch.tensor(losses)))
        assert_learns(losses, f"rank {rank}: stage {stage} {model} bf16")
        rel = max_rel(losses, r["ddp", model])
        assert rel < BF16_REL, f"rank {rank}: stage {stage} {model} bf16 differs from fp32 DDP by {rel:.2e}"


@pytest.mark.parametrize("model", sorted(MODELS))
def test_hpz_losses_match_ddp(parity, model):
    world, results = parity
    if world != 4:
        pytest.skip("hpZ needs a secondary group smaller than the world (k=2 of 4 ranks)")
    for r in results:
        assert_learns(r["ddp", model], f"DDP {model}")
        assert max_rel(r["hpz", model], r["ddp", model]) < 1e-5


def test_engines_computed_logits_in_blocks(parity):
    world, results = parity
    engines = len(MODELS) * (len(STAGES) + len(BF16_STAGES) + (world == 4))
    for r in results:
        taken = r["blocked_logits"]
        # Every training step of every engine above (and of the accumulation and clipping runs after them).
        assert taken.count("forward") >= engines * STEPS and taken.count("weight_grad") >= engines * STEPS, taken


def test_ranks_see_different_data(parity):
    world, results = parity
    if world == 1:
        pytest.skip("one rank")
    first = [r["ddp", "gpt2"][0] for r in results]
    assert len(set(first)) == world  # the batch is sharded, so each rank's first loss differs


@pytest.mark.parametrize("stage", STAGES)
def test_accumulation_equals_concatenated_batch(parity, stage):
    _, results = parity
    for r in results:
        acc = r["accum", stage]
        assert acc["silent"], "a non-final micro-step reduced gradients"
        # AdamW's first step moves every weight that has a gradient by lr * g / (|g| + eps), about lr = 1e-3.
        assert acc["moved"] > LR / 2, f"the weights did not move ({acc['moved']:.2e}): no optimizer step"
        assert max_rel(acc["split"], acc["whole"]) < 1e-5
        assert acc["param_diff"] < 1e-5


def test_a_scripts_own_clip_is_repeated_by_the_step_only_when_tighter(parity):
    _, results = parity
    for r in results:
        ref, tight, loose = r["clip", "ddp_sgd"], r["clip", "tight_first"], r["clip", "loose_first"]
        assert min(ref["norm"]) > 0.05 * 2, "the threshold must actually clip"
        # Clipped to 0.05 by the script: the step's 1.0 is not applied again (one clip per step, the script's).
        assert tight["calls"] == [0.05] * 5
        # Clipped to 10 by the script: the step still clips to its 0.05.
        assert loose["calls"] == [10.0, 0.05] * 5
        for run in (tight, loose):  # both are DDP clipped to 0.05, norms (before clipping) included
            assert max_rel(run["loss"], ref["loss"]) < 1e-5
            assert max_rel(run["norm"], ref["norm"]) < 1e-5


@pytest.mark.parametrize("stage", STAGES)
def test_clipping_equals_clip_grad_norm(parity, stage):
    _, results = parity
    for r in results:
        ref, got = r["clip", "ddp"], r["clip", stage]
        assert min(ref["norm"]) > 0.05 * 2, "the threshold must actually clip"
        # AdamW is blind to the gradient's scale, so even clipped steps move weights by about lr = 1e-3.
        assert got["moved"] > LR / 2, f"the weights did not move ({got['moved']:.2e}): no optimizer step"
        assert max_rel(got["norm"], ref["norm"]) < 1e-5
        assert max_rel(got["loss"], ref["loss"]) < 1e-5
