"""Keep freed host memory inside the process for reuse, so CPU training stops page-faulting every step.

glibc's malloc serves every block over its mmap threshold (32 MiB at most) with a fresh ``mmap`` and returns it
with ``munmap`` on free. A ZeRO step on CPU allocates and frees the same large buffers every step (gathered
weights, gradients, the reduce-scatter input, communication buffers), so each step the kernel maps, zeroes and
faults in those pages again: on ``ds-plugin bench slow-link``'s 67M-parameter model that was ~300k page faults,
about 0.45 s of kernel time, per rank per step, most of the step's CPU time. This is what a caching allocator
avoids on GPUs.

:func:`reuse_freed_host_memory` tells glibc (``mallopt``) to serve large blocks from its heap and not to hand
freed heap memory back to the kernel, so later steps reuse pages that are already mapped. The process's
resident memory then stays at its peak between steps instead of dropping back, as with a GPU caching allocator.
It is process-wide and cannot be undone; the engine applies it when it trains on CPU, unless the config sets
``host_memory_reuse`` to false. On other C libraries it does nothing and says why.

:func:`release_freed_host_memory` is the opposite, for runs whose limit is memory rather than page faults (a
checkpoint bigger than one rank's share of RAM): ``host_memory_reuse: false`` on CPU. By default glibc raises its
mmap threshold to the largest block freed so far (up to 32 MiB), after which blocks below it come from the heap,
where freed ones stay resident between live ones: a ZeRO-3 step that gathers and frees each block's weights in turn
then keeps gigabytes of dead heap. A fixed 1 MiB threshold maps every large block on its own and unmaps it when
freed, so the resident memory is what is live.

With reuse on, glibc's per-thread cache (tcache) fragments the heap: it keeps recently freed small chunks (up to 7
per size class) marked as in use, scattered between the large blocks, so a freed large block cannot merge with its
neighbours and the next large request grows the heap instead. On a 16M GPT-2 ZeRO-3 step whose loss temporaries are
98 MiB each, ranks peaked 0.22-0.44 GB above what was live; with the cache off, 0.07 GB (step time within the noise).
The cache can only be turned off when a process starts (the ``GLIBC_TUNABLES`` environment variable), so it is the
launchers' job: :func:`rank_tunables` gives the value for CPU ranks (``ds-plugin launch`` and
``ds_plugin.launch.run_ranks`` set it) and :func:`thread_cache_on` tells a running process whether it got it.
"""

from __future__ import annotations

import ctypes
import logging
import platform

__all__ = [
    "THREAD_CACHE_OFF",
    "host_memory_reuse_state",
    "rank_tunables",
    "release_freed_host_memory",
    "reuse_freed_host_memory",
    "thread_cache_on",
    "warn_thread_cache",
]

logger = logging.getLogger(__name__)

# mallopt parameters from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
# release_freed_host_memory: blocks from 1 MiB up get their own mapping; a free heap top over 8 MiB is trimmed.
_RELEASE_MMAP_THRESHOLD = 1 << 20
_RELEASE_TRIM_THRESHOLD = 8 << 20
# mallopt takes an int: the largest free heap top glibc then keeps instead of trimming is 2 GiB.
_INT_MAX = 2**31 - 1

_STATE: dict[str, object] = {"applied": False, "released": False, "reason": "not requested"}
_NOTED: set[str] = set()  # warn_thread_cache has spoken in this process

# The GLIBC_TUNABLES entry that turns glibc's per-thread malloc cache off (glibc 2.26 and later; ignored elsewhere).
THREAD_CACHE_OFF = "glibc.malloc.tcache_count=0"
# thread_cache_on's probe: a size glibc keeps in fastbins when the per-thread cache does not take it.
_PROBE_BYTES = 100
_PROBE_CHUNKS = 7  # a tcache bin's default capacity


def reuse_freed_host_memory() -> str | None:
    """Make glibc malloc keep freed memory for reuse in this process; idempotent.

    Returns:
        None when it is in effect, else the one-line reason it could not be applied (not glibc, no ``mallopt``,
        or ``mallopt`` refused a value). Never raises.
    """
    if _STATE["applied"]:
        return None
    if _STATE["released"]:
        return "release_freed_host_memory() is already in effect in this process"
    # Trim threshold first: if the mmap limit were set alone, freed heap memory would still go back at every free.
    reason = _mallopt(((_M_TRIM_THRESHOLD, _INT_MAX, "M_TRIM_THRESHOLD"), (_M_MMAP_MAX, 0, "M_MMAP_MAX")))
    _STATE.update(applied=reason is None, reason=reason or "applied")
    if reason is None:
        logger.info("host memory reuse on: glibc malloc keeps freed blocks (config host_memory_reuse: false to stop)")
    else:
        logger.info("host memory reuse unavailable: %s", reason)
    return reason


