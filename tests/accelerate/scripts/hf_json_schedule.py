"""The HF Trainer with a transformers-style DeepSpeed JSON ("auto" everywhere, AdamW + WarmupLR / WarmupDecayLR
blocks) on one process, through `python -m ds_plugin.accelerate`: records the learning rate the Trainer logs at every
step, the optimizer the engine built, and ds_plugin's own schedule on the values transformers fills (held to
DeepSpeed 0.19.8's by tests/zero/test_config_optimizer.py). Writes --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from hf_trainers import Sequences, llama

from ds_plugin.lr_schedules import SCHEDULERS

STEPS = 10
WARMUP = 4
LR = 5e-3


def run(config_path: str, workdir: str) -> dict:
    from transformers import Trainer, TrainingArguments

    config = json.loads(Path(config_path).read_text())
    args = TrainingArguments(output_dir=workdir, per_device_train_batch_size=2, learning_rate=LR, max_steps=STEPS,
                             warmup_steps=WARMUP, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             seed=0, adam_beta2=0.98, weight_decay=0.01, deepspeed=config,
                             disable_tqdm=True)  # fmt: skip
    trainer = Trainer(model=llama(), args=args, train_dataset=Sequences())
    trainer.train()
    logged = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    engine = trainer.accelerator.engine
    opt = engine.optimizer

    # The reference: the schedule on transformers' fill of the "auto" params, stepped once per optimizer step.
    block = dict(config["scheduler"]["params"])
    fill = {"warmup_min_lr": 0, "warmup_max_lr": LR, "warmup_num_steps": WARMUP, "total_num_steps": STEPS}
    params = {k: fill[k] if v == "auto" else v for k, v in block.items()}
    ref_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched = SCHEDULERS[config["scheduler"]["type"]](ref_opt, **params)
    expected = []
    for _ in range(STEPS):
        sched.step()
        expected.append(ref_opt.param_groups[0]["lr"])
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"logged": logged, "expected": expected, "optimizer": type(opt).__name__, "defaults": {
        "lr": opt.defaults["lr"], "betas": list(opt.defaults["betas"]), "eps": opt.defaults["eps"],
        "weight_decay": opt.defaults["weight_decay"]}, "scheduler": type(engine.lr_scheduler).__name__,
        "losses": losses}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", nargs="+", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {}
    for path in args.configs:
        with tempfile.TemporaryDirectory() as workdir:
            result[Path(path).name] = run(path, workdir)
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
