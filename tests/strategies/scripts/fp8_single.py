"""`plugins=Fp8Precision()` with `ZeroStrategy` on one CPU rank: a model with eligible linears trains with FP8
layers swapped in (on `fit_loader`, which it can learn, next to the same steps in plain fp32 torch); a model without
any (features not multiples of 16) fails setup with one line.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import lightning.pytorch as pl
from _tiny_lightning import LossRecorder, TinyMLP, fit_loader, regression_loader, run, trainer

from ds_plugin.precision import fp8_all_gather_stats
from ds_plugin.precision.fp8_linear import Fp8Linear
from ds_plugin.strategies import Fp8Precision

STEPS = 12  # three epochs of fit_loader's four batches
# In order, as the plain torch reference takes them: Lightning would shuffle the training set through its own
# DistributedSampler, even for one device.
IN_ORDER = {"use_distributed_sampler": False}


def _plain_torch() -> list[float]:
    """The same steps in fp32 with plain torch: TinyMLP's own init (seed 0) and optimizer, the batches in order."""
    model = TinyMLP(width=16)
    opt = model.configure_optimizers()
    batches = list(fit_loader())
    losses = []
    for step in range(STEPS):
        loss = model.training_step(batches[step % len(batches)], step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main(args: argparse.Namespace) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    module = TinyMLP(width=16)
    recorder = LossRecorder()
    t = trainer("zero3", devices=1, max_steps=STEPS, plugins=Fp8Precision(), callbacks=[recorder], **IN_ORDER)
    t.fit(module, fit_loader())
    cfg = t.strategy.config
    out: dict[str, Any] = {
        "losses": recorder.losses,
        "finite": all(math.isfinite(x) for x in recorder.losses),
        "fp8_layers": sum(isinstance(m, Fp8Linear) for m in module.modules()),
        "fp8": {"enabled": cfg.fp8.enabled, "recipe": cfg.fp8.recipe},
        "compute_dtype": cfg.compute_dtype,
        "reference": _plain_torch(),
    }
    # The same run with the weights gathered as fp8 (a one-rank "gather" still takes the fp8 path).
    pl.seed_everything(0, verbose=False)
    gathered = LossRecorder()
    plugin = Fp8Precision(all_gather=True)
    gathered_module = TinyMLP(width=16)
    trainer("zero3", devices=1, max_steps=STEPS, plugins=plugin, callbacks=[gathered], **IN_ORDER).fit(
        gathered_module, fit_loader()
    )
    out["all_gather_losses"] = gathered.losses
    stats = [fp8_all_gather_stats(m) for m in gathered_module.modules()]
    out["fp8_gathers"] = sum(s.fp8_gathers for s in stats if s is not None)
    try:
        trainer("zero3", devices=1, max_steps=1, plugins=Fp8Precision()).fit(TinyMLP(width=10), regression_loader())
    except ValueError as e:
        out["no_eligible_error"] = str(e)
    return out


if __name__ == "__main__":
    run(main)
