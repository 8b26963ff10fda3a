"""A rank that dies or hangs ends the job in minutes, with one clear error on every other rank.

torch's default collective timeout is 30 minutes. ds_plugin's is `DEFAULT_TIMEOUT` (10 minutes, or
`DS_PLUGIN_TIMEOUT` seconds from the environment): long enough for a slow first all-gather or a checkpoint written
by rank 0 alone while the others wait, short enough that a frozen node (its sockets stay open, so its peers see no
error, only silence) costs minutes, not half an hour. `init_distributed` (DeepSpeed's name) and the Lightning and
Fabric strategies use it; a process group created elsewhere keeps its own.

What the survivors see. A peer that is killed closes its sockets: gloo's next read on that pair fails at once
("Connection reset by peer"); a peer that hangs is noticed when the timeout expires ("Timed out waiting ...").
A rank may instead see the broken socket of a survivor that gave up first. From the engine's forward,
backward, step and checkpoint calls that surfaces as `RankFailureError`: the step, what was running, the original
first line, and how to resume, instead of a traceback from inside FSDP2's hooks. The process then exits as on any
error; nothing waits on the dead rank. (Tested on gloo. NCCL may notice neither before the timeout, when torch's
watchdog, at `TORCH_NCCL_ASYNC_ERROR_HANDLING`'s default, takes the process down itself: no Python error to translate.)

A rank that finished must not die at exit either: gloo's worker threads release a finished collective's tensors a
moment after the caller has gone on, and that needs the GIL; a thread that asks for it once the interpreter has
begun shutting down is killed mid-destructor, and the process aborts ("terminate called without an active
exception", exit status -6; seen after a checkpoint's last broadcast in about one run in three). `settle_at_exit`
(called when a ZeRO mesh is built on gloo) registers an exit handler that lets go of the GIL for a moment first.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import time
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_TIMEOUT",
    "RankFailureError",
    "default_timeout",
    "init_distributed",
    "peer_failure_guard",
    "settle_at_exit",
]

DEFAULT_TIMEOUT = timedelta(minutes=10)
TIMEOUT_ENV = "DS_PLUGIN_TIMEOUT"

# What a collective raises when a peer is gone: gloo's transport errors (a plain RuntimeError), NCCL's through
# DistBackendError (a RuntimeError) with the watchdog's timeout or a lost remote process, store/socket failures.
# Narrow on purpose: a size mismatch or an invalid argument reported by the same backends is a bug, and must keep
# its own message and traceback.
_PEER_FAILURE = re.compile(
    r"Connection (reset|closed) by peer|Timed out waiting|Application timeout caused pair closure|Broken pipe|"
    r"(Read|Write) error \[|Socket Timeout|"
    r"collective operation timeout|communicator was aborted|remote process exited|network error",
    re.IGNORECASE,
)


class RankFailureError(RuntimeError):
    """A collective failed because another rank died, hung or lost its network; the message is one line."""


def default_timeout() -> timedelta:
    """The collective timeout ds_plugin gives the process groups it creates: `DS_PLUGIN_TIMEOUT` seconds, else 10 min.

    Raises:
        ValueError: `DS_PLUGIN_TIMEOUT` is not a positive number of seconds.
    """
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or raw == "":
        return DEFAULT_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a positive number of seconds (e.g. 600)")
    return timedelta(seconds=seconds)


def init_distributed(
    backend: str | None = None, *, timeout: timedelta | float | None = None, init_method: str | None = None
) -> None:
    """DeepSpeed's `init_distributed`: join the process group a launcher (torchrun, Slurm via its env) describes.

    Does nothing when torch.distributed is already initialised. Without launcher variables (`RANK`,
    `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) it starts a one-process group.

    Args:
        backend: "nccl" on CUDA, "gloo" otherwise by default.
        timeout: how long a collective waits for a silent peer (a `timedelta` or seconds); default
            `default_timeout()`, 10 minutes unless `DS_PLUGIN_TIMEOUT` says otherwise.
        init_method: where the ranks meet, e.g. "file:///shared/store"; default the launcher's
            `MASTER_ADDR`/`MASTER_PORT`.
    """
    if dist.is_initialized():
        return
    if timeout is None:
        timeout = default_timeout()
    elif not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    if backend == "nccl" and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)


_SETTLE_SECONDS = 0.1
_settling = False


def settle_at_exit() -> None:
    """Once per process: at exit, sleep briefly (GIL released) so gloo's threads finish with their tensors."""
    global _settling
    if not _settling:
        _settling = True
        atexit.register(time.sleep, _SETTLE_SECONDS)


def is_peer_failure(exc: BaseException) -> bool:
    """Whether `exc` is a collective failing because of another rank (not a bug or a bad input on this one)."""
    if isinstance(exc, RankFailureError):
        return False  # already translated
    lost = tuple(getattr(dist, name) for name in ("DistNetworkError", "DistStoreError") if hasattr(dist, name))
    if lost and isinstance(exc, lost):
        return True
    return isinstance(exc, RuntimeError) and bool(_PEER_FAILURE.search(str(exc)))


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\.cc:\d+\]\s*", "", text)  # gloo's "[/path/to/pair.cc:537] " source prefix
    return text.split(". ")[0][:200]  # the cause, without gloo's generic advice that follows it


def _where() -> str:
    if not (dist.is_available() and dist.is_initialized()):
        return "this rank"
    return f"rank {dist.get_rank()} of {dist.get_world_size()}"


def _timeout_text() -> str:
    try:  # the world group's own timeout (set at init_process_group), not torch's default
        backend = dist.group.WORLD._get_backend(torch.device("cuda" if dist.get_backend() == "nccl" else "cpu"))
        return f"{backend.options._timeout.total_seconds():g} s"
    except Exception:  # private API: the message loses a detail, nothing else
        return "the process group's"


@contextlib.contextmanager
def peer_failure_guard(what: str, step: int | None = None, resume_hint: str | None = None) -> Iterator[None]:
    """Re-raise a collective failure caused by another rank as one-line `RankFailureError`; other errors pass.

    Args:
        what: what was running, e.g. "backward".
        step: the optimizer step it belonged to, for the message.
        resume_hint: how this framework resumes (default: the engine's `load_checkpoint`).
    """
    try:
        yield
    except Exception as exc:
        if not is_peer_failure(exc):
            raise
        at = f" at step {step}" if step is not None else ""
        hint = resume_hint or "engine.load_checkpoint(save_dir) resumes from the newest complete checkpoint"
        message = (
            f"{_where()}: {what}{at} failed because another rank died, hung or lost its network "
            f"({_first_line(exc)}; collective timeout {_timeout_text()}). Restart the job; {hint}"
        )
        raise RankFailureError(message) from None
