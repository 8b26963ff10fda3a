"""Run a function on N gloo ranks in fresh processes and hand each rank's return value back (tests, benchmarks).

Ranks rendezvous through a FileStore in a private directory (no port to race for when several test runs
share a machine), run one thread each (two cores host four ranks), and end with a barrier and
`destroy_process_group()`. Each rank writes its result (or its traceback) to a file; the parent waits with
one deadline, kills whatever is left and raises the first rank's error. A rank that exits abnormally *after*
handing back its result and shutting the group down (gloo ranks sometimes abort at interpreter exit with
"terminate called without an active exception") does not fail the test: the result is already complete.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = ["run_ranks"]


def _worker(
    fn: Callable[..., Any], rank: int, world_size: int, workdir: str, kwargs: dict[str, Any], env: dict[str, str]
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = Path(workdir)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{out / 'store'}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=120),
        )
        result = fn(rank, world_size, **kwargs)
        dist.barrier()
        dist.destroy_process_group()
        (out / f"rank{rank}.tmp").write_bytes(pickle.dumps(("ok", result)))
    except BaseException:
        (out / f"rank{rank}.tmp").write_bytes(pickle.dumps(("error", traceback.format_exc())))
    # Rename last so the parent never reads half a file.
    os.replace(out / f"rank{rank}.tmp", out / f"rank{rank}.pkl")


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    timeout: float = 180.0,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Call `fn(rank, world_size, **kwargs)` on `world_size` gloo ranks; return the results by rank.

    Args:
        fn: a module-level (picklable) function; it may return any picklable value (tensors: move to CPU).
        world_size: number of ranks.
        timeout: seconds for the whole run before every rank is killed.
        env: environment variables set in every rank before `fn` runs (e.g. LOCAL_WORLD_SIZE to simulate nodes).
        kwargs: passed to `fn`; must be picklable.
    """
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="ds_plugin_dist_") as workdir:
        procs = [
            ctx.Process(target=_worker, args=(fn, rank, world_size, workdir, kwargs, dict(env or {})), daemon=True)
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        results: dict[int, tuple[str, Any]] = {}

        def collect() -> None:
            for rank in range(world_size):
                path = Path(workdir) / f"rank{rank}.pkl"
                if rank not in results and path.exists():
                    results[rank] = pickle.loads(path.read_bytes())

        try:
            while time.monotonic() < deadline:
                collect()
                if len(results) == world_size or any(kind == "error" for kind, _ in results.values()):
                    break  # done, or one rank failed and the others would wait for it until the gloo timeout
                if any(procs[r].exitcode is not None for r in range(world_size) if r not in results):
                    time.sleep(0.5)  # a rank that just exited may still be renaming its file
                    collect()
                    if any(procs[r].exitcode is not None for r in range(world_size) if r not in results):
                        break
                time.sleep(0.05)
            if len(results) == world_size:
                for p in procs:  # let finished ranks exit on their own; stragglers are killed below
                    p.join(timeout=max(0.1, min(15.0, deadline - time.monotonic())))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        errors = [(r, v) for r, (kind, v) in sorted(results.items()) if kind == "error"]
        if errors:
            rank, tb = errors[0]
            raise RuntimeError(f"rank {rank} of {world_size} failed:\n{tb}")
        missing = [r for r in range(world_size) if r not in results]
        if missing:
            codes = {r: procs[r].exitcode for r in missing}
            raise RuntimeError(
                f"ranks {missing} of {world_size} returned nothing (exit codes {codes}; timeout {timeout}s)"
            )
        return [results[r][1] for r in range(world_size)]
