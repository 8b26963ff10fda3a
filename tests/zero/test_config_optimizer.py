"""The DeepSpeed JSON's `optimizer` and `scheduler` blocks act, with DeepSpeed 0.19.8's numbers.

DeepSpeed's own scheduler classes (`deepspeed.runtime.lr_schedules`) give the reference learning rates; they run in a
subprocess (as in tests/test_config_keys.py) so that importing DeepSpeed cannot touch this process or the ranks.
One 2-rank spawn trains every case of `CASES` for 50 steps through `ds_plugin.initialize` with only the JSON, at
ZeRO stages 0-3, and records the learning rate of every step and the final weights. The tests then demand:
- the learning rate used at every step equals DeepSpeed's scheduler on the same config;
- the weights equal a plain single-process torch loop (the same torch optimizer, the whole batch, the same
  learning rates) within 1e-6;
- an optimizer passed in code wins over the JSON's, and the JSON's scheduler drives it (DeepSpeed's rule).
A run whose optimizer never steps fails the weight check (the reference moves); one whose scheduler never steps
fails the learning-rate check.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from _dist import run_ranks
from torch import nn

from ds_plugin.config import ConfigError, from_deepspeed
from ds_plugin.lr_schedules import SCHEDULERS
from ds_plugin.optimizer_config import build_optimizer, build_scheduler, fill_auto

STEPS = 50
WORLD = 2
TOL = 1e-6

ADAMW = {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1}}
# name -> (zero stage, optimizer block, scheduler block or None)
CASES: dict[str, tuple[int, dict[str, Any], dict[str, Any] | None]] = {
    "warmup_lr": (
        3,
        ADAMW,
        {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_num_steps": 20}},
    ),
    "warmup_decay_lr": (
        2,
        ADAMW,
        {
            "type": "WarmupDecayLR",
            "params": {"total_num_steps": 50, "warmup_max_lr": 0.02, "warmup_num_steps": 10, "warmup_type": "linear"},
        },
    ),
    "warmup_cosine_lr": (
        1,
        ADAMW,
        {
            "type": "WarmupCosineLR",
            "params": {"total_num_steps": 50, "warmup_num_steps": 10, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01},
        },
    ),
    "one_cycle": (
        3,
        ADAMW,
        {
            "type": "OneCycle",
            "params": {
                "cycle_min_lr": 0.001,
                "cycle_max_lr": 0.01,
                "cycle_first_step_size": 15,
                "cycle_second_step_size": 20,
                "decay_lr_rate": 0.5,
                "decay_step_size": 5,
                "cycle_min_mom": 0.85,
                "cycle_max_mom": 0.95,
                "decay_mom_rate": 0.01,
            },
        },
    ),
    "lr_range_test": (
        0,
        {"type": "SGD", "params": {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.01}},
        {
            "type": "LRRangeTest",
            "params": {
                "lr_range_test_min_lr": 0.001,
                "lr_range_test_step_size": 7,
                "lr_range_test_step_rate": 0.5,
                "lr_range_test_staircase": True,
            },
        },
    ),
    # "Adam" means decoupled weight decay (torch's AdamW) unless adam_w_mode is false.
    "adam": (3, {"type": "Adam", "params": {"lr": 0.005, "weight_decay": 0.1}}, None),
    "adam_l2": (2, {"type": "Adam", "params": {"lr": 0.005, "weight_decay": 0.1, "adam_w_mode": False}}, None),
    "adamw": (1, {"type": "AdamW", "params": {"lr": 0.005, "weight_decay": 0.1, "torch_adam": True}}, None),
    "adagrad": (3, {"type": "Adagrad", "params": {"lr": 0.05, "weight_decay": 0.01}}, None),
}
REFERENCE_CLASS = {
    "adam": torch.optim.AdamW,
    "adam_l2": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "adagrad": torch.optim.Adagrad,
    "lr_range_test": torch.optim.SGD,
}
# Schedules checked against DeepSpeed in this process too (no engine): the corners of each formula.
EXTRA_SCHEDULES = {
    "warmup_lr_log_default": {"type": "WarmupLR", "params": {"warmup_num_steps": 1}},
    "warmup_decay_log": {"type": "WarmupDecayLR", "params": {"total_num_steps": 30, "warmup_num_steps": 12}},
    "cosine_linear_short": {
        "type": "WarmupCosineLR",
        "params": {"total_num_steps": 8, "warmup_num_steps": 3, "warmup_type": "linear"},
    },
    "one_cycle_stairs": {
        "type": "OneCycle",
        "params": {
            "cycle_min_lr": 0.1,
            "cycle_max_lr": 1.0,
            "cycle_first_step_size": 10,
            "cycle_first_stair_count": 3,
            "cycle_second_stair_count": 4,
        },
    },
    "range_continuous": {
        "type": "LRRangeTest",
        "params": {"lr_range_test_min_lr": 0.002, "lr_range_test_step_size": 3},
    },
}

# Prints one line "LRS <json>": per schedule, the learning rate (and betas) after construction and after each step.
_PROBE = r"""
import json, os, sys
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import logging
logging.disable(logging.WARNING)
import torch
from deepspeed.runtime import lr_schedules
cases, steps = json.loads(sys.argv[1]), int(sys.argv[2])
out = {}
for name, (lr, sched) in cases.items():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=lr, weight_decay=0.0)
    s = getattr(lr_schedules, sched["type"])(opt, **sched["params"])
    lrs, betas = [], []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        betas.append(list(opt.param_groups[0]["betas"]))
        s.step()
    out[name] = {"lr": lrs, "betas": betas}
