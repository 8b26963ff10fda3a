"""Whether this CPU computes bf16 natively, and the compute dtype to pick on it when the user did not choose one.

A CPU with bf16 units (x86 AVX512-BF16 or AMX, Arm's BF16 extension) multiplies bf16 matrices at least as fast as
fp32 ones. Without them (AVX2-only x86, e.g. many AMD EPYC cloud VMs) oneDNN converts every element and a bf16
matmul is tens of times slower than the fp32 one: a 512x1024 by 1024x1024 product took 2.1 s in bf16 against
0.045 s in fp32 on such a machine. A CPU user who asks for bf16 there waits minutes per step without knowing why.

* :func:`cpu_bf16_units` reads the CPU's feature flags (``/proc/cpuinfo`` on Linux; elsewhere torch's oneDNN
  check) and says which units it found, or why it found none.
* :func:`bf16_matmul_slowdown` measures the bf16/fp32 time ratio of one matmul (``ds-plugin env`` reports it).
* :func:`warn_slow_bf16` is the engine's one-line warning, once per process, when it is asked to compute in bf16
  on a CPU without the units.
* :func:`fast_compute_dtype` is the default the examples, recipes and benchmarks take: bf16 on a GPU and on a CPU
  with bf16 units, fp32 on any other CPU; with the reason, so they can say which they picked.
"""

from __future__ import annotations

import functools
import logging
import platform
import time
from pathlib import Path

import torch

__all__ = ["bf16_matmul_slowdown", "cpu_bf16_units", "fast_compute_dtype", "units_from_cpuinfo", "warn_slow_bf16"]

logger = logging.getLogger(__name__)

# Flags that mean native bf16 arithmetic: x86 (AVX512-BF16, AMX-BF16) and Arm (FEAT_BF16, "bf16" in Features).
_X86_FLAGS = ("avx512_bf16", "amx_bf16")
_ARM_FLAGS = ("bf16",)
_warned: set[str] = set()


def _flags(cpuinfo: str) -> set[str]:
    found: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            found.update(value.split())
    return found


def units_from_cpuinfo(cpuinfo: str) -> tuple[bool, str]:
    """Whether ``/proc/cpuinfo``'s text names bf16 units, and which ones (or what the CPU has instead).

    Args:
        cpuinfo: the file's text.
    """
    flags = _flags(cpuinfo)
    native = [f for f in (*_X86_FLAGS, *_ARM_FLAGS) if f in flags]
    if native:
        return True, ", ".join(native)
    best = next((f for f in ("avx512f", "avx2", "asimd", "neon") if f in flags), None)
    return False, f"{best or 'no vector'} only, no bf16 units" if flags else "no CPU flags listed"


@functools.cache
def cpu_bf16_units() -> tuple[bool, str]:
    """Whether this CPU has bf16 units, and which (or the one-line reason it has none); cached per process."""
    info = Path("/proc/cpuinfo")
    if platform.system() == "Linux" and info.is_file():
        try:
            return units_from_cpuinfo(info.read_text(errors="replace"))
        except OSError as e:
            return False, f"/proc/cpuinfo unreadable ({e.strerror})"
    try:
        native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False, "no way to read this CPU's features"
    return native, "oneDNN reports bf16 support" if native else "oneDNN reports no bf16 support"


def bf16_matmul_slowdown(m: int = 256, k: int = 512, n: int = 512, repeats: int = 3) -> float:
    """The time of an ``(m, k) @ (k, n)`` matmul in bf16 over the same in fp32 on this CPU, one thread (best of
    ``repeats``): about 1 or below with bf16 units, tens without. The default shape takes under half a second
    even where bf16 is slow.

    Args:
        m: rows of the left operand.
        k: the shared dimension.
        n: columns of the right operand.
        repeats: timed runs of each, after one warm-up.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
        times = {}
        for dtype in (torch.float32, torch.bfloat16):
            x, y = a.to(dtype), b.to(dtype)
            x @ y
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                x @ y
                best = min(best, time.perf_counter() - start)
            times[dtype] = max(best, 1e-9)
        return times[torch.bfloat16] / times[torch.float32]
    finally:
        torch.set_num_threads(threads)


def warn_slow_bf16(device_type: str, compute_dtype: str) -> bool:
    """Warn once per process, in one line with the fix, when bf16 compute is asked for on a CPU without bf16 units.

    Args:
        device_type: where the model computes ("cpu", "cuda", ...).
        compute_dtype: the plan's compute dtype ("bf16", "fp16", "fp32").

    Returns:
        Whether it warned (now or earlier in this process).
    """
    if device_type != "cpu" or compute_dtype != "bf16":
        return False
    native, why = cpu_bf16_units()
    if native:
        return False
    if "bf16" not in _warned:
        _warned.add("bf16")
        logger.warning(
            "bf16 compute on a CPU without bf16 units (%s): each bf16 matmul is emulated, tens of times slower "
            'than fp32 here; set "bf16": {"enabled": false} (Lightning precision="32-true", Accelerate '
            "--mixed_precision no) to train in fp32, or run on a CPU with AVX512-BF16/AMX or a GPU",
            why,
        )
    return True


def fast_compute_dtype(device_type: str = "cpu") -> tuple[str, str]:
    """The compute dtype to take when the user chose none ("bf16" or "fp32"), and why, in a few words.

    Args:
        device_type: where the model computes.
    """
    if device_type == "cuda" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        return "fp32", "this GPU has no bf16 support"
    if device_type != "cpu":
        return "bf16", f"on {device_type}"
    native, why = cpu_bf16_units()
    return ("bf16", f"this CPU has bf16 units ({why})") if native else ("fp32", f"this CPU has {why}")