def release_freed_host_memory() -> str | None:
    """Make glibc malloc hand blocks of 1 MiB and more back to the kernel as soon as they are freed; idempotent.

    Returns:
        None when it is in effect, else the one-line reason it could not be applied (as
        :func:`reuse_freed_host_memory`, or reuse already in effect). Never raises.
    """
    if _STATE["released"]:
        return None
    if _STATE["applied"]:
        return "reuse_freed_host_memory() is already in effect in this process"
    reason = _mallopt(
        (
            (_M_MMAP_THRESHOLD, _RELEASE_MMAP_THRESHOLD, "M_MMAP_THRESHOLD"),
            (_M_TRIM_THRESHOLD, _RELEASE_TRIM_THRESHOLD, "M_TRIM_THRESHOLD"),
        )
    )
    _STATE["released"] = reason is None
    if reason is None:
        _STATE["reason"] = "released: freed blocks of 1 MiB and up go back to the kernel"
        logger.info("host memory release on: glibc malloc unmaps freed blocks of 1 MiB and more")
    else:
        logger.info("host memory release unavailable: %s", reason)
    return reason


def host_memory_reuse_state() -> dict[str, object]:
    """Whether :func:`reuse_freed_host_memory` is in effect in this process, and if not, why."""
    return dict(_STATE)


def _not_glibc() -> str | None:
    """Why this process's malloc is not glibc's (one line), or None when it is."""
    if platform.system() != "Linux":
        return f"needs glibc on Linux, this is {platform.system()}"
    libc_name, _ = platform.libc_ver()
    if libc_name != "glibc":
        return f"needs glibc, this process uses {libc_name or 'an unknown C library'}"
    return None


def _mallopt(settings: tuple[tuple[int, int, str], ...]) -> str | None:
    if reason := _not_glibc():
        return reason
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError) as exc:
        return f"mallopt is not reachable ({exc})"
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    for param, value, name in settings:
        if mallopt(param, value) != 1:
            return f"mallopt({name}, {value}) failed"
    return None


def rank_tunables(current: str | None) -> str:
    """The ``GLIBC_TUNABLES`` value to start a CPU rank with: `current` plus the per-thread cache turned off.

    Args:
        current: the caller's ``GLIBC_TUNABLES`` (None or empty: unset). A value that already sets
            ``glibc.malloc.tcache_count`` is returned as it is: the user's choice stands.
    """
    if current and "glibc.malloc.tcache_count=" in current:
        return current
    return f"{current}:{THREAD_CACHE_OFF}" if current else THREAD_CACHE_OFF


def thread_cache_on() -> bool | None:
    """Whether glibc's per-thread malloc cache is on in this process (None: not glibc, or it cannot be probed).

    Probes instead of reading the environment: frees a few small chunks and asks ``mallinfo2`` whether they went to
    the heap's fastbins (cache off) or stayed marked in use (held by the cache).
    """
    if _not_glibc():
        return None
    libc = ctypes.CDLL(None)
    try:
        info = libc.mallinfo2
    except AttributeError:  # glibc before 2.33
        return None
    info.restype = _MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    # Take twice a bin's capacity first, so the cache's bin for this size is empty whatever it held before.
    chunks = [libc.malloc(_PROBE_BYTES) for _ in range(2 * _PROBE_CHUNKS)]
    if not all(chunks):
        for c in chunks:
            libc.free(c)
        return None
    before = info().fsmblks
    for c in chunks[:_PROBE_CHUNKS]:
        libc.free(c)
    in_fastbins = info().fsmblks - before
    for c in chunks[_PROBE_CHUNKS:]:
        libc.free(c)
    return in_fastbins < _PROBE_CHUNKS * _PROBE_BYTES


def warn_thread_cache() -> None:
    """Log once, at info level, when this process reuses host memory with glibc's per-thread cache on."""
    if _NOTED or not _STATE["applied"]:
        return
    _NOTED.add("thread cache")
    if thread_cache_on():
        logger.info(
            "host memory reuse with glibc's per-thread malloc cache on fragments the heap (0.2-0.4 GB more peak RSS "
            "per rank measured on GPT-2 16M/124M); start ranks with GLIBC_TUNABLES=%s (ds-plugin launch does on CPU)",
            THREAD_CACHE_OFF,
        )


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]
