"""The HF Trainer with transformers-style DeepSpeed JSONs ("auto" everywhere, AdamW + WarmupLR / WarmupDecayLR):
the JSON's blocks act, "auto" filled from `TrainingArguments` as transformers fills them.

One process (scripts/hf_json_schedule.py through `python -m ds_plugin.accelerate`, in a subprocess with a timeout):
the learning rate the Trainer logs at every step equals the schedule on transformers' values (ds_plugin's schedule
classes, which tests/zero/test_config_optimizer.py holds to DeepSpeed 0.19.8's), and the engine's optimizer is the
JSON's AdamW with lr, betas, eps and weight decay from the arguments. A Trainer whose own linear schedule ran instead
would log other rates (it decays from the first step after warmup, without DeepSpeed's log warmup).
"""

from __future__ import annotations

import json
import sys

import pytest
from _accelerate_launch import REPO, SCRIPTS, clean_env, run

pytestmark = pytest.mark.slow

CONFIGS = [
    REPO / "tests" / "configs" / "hf_trainer_zero3_auto.json",
    REPO / "tests" / "configs" / "hf_ds_config_zero2_decay.json",
]


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("hf_sched") / "result.json"
    cmd = [sys.executable, "-m", "ds_plugin.accelerate", str(SCRIPTS / "hf_json_schedule.py"), "--configs",
           *map(str, CONFIGS), "--out", str(out)]  # fmt: skip
    proc = run(cmd, timeout=300, env=clean_env(), done_file=out)
    assert out.is_file(), proc.stdout[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize(("config", "scheduler"), [(CONFIGS[0].name, "WarmupLR"), (CONFIGS[1].name, "WarmupDecayLR")])
def test_trainer_logs_deepspeeds_schedule(result: dict, config: str, scheduler: str) -> None:
    r = result[config]
    assert r["scheduler"] == scheduler and r["optimizer"] == "AdamW"
    assert r["logged"] == pytest.approx(r["expected"], rel=1e-12, abs=0.0)
    assert len(set(r["logged"])) >= 4 and r["logged"][0] == 0.0  # DeepSpeed's log warmup starts at warmup_min_lr
    assert r["defaults"] == {"lr": 5e-3, "betas": [0.9, 0.98], "eps": 1e-8, "weight_decay": 0.01}
    assert r["losses"][-1] < r["losses"][0]
