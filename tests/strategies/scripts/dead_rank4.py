"""`Trainer(strategy="zero3")` on 4 CPU ranks whose rank 2 SIGKILLs itself in the middle of a step of epoch 1
(after its forward, before its backward). The surviving ranks must end on their own: rank 0 reports the error it
got, and each survivor's exit is judged by the test from the processes' output.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Any

import lightning.pytorch as pl
from _tiny_lightning import TinyMLP, fit_loader, rank, run, trainer
from lightning.pytorch.callbacks import ModelCheckpoint


class KillRank2(pl.Callback):
    def on_before_backward(self, trainer: pl.Trainer, module: Any, loss: Any) -> None:
        if trainer.current_epoch == 1 and rank() == 2:
            os.kill(os.getpid(), signal.SIGKILL)


def main(args: argparse.Namespace) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    ckpt = ModelCheckpoint(dirpath=args.workdir / "ckpt", save_last=True, every_n_epochs=1)
    t = trainer("zero3", devices=4, max_epochs=3, callbacks=[KillRank2(), ckpt], enable_checkpointing=True)
    start = time.monotonic()
    try:
        t.fit(TinyMLP(), fit_loader(n=16, batch=2))
    except Exception as e:  # the survivors' error is what this test is about
        return {"error_type": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    return {"error": "rank 2 was meant to die in epoch 1, yet the fit finished"}


if __name__ == "__main__":
    run(main)
