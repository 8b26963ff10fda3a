"""Quantized-weight GEMM kernels vs bf16 ``torch.matmul`` on Llama-2-70B's linear shapes (``ds-plugin bench kernels``).

For each weight shape N x K (q/k/v fused, o, gate/up fused, down) and each M, times ``y = x @ W.T`` with W stored
as fp6, int4 and int8 through ``ds_plugin::quantized_linear`` (the Triton kernels, autotuned in this process), the
same product with a bf16 W through ``torch.matmul``, and GemLite's int4 kernel when ``gemlite`` imports; at
M = 4096 also the backward ``dx = dy @ W``. Each row gives the latency, the bf16 latency, the speedup over bf16 and
the achieved bandwidth (weight, activation and output bytes over the latency) as a fraction of the device's peak.

Times are ``triton.testing.do_bench`` medians: L2 flushed before every call, so W streams from HBM as it would in
a model. At M = 1, 16 and 128 each forward row also gives ``graph_latency_us`` and ``bf16_graph_latency_us``: the
same call replayed from a CUDA graph, each replay after an L2 flush whose own graph time is subtracted, so the host's
launch cost is left out and only the device's time remains (null where capture failed, with ``graph_error``; the
other rows hold none: each capture costs tenths of a second, and the check runs in a window of minutes). The gap
between a row's two latencies is what the host adds per call: where it is large, the product is bound by Python
and the launch path, not by the kernel. Weights hold random codes and scales (timing does not depend on the
values; the tests check the maths). Writes ``kernels-<device>-<date>.json`` (and ``.png`` when matplotlib imports)
to ``--out-dir`` ($OUT, else ``benchmarks/results``). Without a CUDA GPU it says so and exits 0.

Each row's ``"backend"`` is what served it, read from the op's counters (:func:`~ds_plugin.quant.frozen.linear_op.
kernel_launches`, :func:`~ds_plugin.quant.frozen.linear_op.backend_calls`): "triton" when the kernel launched and
the reference never ran, else "reference". It runs strict (``DS_PLUGIN_STRICT_KERNELS=1``: a kernel that fails to
launch is an error, not a fallback; ``--allow-fallback`` turns that off), and exits 1 naming every fp6 / int4 / int8
row that the kernels did not serve (:func:`check_kernel_rows`), so reference timings never pass for the kernels'.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import logging
import math
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ds_plugin._argparse import MAX_COUNT, ArgumentParser, choice_list, output_dir, shown

__all__ = ["LLAMA2_70B_SHAPES", "M_VALUES", "benchmark", "check_kernel_rows", "main", "peak_bandwidth"]
__all__ += ["write_report"]

logger = logging.getLogger(__name__)

SKIP_MESSAGE = "needs a CUDA GPU"
# (N, K) of Llama-2-70B's linears: fused q/k/v (8192 + 2 * 1024 kv), o, fused gate/up (2 * 28672), down.
LLAMA2_70B_SHAPES = ((10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672))
M_VALUES = (1, 2, 4, 8, 16, 32, 64, 128, 4096)
BACKWARD_M = 4096
GRAPH_M_VALUES = (1, 16, 128)  # forward rows also timed from a CUDA graph: where host cost can rival the kernel's
FORMATS = ("fp6", "int4", "int8")
GROUP_SIZE = {"fp6": 128, "int4": 64, "int8": 128}
# HBM bandwidth by device name, most specific first (vendor datasheets, bytes/s).
_PEAKS = (
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),
)


def peak_bandwidth(device_name: str) -> float | None:
    """The device's peak HBM bandwidth in bytes/s, looked up by name; None when unknown.

    Args:
        device_name: ``torch.cuda.get_device_name()``, e.g. "NVIDIA H100 80GB HBM3".
    """
    for key, peak in _PEAKS:
        if key in device_name:
            return peak
    return None


def _random_parts(fmt: str, n: int, k: int, device: torch.device, gen: torch.Generator) -> dict[str, torch.Tensor]:
    group = GROUP_SIZE[fmt]
    cols = {"fp6": 3 * k // 4, "int4": k // 2, "int8": k}[fmt]
    parts = {
        "codes": torch.randint(0, 256, (n, cols), generator=gen, device=device, dtype=torch.uint8),
        "scales": (torch.rand(n, k // group, generator=gen, device=device) * 0.01 + 1e-3).to(torch.bfloat16),
    }
    if fmt == "int4":
        parts["zeros"] = torch.randint(0, 256, (n, k // group), generator=gen, device=device, dtype=torch.uint8)
    return parts


def _median_us(fn: Any) -> float:
    import triton.testing

    fn()  # compiles and autotunes outside do_bench, whose first calls size its repetitions
    torch.cuda.synchronize()
    return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def _graph_us(fn: Any) -> tuple[float | None, str | None]:
    """``(device us, None)`` of one ``fn()`` replayed from a CUDA graph after an L2 flush (the flush's own time
    subtracted), or ``(None, why)``: off CUDA, or where ``fn`` cannot be captured."""
    if not torch.cuda.is_available():
        return None, SKIP_MESSAGE
    import triton.testing

    try:
        both = triton.testing.do_bench_cudagraph(lambda: (_l2_flush().zero_(), fn()), rep=20, return_mode="median")
        alone = _flush_graph_ms()
    except Exception as e:  # a capture error is a finding for this row, not the end of the benchmark
        torch.cuda.synchronize()
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return 1e3 * max(both - alone, 0.0), None


@functools.cache
def _l2_flush() -> torch.Tensor:
    """The L2 flush buffer (256 MiB, zeroed before each timed call, as do_bench does), made once per process."""
    return torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")


@functools.cache
def _flush_graph_ms() -> float:
    """One flush's time replayed from a CUDA graph, measured once per process."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(_l2_flush().zero_, rep=20, return_mode="median")


