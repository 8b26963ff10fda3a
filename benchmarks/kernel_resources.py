"""`ds-plugin bench kernel-resources`: the GEMM kernels built for an NVIDIA GPU without one, and each tiling's cost.

Triton's interpreter never runs its compiler, so a kernel can pass every CPU test and still fail to build, or ask
for more shared memory than the GPU has, or spill registers. This compiles every candidate tiling of
:mod:`ds_plugin.kernels.quant_linear_triton` (each format, bf16 and fp16, forward and backward) with the ptxas that
Triton ships, and reports per tiling the shared memory, registers per thread, spilled bytes, which tensor-core
instruction the dot became (``wgmma`` on Hopper, else ``mma.sync``) and how many asynchronous copies (the
software pipeline's loads) the PTX holds::

    ds-plugin bench kernel-resources --arch 90 [--json] [--out report.json]

A tiling over the device's shared memory is skipped by the op's tuner at run time; one that spills runs slowly.

Each build is of the launch the op issues (:func:`launch_for`: the kernel module's own ``forward_launch`` /
``backward_launch`` on meta tensors of Llama-2-70B's o_proj, no bias; Triton's binder reads its signature and
specialisations), so it cannot drift from what runs on the GPU. Triton 3.6 and 3.9 both build these offline, on a
machine without a GPU or CUDA install, with the ptxas they ship.
"""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import triton
from tqdm import tqdm

from ds_plugin.kernels import quant_linear_triton as qlt

__all__ = ["SHARED_MEMORY_LIMIT", "candidate_tilings", "compile_for", "launch_for", "ptxas_usage", "report"]

# Opt-in shared memory per block (bytes), by compute capability: A100 163 KiB, L40/4090 99 KiB, H100/H200 227 KiB.
SHARED_MEMORY_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
_DTYPES = ("bf16", "fp16")
_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_SHAPE_CLASSES = (("M<=16", 16), ("16<M<=128", 128), ("M>128", 4096))


