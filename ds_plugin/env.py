"""`ds-plugin env`: what is installed and what can run here (the role of DeepSpeed's ds_report)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import platform
from typing import Any

PACKAGES = ("torch", "triton", "bitsandbytes", "lightning", "accelerate", "peft", "transformers", "safetensors")


def import_bitsandbytes_quietly() -> bool:
    """Import bitsandbytes (when installed) without the warnings of its optional hub kernel; False when absent.

    On CPUs with AVX512-bf16, importing bitsandbytes (0.50) looks an optional CPU 4-bit GEMM kernel up on the Hugging
    Face Hub through `kernels`, and both libraries log a warning when it cannot be had (offline, or not cached): no
    fault of the installation, and nothing ds_plugin uses. Other errors of the import are raised as they come.
    """
    if importlib.util.find_spec("bitsandbytes") is None:
        return False
    quiet = [logging.getLogger(name) for name in ("bitsandbytes", "kernels")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        import bitsandbytes  # noqa: F401
    finally:
        for log, level in zip(quiet, levels, strict=True):
            log.setLevel(level)
    return True


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _probe(fn) -> str:
    """Run a small capability check; report "yes" or the one-line reason it cannot run."""
    try:
        result = fn()
    except Exception as exc:  # a probe reports any failure as a reason, never raises
        return f"no ({type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''})"
    return "yes" if result in (None, True) else f"no ({result})"


def _interpreter_row() -> str:
    # The quantize kernels run under any interpreter; the quantized-weight GEMMs' loops need Triton >= 3.7 or an
    # older NumPy (`interpreter_problem`), and a launch there stops with that line.
    from ds_plugin.kernels.quant_linear_tilings import interpreter_problem

    problem = interpreter_problem()
    return "yes" if problem is None else f"quantize kernels only; GEMM kernels no ({problem})"


def _scaled_mm_probe(device: str, rowwise: bool):
    import torch

    def run():
        a = torch.randn(16, 32, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(16, 32, device=device).to(torch.float8_e4m3fn).t()
        if rowwise:
            sa, sb = torch.ones(16, 1, device=device), torch.ones(1, 16, device=device)
        else:
            sa, sb = torch.ones((), device=device), torch.ones((), device=device)
        torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    return run


def _cpu_bf16_row() -> str:
    from ds_plugin.runtime.cpu_bf16 import cpu_bf16_units

    native, why = cpu_bf16_units()
    return f"yes ({why})" if native else f"no ({why}: bf16 matmuls are emulated; train in fp32 on this CPU)"


def _slowdown() -> str:
    from ds_plugin.runtime.cpu_bf16 import bf16_matmul_slowdown

    return f"{bf16_matmul_slowdown():.1f}x (256x512 @ 512x512, one thread; about 1x or less with bf16 units)"


def _peer_reads_row() -> str:
    from ds_plugin.zero.cma import availability

    ok, why = availability()
    return f"yes ({why})" if ok else f"no ({why}; ring collectives send over gloo instead)"


def _thread_cache_row() -> str:
    from ds_plugin.runtime.host_memory import THREAD_CACHE_OFF, thread_cache_on

    on = thread_cache_on()
    if on is None:
        return "not glibc 2.33+ (no per-thread cache to probe)"
    if not on:
        return "off in this process (less heap fragmentation on CPU ranks)"
    return f"on in this process; CPU ranks fragment their heap less with GLIBC_TUNABLES={THREAD_CACHE_OFF}"


def _probe_value(fn) -> str:
    """A measured value, or the one-line reason it could not be measured."""
    try:
        return fn()
    except Exception as exc:  # a probe reports any failure as a reason, never raises
        return f"not measured ({type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''})"


def collect_env() -> dict[str, Any]:
    """Versions, devices and the capability matrix, as a JSON-ready dict."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    gpus = []
    if cuda:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append(
                {"name": p.name, "capability": f"{p.major}.{p.minor}", "memory_gb": round(p.total_memory / 1e9, 1)}
            )
    cap = torch.cuda.get_device_capability() if cuda else (0, 0)
    device = "cuda" if cuda else "cpu"
    triton_ok = importlib.util.find_spec("triton") is not None

    def bnb_backend():
        # Importing reports a broken native library.
        return import_bitsandbytes_quietly() or "not installed"

    caps = {
        "gloo backend (CPU)": _probe(lambda: dist.is_gloo_available() or "torch built without gloo"),
        "nccl backend (GPU)": _probe(lambda: (dist.is_nccl_available() and cuda) or "needs CUDA and NCCL"),
        "FSDP2 fully_shard": _probe(lambda: importlib.import_module("torch.distributed.fsdp").fully_shard and True),
        "peer memory reads (CPU ranks of one host)": _probe_value(_peer_reads_row),
        "glibc per-thread malloc cache": _probe_value(_thread_cache_row),
        "bf16 compute": _probe(lambda: (torch.ones(2, dtype=torch.bfloat16, device=device) * 2).sum() and True),
        "bf16 units (CPU)": _cpu_bf16_row(),
        "bf16/fp32 matmul time (CPU)": _probe_value(_slowdown),
        "fp8 tensorwise _scaled_mm": _probe(_scaled_mm_probe(device, rowwise=False)),
        "fp8 rowwise _scaled_mm": _probe(_scaled_mm_probe(device, rowwise=True)),
        "fp8 blockwise _scaled_mm": "yes" if cuda and cap >= (9, 0) else "no (needs sm90+; emulated)",
        "triton kernels (compiled)": "yes"
        if triton_ok and cuda
        else "no (needs triton and a GPU; torch fallbacks run)",
        "triton interpreter (TRITON_INTERPRET=1)": _interpreter_row() if triton_ok else "no (triton not installed)",
        "bitsandbytes (NF4, 8-bit optimizers)": _probe(bnb_backend),
    }
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in PACKAGES},
        "ds_plugin": _version("ds_plugin"),
        "cuda": torch.version.cuda,
        "gpus": gpus,
        "cpu_threads": torch.get_num_threads(),
        "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
        "capabilities": caps,
    }


def format_env(report: dict[str, Any]) -> str:
    """The report as aligned text."""
    lines = [f"ds_plugin {report['ds_plugin']}  python {report['python']}  {report['platform']}", "", "packages:"]
    for name, version in report["packages"].items():
        lines.append(f"  {name:<14}{version or 'not installed'}")
    lines.append(f"\nCUDA: {report['cuda'] or 'none (CPU build)'}")
    if report["gpus"]:
        for i, g in enumerate(report["gpus"]):
            lines.append(f"  GPU {i}: {g['name']} (sm {g['capability']}, {g['memory_gb']} GB)")
    else:
        lines.append("  no GPU: everything runs on CPU with gloo")
    lines.append("\nwhat can run here:")
    width = max(len(k) for k in report["capabilities"])
    for name, status in report["capabilities"].items():
        lines.append(f"  {name:<{width}}  {status}")
    return "\n".join(lines)
