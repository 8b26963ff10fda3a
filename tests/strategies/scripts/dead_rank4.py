"""`Trainer(strategy="zero3")` on 4 CPU ranks whose rank 2 freezes (SIGSTOP) in the middle of a step of epoch 1,
after its forward and before its backward: a hung node, whose sockets stay open. The others must give up after the
collective timeout, set to 15 s through `DS_PLUGIN_TIMEOUT`, and rank 0 reports the error it got.

A frozen rank rather than a killed one: Lightning's launcher notices a child that *exits* and kills the whole job
itself within seconds, which races with rank 0 writing its report; a frozen child it cannot notice.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

import lightning.pytorch as pl
from _tiny_lightning import TinyMLP, fit_loader, rank, run, trainer
from lightning.pytorch.callbacks import ModelCheckpoint

os.environ.setdefault("DS_PLUGIN_TIMEOUT", "15")  # read by every rank (Lightning re-runs this script for them)


class FreezeRank2(pl.Callback):
    def on_before_backward(self, trainer: pl.Trainer, module: Any, loss: Any) -> None:
        if trainer.current_epoch == 1 and rank() == 2:
            # A frozen node's output is not the survivors' concern: let go of the shared pipe, so the test's reader
            # sees it close once the survivors are gone (the test kills this process afterwards).
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os.close(1)
            os.close(2)
            os.kill(os.getpid(), signal.SIGSTOP)


def main(args: argparse.Namespace) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    ckpt = ModelCheckpoint(dirpath=args.workdir / "ckpt", save_last=True, every_n_epochs=1)
    t = trainer("zero3", devices=4, max_epochs=3, callbacks=[FreezeRank2(), ckpt], enable_checkpointing=True)
    start = time.monotonic()
    try:
        t.fit(TinyMLP(), fit_loader(n=16, batch=2))
    except Exception as e:  # the survivors' error is what this test is about
        return {"error_type": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    return {"error": "rank 2 was meant to freeze in epoch 1, yet the fit finished"}


if __name__ == "__main__":
    run(main)
