"""`DummyOptim` / `DummyScheduler` mean the DeepSpeed JSON's optimizer and scheduler, "auto" filled as Accelerate does.

One process (scripts/dummy_optim.py, in a subprocess with a timeout): the JSON's AdamW + WarmupDecayLR with "auto"
params, filled from the placeholders, train exactly as a plain torch AdamW with ds_plugin's WarmupDecayLR; the
scheduler the script steps is the engine's (its `step()` does nothing, so the schedule advances once per step).
DeepSpeed is hidden from that process: ds_plugin's Accelerate adapter must import and train without it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _accelerate_launch import SCRIPTS, clean_env, run


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("dummy") / "result.json"
    proc = run([sys.executable, str(SCRIPTS / "dummy_optim.py"), "--out", str(out)], timeout=300, env=clean_env(),
               done_file=out)  # fmt: skip
    assert out.is_file(), proc.stdout[-3000:]
    return json.loads(Path(out).read_text())


def test_json_optimizer_and_schedule_train_like_torch(result: dict) -> None:
    assert result["lr"] == pytest.approx(result["reference_lr"], rel=1e-12, abs=0.0)
    assert len(set(result["lr"])) > 10 and max(result["lr"]) == pytest.approx(0.01)  # warmup_max_lr <- DummyOptim.lr
    assert result["max_diff"] <= 1e-6 and result["moved"] > 1e-3
    assert result["deepspeed_hidden"]  # ran as on a machine without DeepSpeed (accelerate.utils: no DummyOptim)
    assert result["engine_lr"] == pytest.approx([0.01 * 1 / 15])  # stepped once per step: at 19 (it starts at -1)


def test_dummy_optim_without_an_optimizer_block_is_one_line(result: dict) -> None:
    msg = result["errors"]["no_optimizer_block"]
    assert "\n" not in msg and "no optimizer block" in msg and '"optimizer"' in msg


def test_json_accumulation_and_micro_batch_rules(result: dict) -> None:
    assert result["json_accumulation"] == [4, 4]
    msg = result["errors"]["micro_batch"]
    assert "\n" not in msg and "train_micro_batch_size_per_gpu: the config says 8" in msg and "gives 4" in msg