print("LRS " + json.dumps(out))
"""


def _schedules() -> dict[str, tuple[float, dict[str, Any]]]:
    cases = {name: (opt["params"]["lr"], sched) for name, (_, opt, sched) in CASES.items() if sched is not None}
    cases.update({name: (0.01, sched) for name, sched in EXTRA_SCHEDULES.items()})
    return cases


@pytest.fixture(scope="module")
def deepspeed_lrs() -> dict[str, dict[str, list]]:
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (the dev extra installs deepspeed==0.19.8)")
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    run = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(_schedules()), str(STEPS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(ln for ln in run.stdout.splitlines() if ln.startswith("LRS "))
    return json.loads(line[len("LRS ") :])


# ---------------------------------------------------------------------------------------------------------- ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(WORLD * 4, 8, generator=g), torch.randn(WORLD * 4, 4, generator=g)


def _train(rank: int, world: int) -> dict[str, Any]:
    import ds_plugin
    from ds_plugin.zero.setup import initialize

    out: dict[str, Any] = {}
    for name, (stage, opt, sched) in CASES.items():
        config = {"zero_optimization": {"stage": stage}, "optimizer": opt}
        if sched is not None:
            config["scheduler"] = sched
        engine = ds_plugin.initialize(_model(), config)
        lrs, betas = [], []
        for step in range(STEPS):
            x, y = _batch(step)
            x, y = x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]
            lrs.append(engine.get_lr()[0])
            betas.append(list(engine.optimizer.param_groups[0].get("betas", ())))
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
        full = {}
        for key, p in engine.module.named_parameters():
            full[key] = p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()
        out[name] = {"lr": lrs, "betas": betas, "params": full, "optimizer": type(engine.optimizer).__name__}
    # An optimizer passed in code wins; the JSON's scheduler is built on it.
    _, opt, sched = CASES["warmup_lr"]
    engine = initialize(_model(), {"optimizer": opt, "scheduler": sched}, lambda p: torch.optim.SGD(p, lr=0.5))
    out["code_wins"] = {
        "optimizer": type(engine.optimizer).__name__,
        "scheduler": type(engine.lr_scheduler).__name__,
        "lr": engine.get_lr()[0],
    }
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_train, WORLD, timeout=400)


def _reference(name: str, lrs: list[float], betas: list[list[float]]) -> dict[str, torch.Tensor]:
    """A plain torch loop: one process, the whole batch, the JSON's optimizer as torch's class, DeepSpeed's rates."""
    _, opt_block, _ = CASES[name]
    model = _model()
    kwargs = {k: v for k, v in opt_block["params"].items() if k not in ("adam_w_mode", "torch_adam")}
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    cls = REFERENCE_CLASS.get(name, torch.optim.AdamW)
    if cls in (torch.optim.Adam, torch.optim.AdamW):
        kwargs.setdefault("weight_decay", 0.0)  # DeepSpeed's Adam default, not torch AdamW's 0.01
    opt = cls(model.parameters(), **kwargs)
    for step in range(STEPS):
        opt.param_groups[0]["lr"] = lrs[step]
        if betas[step]:
            opt.param_groups[0]["betas"] = tuple(betas[step])
        x, y = _batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # DeepSpeed's default gradient_clipping
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: p.detach() for k, p in model.named_parameters()}


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[2] is not None])
def test_learning_rate_of_every_step_equals_deepspeed(ranks, deepspeed_lrs, name):
    expected = deepspeed_lrs[name]["lr"]
    for result in ranks:
        got = result[name]["lr"]
        assert len(got) == STEPS
        assert got == pytest.approx(expected, rel=1e-12, abs=0.0), name
    assert len(set(expected)) > 3, "the schedule must change the learning rate"
    if name == "one_cycle":
        got_betas = [b for pair in ranks[0][name]["betas"] for b in pair]
        assert got_betas == pytest.approx([b for pair in deepspeed_lrs[name]["betas"] for b in pair], rel=1e-12)


