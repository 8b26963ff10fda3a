"""One config through the three entry points on 2 CPU ranks: `ds_plugin.initialize`, `Trainer(strategy=ZeroStrategy)`
and `Fabric(strategy=ZeroFabricStrategy)` must resolve equal plans and train to equal losses (same model, same
batches per rank, bf16, ZeRO-3 with qwZ, clipping from the config).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from _tiny_lightning import LossRecorder, TinyMLP, regression_loader, trainer
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

import ds_plugin
from ds_plugin.strategies import ZeroFabricStrategy, ZeroStrategy

CONFIG = {
    "zero_optimization": {"stage": 3, "zero_quantized_weights": True},
    "bf16": {"enabled": True},
    "gradient_clipping": 0.5,
}
STEPS = 3


def _plan(plan: Any) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(plan).items() if k != "config"}


def _mean(loss: torch.Tensor) -> float:
    loss = loss.detach().float().clone()
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()


def _trainer(batches: list[list[torch.Tensor]]) -> tuple[dict[str, Any], list[float]]:
    pl.seed_everything(0, verbose=False)
    recorder = LossRecorder()
    t = trainer(
        ZeroStrategy(CONFIG),
        max_steps=STEPS,
        precision="bf16-mixed",
        callbacks=[recorder],
        use_distributed_sampler=False,
    )
    t.fit(TinyMLP(), DataLoader(batches, batch_size=None))  # this rank's batches, as Fabric's sampler cut them
    return _plan(t.strategy.engine.plan), recorder.losses


def _fabric() -> tuple[dict[str, Any], list[float], list[list[torch.Tensor]]]:
    fabric = Fabric(strategy=ZeroFabricStrategy(CONFIG), accelerator="cpu", devices=2, precision="bf16-mixed")
    fabric.launch()
    pl.seed_everything(0, verbose=False)
    model = TinyMLP()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-2))
    # Targets already bf16-exact: the Trainer hands the whole batch through FSDP2's input cast (targets too), while
    # Fabric and the engine cast only the model's input.
    batches = [[x, y.bfloat16().float()] for x, y in list(fabric.setup_dataloaders(regression_loader()))[:STEPS]]
    losses = []
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(_mean(loss))
    return _plan(fabric.strategy.engine.plan), losses, batches


def _initialize(batches: list[list[torch.Tensor]]) -> tuple[dict[str, Any], list[float]]:
    pl.seed_everything(0, verbose=False)
    model = TinyMLP()
    engine = ds_plugin.initialize(model, CONFIG, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-2))
    losses = []
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(_mean(loss))
    return _plan(engine.plan), losses


def main(args: argparse.Namespace) -> dict[str, Any]:
    plans, losses = {}, {}
    plans["fabric"], losses["fabric"], batches = _fabric()
    plans["initialize"], losses["initialize"] = _initialize(batches)
    plans["trainer"], losses["trainer"] = _trainer(batches)
    return {"plans": plans, "losses": losses}
