"""``ds_plugin::quantized_linear``: a Linear on a frozen weight stored as codes, as torch.library custom ops.

Two ops, each with a registered autograd formula and a fake (meta) implementation, so ``torch.compile`` traces
either as one opaque node:

* ``quantized_linear(x, parts, fmt, group_size, bias) -> x @ dequant(W).T + bias``, in ``x``'s dtype;
* ``quantized_linear_grad_input(grad_out, parts, fmt, group_size, in_features) -> grad_out @ dequant(W)``: the
  forward's input gradient (its own gradient is the forward again, so double backward works too).

``parts`` is the weight's components (:mod:`ds_plugin.quant.frozen.codecs`) as a list, in :func:`parts_list`'s
order. :class:`~ds_plugin.quant.frozen.tensor.QuantizedWeight`'s ``F.linear`` calls both (forward, and backward
with the components re-read from the weight, which ZeRO-3 may have gathered again in between).

Backends: the Triton kernels of :mod:`ds_plugin.kernels.quant_linear_triton` take fp6, int4 and int8 weights with
bf16 or fp16 activations on CUDA (or on any device under ``TRITON_INTERPRET=1``). Everything else runs the
plain-torch reference, ``dequantize_weight`` then ``F.linear`` / ``matmul``: CPU, fp32 activations, shapes the
kernels refuse, and NF4 everywhere (its codebook lookup and double-quantized absmax have no kernel here). The
reference is the arithmetic the frozen-weight Linear always used, so CPU results are unchanged bit for bit.

On a GPU the kernels' tiling for each (pass, format, dtype, N, K, group, class of M) is timed once per process over
the kernel module's few candidates (``DS_PLUGIN_KERNEL_AUTOTUNE=0``: its first guess). Should a kernel's first
launch for a (pass, format, dtype) fail (a Triton or driver these kernels never met), that combination falls back
to the reference with one warning; once one has run, its errors propagate. With ``DS_PLUGIN_STRICT_KERNELS=1``
(:func:`ds_plugin.quant.strict_kernels`: the GPU tests and benchmarks) every failed launch raises
:class:`~ds_plugin.quant.KernelLaunchError` instead, naming the pass, format, dtype and cause.

What ran is public: :func:`kernel_launches` counts the kernels' launches that returned per (pass, format),
:func:`backend_calls` the op calls each backend served, and :func:`last_backend` names the one that served the
latest call, so a benchmark or a test can tell the kernels from the reference instead of assuming.
"""

import collections
import contextlib
import functools
import importlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ds_plugin.quant import KernelLaunchError, interpreter_requested, strict_kernels
from ds_plugin.quant.frozen.codecs import dequantize_weight

__all__ = ["backend_calls", "kernel_backend", "kernel_launches", "last_backend", "parts_list", "quantized_linear"]
__all__ += ["quantized_linear_grad_input", "reference_only"]

logger = logging.getLogger(__name__)

# Component names per format, in the order the ops take them; NF4 has two forms (see codecs).
_NAMES = {
    "int8": ("codes", "scales"),
    "int4": ("codes", "scales", "zeros"),
    "fp6": ("codes", "scales"),
    "nf4": ("codes", "absmax_codes", "absmax_scale", "absmax_offset"),
}
_NF4_PLAIN = ("codes", "absmax")
_KERNEL_MODULE = "ds_plugin.kernels.quant_linear_triton"


def _new_state() -> dict[str, Any]:
    # calls: op calls per (pass, format, backend); last: the backend of the latest call.
    # reference_only: how many `reference_only()` blocks are open (every call then takes the torch reference).
    state: dict[str, Any] = {"verified": set(), "failed": {}, "tuned": {}, "calls": collections.Counter()}
    return state | {"last": None, "reference_only": 0}


_state = _new_state()


