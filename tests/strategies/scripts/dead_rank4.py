"""`Trainer(strategy="zero3")` on 4 CPU ranks whose rank 2 freezes (`--die stop`: SIGSTOP, a hung node whose sockets
stay open) or is killed (`--die kill`: SIGKILL) in the middle of a step of epoch 1, after its forward and before its
backward. Every other rank must end its fit with the error it got, and writes it to `rank<N>.json` in `--workdir`.

Started by tests/strategies/test_lightning_dead_rank.py as 4 plain processes, as torchrun or Slurm would start them
(`LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` in each one's environment, so Lightning launches nothing): Lightning's own
launcher notices a child that exits and SIGKILLs the whole job within 5 s, racing with the survivors' reports (that
path, at 2 ranks, is the `killed` fixture of test_lightning_multiprocess.py). `DS_PLUGIN_TIMEOUT` (15 s for the
frozen rank) bounds the rendezvous as well as the collectives, so the ranks first wait for each other on files: a
slow import on a busy machine must not use up the rendezvous's 15 s.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from _tiny_lightning import TinyMLP, fit_loader, rank, trainer
from lightning.pytorch.callbacks import ModelCheckpoint

WORLD, DYING_RANK = 4, 2


class KillRank2(pl.Callback):
    def __init__(self, signum: int) -> None:
        self.signum = signum

    def on_before_backward(self, trainer: pl.Trainer, module: Any, loss: Any) -> None:
        if trainer.current_epoch == 1 and rank() == DYING_RANK:
            os.kill(os.getpid(), self.signum)


def wait_for_all(workdir: Path, timeout: float = 300.0) -> None:
    """A file barrier before the rendezvous: each rank has imported everything once all `ready<N>` files exist."""
    (workdir / f"ready{os.environ['LOCAL_RANK']}").touch()
    deadline = time.monotonic() + timeout
    while len(list(workdir.glob("ready*"))) < WORLD:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not all {WORLD} ranks started within {timeout} s")
        time.sleep(0.05)


def main(args: argparse.Namespace) -> None:
    pl.seed_everything(0, verbose=False)
    ckpt = ModelCheckpoint(dirpath=args.workdir / "ckpt", save_last=True, every_n_epochs=1)
    die = KillRank2(signal.SIGKILL if args.die == "kill" else signal.SIGSTOP)
    t = trainer("zero3", devices=WORLD, max_epochs=3, callbacks=[die, ckpt], enable_checkpointing=True)
    wait_for_all(args.workdir)
    start = time.monotonic()
    try:
        t.fit(TinyMLP(), fit_loader(n=16, batch=2))
        result = {"error": f"rank {DYING_RANK} was meant to die in epoch 1, yet the fit finished"}
    except Exception as e:  # the survivors' error is what this test is about
        result = {"error_type": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    report = args.workdir / f"rank{rank()}.json"
    report.with_suffix(".tmp").write_text(json.dumps(result))
    os.replace(report.with_suffix(".tmp"), report)  # whole or absent
    # No final barrier: a peer is dead or frozen. Destroying the group only frees this rank's side of it.
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--die", choices=["stop", "kill"], required=True)
    torch.set_num_threads(1)
    main(parser.parse_args())
