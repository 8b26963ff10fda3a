"""Quantization, in two homes that share no state:

* :mod:`ds_plugin.quant.comm`: the blockwise INT8 / INT4 format that ZeRO++'s quantized collectives put on the wire
  (qwZ weight all-gather, qgZ gradient reduce-scatter): the format and its reference maths, the torch backend of
  the row steps and the dispatch between it and the Triton kernels.
* :mod:`ds_plugin.quant.frozen`: frozen Linear weights *stored* as INT8 / INT4 / NF4 / FP6 (LoRA / QLoRA bases): the
  per-format codecs, the ``QuantizedWeight`` tensor subclass, its Linear custom op and the ``quantize_frozen_`` verb.

The frozen INT8 codec (and INT4's absmax method) reuse the comm format's block rule, scales rounded up to bf16 so
that no code clips, by importing :mod:`ds_plugin.quant.comm.format`; nothing in ``comm`` imports ``frozen``.

Both homes pick Triton kernels by one switch, :func:`interpreter_requested`, and treat a failed kernel launch by one
rule, :func:`strict_kernels`, both defined here so that neither imports the other's dispatch for them.
"""

from __future__ import annotations

import os

__all__ = ["STRICT_KERNELS_ENV", "KernelLaunchError", "interpreter_requested", "strict_kernels"]

STRICT_KERNELS_ENV = "DS_PLUGIN_STRICT_KERNELS"


class KernelLaunchError(RuntimeError):
    """A Triton kernel failed to launch while :func:`strict_kernels` is on (off, it falls back to torch)."""


def interpreter_requested() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's CPU interpreter, read without importing triton."""
    # Same spelling triton accepts for its boolean environment knobs.
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")


def strict_kernels() -> bool:
    """Whether ``DS_PLUGIN_STRICT_KERNELS`` asks for strict kernels: a failed launch raises
    :class:`KernelLaunchError` instead of falling back to the torch form (GPU checks and benchmarks, which must not
    report the fallback's numbers as the kernel's)."""
    return os.environ.get(STRICT_KERNELS_ENV, "0").strip().lower() in ("1", "true", "on")
