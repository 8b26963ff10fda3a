"""`ds-plugin bench kernel-resources` and `ds-plugin bench kernels` on CPU (from tests/kernels/test_quant_linear.py).

kernel-resources builds the GEMM kernels for sm_90 with the ptxas Triton ships, so the compiler's rules (which the
interpreter never applies) are checked without a GPU: a few builds here, every candidate tiling in the `long` tier.
kernels runs its whole timing loop under Triton's interpreter with a stand-in timer.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("triton")

from ds_plugin.kernels import quant_linear_triton as qlt

FORMATS = ["fp6", "int4", "int8"]


@pytest.fixture
def interpreter(monkeypatch):
    if problem := qlt.interpreter_problem():
        pytest.skip(problem)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert qlt.interpreter_enabled()


@pytest.fixture
def compiled(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


# ------------------------------------------------------------------------------- ds-plugin bench kernel-resources


def test_kernels_compile_for_hopper_without_a_gpu(compiled):
    # The interpreter never runs Triton's compiler, whose rules differ (static branches, types, layouts); this
    # builds sm_90 cubins on CPU with the ptxas triton ships (Triton 3.6 and 3.9 alike), so those errors show up
    # without a GPU. The builds are of the launches themselves (Launch.specialisation): with a bias, int4 zeros,
    # split-K's fp32 output.
    pytest.importorskip("triton.backends.nvidia")
    from benchmarks.kernel_resources import compile_for

    try:
        compile_for("fwd", "int8", "bf16", qlt.forward_configs(1, 128, 8192)[0])
    except (FileNotFoundError, RuntimeError) as e:  # no ptxas in this triton build
        if "ptxas" in str(e):
            pytest.skip(f"cannot compile for sm_90 here: {e}")
        raise
    compile_for("fwd", "fp6", "bf16", qlt.forward_configs(1, 128, 8192)[0], bias="bf16")
    split = next(c for c in qlt.forward_configs(1, 64, 8192) if c.split_k > 1)
    compile_for("fwd", "int4", "bf16", split, group=64)
    compile_for("fwd", "int4", "fp16", qlt.forward_configs(4096, 64, 8192)[2], group=64)
    compile_for("bwd", "fp6", "fp16", qlt.backward_configs(4096)[0])


def test_compile_for_builds_the_launch_the_op_issues(compiled, monkeypatch):
    # kernel-resources' launch (meta tensors) and the op's real launch on the same shapes specialise alike:
    # same signature, constexprs and divisibility hints, so the sm_90 report is of what the GPU will run.
    pytest.importorskip("triton.backends.nvidia")
    from benchmarks.kernel_resources import launch_for
    from ds_plugin.quant.frozen.codecs import quantize_weight

    launched = []
    monkeypatch.setattr(qlt.Launch, "run", lambda self: launched.append(self))
    n, k, m = 256, 512, 16
    split = next(c for c in qlt.forward_configs(1, 64, k) if c.split_k > 1)
    cases = [
        ("fwd", "int4", "bf16", split, 64, None),
        ("fwd", "int8", "fp16", qlt.Config(16, 64, 128), 128, "fp16"),
        ("fwd", "fp6", "bf16", qlt.Config(64, 64, 64), 128, "fp32"),
        ("bwd", "int4", "fp16", qlt.Config(16, 64, 64), 64, None),
    ]
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    for kind, fmt, dtype, cfg, group, bias in cases:
        parts = quantize_weight(torch.randn(n, k), fmt, group)
        weight = (parts["codes"], parts["scales"], parts.get("zeros"), group)
        if kind == "fwd":
            b = None if bias is None else torch.randn(n).to(dtypes[bias])
            qlt.linear_forward(torch.randn(m, k).to(dtypes[dtype]), fmt, *weight, b, config=cfg)
        else:
            qlt.linear_backward(torch.randn(m, n).to(dtypes[dtype]), fmt, *weight, k, config=cfg)
        real = launched.pop().specialisation(90)
        built = launch_for(kind, fmt, dtype, cfg, group, bias=bias, n=n, k=k, m=m).specialisation(90)
        assert built[:3] == real[:3], (kind, fmt, dtype, bias)
        assert built[3].__dict__ == real[3].__dict__


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
    graph = ["graph_latency_us", "bf16_graph_latency_us", "graph_error"]
    assert all(list(r) == [*keys, "backend", *(graph if (r["pass"], r["M"]) == ("fwd", 1) else [])] for r in rows)
    # Off CUDA nothing is timed from a graph, and each row says why.
    assert {(r["graph_latency_us"], r["graph_error"]) for r in rows if "graph_error" in r} == {
        (None, "needs a CUDA GPU")
    }
    assert {r["backend"] for r in rows} == {"triton"} and bench.check_kernel_rows(rows) == []
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


def test_bench_kernels_graph_times_at_chosen_m(interpreter, monkeypatch):
    # The device-only latencies go on the forward rows with M in GRAPH_M_VALUES, each from its own capture: ours
    # per format, bf16's once per M.
    from benchmarks import kernels as bench

    monkeypatch.setattr(bench, "_median_us", lambda fn: fn() is None or 10.0)
    captured = []

    def graph_us(fn):
        fn()
        captured.append(fn)
        return float(len(captured)), None

    monkeypatch.setattr(bench, "_graph_us", graph_us)
    monkeypatch.setattr(bench, "GRAPH_M_VALUES", (1,))
    rows = bench.benchmark(torch.device("cpu"), ((32, 128),), (1, 3), formats=("int4", "fp6"), gemlite=False,
                           backward_m=3)  # fmt: skip
    timed = [
        (r["kernel"], r["M"], r["graph_latency_us"], r["bf16_graph_latency_us"]) for r in rows if "graph_error" in r
    ]
    assert timed == [("int4", 1, 2.0, 1.0), ("fp6", 1, 3.0, 1.0)]  # M = 3 and the backward: none
    assert len(captured) == 3


def test_check_kernel_rows_names_each_row_the_kernels_did_not_serve():
    from benchmarks.kernels import check_kernel_rows

    def row(kernel, backend, m=1, kind="fwd"):
        return {"kernel": kernel, "N": 8192, "K": 8192, "M": m, "pass": kind, "backend": backend}

    rows = [row("fp6", "triton"), row("int4", "reference", 16), row("int8", "triton", 4096, "bwd")]
    rows += [row("gemlite_int4", "reference"), {k: v for k, v in row("int8", "-").items() if k != "backend"}]
    assert check_kernel_rows(rows) == [
        "int4 fwd N=8192 K=8192 M=16: backend 'reference', not 'triton'",
        "int8 fwd N=8192 K=8192 M=1: backend None, not 'triton'",
    ]


class _Broken:
    # A kernel module whose launches all fail, as a Triton or driver these kernels never met would.
    @staticmethod
    def forward_configs(*args):
        return [None]

    backward_configs = forward_configs

    @staticmethod
    def linear_forward(*args, **kwargs):
        raise RuntimeError("no such device feature")

    linear_backward = linear_forward


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    # main() on CPU as on a GPU: the device is the CPU under a GPU's name, do_bench a stand-in timer.
    from benchmarks import kernels as bench
    from ds_plugin.quant.frozen import linear_op

    monkeypatch.setattr(bench, "_cuda_device", lambda: (torch.device("cpu"), "NVIDIA H100 80GB HBM3"))
    monkeypatch.setattr(bench, "_median_us", lambda fn: fn() is None or 1.0)
    monkeypatch.setattr(linear_op, "_state", linear_op._new_state())
    monkeypatch.delenv("DS_PLUGIN_STRICT_KERNELS", raising=False)
    args = ["--shapes", "32x128", "--m", "3", "--no-gemlite", "--json", "--out-dir", str(tmp_path)]
    return bench, linear_op, args


def test_bench_kernels_strict_turns_a_failing_kernel_into_an_error(fake_gpu, monkeypatch, capsys):
    bench, linear_op, args = fake_gpu
    monkeypatch.setattr(linear_op, "kernel_backend", lambda t, fmt, *a: _Broken)
    assert bench.main(args) == 1
    err = capsys.readouterr().err
    assert "ds-plugin bench kernels: quantized_linear: the fwd Triton kernel failed for fp6 weights" in err
    assert "no such device feature" in err
    assert "DS_PLUGIN_STRICT_KERNELS" not in os.environ  # restored after main


def test_bench_kernels_fails_naming_the_rows_the_reference_served(fake_gpu, monkeypatch, capsys):
    # --allow-fallback: the failing kernels fall back, their rows say so, and the run still fails, naming them.
    bench, linear_op, args = fake_gpu
    monkeypatch.setattr(linear_op, "kernel_backend", lambda t, fmt, *a: _Broken)
    assert bench.main([*args, "--formats", "int4", "--m", "3,4096", "--allow-fallback"]) == 1
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["strict"] is False
    assert [(r["kernel"], r["pass"], r["M"], r["backend"]) for r in report["rows"]] == [
        ("int4", "fwd", 3, "reference"), ("int4", "fwd", 4096, "reference"), ("int4", "bwd", 4096, "reference")
    ]  # fmt: skip
    assert "3 rows did not run the Triton kernels" in err
    assert "int4 bwd N=32 K=128 M=4096: backend 'reference', not 'triton'" in err


def test_bench_kernels_passes_when_the_kernels_ran(interpreter, fake_gpu, tmp_path, capsys):
    bench, _, args = fake_gpu
    assert bench.main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["strict"] is True and len(report["rows"]) == 3
    assert {r["backend"] for r in report["rows"]} == {"triton"}
    assert json.loads(next(tmp_path.glob("kernels-*.json")).read_text())["rows"] == report["rows"]


def test_gpu_check_names_rows_the_kernels_did_not_serve():
    from benchmarks.gpu_check import check_rows

    report = {
        "runs": [
            {"numel": 1 << 20, "bits": 8, "backend": "triton"},
            {"numel": 1 << 20, "bits": 4, "backend": "reference"},
        ],
        "linear": [{"format": "fp6", "backend": "triton"}, {"format": "int4"}],
    }
    assert check_rows(report) == [
        "quantizer numel=1048576 bits=4: not served by the Triton kernels",
        "linear int4: not served by the Triton kernels",
    ]