def kernel_launches() -> dict[tuple[str, str], int]:
    """The Triton kernels' launches so far that returned, per (pass, format): ``{("fwd", "int4"): 3, ...}``.

    Counted by the kernel module after each launch call returned (a launch that failed, or a call the reference
    served, adds nothing); autotuning's timed launches count too, and under ``TRITON_INTERPRET=1`` interpreted ones.
    Empty until the kernels were first used. Compare two readings to see whether a piece of code ran the kernels.
    """
    kernels = sys.modules.get(_KERNEL_MODULE)
    return {} if kernels is None else kernels.launch_counts()


def backend_calls() -> dict[tuple[str, str, str], int]:
    """Calls of the two ops so far per (pass, format, backend), backend "triton" or "reference".

    "triton": the kernel module returned the result; "reference": ``dequantize_weight`` + torch did (CPU, NF4, fp32
    activations, shapes the kernels refuse, or a failed first launch outside strict mode).
    """
    return dict(_state["calls"])


def last_backend() -> str | None:
    """The backend that served the latest call of either op, "triton" or "reference"; None before any call."""
    return _state["last"]


def _served(kind: str, fmt: str, backend: str) -> None:
    _state["calls"][(kind, fmt, backend)] += 1
    _state["last"] = backend


def parts_list(fmt: str, parts: dict[str, Tensor]) -> list[Tensor]:
    """A weight's components as the ops take them.

    Args:
        fmt: the weight's format.
        parts: its components by name (``QuantizedWeight.parts``, in any order).
    """
    names = _NF4_PLAIN if fmt == "nf4" and "absmax" in parts else _NAMES[fmt]
    return [parts[n] for n in names]


def _named(fmt: str, parts: list[Tensor]) -> dict[str, Tensor]:
    names = _NF4_PLAIN if fmt == "nf4" and len(parts) == len(_NF4_PLAIN) else _NAMES.get(fmt)
    if names is None or len(names) != len(parts):
        raise ValueError(f"quantized_linear: {len(parts)} parts do not make a {fmt!r} weight")
    return dict(zip(names, parts, strict=True))


@functools.cache
def _kernel_module() -> ModuleType | None:
    try:
        return importlib.import_module("ds_plugin.kernels.quant_linear_triton")
    except ImportError:
        return None


def kernel_backend(t: Tensor, fmt: str, in_features: int, group_size: int, kind: str = "fwd") -> ModuleType | None:
    """The Triton kernel module when it takes this weight for activations like ``t``, else None (the reference).

    Args:
        t: the activations (or output gradient); their device and dtype decide.
        fmt: the weight's format.
        in_features: the weight's K.
        group_size: its group size.
        kind: "fwd" or "bwd" (a pass whose first launch failed stays on the reference).
    """
    if fmt == "nf4" or not (t.is_cuda or interpreter_requested()) or _state["reference_only"]:
        return None  # checked first: CPU never imports triton
    kernels = _kernel_module()
    if kernels is None or not kernels.supports(fmt, t.dtype, in_features, group_size):
        return None
    return None if (kind, fmt, t.dtype) in _state["failed"] and not strict_kernels() else kernels


@contextlib.contextmanager
def reference_only() -> Iterator[None]:
    """Inside the block every quantized linear runs the plain-torch reference, kernels or not: the same stored
    weights through the arithmetic the kernels are checked against (a benchmark's baseline, a kernel's check)."""
    _state["reference_only"] += 1
    try:
        yield
    finally:
        _state["reference_only"] -= 1


def _m_class(rows: int) -> int:
    return 1 << max(0, min(rows, 4096) - 1).bit_length()


def _time_ms(run: Callable[[], Any], repeats: int = 10) -> float:
    run()  # compiles, and warms up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _tuned(key: tuple, candidates: list[Any], run: Callable[[Any], Any]) -> Any:
    """The fastest of ``candidates`` for ``key``, timed once per process; the first off a GPU or when disabled."""
    if len(candidates) <= 1 or not torch.cuda.is_available() or interpreter_requested():
        return candidates[0] if candidates else None
    if key not in _state["tuned"] and torch.cuda.is_current_stream_capturing():
        return candidates[0]  # no timing inside a CUDA graph capture; a later eager call tunes this shape
    if os.environ.get("DS_PLUGIN_KERNEL_AUTOTUNE", "1") == "0":
        return candidates[0]
    if key not in _state["tuned"]:
        timed = []
        for cfg in candidates:
            try:
                timed.append((_time_ms(lambda cfg=cfg: run(cfg)), cfg))
            except Exception:  # a tiling this device cannot hold (shared memory, registers): skipped
                continue
        _state["tuned"][key] = min(timed, key=lambda t: t[0])[1] if timed else candidates[0]
        logger.debug("quantized_linear tiling for %s: %s", key, _state["tuned"][key])
    return _state["tuned"][key]


