"""A tiny multi-process runner for the comms-logger and checkpoint tests (gloo, CPU, file rendezvous).

`run_ranks(fn, world_size, *args)` starts `world_size` spawned processes, each running
`fn(rank, world_size, *args)` inside an initialised gloo process group, and returns the per-rank results.
A failing rank fails the test at once with its traceback; a hang fails it after `timeout`; every process is
joined or killed before returning. A rank that reported its result and then dies at interpreter exit (the
SIGABRT torch sometimes raises at shutdown, see DESIGN.md) does not fail the test: its work is done.
"""

from __future__ import annotations

import datetime
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def _entry(fn: Callable[..., Any], rank: int, world_size: int, store: str, q: Any, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60)
    )
    try:
        result = fn(rank, world_size, *args)
    except BaseException:
        q.put((rank, False, traceback.format_exc()))
        q.close()
        q.join_thread()  # flush the traceback to the parent before the hard exit
        # Peers may be blocked in a collective with us; the parent kills them, so skip the barrier.
        os._exit(1)
    q.put((rank, True, result))
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks and return the results by rank.

    Args:
        fn: a module-level (picklable) function.
        world_size: number of processes.
        args: extra picklable arguments.
        timeout: seconds for the whole run before every rank is killed.
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    results: dict[int, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = f"file://{tmp}/store"
        old = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the children: two cores, up to four ranks
        try:
            procs = [
                ctx.Process(target=_entry, args=(fn, r, world_size, store, q, args), daemon=True)
                for r in range(world_size)
            ]
            for p in procs:
                p.start()
        finally:
            if old is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = old
        deadline = time.monotonic() + timeout
        dead_since: float | None = None
        try:
            while len(results) < world_size:
                try:
                    rank, ok, payload = q.get(timeout=0.5)
                except queue.Empty:
                    rank, ok, payload = None, True, None
                if rank is not None:
                    if not ok:
                        raise AssertionError(f"rank {rank} failed:\n{payload}")
                    results[rank] = payload
                    continue
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(results))} timed out")
                dead = [i for i, p in enumerate(procs) if p.exitcode is not None and i not in results]
                if dead:
                    # A dying rank's traceback may still be in flight: give it two seconds before blaming the exit code.
                    dead_since = dead_since or time.monotonic()
                    if time.monotonic() - dead_since > 2.0:
                        raise AssertionError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
            for p in procs:
                p.join(timeout=max(5.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
            q.close()
    return [results[r] for r in range(world_size)]