@pytest.mark.parametrize("name", list(CASES))
def test_weights_equal_a_plain_torch_loop(ranks, deepspeed_lrs, name):
    result = ranks[0][name]
    if CASES[name][2] is not None:
        lrs, betas = deepspeed_lrs[name]["lr"], deepspeed_lrs[name]["betas"]
    else:
        lrs, betas = [CASES[name][1]["params"]["lr"]] * STEPS, [[]] * STEPS
    if REFERENCE_CLASS.get(name) in (torch.optim.SGD, torch.optim.Adagrad):
        betas = [[]] * STEPS
    reference = _reference(name, lrs, betas)
    start = {k: p.detach() for k, p in _model().named_parameters()}
    assert result["optimizer"] == REFERENCE_CLASS.get(name, torch.optim.AdamW).__name__
    for key, want in reference.items():
        got = result["params"][key]
        assert torch.allclose(got, want, rtol=0, atol=TOL), (name, key, float((got - want).abs().max()))
        assert not torch.equal(want, start[key]), "the reference must move"
    assert all(torch.equal(ranks[1][name]["params"][k], result["params"][k]) for k in reference)


def test_an_optimizer_passed_in_code_wins(ranks, deepspeed_lrs):
    got = ranks[0]["code_wins"]
    assert got["optimizer"] == "SGD" and got["scheduler"] == "WarmupLR"
    assert got["lr"] == deepspeed_lrs["warmup_lr"]["lr"][0] == 0.0  # the schedule, not SGD's 0.5


# ---------------------------------------------------------------------------------------------------- one process


@pytest.mark.parametrize("name", list(EXTRA_SCHEDULES))
def test_schedule_corners_equal_deepspeed(deepspeed_lrs, name):
    block = from_deepspeed({"scheduler": EXTRA_SCHEDULES[name]}).scheduler
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=0.01, weight_decay=0.0)
    sched = build_scheduler(block, opt)
    lrs = []
    for _ in range(STEPS):
        lrs.append(opt.param_groups[0]["lr"])
        sched.step()
    assert lrs == pytest.approx(deepspeed_lrs[name]["lr"], rel=1e-12, abs=0.0)
    assert type(sched) is SCHEDULERS[EXTRA_SCHEDULES[name]["type"]]


@pytest.mark.parametrize(
    ("block", "words"),
    [
        ({"optimizer": {"type": "OneBitAdam"}}, ['optimizer.type: "OneBitAdam"', 'use "Adam"']),
        ({"optimizer": {"type": "ZeroOneAdam"}}, ['"ZeroOneAdam"', 'use "Adam"']),
        ({"optimizer": {"type": "OneBitLamb"}}, ['"OneBitLamb"', 'use "AdamW"']),
        ({"optimizer": {"type": "Lamb"}}, ['"Lamb"', 'use "AdamW"']),
        ({"optimizer": {"type": "Lion"}}, ['"Lion"', 'use "AdamW"']),
        ({"optimizer": {"type": "AdamW", "params": {"lrr": 1}}}, ["optimizer.params.lrr", "'lr'"]),
        ({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1}}}, ["gradient_clipping"]),
        ({"optimizer": {"type": "AdamW", "params": {"lr": -1}}}, ["optimizer.params", "learning rate"]),
        ({"optimizer": {"type": "sgd"}}, ["optimizer.type", "'SGD'"]),
        ({"optimizer": {"params": {"lr": 1}}}, ["optimizer.type: missing"]),
        ({"scheduler": {"type": "WarmupLr"}}, ["scheduler.type", "'WarmupLR'"]),
        ({"scheduler": {"type": "WarmupDecayLR"}}, ["scheduler.params.total_num_steps"]),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}, ["warmup_num_steps"]),
    ],
)
def test_bad_blocks_fail_in_one_line_when_read(block, words):
    with pytest.raises(ConfigError) as err:
        from_deepspeed(block)
    msg = str(err.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_auto_is_filled_like_accelerate_and_refused_when_nobody_fills_it():
    cfg = from_deepspeed(
        {
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": [0.9, 0.95]}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_max_lr": "auto"}},
        }
    )
    with pytest.raises(ConfigError, match=r'optimizer.params.lr: "auto" is not resolved'):
        build_optimizer(cfg.optimizer, [nn.Parameter(torch.zeros(1))])
    values = {"optimizer.params.lr": 3e-4, "optimizer.params.weight_decay": 0.0, "scheduler.params.total_num_steps": 9}
    opt, sched = fill_auto(cfg.optimizer, cfg.scheduler, {**values, "scheduler.params.warmup_max_lr": 3e-4})
    assert opt.params == {"lr": 3e-4, "weight_decay": 0.0, "betas": [0.9, 0.95]}
    assert sched.params == {"total_num_steps": 9, "warmup_max_lr": 3e-4}
    built = build_optimizer(opt, [nn.Parameter(torch.zeros(1))])
    assert type(built) is torch.optim.AdamW and built.defaults["betas"] == (0.9, 0.95)
    assert math.isclose(built.defaults["eps"], 1e-8)
    # Written back unchanged, and only written when present.
    assert from_deepspeed(cfg.to_deepspeed()) == cfg
    assert "optimizer" not in from_deepspeed({}).to_deepspeed()