def _launch(key: tuple, run: Callable[[], Tensor]) -> Tensor | None:
    """``run()``; None when it is the first launch of its (pass, format, dtype) and failed: the caller falls back.

    Strict (``DS_PLUGIN_STRICT_KERNELS=1``): any failure raises :class:`KernelLaunchError` in one line instead.
    """
    verify = key[:3]
    try:
        out = run()
    except Exception as e:
        kind, fmt, dtype = verify
        cause = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if strict_kernels():
            op = "quantized_linear" if kind == "fwd" else "quantized_linear_grad_input"
            raise KernelLaunchError(
                f"{op}: the {kind} Triton kernel failed for {fmt} weights with {str(dtype).removeprefix('torch.')} "
                f"activations: {cause} (DS_PLUGIN_STRICT_KERNELS=1; unset it to fall back to the torch reference)"
            ) from e
        if verify in _state["verified"] or interpreter_requested():
            raise
        _state["failed"][verify] = cause
        logger.warning("quantized_linear kernel failed on first use (%s); using the torch reference", cause)
        return None
    _state["verified"].add(verify)
    _served(kind=verify[0], fmt=verify[1], backend="triton")
    return out


def _components(fmt: str, parts: list[Tensor]) -> tuple[Tensor, Tensor, Tensor | None]:
    named = _named(fmt, parts)
    return named["codes"], named["scales"], named.get("zeros")


def _dequantized(fmt: str, parts: list[Tensor], group_size: int, dtype: torch.dtype) -> Tensor:
    # fp64 (gradcheck) gets the fp32 weight widened: the same values.
    direct = dtype in (torch.float32, torch.bfloat16, torch.float16)
    return dequantize_weight(_named(fmt, parts), fmt, group_size, dtype if direct else torch.float32).to(dtype)


@torch.library.custom_op("ds_plugin::quantized_linear", mutates_args=())
def quantized_linear(x: Tensor, parts: list[Tensor], fmt: str, group_size: int, bias: Tensor | None) -> Tensor:
    """``x @ dequant(W).T + bias`` for a weight stored as ``parts``.

    Args:
        x: ``(..., K)`` floating activations; the result has their dtype.
        parts: the weight's components, in :func:`parts_list`'s order.
        fmt: "int8", "int4", "nf4" or "fp6".
        group_size: elements per scale.
        bias: optional ``(N,)`` bias.
    """
    k = x.shape[-1]
    kernels = kernel_backend(x, fmt, k, group_size)
    if kernels is not None:
        codes, scales, zeros = _components(fmt, parts)
        m = x.numel() // max(k, 1)
        key = ("fwd", fmt, x.dtype, codes.shape[0], k, group_size, bias is not None, _m_class(m))

        def run(cfg: Any) -> Tensor:
            return kernels.linear_forward(x, fmt, codes, scales, zeros, group_size, bias, config=cfg)

        y = _launch(key, lambda: run(_tuned(key, kernels.forward_configs(m, group_size, k), run)))
        if y is not None:
            return y
    if not x.is_floating_point():
        raise TypeError(f"quantized_linear takes floating activations, got {x.dtype}")
    _served("fwd", fmt, "reference")
    w = _dequantized(fmt, parts, group_size, x.dtype)
    return F.linear(x, w, bias.to(w.dtype) if bias is not None and bias.dtype != w.dtype else bias)


