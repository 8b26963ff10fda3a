"""`torch.compile` for the quantizers' CPU steps: when a step takes its compiled form, compiling it, and reporting.

Shared by the ZeRO++ row steps (`ds_plugin.quant.comm.fused`) and the frozen-weight decode
(`ds_plugin.quant.frozen.fused`); it imports nothing of ours, so both sit on it without depending on each other.

When to compile: compiling costs seconds once per process (then the on-disk inductor cache makes it faster), so by
default only CPU tensors of at least :data:`COMPILE_MIN_NUMEL` elements take the compiled form: tiny test models stay
eager, large models pay once and win on every step. ``DS_PLUGIN_QUANT_COMPILE=1`` compiles every CPU step, ``=0``
none. If compiling fails (no C++ compiler, an unsupported platform), the eager form runs and one warning says why.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["COMPILE_MIN_NUMEL", "ENV", "bf16_bits", "compile_report", "compiled_step", "use_compiled"]

logger = logging.getLogger(__name__)

# Below this a step takes a few milliseconds eagerly: seconds of compiling would pay back only after thousands
# of steps, and tests on tiny models would pay it in every process.
COMPILE_MIN_NUMEL = 1 << 20
ENV = "DS_PLUGIN_QUANT_COMPILE"

# Step name -> (argument, dims) marked static before each call.
_STATIC_DIMS: dict[str, tuple[tuple[int, tuple[int, ...]], ...]] = {}
COMPILE_FAILED: set[Callable] = set()
COMPILED_RUNS: set[Callable] = set()


def use_compiled(t: Tensor) -> bool:
    """Whether a step on a tensor like `t` takes its compiled form (CPU, size, ``DS_PLUGIN_QUANT_COMPILE``)."""
    if t.device.type != "cpu":
        return False
    setting = os.environ.get(ENV, "auto").strip().lower()
    if setting in ("0", "false", "off"):
        return False
    return setting in ("1", "true", "on") or t.numel() >= COMPILE_MIN_NUMEL


def compile_report() -> dict[str, object]:
    """Which form the steps took in this process, for benchmark reports: the setting, the size rule, and the
    steps that ran compiled or whose compile failed (and so ran eager)."""
    return {
        "setting": os.environ.get(ENV, "auto"),
        "compile_min_numel": COMPILE_MIN_NUMEL,
        "compiled_steps": sorted(fn.__name__ for fn in COMPILED_RUNS),
        "compile_failed": sorted(fn.__name__ for fn in COMPILE_FAILED),
    }


def compiled_step(fn: Callable, static_dims: tuple[tuple[int, tuple[int, ...]], ...] = ()) -> Callable:
    """`fn` compiled with dynamic shapes, `static_dims` ((argument, dims) pairs) marked static on every call.

    A step whose block or group is its inner loop marks that dim static: compiled with a symbolic length instead,
    inductor emitted scalar code 5x slower. After a failed compile the eager `fn` runs, with one warning. `fn`'s
    name must be unique among compiled steps; the same `fn` always gets the same wrapper.
    """
    _STATIC_DIMS.setdefault(fn.__name__, static_dims)
    return _compiled(fn)


@functools.cache
def _compiled(fn: Callable) -> Callable:
    # dynamic=True: one graph serves every size instead of a recompile per shape.
    compiled = torch.compile(fn, dynamic=True)

    @functools.wraps(fn)
    def run(*args):
        if fn in COMPILE_FAILED:
            return fn(*args)
        for index, dims in _STATIC_DIMS[fn.__name__]:
            for dim in dims:
                torch._dynamo.mark_static(args[index], dim % args[index].dim())
        try:
            result = compiled(*args)
            COMPILED_RUNS.add(fn)
            return result
        except Exception as exc:  # a missing compiler or an unsupported platform must not stop training
            COMPILE_FAILED.add(fn)
            logger.warning(
                "torch.compile of the quantizer step %s failed (%s); using its eager form (correct, slower). Set "
                "%s=0 to skip the attempt.",
                fn.__name__,
                str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__,
                ENV,
            )
            return fn(*args)

    return run


def bf16_bits(x: Tensor) -> Tensor:
    """fp32 `x` rounded to bf16 (to nearest, ties to even, as `.to(torch.bfloat16)`), as the int32 bits of its fp32
    value. In integers: compiled, inductor would drop `x.to(torch.bfloat16).float()` as a no-op (torch 2.13 keeps it
    only with `emulate_precision_casts`, 2.11 not even then). Infinities and overflow to infinity come out as the
    cast gives them; a nan stays a nan (its payload is not canonicalised)."""
    bits = x.view(torch.int32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
    return torch.where(x != x, bits, rounded)
