"""Run a function on N gloo ranks, each its own process, and hand each rank's return value back (tests, benchmarks).

Ranks are forked from a forkserver (where the platform has one) that has imported the heavy modules the caller
already holds (torch, its FSDP2 and DCP packages, transformers' model code, ds_plugin's engine) once: a spawned rank
spends seconds of CPU importing them again (~9 s of wall time for a 2-rank launch on two cores), a forked one
nothing. Each rank still starts from the caller's current environment, as a spawned one would; modules that read an
environment variable at import time read the one the forkserver started with. `start_method="spawn"` gives every
rank a fresh interpreter (a benchmark that reports each rank's peak RSS, imports included, wants that).

Ranks rendezvous through a FileStore in a private directory (no port to race for when several test runs
share a machine), run one thread each (two cores host four ranks), and end with a barrier and
`destroy_process_group()`. Each rank writes its result (or its traceback) to a file; the parent waits with
one deadline, kills whatever is left and raises the first rank's error. A rank that exits abnormally *after*
handing back its result and shutting the group down (gloo ranks sometimes abort at interpreter exit with
"terminate called without an active exception") does not fail the test: the result is already complete.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = ["run_ranks"]

# What the forkserver imports once, of what the caller has already imported (a module the caller never needed is not
# added to every rank). The ones that cost seconds: torch itself, torch.distributed's tensor/FSDP2/DCP packages,
# transformers' model files, peft, Lightning.
_PRELOAD = (
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "ds_plugin.zero.setup",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
    "peft",
    "lightning.pytorch",
)


def _context(start_method: str) -> Any:
    if start_method == "spawn" or "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    if start_method != "forkserver":
        raise ValueError(f"run_ranks: start_method must be 'forkserver' or 'spawn', got {start_method!r}")
    ctx = multiprocessing.get_context("forkserver")
    # The server starts once per process, on first use; later calls reuse it (and its preload list).
    ctx.set_forkserver_preload([m for m in _PRELOAD if m in sys.modules])
    # OMP_NUM_THREADS is read once, when torch loads its OpenMP runtime in the server.
    with _start_environment(OMP_NUM_THREADS="1"):
        multiprocessing.forkserver.ensure_running()
    return ctx


@contextlib.contextmanager
def _start_environment(**overrides: str) -> Iterator[None]:
    """Environment for starting rank processes (or their forkserver): `overrides`, and glibc's per-thread malloc
    cache off (read only when a process starts; it fragments a CPU rank's heap, see `runtime.host_memory`)."""
    from ds_plugin.runtime.host_memory import rank_tunables  # here: `ds_plugin.runtime` imports torch

    overrides["GLIBC_TUNABLES"] = rank_tunables(os.environ.get("GLIBC_TUNABLES"))
    previous = {name: os.environ.get(name) for name in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    workdir: str,
    kwargs: dict[str, Any],
    caller_env: dict[str, str],
    env: dict[str, str],
) -> None:
    # The caller's environment now (a forked rank would otherwise have the forkserver's, from when it started).
    os.environ.clear()
    os.environ.update(caller_env)
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
    start_method: str = "forkserver",
    **kwargs: Any,
) -> list[Any]:
    """Call `fn(rank, world_size, **kwargs)` on `world_size` gloo ranks; return the results by rank.

    Args:
        fn: a module-level (picklable) function; it may return any picklable value (tensors: move to CPU).
        world_size: number of ranks.
        timeout: seconds for the whole run before every rank is killed.
        env: environment variables set in every rank, over the caller's, before `fn` runs (e.g. LOCAL_WORLD_SIZE
            to simulate nodes).
        start_method: "forkserver" (ranks forked from a server holding the heavy imports; "spawn" where the
            platform has no forkserver) or "spawn" (a fresh interpreter per rank).
        kwargs: passed to `fn`; must be picklable.
    """
    ctx = _context(start_method)
    caller_env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="ds_plugin_dist_") as workdir:
        procs = [
            ctx.Process(
                target=_worker, args=(fn, rank, world_size, workdir, kwargs, caller_env, dict(env or {})), daemon=True
            )
            for rank in range(world_size)
        ]
        with _start_environment():  # a spawned rank is a new process; a forked one has the server's settings
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
