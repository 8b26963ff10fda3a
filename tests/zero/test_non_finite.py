"""A non-finite gradient without fp16 loss scaling (bf16 / fp32): stop with the parameter's name, or skip the step.

One 2-rank spawn runs every case in `CASES`; each test checks one.
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch
from torch import nn

from ds_plugin.launch import run_ranks

pytestmark = pytest.mark.slow


def _worker(rank: int, world: int, policy: str, stage: int, clip: float) -> dict:
    torch.set_num_threads(1)
    from ds_plugin import initialize
    from tests.zero._tiny import full_params

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    cfg = {"zero_optimization": {"stage": stage}, "gradient_clipping": clip, "non_finite_gradients": policy}
    engine = initialize(model, cfg, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    g = torch.Generator().manual_seed(rank)
    out: dict = {"stepped": [], "changed": []}
    for step in range(4):
        x = torch.randn(4, 8, generator=g)
        loss = engine(x).pow(2).mean()
        if step == 1 and rank == world - 1:
            loss = loss * float("nan")  # one rank's data goes bad: every rank must take the same decision
        before = full_params(engine.module)
        engine.backward(loss)
        try:
            out["stepped"].append(engine.step())
        except FloatingPointError as e:
            out["error"] = str(e)
            out["untouched"] = all(torch.equal(before[n], v) for n, v in full_params(engine.module).items())
            break
        after = full_params(engine.module)
        out["changed"].append(any(not torch.equal(before[n], v) for n, v in after.items()))
    out["skipped"] = engine.skipped_steps
    return out


ERROR_CASES = [(3, 0.0), (1, 1.0)]  # (stage, gradient_clipping)
SKIP_CASES = [(3, 1.0), (0, 0.0)]
CASES = [("error", *c) for c in ERROR_CASES] + [("skip", *c) for c in SKIP_CASES]


def _all_cases(rank: int, world: int) -> dict[tuple, tuple[str, Any]]:
    import _break  # a fresh (spawned) process: DS_PLUGIN_TEST_NOOP_STEP must be applied here too

    _break.install()
    out = {}
    for case in CASES:
        try:
            out[case] = ("ok", _worker(rank, world, *case))
        except Exception:  # reported by the case's own test
            out[case] = ("error", traceback.format_exc())
    return out


@pytest.fixture(scope="module")
def spawned() -> list[dict]:
    return run_ranks(_all_cases, 2, timeout=300)


def results_of(spawned: list[dict], case: tuple) -> list[dict]:
    for rank, r in enumerate(spawned):
        if r[case][0] == "error":
            pytest.fail(f"rank {rank}, case {case}:\n{r[case][1]}", pytrace=False)
    return [r[case][1] for r in spawned]


@pytest.mark.parametrize(("stage", "clip"), ERROR_CASES)
def test_non_finite_gradient_stops_training_naming_the_parameter(spawned, stage, clip):
    results = results_of(spawned, ("error", stage, clip))
    for r in results:
        assert r["stepped"] == [True]  # the first step trained, the second stopped on every rank
        assert r["untouched"]
        assert "\n" not in r["error"] and "optimizer step 2: non-finite gradient, first in 0." in r["error"], r["error"]
        assert "non_finite_gradients" in r["error"]


@pytest.mark.parametrize(("stage", "clip"), SKIP_CASES)
def test_skip_policy_skips_the_step_on_every_rank_and_trains_on(spawned, stage, clip):
    results = results_of(spawned, ("skip", stage, clip))
    for r in results:
        assert r["stepped"] == [True, False, True, True]
        assert r["changed"] == [True, False, True, True]  # the bad step left the weights alone; the rest trained
        assert r["skipped"] == 1 and "error" not in r
