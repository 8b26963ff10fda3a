"""SIGKILL a checkpoint save at a chosen phase: the crashing half of tests/checkpoint/test_checkpoint_faults.py.

    python crash_save.py ROOT SCENARIO [SCENARIO ...]                                  # one process, no dist
    python crash_save.py ROOT SCENARIO --rank R --world 2 --store FILE --kill-rank K   # one of two gloo ranks

A scenario is TARGET:PHASE. For each, the script saves checkpoint A (`make_state(0)`) to ROOT/<T-P>/ckpts/ck, then
saves B (`make_state(1)`) over it (`same`: overwrite=True) or beside it (`new`: ckpts/ck_new), and SIGKILLs itself
when that save reaches PHASE:

    shards    half-way through a shard file: its first item written and flushed, the next not
    metadata  every shard written, DCP's `.metadata` not yet
    marker    `.metadata` written, the marker half-written
    rename    the marker written, the directory not yet renamed (or exchanged) into place
    swap      `same` only, on the rename fallback (as without renameat2): A moved aside to `.ck.old-*`, B not renamed in
    swapped   `same` only: B exchanged into place, A (now under the temporary name) not yet removed; the file
              `exchanged` records that the exchange happened (a filesystem without it falls back instead)

The kill is injected by wrapping, here only, the function that runs at that phase: the library has no hooks. The
full values of A and B go to ref_A.pt / ref_B.pt beside ckpts/. Alone, the script saves and dies in one process;
with several scenarios each B-save runs in a forked child, so one interpreter start serves them all, and the parent
writes ROOT/result.json: {scenario: {"signal": N} or {"exit": N}} (a child exits 3 if the kill point never came).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: forked children must not inherit an OpenMP pool

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_fs

import ds_plugin.checkpoint.io as ckpt

PHASES = ("shards", "metadata", "marker", "rename", "swap", "swapped")


def make_state(seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A model and optimizer state: odd shapes (uneven shards at 2 ranks), a bf16 tensor, non-tensor values."""
    g = torch.Generator().manual_seed(seed)
    model = {
        "w": torch.randn(7, 5, generator=g),
        "emb": torch.randn(13, 3, generator=g).to(torch.bfloat16),
        "b": torch.randn(5, generator=g),
    }
    optim = {
        "state": {"w": {"exp_avg": torch.randn(7, 5, generator=g), "step": torch.tensor(float(seed + 1))}},
        "param_groups": [{"lr": 0.1 * (seed + 1), "betas": [0.9, 0.999], "params": ["w"]}],
    }
    return model, optim


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _inject(phase: str, workdir: Path) -> None:
    """Make this process SIGKILL itself when the save reaches `phase`."""
    ours = workdir.resolve()

    def in_ckpts(*paths: Any) -> bool:
        return any(Path(p).resolve().parent == ours for p in paths)

    if phase == "shards":
        write_item, calls = dcp_fs._write_item, []

        def torn(transforms: Any, stream: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            if len(calls) == 2:
                stream.flush()  # the first item reaches the file; the second never does
                _die()
            return write_item(transforms, stream, *args, **kwargs)

        dcp_fs._write_item = torn
    elif phase == "metadata":
        dcp_fs.FileSystemWriter.finish = lambda *a, **k: _die()
    elif phase == "marker":

        def half(obj: Any, fp: Any, **kwargs: Any) -> None:
            text = json.dumps(obj, **kwargs)
            fp.write(text[: len(text) // 2])
            fp.flush()
            _die()

        ckpt.json.dump = half  # the json module: patched in this doomed process only
    elif phase in ("rename", "swap"):
        replace = os.replace

        def guarded(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            # rename: the first rename of the save; swap: the one that would bring B in after A was moved aside.
            if in_ckpts(src, dst) and (phase == "rename" or Path(src).name.startswith(".ck.partial-")):
                _die()
            replace(src, dst, *args, **kwargs)

        ckpt.os.replace = guarded
        ckpt.exchange = (lambda a, b: _die()) if phase == "rename" else (lambda a, b: False)
    elif phase == "swapped":
        real_exchange = ckpt.exchange

        def then_die(a: Path, b: Path) -> bool:
            done = real_exchange(a, b)
            (workdir.parent / "exchanged").write_text(json.dumps(done))
            _die()
            return done

        ckpt.exchange = then_die


def _save(path: Path, seed: int, shard: Any = None, overwrite: bool = False) -> None:
    model, optim = make_state(seed)
    if shard is not None:
        model = {k: shard(v) if k != "b" else v for k, v in model.items()}
        optim["state"]["w"]["exp_avg"] = shard(optim["state"]["w"]["exp_avg"])
    ckpt.save_checkpoint(path, model_state=model, optimizer_state=optim, extra={"seed": seed}, overwrite=overwrite)


def _scenario(root: Path, scenario: str) -> tuple[Path, str, str]:
    target, _, phase = scenario.partition(":")
    if target not in ("same", "new") or phase not in PHASES or (target == "new" and phase in ("swap", "swapped")):
        raise SystemExit(f"crash_save.py: bad scenario {scenario!r}: TARGET:PHASE, TARGET same|new, PHASE {PHASES}")
    return root / f"{target}-{phase}", target, phase


def _save_a(workdir: Path, shard: Any = None) -> None:
    (workdir / "ckpts").mkdir(parents=True, exist_ok=True)
    if not dist.is_initialized() or dist.get_rank() == 0:
        for seed, name in ((0, "ref_A.pt"), (1, "ref_B.pt")):
            torch.save(make_state(seed), workdir / name)
    _save(workdir / "ckpts" / "ck", 0, shard)


def _crash(workdir: Path, target: str, phase: str, shard: Any = None, kill: bool = True) -> None:
    if kill:
        _inject(phase, workdir / "ckpts")
    name = "ck" if target == "same" else "ck_new"
    _save(workdir / "ckpts" / name, 1, shard, overwrite=target == "same")


def _single(root: Path, scenarios: list[str]) -> None:
    results = {}
    for scenario in scenarios:
        workdir, target, phase = _scenario(root, scenario)
        _save_a(workdir)
        pid = os.fork()
        if pid == 0:
            try:
                _crash(workdir, target, phase)
                code = 3  # the save finished: the kill point was never reached
            except BaseException:
                traceback.print_exc()
                code = 4
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        results[scenario] = (
            {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"exit": os.WEXITSTATUS(status)}
        )
    (root / "result.json").write_text(json.dumps(results, indent=1))


def _ranked(root: Path, scenario: str, rank: int, world: int, store: Path, kill_rank: int) -> None:
    from datetime import timedelta

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    mesh = init_device_mesh("cpu", (world,))
    workdir, target, phase = _scenario(root, scenario)
    shard = lambda t: distribute_tensor(t, mesh, [Shard(0)])  # noqa: E731
    _save_a(workdir, shard)
    dist.barrier()
    _crash(workdir, target, phase, shard, kill=rank == kill_rank)
    print(f"rank {rank}: the save finished: the kill point was never reached", file=sys.stderr)
    sys.exit(3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("scenarios", nargs="+")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--store", type=Path)
    parser.add_argument("--kill-rank", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.rank is None:
        _single(args.root, args.scenarios)
    else:
        _ranked(args.root, args.scenarios[0], args.rank, args.world, args.store, args.kill_rank)


if __name__ == "__main__":
    main()
