"""`ds-plugin launch --num_gpus 2` runs a DeepSpeedExamples-style CIFAR script on CPU, its import line the only change.

examples/with_deepspeed/cifar_style.py (argparse + `add_config_arguments`, `initialize(args=..., model=...,
model_parameters=..., training_data=...)`, `engine.local_rank` / `device`, `backward`, `step`, `save_checkpoint`)
with the JSON's Adam + WarmupLR at ZeRO-3: started as DeepSpeed's launcher starts it, in a subprocess with a timeout
(every process it started is killed at the end); its printed loss must fall by more than half and the checkpoint
must be there. A run whose optimizer never steps keeps the loss near ln(10) and fails.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "accelerate"))
from _accelerate_launch import REPO, clean_env, free_port, run

pytestmark = pytest.mark.slow

SCRIPT = REPO / "examples" / "with_deepspeed" / "cifar_style.py"
CONFIG = REPO / "examples" / "with_deepspeed" / "ds_config.json"


def test_cifar_style_script_learns_under_ds_plugin_launch(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    launcher = [sys.executable, "-m", "ds_plugin.cli", "launch", "--num_gpus", "2", "--master_port", str(free_port())]
    cmd = [*launcher, str(SCRIPT), "--deepspeed", "--deepspeed_config", str(CONFIG), "--epochs", "3"]
    cmd += ["--save-dir", str(save)]
    proc = run(cmd, timeout=300, env=clean_env())
    assert proc.returncode == 0, proc.stdout[-3000:]
    losses = [float(v) for v in re.findall(r"loss:\s+([0-9.]+)", proc.stdout)]
    assert len(losses) == 12, proc.stdout[-3000:]  # rank 0 only: 3 epochs x 4 reports
    assert losses[0] > 2.0 and losses[-1] < losses[0] / 2, losses
    assert proc.stdout.count("Finished Training") == 2  # both ranks
    assert (save / "latest").read_text().strip() == "global_step96"  # 3 epochs x 32 steps of 8 per rank
