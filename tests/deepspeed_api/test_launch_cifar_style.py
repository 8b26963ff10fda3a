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


UNCHANGED = """
import argparse
import torch
import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.adam import FusedAdam

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--runtime-utils", action="store_true")
args = deepspeed.add_config_arguments(parser).parse_args()
if args.runtime_utils:
    from deepspeed.runtime.utils import see_memory_usage
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
engine, *_ = deepspeed.initialize(args=args, model=model, optimizer=FusedAdam(model.parameters(), lr=1e-2))
x = torch.randn(64, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
for step in range(30):
    loss = torch.nn.functional.mse_loss(engine(x), x.sum(1, keepdim=True))
    engine.backward(loss)
    engine.step()
    if dist.get_rank() == 0 and step % 29 == 0:
        print(f"loss {loss.item():.4f} on {get_accelerator().device_name()} with {deepspeed.__name__}")
dist.barrier()
"""


def test_an_unchanged_import_deepspeed_script_runs_on_ds_plugin(tmp_path: Path) -> None:
    # Where DeepSpeed is not installed `import deepspeed` under `ds-plugin launch` is ds_plugin's API; this machine
    # has DeepSpeed (the config-key tests read its models), so the variable turns the alias on as it would be there.
    script, config = tmp_path / "train.py", tmp_path / "ds.json"
    script.write_text(UNCHANGED)
    config.write_text('{"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}}')
    launcher = [sys.executable, "-m", "ds_plugin.cli", "launch", "--num_gpus", "2", "--master_port", str(free_port())]
    cmd = [*launcher, str(script), "--deepspeed", "--deepspeed_config", str(config)]
    env = clean_env(DS_PLUGIN_DEEPSPEED_ALIAS="1")
    proc = run(cmd, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:]
    found = re.findall(r"loss ([0-9.]+) on cpu with ds_plugin\.deepspeed", proc.stdout)
    assert len(found) == 2 and float(found[1]) < float(found[0]) / 5, proc.stdout[-3000:]  # it trains
    # A DeepSpeed module ds_plugin does not cover: one line from each rank that reaches the import before the
    # launcher stops the others (the first rank to end does), no traceback.
    proc = run([*cmd, "--runtime-utils"], timeout=300, env=env)
    refused = [line for line in proc.stdout.splitlines() if line.startswith("ds_plugin: deepspeed.runtime is not")]
    assert proc.returncode != 0 and 1 <= len(refused) <= 2 and "Traceback" not in proc.stdout, proc.stdout[-3000:]
