"""`Fabric(strategy="zero1"/"zero3")` against `Fabric(strategy="ddp")` on 2 CPU ranks: per-step losses with
gradient accumulation through `no_backward_sync` and an LR scheduler passed to `setup`, also with
`fabric.clip_gradients` by norm and by value; then `fabric.save` at stage 3 and `fabric.load` into a stage-2 run,
which must restore weights, scheduler and plain entries.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as pl
import torch
from _tiny_lightning import max_diff, regression_loader, run
from lightning.fabric import Fabric

ACCUMULATE, STEPS = 2, 3
# Small enough that both clip: the gradients' global norm here is ~0.3-1, and most elements exceed 0.01.
CLIP = {"norm": {"max_norm": 0.05}, "value": {"clip_val": 0.01}}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(3)]
    return torch.nn.Sequential(*layers, torch.nn.Linear(16, 1))


def _setup(strategy: str) -> tuple[Fabric, Any, Any, Any]:
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2)
    fabric.launch()
    pl.seed_everything(0, verbose=False)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 2))
    model, opt, sched = fabric.setup(model, opt, scheduler=sched)
    return fabric, model, opt, sched


def _train(strategy: str, clip: str | None = None) -> tuple[list[float], Fabric, Any, Any, Any]:
    fabric, model, opt, sched = _setup(strategy)
    losses, norms = [], []
    for i, (x, y) in enumerate(fabric.setup_dataloaders(regression_loader(n=64))):
        accumulating = (i + 1) % ACCUMULATE != 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            loss = torch.nn.functional.mse_loss(model(x), y)
            fabric.backward(loss / ACCUMULATE)
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
        if not accumulating:
            if clip is not None:
                norm = fabric.clip_gradients(model, opt, **CLIP[clip])
                norms.append(None if norm is None else float(norm))
            opt.step()
            sched.step()
            opt.zero_grad()
        if len(losses) == ACCUMULATE * STEPS:
            break
    if clip == "norm":
        losses.append(norms)  # the pre-clipping norms, one per optimizer step
    return losses, fabric, model, opt, sched


def _meta_init() -> dict[str, Any]:
    """`fabric.init_module(empty_init=True)`, then `setup_module` + `setup_optimizers`: sharded initialisation."""
    fabric = Fabric(strategy="zero3", accelerator="cpu", devices=2)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = _model()
    meta = all(p.is_meta for p in model.parameters())
    model = fabric.setup_module(model)
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-2))
    losses = []
    for x, y in list(fabric.setup_dataloaders(regression_loader()))[:2]:
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    weights = fabric.strategy.full_state_dict()
    return {
        "built_on_meta": meta,
        "losses": losses,
        "weight_std": weights["0.0.weight"].std().item() if weights else None,
    }


def main(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"losses": {}}
    for strategy in ("ddp", "zero1", "zero3"):
        out["losses"][strategy], fabric, model, opt, sched = _train(strategy)
    out["engine_steps"] = [fabric.strategy.engine.global_steps, fabric.strategy.engine.micro_steps]
    for clip, strategies in (("norm", ("ddp", "zero1", "zero3")), ("value", ("ddp", "zero3"))):
        out[f"clip_{clip}"] = {strategy: _train(strategy, clip)[0] for strategy in strategies}
    saved = fabric.strategy.full_state_dict()
    path = args.workdir / "fabric_ckpt"
    fabric.save(path, {"model": model, "optimizer": opt, "scheduler": sched, "step": 6, "note": "hello"})

    out["meta_init"] = _meta_init()

    fabric2, model2, opt2, sched2 = _setup("zero2")
    state = {"model": model2, "optimizer": opt2, "scheduler": sched2, "step": 0}
    remainder = fabric2.load(path, state)
    loaded = fabric2.strategy.full_state_dict()
    out.update(
        step=state["step"],
        remainder=remainder,
        scheduler_epoch=[sched.last_epoch, sched2.last_epoch],
        lr=[opt.param_groups[0]["lr"], opt2.param_groups[0]["lr"]],
        optimizer_steps=[
            int(opt.state_dict()["state"][0]["step"]),
            int(opt2.state_dict()["state"][0]["step"]),
        ],
        weights_diff=max_diff(saved, loaded) if saved else 0.0,
    )
    return out


if __name__ == "__main__":
    run(main)
