"""Plain Accelerate, the FSDP2-style order: `prepare(model)` first, the optimizer built on the prepared model's
parameters and prepared later with its scheduler and dataloader; fp16 (the engine's loss scaler), clipping by value.
Run through `python -m ds_plugin.accelerate --ds-config C` in one process; writes `--out` (JSON).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    accelerator = Accelerator(mixed_precision="fp16")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    x = torch.randn(64, 16)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8)
    model = accelerator.prepare(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9**step)
    optimizer, loader, scheduler = accelerator.prepare(optimizer, loader, scheduler)
    losses, skipped = [], 0
    for _ in range(3):
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb).float(), yb)
            accelerator.backward(loss)
            accelerator.clip_grad_value_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            skipped += accelerator.optimizer_step_was_skipped
            losses.append(loss.item())
    engine = accelerator.engine
    result = {
        "losses": losses,
        "skipped": skipped,
        "stage": engine.plan.stage,
        "compute": engine.plan.compute_dtype,
        "loss_scale": engine.loss_scaler.scale if engine.loss_scaler is not None else None,
        "global_steps": engine.global_steps,
        "lr": scheduler.get_last_lr()[0],
        "optimizer_lr": engine.optimizer.param_groups[0]["lr"],  # what the engine steps with
        "optimizer_is_engines": optimizer.optimizer is engine.optimizer,
    }
    Path(args.out).write_text(json.dumps(result))
    accelerator.end_training()


if __name__ == "__main__":
    main()
