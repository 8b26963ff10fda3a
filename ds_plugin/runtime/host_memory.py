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
"""

from __future__ import annotations

import ctypes
import logging
import platform

__all__ = ["host_memory_reuse_state", "reuse_freed_host_memory"]

logger = logging.getLogger(__name__)

# mallopt parameters from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
# mallopt takes an int: the largest free heap top glibc then keeps instead of trimming is 2 GiB.
_INT_MAX = 2**31 - 1

_STATE: dict[str, object] = {"applied": False, "reason": "not requested"}


def reuse_freed_host_memory() -> str | None:
    """Make glibc malloc keep freed memory for reuse in this process; idempotent.

    Returns:
        None when it is in effect, else the one-line reason it could not be applied (not glibc, no ``mallopt``,
        or ``mallopt`` refused a value). Never raises.
    """
    if _STATE["applied"]:
        return None
    reason = _apply()
    _STATE.update(applied=reason is None, reason=reason or "applied")
    if reason is None:
        logger.info("host memory reuse on: glibc malloc keeps freed blocks (config host_memory_reuse: false to stop)")
    else:
        logger.info("host memory reuse unavailable: %s", reason)
    return reason


def host_memory_reuse_state() -> dict[str, object]:
    """Whether :func:`reuse_freed_host_memory` is in effect in this process, and if not, why."""
    return dict(_STATE)


def _apply() -> str | None:
    if platform.system() != "Linux":
        return f"needs glibc on Linux, this is {platform.system()}"
    libc_name, _ = platform.libc_ver()
    if libc_name != "glibc":
        return f"needs glibc, this process uses {libc_name or 'an unknown C library'}"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError) as exc:
        return f"mallopt is not reachable ({exc})"
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # Trim threshold first: if the mmap limit were set alone, freed heap memory would still go back at every free.
    for param, value, name in ((_M_TRIM_THRESHOLD, _INT_MAX, "M_TRIM_THRESHOLD"), (_M_MMAP_MAX, 0, "M_MMAP_MAX")):
        if mallopt(param, value) != 1:
            return f"mallopt({name}, {value}) failed"
    return None
