"""FP16 with injected inf/nan gradients at stages 1, 2, 3 on 2 ranks: every injected step is skipped on every
rank, the weights do not move across it, and training continues to a loss close to a clean run's."""

from __future__ import annotations

import math

import pytest
import torch
from _dist import run_ranks
from _tiny import batch, full_params, gpt2, make_optimizer, quiet, zero_config

pytestmark = [pytest.mark.slow, pytest.mark.long]  # minutes of CPU on 2 cores: the `long` tier

STEPS = 20
INJECT = {5: math.inf, 11: math.nan}  # step -> value written into one gradient element on rank 0 only


def _worker(rank: int, world: int) -> dict:
    quiet()
    from ds_plugin.zero.setup import initialize

    out = {}
    for stage in (1, 2, 3):
        for injected in (False, True):
            engine = initialize(gpt2(), zero_config(stage, dtype="fp16"), make_optimizer("adamw"))
            losses, stepped, moved = [], [], []
            for step in range(STEPS):
                x = batch(step, rank, world)
                loss = engine(input_ids=x, labels=x).loss
                # The inf/nan enters during backward, where every stage reduces (stages 0/1 launch their bucket
                # reductions from backward hooks, as FSDP2 does at 2/3): rank 0's gradients turn non-finite.
                poisoned = injected and step in INJECT and rank == 0
                engine.backward(loss * INJECT[step] if poisoned else loss)
                before = full_params(engine.module) if injected and step in INJECT else None
                stepped.append(bool(engine.step()))
                if before is not None:
                    after = full_params(engine.module)
                    moved.append(any(not torch.equal(before[k], after[k]) for k in before))
                losses.append(loss.item())
            out[stage, injected] = {
                "loss": losses,
                "stepped": stepped,
                "moved": moved,
                "scale": engine.loss_scaler.scale,
            }
    return out


@pytest.mark.timeout(600)
def test_injected_overflows_are_skipped_everywhere():
    results = run_ranks(_worker, 2, timeout=550)
    for stage in (1, 2, 3):
        for rank, r in enumerate(results):
            poisoned = r[stage, True]
            for step in range(STEPS):
                # Only rank 0 was poisoned, yet both ranks skip exactly the injected steps.
                assert poisoned["stepped"][step] == (step not in INJECT), (stage, rank, step)
            assert poisoned["moved"] == [False] * len(INJECT), (stage, rank)
            clean = r[stage, False]
            assert all(clean["stepped"])
            # Training went on: the final loss is within 2% of the clean run's.
            final = lambda run: sum(run["loss"][-5:]) / 5  # noqa: E731
            assert abs(final(poisoned) - final(clean)) / final(clean) < 0.02, (stage, rank)
