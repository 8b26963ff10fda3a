"""`ds-plugin bench kernel-resources` and `ds-plugin bench kernels` on CPU (from tests/kernels/test_quant_linear.py).

kernel-resources builds the GEMM kernels for sm_90 with the ptxas Triton ships, so the compiler's rules (which the
interpreter never applies) are checked without a GPU: a few builds here, every candidate tiling in the `long` tier.
kernels runs its whole timing loop under Triton's interpreter with a stand-in timer.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import triton

from ds_plugin.kernels import quant_linear_triton as qlt

FORMATS = ["fp6", "int4", "int8"]


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


# As in tests/kernels/test_quant_linear.py: Triton <= 3.6's interpreter cannot run the kernels' loops under
# NumPy >= 2.5 (fixed in Triton 3.7).
INTERPRETER_LOOPS = not (_release(triton.__version__) < (3, 7) and _release(np.__version__) >= (2, 5))


@pytest.fixture
def interpreter(monkeypatch):
    if not INTERPRETER_LOOPS:
        pytest.skip(
            f"triton {triton.__version__}'s interpreter cannot run loops under numpy {np.__version__}: "
            "use triton >= 3.7 or numpy < 2.5"
        )
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert qlt.interpreter_enabled()


@pytest.fixture
def compiled(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


# ------------------------------------------------------------------------------- ds-plugin bench kernel-resources


def test_kernels_compile_for_hopper_without_a_gpu(compiled):
    # The interpreter never runs Triton's compiler, whose rules differ (static branches, types, layouts); this
    # builds sm_90 cubins on CPU with the ptxas triton ships, so those errors show up without a GPU.
    pytest.importorskip("triton.backends.nvidia")
    from benchmarks.kernel_resources import compile_for

    try:
        compile_for("fwd", "int8", "bf16", qlt.forward_configs(1, 128, 8192)[0])
    except (FileNotFoundError, RuntimeError) as e:  # no ptxas in this triton build
        if "ptxas" in str(e):
            pytest.skip(f"cannot compile for sm_90 here: {e}")
        raise
    compile_for("fwd", "fp6", "bf16", qlt.forward_configs(1, 128, 8192)[0])
    compile_for("fwd", "int4", "fp16", qlt.forward_configs(4096, 64, 8192)[2], group=64)
    compile_for("bwd", "fp6", "fp16", qlt.backward_configs(4096)[0])


def test_bench_kernel_resources_reports_each_build(compiled, monkeypatch, tmp_path, capsys):
    # The command end to end on one tiling (6 builds: 3 formats x 2 dtypes); the long tier runs every tiling.
    pytest.importorskip("triton.backends.nvidia")
    from benchmarks import kernel_resources
    from ds_plugin.cli import main

    one = qlt.Config(16, 64, 64)
    monkeypatch.setattr(kernel_resources, "candidate_tilings", lambda group, k=8192: [("fwd", "M<=16", one)])
    out = tmp_path / "new" / "resources.json"
    assert main(["bench", "kernel-resources", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["arch"] == "sm_90" and report["shared_memory_limit"] == 232448
    want = [(f, d) for f in qlt.KERNEL_FORMATS for d in ("bf16", "fp16")]
    assert [(r["format"], r["dtype"]) for r in report["rows"]] == want
    # 16-row tiles are below wgmma's 64 rows: Triton lowers their dots to mma.sync.
    assert all(r["fits"] and 0 < r["registers"] <= 255 and r["mma"] == "mma.sync" for r in report["rows"])
    assert table.count("16x64x64 w4 s3") == 6


@pytest.mark.long
def test_every_candidate_tiling_builds_for_hopper_and_fits(compiled):
    # Every tiling the op may time, for each format and dtype, forward and backward (about 2 minutes of compiles):
    # it builds and fits in an H100's shared memory (else the tuner skips it on the GPU); none spills more than a
    # few words per thread (the post-scaled 128 x 256 tile spilled 1 KB: a slow kernel), each shape class keeps one
    # that spills nothing, and large-M dots become Hopper's wgmma.
    pytest.importorskip("triton.backends.nvidia")
    from benchmarks import kernel_resources as resources

    rows = resources.report(90, progress=False)["rows"]
    assert len(rows) == 2 * sum(len(resources.candidate_tilings(64 if f == "int4" else 128)) for f in FORMATS)
    assert [r for r in rows if not r["fits"]] == []
    assert [r for r in rows if r["spill_stores"] > 128] == []
    classes = {(r["format"], r["dtype"], r["pass"], r["shape_class"]) for r in rows}
    spill_free = {(r["format"], r["dtype"], r["pass"], r["shape_class"]) for r in rows if r["spill_stores"] == 0}
    assert classes == spill_free
    assert {r["mma"] for r in rows if r["shape_class"] in ("M>128", "M>16")} == {"wgmma"}


# ---------------------------------------------------------------------------------------- ds-plugin bench kernels


def test_bench_kernels_without_a_gpu_says_so(monkeypatch, capsys):
    from ds_plugin.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "kernels", "--json"]) == 0
    assert '"skipped"' in capsys.readouterr().out


def test_bench_kernels_rows_and_report(interpreter, monkeypatch, tmp_path):
    # The whole timing loop on CPU: Triton's interpreter for the kernels, a stand-in timer for do_bench.
    from benchmarks import kernels as bench

    ticks = iter(range(1, 1000))
    monkeypatch.setattr(bench, "_median_us", lambda fn: fn() is None or float(next(ticks)))
    rows = bench.benchmark(torch.device("cpu"), ((32, 128),), (1, 3), gemlite=False, backward_m=3)
    keys = ["kernel", "N", "K", "M", "pass", "latency_us", "bf16_latency_us", "speedup_vs_bf16", "bandwidth_fraction"]
    assert all(list(r) == keys for r in rows)
    assert [(r["kernel"], r["M"], r["pass"]) for r in rows] == [
        *[(f, m, "fwd") for m in (1, 3) for f in ("fp6", "int4", "int8")],
        *[(f, 3, "bwd") for f in ("fp6", "int4", "int8")],
    ]
    assert rows[0]["speedup_vs_bf16"] == rows[0]["bf16_latency_us"] / rows[0]["latency_us"]
    assert bench.peak_bandwidth("NVIDIA H200") == 4.8e12 and bench.peak_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    report = {"device": "NVIDIA H100 80GB HBM3", "torch": "2", "triton": "3", "date": "2026-01-02", "rows": rows}
    path = bench.write_report(report, tmp_path)
    assert path.name == "kernels-nvidia-h100-80gb-hbm3-2026-01-02.json"
    assert list(json.loads(path.read_text())) == ["device", "torch", "triton", "date", "rows"]
