"""`Fabric(strategy="zero1"/"zero3")` against `Fabric(strategy="ddp")` on 2 CPU ranks: per-step losses with
gradient accumulation through `no_backward_sync` and an LR scheduler passed to `setup`, also with
`fabric.clip_gradients` by norm and by value; then `fabric.save` at stage 3 and `fabric.load` into a stage-2 run,
which must restore weights, scheduler and plain entries. The data (`fit_loader`) is learnable and repeats at
every step, so a run that never steps shows in its losses.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as pl
import torch
from _tiny_lightning import fit_loader, max_diff, run
from lightning.fabric import Fabric

ACCUMULATE, STEPS = 2, 3
META_STEPS = 4
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
    # This rank's two batches of `fit_loader`, once per optimizer step: a run that never steps repeats its losses.
    batches = list(fabric.setup_dataloaders(fit_loader())) * STEPS
    for i, (x, y) in enumerate(batches):
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
    if clip == "norm":
        losses.append(norms)  # the pre-clipping norms, one per optimizer step
    return losses, fabric, model, opt, sched


def _meta_init() -> dict[str, Any]:
    """`fabric.init_module(empty_init=True)`, then `setup_module` + `setup_optimizers`: sharded initialisation.

    Then META_STEPS steps on one batch per rank, and the same steps in plain single-process torch from the same
    initial weights on both ranks' rows together (equal halves: the mean loss, hence the gradient, is the same).
    """
    fabric = Fabric(strategy="zero3", accelerator="cpu", devices=2)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = _model()
    meta = all(p.is_meta for p in model.parameters())
    model = fabric.setup_module(model)
    initial = fabric.strategy.full_state_dict()  # the weights as materialised, shard by shard (rank 0)
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-2))
    x, y = next(iter(fabric.setup_dataloaders(fit_loader())))
    losses = []
    for _ in range(META_STEPS):
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    weights = fabric.strategy.full_state_dict()
    both = fabric.all_gather(x).flatten(0, 1), fabric.all_gather(y).flatten(0, 1)
    return {
        "built_on_meta": meta,
        "losses": losses,
        "reference": _plain_torch(initial, *both) if initial else None,
        "weight_std": weights["0.0.weight"].std().item() if weights else None,
    }


def _plain_torch(initial: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> list[float]:
    model = _model()
    model.load_state_dict(initial)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    losses = []
    for _ in range(META_STEPS):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


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
        # An optimizer that never stepped has no state: 0 steps, for the test to report, not a KeyError here.
        optimizer_steps=[int(o.state_dict()["state"].get(0, {}).get("step", 0)) for o in (opt, opt2)],
        weights_diff=max_diff(saved, loaded) if saved else 0.0,
    )
    return out


if __name__ == "__main__":
    run(main)