def launch_for(
    kind: str,
    fmt: str,
    dtype: str,
    cfg: qlt.Config,
    group: int = 128,
    *,
    bias: str | None = None,
    n: int = 8192,
    k: int = 8192,
    m: int = 16,
) -> qlt.Launch:
    """The launch the op issues for an ``(m, k)`` input on an ``n x k`` weight, built by the kernel module's own
    :func:`~ds_plugin.kernels.quant_linear_triton.forward_launch` / ``backward_launch`` on meta tensors (no memory).

    Args:
        kind: "fwd" or "bwd".
        fmt: "int8", "int4" or "fp6".
        dtype: the activations, "bf16" or "fp16".
        cfg: the tiling, already fitted to ``group`` (as :func:`candidate_tilings` gives it).
        group: the weight's group size.
        bias: the forward's bias dtype ("bf16", "fp16", "fp32") or None (Llama's linears have none).
        n, k: the weight's shape (default: Llama-2-70B's o_proj).
        m: rows of x (dy); never specialised, so it only sizes the grid.
    """
    meta = torch.device("meta")
    act = _TORCH_DTYPES[dtype]
    cols = {"fp6": 3 * k // 4, "int4": k // 2, "int8": k}[fmt]
    codes = torch.empty(n, cols, dtype=torch.int8 if fmt == "int8" else torch.uint8, device=meta)
    scales = torch.empty(n, k // group, dtype=torch.bfloat16, device=meta)
    zeros = torch.empty(n, k // group, dtype=torch.uint8, device=meta) if fmt == "int4" else None
    if kind == "fwd":
        x = torch.empty(m, k, dtype=act, device=meta)
        b = None if bias is None else torch.empty(n, dtype=_TORCH_DTYPES[bias], device=meta)
        y = torch.empty(m, n, dtype=act, device=meta)
        return qlt.forward_launch(x, fmt, codes, scales, zeros, group, b, cfg, y)
    dy = torch.empty(m, n, dtype=act, device=meta)
    dx = torch.empty(m, k, dtype=act, device=meta)
    return qlt.backward_launch(dy, fmt, codes, scales, zeros, group, cfg, dx)


def compile_for(
    kind: str, fmt: str, dtype: str, cfg: qlt.Config, arch: int = 90, group: int = 128, *, bias: str | None = None
) -> Any:
    """The forward (``kind="fwd"``) or backward kernel compiled for ``sm_<arch>``, as a launch specialises it.

    The signature, constexprs and divisibility hints are Triton's own reading of :func:`launch_for`'s launch
    (:meth:`~ds_plugin.kernels.quant_linear_triton.Launch.specialisation`), so this builds what the op launches.

    Args:
        kind, fmt, dtype, cfg, group, bias: as for :func:`launch_for`.
        arch: the compute capability, e.g. 90 for H100/H200.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    launch = launch_for(kind, fmt, dtype, cfg, group, bias=bias)
    signature, constexprs, attrs, options = launch.specialisation(arch)
    source = ASTSource(fn=launch.kernel(), signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options.__dict__)


def ptxas_usage(ptx: str, arch: int = 90) -> dict[str, int]:
    """Registers per thread and spilled bytes of a kernel's PTX, as ``ptxas -v`` (Triton's own ptxas) reports them.

    Args:
        ptx: the kernel's PTX (``compiled.asm["ptx"]``).
        arch: the compute capability it targets.
    """
    from triton.backends.nvidia.compiler import get_ptxas

    target = re.search(r"^\.target\s+(\S+)", ptx, re.M)
    sm = target.group(1) if target else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        out = subprocess.run(
            [get_ptxas(arch).path, f"-arch={sm}", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    if regs is None or spills is None:
        raise RuntimeError(f"unexpected ptxas -v output: {out.strip()[:300]}")
    return {"registers": int(regs.group(1)), "spill_stores": int(spills.group(1)), "spill_loads": int(spills.group(2))}


def candidate_tilings(group: int = 128, k: int = 8192) -> list[tuple[str, str, qlt.Config]]:
    """Every (kind, shape class, tiling) the op may time for a weight of this group and K, adjusted to it."""
    out = [("fwd", label, c) for label, m in _SHAPE_CLASSES for c in qlt.forward_configs(m, group, k)]
    backward = (_SHAPE_CLASSES[0], ("M>16", 4096))
    return out + [("bwd", label, c) for label, m in backward for c in qlt.backward_configs(m, group)]


def report(arch: int = 90, formats: tuple[str, ...] = qlt.KERNEL_FORMATS, progress: bool = True) -> dict[str, Any]:
    """Compile every candidate for ``sm_<arch>`` and measure it; see the module docstring.

    Args:
        arch: the compute capability.
        formats: the weight formats to compile.
        progress: show a progress bar on stderr.
    """
    limit = SHARED_MEMORY_LIMIT.get(arch)
    jobs = [
        (fmt, group, kind, shape, cfg, dtype)
        for fmt in formats
        for group in (64 if fmt == "int4" else 128,)
        for kind, shape, cfg in candidate_tilings(group)
        for dtype in _DTYPES
    ]
    rows = []
    for fmt, group, kind, shape, cfg, dtype in tqdm(jobs, desc=f"compiling for sm_{arch}", disable=not progress):
        compiled = compile_for(kind, fmt, dtype, cfg, arch, group)
        ptx = compiled.asm["ptx"]
        row = {"format": fmt, "dtype": dtype, "pass": kind, "shape_class": shape, "tiling": _tiling(cfg)}
        row["shared_bytes"] = int(compiled.metadata.shared)
        row.update(ptxas_usage(ptx, arch))
        row["mma"] = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none"
        row["async_copies"] = len(re.findall(r"\bcp\.async\.", ptx))  # pipelined loads, in the PTX
        row["fits"] = limit is None or row["shared_bytes"] <= limit
        rows.append(row)
    return {
        "arch": f"sm_{arch}",
        "triton": triton.__version__,
        "ptxas": _ptxas_version(arch),
        "date": datetime.date.today().isoformat(),
        "shared_memory_limit": limit,
        "rows": rows,
    }


def _tiling(cfg: qlt.Config) -> str:
    text = f"{cfg.bm}x{cfg.bn}x{cfg.bk} w{cfg.num_warps} s{cfg.num_stages}"
    text += f" split{cfg.split_k}" if cfg.split_k > 1 else ""
    return text + ("" if cfg.post_scale else " per-element")


def _ptxas_version(arch: int) -> str:
    from triton.backends.nvidia.compiler import get_ptxas

    return str(get_ptxas(arch).version)


def _table(result: dict[str, Any]) -> str:
    head = f"{'format':6} {'dtype':5} {'pass':4} {'shape':9} {'tiling':32} {'shared B':>8} {'regs':>4} {'spill B':>7}"
    head += "  mma"
    lines = [f"sm_{result['arch'][3:]}, triton {result['triton']}, ptxas {result['ptxas']}", head]
    for r in result["rows"]:
        lines.append(
            f"{r['format']:6} {r['dtype']:5} {r['pass']:4} {r['shape_class']:9} {r['tiling']:32} "
            f"{r['shared_bytes']:>8} {r['registers']:>4} {r['spill_stores']:>7}  {r['mma']}"
            + ("" if r["fits"] else "  OVER SHARED MEMORY")
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `ds-plugin bench kernel-resources`."""
    from ds_plugin._argparse import ArgumentParser, count, output_file

    parser = ArgumentParser(prog="ds-plugin bench kernel-resources", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=count(70, 200), default=90, help="compute capability (default 90: H100/H200)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    parser.add_argument("--out", type=output_file, default=None, help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        print(json.dumps({"skipped": "this triton build has no NVIDIA backend: nothing to compile"}))
        return 0
    try:
        result = report(args.arch)
    except FileNotFoundError as e:  # a triton build without its ptxas
        print(f"ds-plugin bench kernel-resources: cannot compile for sm_{args.arch} here: {e}", file=sys.stderr)
        return 1
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1) if args.json else _table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
