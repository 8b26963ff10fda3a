"""Checkpointing through the Trainer with `ZeroStrategy`, on 2 CPU ranks.

`--mode kill`: a zero3 fit with `ModelCheckpoint(save_last=True)` whose rank 1 SIGKILLs itself in the middle of
the first step of its third epoch; rank 0 must then end on its own with `RankFailureError`; `last.ckpt` (a DCP
directory) holds the end of epoch two.
`--mode resume --killed DIR`: (1) the same fit uninterrupted; (2) `fit(ckpt_path="last")` from the killed run,
which must end with the same weights and global step; (3) `trainer.save_checkpoint(...)` of the result (the
pytest side runs `ds-plugin export` on it) and `validate(ckpt_path=...)` of it under zero1 (another stage);
(4) zero1 resumed in-process from a 2-epoch run against an uninterrupted 3-epoch run.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from _tiny_lightning import CausalLM, LossRecorder, full_weights, hf_model, max_diff, rank, run, token_loader, trainer
from lightning.pytorch.callbacks import ModelCheckpoint

EPOCHS = 3


class KillAtEpoch(pl.Callback):
    """Rank 1 alone SIGKILLs itself in the middle of the first step of `epoch`: after the forward of the step's
    second micro-batch, before its backward (a crash of one process, which rank 0 must notice by itself). The
    second micro-batch's backward reduces the step's gradients, so rank 0 is then inside a collective of the
    engine's. (In the first micro-batch's backward rank 0 may communicate nothing at all: no gradient sync while
    accumulating, and stage 3 keeps this small model's blocks gathered from forward to backward.)"""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.batch_idx = -1

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        self.batch_idx = batch_idx

    def on_before_backward(self, trainer: pl.Trainer, module: Any, loss: Any) -> None:
        if trainer.current_epoch == self.epoch and self.batch_idx == 1 and rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)


def _fit(strategy: str, ckpt_dir: Path | None, epochs: int, ckpt_path: str | None = None, callbacks=()):
    pl.seed_everything(0, verbose=False)
    module = CausalLM(hf_model("gpt2", seed=0))
    recorder = LossRecorder()
    cbs = [*callbacks, recorder]
    if ckpt_dir is not None:
        cbs.append(ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_epochs=1))
    t = trainer(strategy, max_epochs=epochs, accumulate_grad_batches=2, callbacks=cbs,
                enable_checkpointing=ckpt_dir is not None)  # fmt: skip
    t.fit(module, token_loader(n=16), ckpt_path=ckpt_path)
    t.batches_run = recorder.batches
    return t, module


def kill(args: argparse.Namespace) -> dict[str, Any]:
    _fit("zero3", args.workdir / "ckpt", EPOCHS, callbacks=[KillAtEpoch(2)])
    return {"error": "the run was meant to be killed at epoch 2"}


def resume(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    t, module = _fit("zero3", None, EPOCHS)
    full, out["full_step"] = full_weights(t, module.model), t.global_step
    out["full_batches"], out["full_lr"] = t.batches_run, t.optimizers[0].param_groups[0]["lr"]
    t, module = _fit("zero3", args.killed / "ckpt", EPOCHS, ckpt_path="last")
    resumed, out["resumed_step"] = full_weights(t, module.model), t.global_step
    out["resumed_engine_steps"] = t.strategy.engine.global_steps
    out["resumed_batches"] = t.batches_run
    out["resumed_lr"] = t.optimizers[0].param_groups[0]["lr"]
    final = args.workdir / "final.ckpt"
    t.save_checkpoint(final)
    out["final_ckpt"] = str(final)
    out["ckpt_files"] = sorted(p.name for p in (args.killed / "ckpt").iterdir())

    pl.seed_everything(0, verbose=False)
    other = CausalLM(hf_model("gpt2", seed=1))
    v = trainer("zero1")
    out["validate"] = v.validate(other, token_loader(n=8), ckpt_path=str(final), verbose=False)
    cross = full_weights(v, other.model)

    t1, m1 = _fit("zero1", args.workdir / "z1", EPOCHS - 1)
    t1, m1 = _fit("zero1", args.workdir / "z1", EPOCHS, ckpt_path="last")
    z1_resumed, out["zero1_resumed_batches"] = full_weights(t1, m1.model), t1.batches_run
    t1, m1 = _fit("zero1", None, EPOCHS)
    z1_full = full_weights(t1, m1.model)
    if rank() == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in resumed.items()}, str(args.workdir / "resumed.safetensors"))
        out.update(
            resume_diff=max_diff(full, resumed),
            changed=max_diff(full, dict(hf_model("gpt2", seed=0).state_dict())),
            cross_stage_diff=max_diff(resumed, cross),
            zero1_resume_diff=max_diff(z1_full, z1_resumed),
        )
    return out


def _args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=("kill", "resume"), default="resume")
    parser.add_argument("--killed", type=Path)


def main(args: argparse.Namespace) -> dict[str, Any]:
    return kill(args) if args.mode == "kill" else resume(args)


if __name__ == "__main__":
    run(main, _args)
