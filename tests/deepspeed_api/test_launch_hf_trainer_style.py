"""`ds-plugin launch` runs an HF Trainer script started the DeepSpeed way (`run_clm.py --deepspeed ds_config.json`)
on the engine, unchanged, and leaves the same script without `--deepspeed` to plain Accelerate, as DeepSpeed's
launcher would.

examples/with_deepspeed/hf_trainer_style.py (HfArgumentParser, a small Llama, `Trainer.train`, `save_model`) with
transformers' ZeRO-2 template ("auto" everywhere, its AdamW and WarmupLR blocks), 2 CPU ranks, each launch in a
subprocess with a timeout. Checked: which Accelerator the Trainer built, the plan ds_plugin logged, the logged loss
falling (a run whose optimizer never steps stays near ln(256) = 5.5 and fails), the saved model reloading with
`from_pretrained` to a loss below the first one logged, and a config ds_plugin refuses ending each rank in one line
(and the launcher in one more, not torchrun's error report).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "accelerate"))
from _accelerate_launch import REPO, clean_env, free_port, run

pytestmark = pytest.mark.slow

SCRIPT = REPO / "examples" / "with_deepspeed" / "hf_trainer_style.py"
CONFIG = REPO / "examples" / "with_deepspeed" / "hf_ds_config_zero2.json"
TRAINING = ["--use_cpu", "--max_steps", "20", "--logging_steps", "4", "--learning_rate", "3e-3",
            "--per_device_train_batch_size", "4", "--report_to", "none", "--save_strategy", "no"]  # fmt: skip


def start(out: Path, *extra: str):
    launcher = [sys.executable, "-m", "ds_plugin.cli", "launch", "--num_gpus", "2", "--master_port", str(free_port())]
    return run([*launcher, str(SCRIPT), "--output_dir", str(out), *TRAINING, *extra], timeout=300, env=clean_env())


def launch(out: Path, *extra: str) -> tuple[str, list[float]]:
    proc = start(out, *extra)
    assert proc.returncode == 0, proc.stdout[-3000:]
    losses = [float(v) for v in re.findall(r"'loss': '([0-9.]+)'", proc.stdout)]
    assert len(losses) == 5, proc.stdout[-3000:]  # rank 0 logs every 4th of 20 steps
    return proc.stdout, losses


def test_hf_trainer_script_with_deepspeed_argument_trains_on_the_engine(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    out, losses = launch(tmp_path / "zero2", "--deepspeed", str(CONFIG))
    assert "accelerator: ds_plugin.accelerate.accelerator" in out, out[-3000:]
    assert "ZeRO stage 2 on 2 ranks" in out and "AdamW steps with torch's fused kernel" in out, out[-3000:]
    assert losses[0] > 5.0 and losses[-1] < losses[0] - 1.5, losses
    model = LlamaForCausalLM.from_pretrained(tmp_path / "zero2")  # rank 0's save_model: the trained weights
    ids = torch.tensor([list((REPO / "examples" / "data" / "tiny_corpus.txt").read_bytes()[:32])])
    with torch.no_grad():
        assert model(input_ids=ids, labels=ids).loss.item() < losses[0] - 1.0

    out, losses = launch(tmp_path / "plain")  # no --deepspeed: the launcher leaves the Trainer alone
    assert "accelerator: accelerate.accelerator" in out and "[ds_plugin]" not in out, out[-3000:]
    assert losses[-1] < losses[0], losses

    # A config ds_plugin refuses: one line, before any process group, from each rank that reads the config before the
    # launcher stops the others (the first rank to end does: on a busy machine the other may not have got there).
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": {"stage": 7}}')
    proc = start(tmp_path / "bad", "--deepspeed", str(bad))
    assert proc.returncode != 0 and "Traceback" not in proc.stdout, proc.stdout[-3000:]
    refused = [line for line in proc.stdout.splitlines() if line.startswith("ds_plugin: ")]
    assert 1 <= len(refused) <= 2 and len(set(refused)) == 1, proc.stdout[-3000:]
    assert "zero_optimization.stage" in refused[0], proc.stdout[-3000:]
    # Whichever rank ended first, the launcher names it in one line.
    assert re.search(r"^ds-plugin launch: rank (\d) \(local rank \1\) ended with exit code 1, ", proc.stdout, re.M), (
        proc.stdout[-3000:]
    )