@quantized_linear.register_fake
def _(x: Tensor, parts: list[Tensor], fmt: str, group_size: int, bias: Tensor | None) -> Tensor:
    return x.new_empty((*x.shape[:-1], parts[0].shape[0]))


@torch.library.custom_op("ds_plugin::quantized_linear_grad_input", mutates_args=())
def quantized_linear_grad_input(
    grad_out: Tensor, parts: list[Tensor], fmt: str, group_size: int, in_features: int
) -> Tensor:
    """``grad_out @ dequant(W)``: the input gradient of :func:`quantized_linear`.

    Args:
        grad_out: ``(..., N)`` floating gradient; the result has its dtype.
        parts: the weight's components, in :func:`parts_list`'s order.
        fmt: "int8", "int4", "nf4" or "fp6".
        group_size: elements per scale.
        in_features: the weight's K.
    """
    kernels = kernel_backend(grad_out, fmt, in_features, group_size, "bwd")
    if kernels is not None:
        codes, scales, zeros = _components(fmt, parts)
        m = grad_out.numel() // max(grad_out.shape[-1], 1)
        key = ("bwd", fmt, grad_out.dtype, codes.shape[0], in_features, group_size, _m_class(m))

        def run(cfg: Any) -> Tensor:
            return kernels.linear_backward(grad_out, fmt, codes, scales, zeros, group_size, in_features, config=cfg)

        dx = _launch(key, lambda: run(_tuned(key, kernels.backward_configs(m, group_size), run)))
        if dx is not None:
            return dx
    _served("bwd", fmt, "reference")
    w = _dequantized(fmt, parts, group_size, grad_out.dtype)
    if w.device.type == "cpu" and w.dtype != torch.float32:
        # The CPU's bf16/fp16 GEMM takes a slow path for dy @ W with W row-major: 30x slower, measured
        # (256x768 @ 768x2048, one thread); W stored transposed avoids it.
        w = w.t().contiguous().t()
    return grad_out @ w


@quantized_linear_grad_input.register_fake
def _(grad_out: Tensor, parts: list[Tensor], fmt: str, group_size: int, in_features: int) -> Tensor:
    return grad_out.new_empty((*grad_out.shape[:-1], in_features))


def _setup_forward(ctx: Any, inputs: tuple, output: Tensor) -> None:
    x, parts, fmt, group_size, bias = inputs
    ctx.save_for_backward(*parts)
    ctx.fmt, ctx.group_size, ctx.in_features = fmt, group_size, x.shape[-1]
    # Recorded here: needs_input_grad counts the parts list's tensors one by one.
    ctx.x_grad = x.requires_grad
    ctx.bias_dtype = bias.dtype if bias is not None and bias.requires_grad else None


def _backward_forward(ctx: Any, grad: Tensor) -> tuple:
    parts = list(ctx.saved_tensors)
    grad_x = grad_bias = None
    if ctx.x_grad:
        grad_x = quantized_linear_grad_input(grad, parts, ctx.fmt, ctx.group_size, ctx.in_features)
    if ctx.bias_dtype is not None:
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.bias_dtype)
    return grad_x, [None] * len(parts), None, None, grad_bias


def _setup_grad_input(ctx: Any, inputs: tuple, output: Tensor) -> None:
    grad_out, parts, fmt, group_size, _ = inputs
    ctx.save_for_backward(*parts)
    ctx.fmt, ctx.group_size, ctx.dy_grad = fmt, group_size, grad_out.requires_grad


def _backward_grad_input(ctx: Any, grad: Tensor) -> tuple:
    # dx = dy @ W is linear in dy: its gradient is grad @ W.T, the forward op again.
    parts = list(ctx.saved_tensors)
    grad_dy = quantized_linear(grad, parts, ctx.fmt, ctx.group_size, None) if ctx.dy_grad else None
    return grad_dy, [None] * len(parts), None, None, None


quantized_linear.register_autograd(_backward_forward, setup_context=_setup_forward)
quantized_linear_grad_input.register_autograd(_backward_grad_input, setup_context=_setup_grad_input)
