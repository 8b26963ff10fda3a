"""`ds-plugin bench kernel-resources`: the GEMM kernels built for an NVIDIA GPU without one, and each tiling's cost.

Triton's interpreter never runs its compiler, so a kernel can pass every CPU test and still fail to build, or ask
for more shared memory than the GPU has, or spill registers. This compiles every candidate tiling of
:mod:`ds_plugin.kernels.quant_linear_triton` (each format, bf16 and fp16, forward and backward) with the ptxas that
Triton ships, and reports per tiling the shared memory, registers per thread, spilled bytes, which tensor-core
instruction the dot became (``wgmma`` on Hopper, else ``mma.sync``) and how many asynchronous copies (the
software pipeline's loads) the PTX holds::

    ds-plugin bench kernel-resources --arch 90 [--json] [--out report.json]

A tiling over the device's shared memory is skipped by the op's tuner at run time; one that spills runs slowly.
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

import triton
from tqdm import tqdm

from ds_plugin.kernels import quant_linear_triton as qlt

__all__ = ["SHARED_MEMORY_LIMIT", "candidate_tilings", "compile_for", "ptxas_usage", "report"]

# Opt-in shared memory per block (bytes), by compute capability: A100 163 KiB, L40/4090 99 KiB, H100/H200 227 KiB.
SHARED_MEMORY_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
_DTYPES = ("bf16", "fp16")
_SHAPE_CLASSES = (("M<=16", 16), ("16<M<=128", 128), ("M>128", 4096))


def compile_for(kind: str, fmt: str, dtype: str, cfg: qlt.Config, arch: int = 90, group: int = 128) -> Any:
    """The forward (``kind="fwd"``) or backward kernel compiled for ``sm_<arch>``, as a launch would specialise it.

    Args:
        kind: "fwd" or "bwd".
        fmt: "int8", "int4" or "fp6".
        dtype: the activations, "bf16" or "fp16".
        cfg: the tiling, already fitted to ``group`` (as :func:`candidate_tilings` gives it).
        arch: the compute capability, e.g. 90 for H100/H200.
        group: the weight's group size.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    forward = kind == "fwd"
    kernel = qlt._jit(qlt._fwd_kernel if forward else qlt._bwd_kernel)
    io = ("x_ptr", "y_ptr") if forward else ("dy_ptr", "dx_ptr")
    sig = {io[0]: f"*{dtype}", "w_ptr": "*i8" if fmt == "int8" else "*i32", "s_ptr": "*i16", "z_ptr": "*u8"}
    sig.update({"b_ptr": "*fp32"} if forward else {})
    sig.update({io[1]: f"*{dtype}", "M": "i32", "N": "i32", "K": "i32", "hi_off": "i32"})
    strides = ("xm", "wn", "sn", "zn", "ym") if forward else ("dym", "wn", "sn", "zn", "dxm")
    sig.update({f"stride_{a}": "i32" for a in strides})
    const = {"FMT": qlt._FMT_ID[fmt], "G": group, "BM": cfg.bm, "BN": cfg.bn, "BK": cfg.bk, "GROUP_M": cfg.group_m}
    const["WIDEN"] = False
    if forward:
        const.update(POST_SCALE=cfg.post_scale, HAS_BIAS=True, SPLIT_K=cfg.split_k)
    sig.update(dict.fromkeys(const, "constexpr"))
    # What a launch on Llama-sized weights specialises on: 16-byte aligned pointers; strides, N, K and the fp6 plane
    # offset divisible by 16 (M is never specialised).
    wide = {"N", "K", "hi_off"}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(sig)
        if sig[name][0] == "*" or "stride" in name or name in wide
    }
    source = ASTSource(fn=kernel, signature=sig, constexprs=const, attrs=attrs)
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "enable_fp_fusion": True}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


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
    return out + [("bwd", label, c) for label, m in backward for c in qlt.backward_configs(m)]


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
