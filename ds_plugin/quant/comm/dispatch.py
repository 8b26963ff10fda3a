"""The one dispatch for the blockwise INT8 / INT4 format: which backend quantizes and dequantizes a tensor.

Two backends implement :mod:`ds_plugin.quant.comm.format`, bit for bit:

* **Triton** (:mod:`ds_plugin.kernels.quant_triton`): taken by ``backend="auto"`` for CUDA tensors when triton is
  importable, and for any tensor when ``TRITON_INTERPRET=1`` is set (Triton's CPU interpreter, for tests).
  ``triton`` is imported lazily, on the first tensor that could use it, so this module imports without it.
* **torch**: everything else: :mod:`ds_plugin.quant.comm.fused`, eager or, for large CPU buckets,
  ``torch.compile``-d.

:func:`triton_kernels` is the rule, used by the row steps below. The row steps are what the
ZeRO++ collectives (:mod:`ds_plugin.zero.zeropp`) call. Their ``compiled`` argument picks between the torch
forms: ``True`` asks for the compiled torch form (and so for torch), ``False`` / ``None`` leave the choice of
backend to the rule, so the collectives' CPU-only compile decision sends CUDA buckets to Triton.

A row kernel whose first launch fails falls back to torch with one warning, unless ``DS_PLUGIN_STRICT_KERNELS=1``
(:func:`ds_plugin.quant.strict_kernels`): then it raises :class:`~ds_plugin.quant.KernelLaunchError`.
:func:`kernel_launches` counts the row kernels' launches that returned, so a check can tell what ran.

:func:`dequantize_sum_rows` (qgZ's decode-and-sum) has no Triton kernel: it runs in torch on every device. Its
result does not depend on which backend produced the codes, since both produce the same bytes.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any, Literal

from torch import Tensor

from ds_plugin.quant import KernelLaunchError, interpreter_requested, strict_kernels
from ds_plugin.quant.comm import fused

# qgZ's decode-and-sum has no Triton kernel: the torch form runs on every device (see the module docstring).
from ds_plugin.quant.comm.fused import compile_report, dequantize_sum_rows, use_compiled

__all__ = [
    "Backend",
    "compile_report",
    "dequantize_rows_into",
    "dequantize_sum_rows",
    "kernel_launches",
    "quantize_rows",
    "triton_kernels",
    "use_compiled",
]

Backend = Literal["auto", "torch", "triton"]

logger = logging.getLogger(__name__)


@functools.cache
def _load_triton_kernels() -> ModuleType | None:
    try:
        return importlib.import_module("ds_plugin.kernels.quant_triton")
    except ImportError:
        return None


def triton_kernels(t: Tensor, backend: Backend = "auto") -> ModuleType | None:
    """The Triton kernel module when ``backend`` selects it for tensors like ``t``, else None (torch).

    Args:
        t: the tensor to be read or written (its device decides).
        backend: ``"auto"`` (Triton where it can run: CUDA with triton importable, or ``TRITON_INTERPRET=1``),
            ``"torch"`` or ``"triton"`` (raises ``RuntimeError`` where Triton cannot run).
    """
    if backend == "torch":
        return None
    if backend not in ("auto", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    # Checked before importing so the CPU path never pays for (or needs) a triton import.
    runnable = t.is_cuda or interpreter_requested()
    kernels = _load_triton_kernels() if runnable else None
    if backend == "triton" and kernels is None:
        why = "triton is not importable" if runnable else "the tensor is on CPU and TRITON_INTERPRET=1 is not set"
        raise RuntimeError(f"backend='triton' cannot run here: {why}")
    return kernels


def kernel_launches() -> dict[tuple[str, int], int]:
    """Launches of the Triton row kernels that returned, per (kernel, bits), e.g. ``{("quantize", 8): 12}``.

    Counted after each launch returned, never for a call that fell back to torch; empty until triton is loaded.
    """
    kernels = sys.modules.get("ds_plugin.kernels.quant_triton")
    return {} if kernels is None else kernels.launch_counts()


# A row kernel's first launch for a given specialisation (kernel, dtype, bits) is its first compile. Should one
# fail (a Triton or driver version these kernels were never run on), training goes on in torch with one warning
# instead of dying inside a collective; once a specialisation has run, its errors propagate as usual. Strict mode
# (DS_PLUGIN_STRICT_KERNELS=1, the GPU checks) raises instead, so a broken kernel cannot pass for a working one.
_triton_rows: dict[str, Any] = {"verified": set(), "failed": None}


def _row_kernels(t: Tensor, compiled: bool | None, backend: Backend) -> ModuleType | None:
    if compiled:
        if backend == "triton":
            raise ValueError("compiled=True asks for the compiled torch form; it cannot run with backend='triton'")
        return None
    if backend == "auto" and _triton_rows["failed"] is not None and not strict_kernels():
        return None
    return triton_kernels(t, backend)


def _launch_rows(backend: Backend, key: tuple, kernel: Callable[..., Any], *args: Any) -> tuple[bool, Any]:
    """Run a row kernel; (False, None) when its first launch for `key` failed and the caller should use torch."""
    try:
        result = kernel(*args)
    except Exception as e:
        cause = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if strict_kernels():
            kind, dtype, bits = key
            op = "quantize_rows" if kind == "quantize" else "dequantize_rows_into"
            raise KernelLaunchError(
                f"{op}: the Triton kernel failed for {str(dtype).removeprefix('torch.')} rows at {bits} bits: {cause} "
                "(DS_PLUGIN_STRICT_KERNELS=1; unset it to fall back to the torch form)"
            ) from e
        if backend == "triton" or key in _triton_rows["verified"]:
            raise
        _triton_rows["failed"] = cause
        logger.warning("Triton quantizer failed on first use (%s); using the torch form", cause)
        return False, None
    _triton_rows["verified"].add(key)
    return True, result


def quantize_rows(
    rows: Tensor, block: int, bits: int, *, compiled: bool | None = None, backend: Backend = "auto"
) -> tuple[Tensor, Tensor]:
    """Quantize the rows (last dim) of a float tensor blockwise with bf16 scales; blocks never straddle rows.

    Args:
        rows: ``(..., numel)`` fp32, bf16 or fp16; any strides along the leading dims (a transposed view is
            read in place, and its codes come out in the view's order).
        block: elements per scale; even for 4 bits. Each row is zero-padded to whole blocks for quantizing.
        bits: 8 (int8 codes, ``(..., numel)``) or 4 (uint8, two codes per byte, ``(..., ceil(numel / 2))``).
        compiled: True for the compiled torch form; False / None let ``backend`` decide, and for torch, False
            is the eager form and None decides by size and environment (:func:`use_compiled`).
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (see :func:`triton_kernels`).

    Returns:
        ``(codes, scales)``: codes of the real elements only (possibly a view that needs ``.contiguous()``), and
        bf16 scales, ``ceil(numel / block)`` per row, row after row.
    """
    kernels = _row_kernels(rows, compiled, backend)
    if kernels is not None:
        key = ("quantize", rows.dtype, bits)
        ran, result = _launch_rows(backend, key, kernels.quantize_rows_triton, rows, block, bits)
        if ran:
            return result
    return fused.quantize_rows(rows, block, bits, compiled=compiled)


def dequantize_rows_into(
    out: Tensor,
    codes: Tensor,
    scales: Tensor,
    block: int,
    *,
    compiled: bool | None = None,
    backend: Backend = "auto",
) -> None:
    """Write ``codes * scale`` (INT8 rows from :func:`quantize_rows`) into ``out``, in ``out``'s dtype.

    Args:
        out, codes, scales, block: as for :func:`ds_plugin.quant.comm.fused.dequantize_rows_into`.
        compiled: as for :func:`quantize_rows`.
        backend: as for :func:`quantize_rows`.
    """
    kernels = _row_kernels(out, compiled, backend)
    if kernels is not None:
        key = ("dequantize", out.dtype, 8)
        if _launch_rows(backend, key, kernels.dequantize_rows_into_triton, out, codes, scales, block)[0]:
            return
    fused.dequantize_rows_into(out, codes, scales, block, compiled=compiled)
