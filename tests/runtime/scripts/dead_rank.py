"""One rank of a ZeRO-3 engine run that checkpoints every 2 steps; rank 1 may die or freeze in the middle of a step.

Started once per rank by `tests/runtime/test_dead_rank.py` as plain processes (no launcher that would kill the
survivors for us): `RANK`/`WORLD_SIZE` in the environment, a FileStore rendezvous, `DS_PLUGIN_TIMEOUT` for the
collective timeout, all through `ds_plugin.runtime.faults.init_distributed`.

`--mode train --die kill|stop --die-at N`: rank 1 SIGKILLs (or SIGSTOPs: a frozen node whose sockets stay open)
itself after the forward of step N; the survivors must end on their own with `RankFailureError`.
`--mode resume`: restart from the newest complete checkpoint (data position from its client_state), finish, then
run the whole schedule again uninterrupted in the same processes and report whether the weights are bit-identical.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "zero"))  # tests/zero: the shared tiny models
from _tiny import SEQ, VOCAB, gpt2, quiet

from ds_plugin.peft_adapters import full_state_dict
from ds_plugin.runtime.faults import init_distributed
from ds_plugin.zero import initialize

ROWS, MICRO_BATCH, SAVE_EVERY = 24, 2, 2


def loader(world: int, rank: int) -> tuple[DataLoader, DistributedSampler]:
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=3, drop_last=True)
    return DataLoader(data, batch_size=MICRO_BATCH, sampler=sampler), sampler


def train(engine, steps: int, die: str | None = None, die_at: int = -1, position: dict | None = None, ckpt=None):
    world, rank = dist.get_world_size(), dist.get_rank()
    data, sampler = loader(world, rank)
    per_epoch = len(data)
    epoch, done_in_epoch = (position["epoch"], position["batches"]) if position else (0, 0)
    while engine.global_steps < steps:
        sampler.set_epoch(epoch)  # the sampler's shuffle for this epoch, then skip what the checkpoint consumed
        for batch in itertools.islice(data, done_in_epoch, None):
            loss = engine(input_ids=batch, labels=batch).loss
            if rank == 1 and engine.global_steps + 1 == die_at:
                os.kill(os.getpid(), signal.SIGKILL if die == "kill" else signal.SIGSTOP)
            engine.backward(loss)
            engine.step()
            done_in_epoch += 1
            if ckpt is not None and engine.global_steps % SAVE_EVERY == 0:
                position_now = {"epoch": epoch, "batches": done_in_epoch}
                if done_in_epoch == per_epoch:
                    position_now = {"epoch": epoch + 1, "batches": 0}
                engine.save_checkpoint(ckpt, client_state=position_now)
            if engine.global_steps == steps:
                return
        epoch, done_in_epoch = epoch + 1, 0


def new_engine():
    return initialize(gpt2(seed=0), {"zero_optimization": {"stage": 3}}, lambda p: torch.optim.AdamW(p, lr=1e-3))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["train", "resume"], required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--die", choices=["kill", "stop"])
    parser.add_argument("--die-at", type=int, default=5)
    args = parser.parse_args()
    quiet()
    torch.set_num_threads(1)
    init_distributed("gloo", init_method=f"file://{args.store}")
    rank = dist.get_rank()
    engine = new_engine()
    if args.mode == "train":
        train(engine, args.steps, args.die, args.die_at, ckpt=args.ckpt)
        raise SystemExit("rank 1 was meant to die")
    path, position = engine.load_checkpoint(args.ckpt)
    start = engine.global_steps
    train(engine, args.steps, position=position)
    resumed = full_state_dict(engine, engine.module)
    fresh = new_engine()
    train(fresh, args.steps)
    full = full_state_dict(fresh, fresh.module)
    initial = gpt2(seed=0).state_dict()
    if rank == 0:
        result = {
            "loaded": None if path is None else path.name,
            "position": position,
            "start_step": start,
            "steps": (engine.global_steps, fresh.global_steps),
            "bit_identical": all(torch.equal(resumed[k], full[k]) for k in full) and set(resumed) == set(full),
            "max_abs_diff": max((resumed[k] - full[k]).abs().max().item() for k in full),
            "changed": max((full[k] - initial[k]).abs().max().item() for k in full),
        }
        args.out.write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