def _gemlite_int4(w_shape: tuple[int, int], device: torch.device, gen: torch.Generator) -> Any | None:
    """A GemLite int4 (group 64) layer of this shape with random codes, or None when gemlite is unavailable."""
    try:
        try:
            from gemlite import DType, GemLiteLinear
        except ImportError:
            from gemlite.core import DType
            from gemlite.core import GemLiteLinearTriton as GemLiteLinear
        n, k = w_shape
        layer = GemLiteLinear(
            W_nbits=4, group_size=64, in_features=k, out_features=n, input_dtype=DType.BF16, output_dtype=DType.BF16
        )
        codes = torch.randint(0, 16, (n, k), generator=gen, device=device, dtype=torch.uint8)
        scales = (torch.rand(n, k // 64, generator=gen, device=device) * 0.01).to(torch.bfloat16)
        zeros = torch.full((n, k // 64), 8.0, device=device, dtype=torch.bfloat16)
        layer.pack(codes, scales, zeros, None)
        return layer
    except Exception as e:  # not installed, or an API this was not written against: leave it out
        logger.warning("gemlite int4 left out: %s: %s", type(e).__name__, e)
        return None


def _row(
    kernel: str,
    n: int,
    k: int,
    m: int,
    kind: str,
    us: float,
    bf16_us: float,
    nbytes: int,
    peak: float | None,
    backend: str,
) -> dict[str, Any]:
    return {
        "kernel": kernel,
        "N": n,
        "K": k,
        "M": m,
        "pass": kind,
        "latency_us": us,
        "bf16_latency_us": bf16_us,
        "speedup_vs_bf16": bf16_us / us,
        "bandwidth_fraction": None if peak is None else nbytes / (us * 1e-6) / peak,
        "backend": backend,
    }


def _timed_op(kind: str, fmt: str, fn: Callable[[], Any]) -> tuple[float, str]:
    """``(median us, backend)`` of one of our ops: "triton" when its kernel launched during the timing and the
    reference served none of the calls, else "reference" (the op's counters, read before and after)."""
    from ds_plugin.quant.frozen.linear_op import backend_calls, kernel_launches

    launches, calls = kernel_launches().get((kind, fmt), 0), backend_calls().get((kind, fmt, "reference"), 0)
    us = _median_us(fn)
    launched = kernel_launches().get((kind, fmt), 0) > launches
    fell_back = backend_calls().get((kind, fmt, "reference"), 0) > calls
    return us, "triton" if launched and not fell_back else "reference"


def check_kernel_rows(rows: list[dict[str, Any]]) -> list[str]:
    """One line per fp6 / int4 / int8 row that the Triton kernels did not serve (``"backend"`` not "triton").

    Args:
        rows: the benchmark's rows (:func:`benchmark`).
    """
    return [
        f"{r['kernel']} {r['pass']} N={r['N']} K={r['K']} M={r['M']}: backend {r.get('backend')!r}, not 'triton'"
        for r in rows
        if r["kernel"] in FORMATS and r.get("backend") != "triton"
    ]


def benchmark(
    device: torch.device,
    shapes: tuple[tuple[int, int], ...] = LLAMA2_70B_SHAPES,
    m_values: tuple[int, ...] = M_VALUES,
    formats: tuple[str, ...] = FORMATS,
    gemlite: bool = True,
    backward_m: int = BACKWARD_M,
    on_shape: Callable[[list[dict[str, Any]]], Any] | None = None,
) -> list[dict[str, Any]]:
    """Time every (format, shape, M) forward and the backward at ``backward_m``; returns the rows.

    Args:
        device: a CUDA device (the tests run it on CPU under Triton's interpreter, with a stand-in timer).
        shapes: (N, K) weight shapes.
        m_values: activation rows; the backward runs when ``backward_m`` is among them.
        formats: our formats to time.
        gemlite: also time GemLite's int4 kernel when it imports.
        backward_m: rows of dy for the backward.
        on_shape: called with the rows so far after each shape (``main`` writes them, so a run cut short by a
            time limit still leaves its finished shapes).
    """
    peak = peak_bandwidth(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    gen = torch.Generator(device=device).manual_seed(0)
    rows: list[dict[str, Any]] = []
    for n, k in shapes:
        rows += _shape_rows(n, k, device, gen, m_values, formats, gemlite, peak, backward_m)
        if on_shape is not None:
            on_shape(rows)
        torch.cuda.empty_cache()  # the next shape's bf16 weight reuses this one's memory
    return rows


def _shape_rows(
    n: int,
    k: int,
    device: torch.device,
    gen: torch.Generator,
    m_values: tuple[int, ...],
    formats: tuple[str, ...],
    gemlite: bool,
    peak: float | None,
    backward_m: int,
) -> list[dict[str, Any]]:
    from ds_plugin.quant.frozen.linear_op import parts_list, quantized_linear, quantized_linear_grad_input

    w = torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16)
    stored = {fmt: parts_list(fmt, _random_parts(fmt, n, k, device, gen)) for fmt in formats}
    weight_bytes = {fmt: sum(t.numel() * t.element_size() for t in stored[fmt]) for fmt in formats}
    gl = _gemlite_int4((n, k), device, gen) if gemlite else None
    rows = []
    for m in m_values:
        x = torch.randn(m, k, generator=gen, device=device, dtype=torch.bfloat16)
        act_bytes = 2 * (m * k + m * n)
        bf16_us = _median_us(lambda: torch.matmul(x, w.t()))  # noqa: B023 - timed before x changes
        for fmt in formats:
            us, backend = _timed_op(
                "fwd",
                fmt,
                lambda f=fmt: quantized_linear(x, stored[f], f, GROUP_SIZE[f], None),  # noqa: B023
            )
            rows.append(_row(fmt, n, k, m, "fwd", us, bf16_us, weight_bytes[fmt] + act_bytes, peak, backend))
            logger.info("%s N=%d K=%d M=%d: %.1f us (bf16 %.1f us, %s)", fmt, n, k, m, us, bf16_us, backend)
        if m in GRAPH_M_VALUES:
            _add_graph_times(rows[-len(formats) :], x, w, stored)
        if gl is not None:
            try:
                us = _median_us(lambda: gl(x))  # noqa: B023
                # GemLite's own Triton kernels, not counted here: check_kernel_rows covers ours only.
                nbytes = n * k // 2 + 4 * n * k // 64
                rows.append(_row("gemlite_int4", n, k, m, "fwd", us, bf16_us, nbytes, peak, "triton"))
            except Exception as e:
                logger.warning("gemlite int4 at M=%d failed: %s", m, e)
    if backward_m in m_values:
        dy = torch.randn(backward_m, n, generator=gen, device=device, dtype=torch.bfloat16)
        bf16_us = _median_us(lambda: torch.matmul(dy, w))
        act_bytes = 2 * (backward_m * n + backward_m * k)
        for fmt in formats:
            us, backend = _timed_op(
                "bwd", fmt, lambda f=fmt: quantized_linear_grad_input(dy, stored[f], f, GROUP_SIZE[f], k)
            )
            nbytes = weight_bytes[fmt] + act_bytes
            rows.append(_row(fmt, n, k, backward_m, "bwd", us, bf16_us, nbytes, peak, backend))
    return rows


def _add_graph_times(rows: list[dict[str, Any]], x: torch.Tensor, w: torch.Tensor, stored: dict[str, Any]) -> None:
    """Add the CUDA-graph (device-only) latencies to one M's forward rows, ours and bf16's."""
    from ds_plugin.quant.frozen.linear_op import quantized_linear

    bf16_graph, bf16_error = _graph_us(lambda: torch.matmul(x, w.t()))
    for r in rows:
        f = r["kernel"]
        us, error = _graph_us(lambda f=f: quantized_linear(x, stored[f], f, GROUP_SIZE[f], None))
        r.update(graph_latency_us=us, bf16_graph_latency_us=bf16_graph, graph_error=error or bf16_error)


def write_report(report: dict[str, Any], out_dir: Path) -> Path:
    """Write ``kernels-<device>-<date>.json`` (and ``.png`` when matplotlib imports) into ``out_dir``; returns the
    JSON's path.

    Args:
        report: ``{"device", "torch", "triton", "date", "rows"}``.
        out_dir: the folder (created when missing).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"kernels-{_slug(report['device'])}-{report['date']}"
    path = stem.with_suffix(".json")
    path.write_text(json.dumps(report, indent=1) + "\n")
    plotted = _plot(report, stem.with_suffix(".png"))
    print(f"wrote {path}{' and its .png' if plotted else ' (no matplotlib: no .png)'}", file=sys.stderr)
    return path


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _plot(report: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shapes = sorted({(r["N"], r["K"]) for r in report["rows"]}, key=lambda s: -s[0] * s[1])
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.2 * len(shapes), 3.6), squeeze=False, sharey=True)
    for ax, (n, k) in zip(axes[0], shapes, strict=True):
        for kernel in sorted({r["kernel"] for r in report["rows"]}):
            pts = [
                (r["M"], r["speedup_vs_bf16"])
                for r in report["rows"]
                if (r["N"], r["K"], r["kernel"], r["pass"]) == (n, k, kernel, "fwd")
            ]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=kernel)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"N={n} K={k}")
        ax.set_xlabel("M (tokens)")
    axes[0][0].set_ylabel("speedup vs bf16 matmul")
    axes[0][-1].legend()
    fig.suptitle(f"{report['device']}: quantized-weight GEMM, forward")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def _sizes(text: str) -> tuple[int, ...]:
    """`--m`: comma-separated positive integers."""
    try:
        sizes = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text)}: give comma-separated integers") from None
    if not sizes or not all(1 <= s <= MAX_COUNT for s in sizes):
        raise argparse.ArgumentTypeError(f"{shown(text)}: give integers from 1 to {MAX_COUNT}")
    return sizes


_SHAPE = re.compile(r"\s*([0-9]+)\s*x\s*([0-9]+)\s*")


def _shapes(text: str) -> tuple[tuple[int, int], ...]:
    """`--shapes`: comma-separated NxK pairs, K a multiple of 128 (the kernels' group size)."""
    shapes = []
    for item in (s for s in text.lower().split(",") if s.strip()):
        m = _SHAPE.fullmatch(item)
        try:
            n, k = (int(m[1]), int(m[2])) if m else (0, 0)
        except ValueError:  # past int()'s 4300 digits
            n, k = 0, 0
        if not (1 <= n <= MAX_COUNT and 128 <= k <= MAX_COUNT and k % 128 == 0):
            raise argparse.ArgumentTypeError(f"{shown(item)}: give NxK pairs with K a multiple of 128, e.g. 8192x8192")
        shapes.append((n, k))
    if not shapes:
        raise argparse.ArgumentTypeError("no NxK pair given, e.g. 8192x8192")
    return tuple(shapes)


def _cuda_device() -> tuple[torch.device, str] | None:
    """The current CUDA device and its name; None without one."""
    if not torch.cuda.is_available():
        return None
    device = torch.device("cuda", torch.cuda.current_device())
    return device, torch.cuda.get_device_name(device)


@contextlib.contextmanager
def _strict_kernels(strict: bool) -> Iterator[None]:
    """``DS_PLUGIN_STRICT_KERNELS`` set to ``strict`` for the block, restored after (main runs in-process too)."""
    from ds_plugin.quant import STRICT_KERNELS_ENV

    before = os.environ.get(STRICT_KERNELS_ENV)
    os.environ[STRICT_KERNELS_ENV] = "1" if strict else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(STRICT_KERNELS_ENV, None)
        else:
            os.environ[STRICT_KERNELS_ENV] = before


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the JSON (``--json``) or a table, and write the result files.

    Returns 1 when a kernel failed to launch (strict) or any fp6 / int4 / int8 row ran on the reference.

    Args:
        argv: command-line arguments (default: ``sys.argv[1:]``).
    """
    from ds_plugin.quant import KernelLaunchError

    # Every value is checked while parsing, so a bad one is an error on a machine without a GPU too, not a skip.
    parser = ArgumentParser(prog="ds-plugin bench kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--m", type=_sizes, default=",".join(map(str, M_VALUES)), help="comma-separated M values")
    parser.add_argument(
        "--shapes", type=_shapes, default=",".join(f"{n}x{k}" for n, k in LLAMA2_70B_SHAPES), help="NxK,..."
    )
    parser.add_argument(
        "--formats", type=choice_list(FORMATS), default=",".join(FORMATS), help="comma-separated: fp6,int4,int8"
    )
    parser.add_argument("--no-gemlite", action="store_true", help="leave GemLite out even when it imports")
    parser.add_argument(
        "--allow-fallback",
        action="store_true",
        help="let a kernel that fails to launch fall back to the torch reference (default: strict, an error); "
        "its rows still say backend 'reference' and fail the run",
    )
    parser.add_argument(
        "--out-dir", type=output_dir, default=os.environ.get("OUT") or "benchmarks/results", help="where files go"
    )
    args = parser.parse_args(argv)
    cuda = _cuda_device()
    if cuda is None:
        print(
            json.dumps({"skipped": SKIP_MESSAGE})
            if args.json
            else f"ds-plugin bench kernels {SKIP_MESSAGE}; none is visible here."
        )
        return 0
    m_values, shapes, formats = args.m, args.shapes, tuple(args.formats)
    import triton

    device, name = cuda
    date = datetime.date.today().isoformat()
    report: dict[str, Any] = {"device": name, "torch": torch.__version__, "triton": triton.__version__, "date": date}
    report["strict"] = not args.allow_fallback

    def save(rows: list[dict[str, Any]]) -> None:
        write_report({**report, "rows": rows}, Path(args.out_dir))

    try:
        with _strict_kernels(not args.allow_fallback):
            rows = benchmark(device, shapes, m_values, formats, gemlite=not args.no_gemlite, on_shape=save)
    except KernelLaunchError as e:
        print(f"ds-plugin bench kernels: {e}", file=sys.stderr)
        return 1
    report["rows"] = rows
    problems = check_kernel_rows(rows)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _print_table(report, formats)
    if problems:
        print(f"ds-plugin bench kernels: {len(problems)} rows did not run the Triton kernels:", file=sys.stderr)
        print("\n".join(f"  {p}" for p in problems), file=sys.stderr)
        return 1
    return 0


def _print_table(report: dict[str, Any], formats: tuple[str, ...]) -> None:
    rows = report["rows"]
    print(f"{report['device']}  torch {report['torch']}  triton {report['triton']}")
    for r in rows:
        frac = "" if r["bandwidth_fraction"] is None else f"  {r['bandwidth_fraction']:.0%} of peak"
        print(
            f"{r['kernel']:>12} {r['pass']} N={r['N']:>5} K={r['K']:>5} M={r['M']:>4}: {r['latency_us']:8.1f} us"
            f"  bf16 {r['bf16_latency_us']:8.1f} us  x{r['speedup_vs_bf16']:.2f}{frac}  [{r['backend']}]"
        )
    for kernel in (*formats, "gemlite_int4"):
        small = [r["speedup_vs_bf16"] for r in rows if (r["kernel"], r["pass"]) == (kernel, "fwd") and r["M"] <= 16]
        if small:
            geomean = math.exp(sum(map(math.log, small)) / len(small))
            print(f"{kernel}: geomean speedup over bf16 at M <= 16: {geomean:.2f}x")


if __name__ == "__main__":
    raise SystemExit(main())
