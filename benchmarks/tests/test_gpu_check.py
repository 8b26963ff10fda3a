"""`benchmarks/gpu_check.sh` on CPU: its dry run passes with every field of the JSON present, and a failing step,
a stand-in `pytest` that fails, or a step past its limit makes it exit 1 naming the step; its report fails GPU
runs whose kernels did not run or whose quantized loss is off; `gpu_train`'s checks and kernel-path evidence.

The script runs are `long` (the dry run trains five tiny models and collects the whole test suite); the report's
and gpu_train's verdicts on made-up step outputs are quick.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import gpu_report, gpu_train

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
OUT_FILES = {"gpu_check.json", "gpu_check.png", "steps.log", "gpu_tests.log"}


def _run(out: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "OUT": str(out), "GPU_CHECK_PYTHON": sys.executable, "TMPDIR": str(out.parent), **env}
    for name in ("GPU_CHECK_STEPS", "GPU_CHECK_FAIL_STEP"):
        if name not in env:
            full.pop(name, None)
    return subprocess.run(["bash", str(SCRIPT), *args], env=full, capture_output=True, text=True, timeout=1500)


def _missing(expected: Any, got: Any, path: str = "") -> list[str]:
    """The fields of `expected` (a skeleton) absent from `got`, by dotted path."""
    if not isinstance(expected, dict):
        return []
    if not isinstance(got, dict):
        return [path or "."]
    out = []
    for key, value in expected.items():
        out += [f"{path}.{key}"] if key not in got else _missing(value, got[key], f"{path}.{key}")
    return out


def _unexplained_nulls(node: Any, path: str = "") -> list[str]:
    """Sections holding a null figure without a reason beside it."""
    if not isinstance(node, dict):
        return []
    out = []
    if "reason" in node and any(v is None for k, v in node.items() if k != "reason") and not node["reason"]:
        out.append(path or ".")
    for key, value in node.items():
        out += _unexplained_nulls(value, f"{path}.{key}")
    return out


@pytest.mark.long
@pytest.mark.timeout(1800)
def test_dry_run_passes_with_every_field(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _run(out, "--dry-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every step passed" in proc.stdout.splitlines()[-1]
    assert {p.name for p in out.iterdir()} <= OUT_FILES and len(list(out.iterdir())) <= 6
    report = json.loads((out / "gpu_check.json").read_text())
    assert _missing(gpu_report.skeleton("dry-run"), report) == []
    assert _unexplained_nulls(report) == []
    assert report["ok"] is True and report["complete"] is True and report["mode"] == "dry-run"
    assert report["settings"]["strict_kernels"] == "1"
    assert report["device"]["torch"] == torch.__version__ and report["date"]
    # Every step ran its CPU path or was skipped with its reason.
    for name, step in report["steps"].items():
        assert step["status"] in ("passed", "skipped"), (name, step)
        assert step["status"] == "passed" or step["reason"], (name, step)
    assert report["gpu_tests"]["tests"] > 0 and report["gpu_tests"]["failed"] == 0
    assert report["kernels"]["reason"] == report["fp8"]["reason"] == "needs a CUDA GPU"
    # The training plumbing ran every format through the engine, and the loss checks were made.
    lora = report["lora"]
    assert lora["backend"] == "gloo" and lora["checks"] and all(c["ok"] for c in lora["checks"])
    for fmt, run in lora["formats"].items():
        assert run["final_loss"] < run["losses"][0], fmt
        assert (fmt in gpu_train.KERNEL_FORMATS) == (run["matches_reference"] is True), fmt
    assert report["png"]["file"] == "gpu_check.png" and (out / "gpu_check.png").stat().st_size > 0


@pytest.mark.long
@pytest.mark.timeout(600)
def test_every_failing_step_fails_the_run_and_is_named(tmp_path: Path) -> None:
    # Every step's command replaced by one that exits 1, in one run: each must be recorded failed and named.
    out = tmp_path / "out"
    steps = ",".join(gpu_report.STEPS)
    proc = _run(out, "--dry-run", GPU_CHECK_STEPS=steps, GPU_CHECK_FAIL_STEP=steps)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1] == f"gpu_check.sh (dry-run): FAILED steps: {', '.join(gpu_report.STEPS)}"
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["ok"] is False and sorted(report["failed_steps"]) == sorted(gpu_report.STEPS)
    for step in gpu_report.STEPS:
        assert report["steps"][step]["status"] == "failed" and report["steps"][step]["rc"] == 1, step
    assert report["complete"] is False
    assert len(list(out.iterdir())) <= 6


@pytest.mark.long
@pytest.mark.timeout(600)
def test_one_failing_step_among_passing_ones_is_the_only_one_named(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _run(out, "--dry-run", GPU_CHECK_STEPS="env,fp8", GPU_CHECK_FAIL_STEP="fp8")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1] == "gpu_check.sh (dry-run): FAILED steps: fp8"
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["failed_steps"] == ["fp8"] and report["steps"]["env"]["status"] == "passed"


def _stand_in_python(tmp_path: Path, trigger: str, action: str) -> str:
    """An interpreter that does `action` when its arguments contain `trigger`, and is the real one otherwise."""
    path = tmp_path / "python"
    path.write_text(f'#!/usr/bin/env bash\ncase "$*" in *"{trigger}"*) {action} ;; esac\nexec {sys.executable} "$@"\n')
    path.chmod(0o755)
    return str(path)


@pytest.mark.long
@pytest.mark.timeout(600)
def test_a_failing_pytest_is_not_hidden(tmp_path: Path) -> None:
    python = _stand_in_python(tmp_path, "-m pytest", "echo '1 failed'; exit 1")
    proc = _run(tmp_path / "out", "--dry-run", GPU_CHECK_STEPS="gpu_tests", GPU_CHECK_PYTHON=python)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1] == "gpu_check.sh (dry-run): FAILED steps: gpu_tests"
    assert "1 failed" in (tmp_path / "out" / "gpu_tests.log").read_text()


@pytest.mark.long
@pytest.mark.timeout(600)
def test_a_step_past_its_limit_fails(tmp_path: Path) -> None:
    python = _stand_in_python(tmp_path, "bench fp8", "exec sleep 60")
    proc = _run(tmp_path / "out", "--dry-run", GPU_CHECK_STEPS="fp8", GPU_CHECK_PYTHON=python, GPU_CHECK_LIMIT_fp8="1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1] == "gpu_check.sh (dry-run): FAILED steps: fp8"
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["steps"]["fp8"]["status"] == "timed out" and report["steps"]["fp8"]["rc"] == 124


def test_unknown_argument_is_one_line() -> None:
    proc = subprocess.run(["bash", str(SCRIPT), "--gpu"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "--dry-run" in proc.stderr


# ------------------------------------------------------------------------- the report's verdicts on a GPU run
def _lora_run(fmt: str, tokens: float, loss: float, within: bool | None) -> dict[str, Any]:
    """One format's run as gpu_train records it; `within`: its match with the torch reference (kernel formats)."""
    kernel = fmt in gpu_train.KERNEL_FORMATS
    path = "triton" if kernel else None
    return {
        "tokens_per_s": tokens,
        "step_s": 4096 / tokens,
        "peak_gpu_mb": 9000.0,
        "setup_peak_gpu_mb": 3000.0,
        "losses": [loss + 1, loss],
        "final_loss": loss,
        "loss_rel_diff_vs_bf16": None if fmt == "bf16" else 0.3,
        "first_loss_rel_diff_vs_bf16": None if fmt == "bf16" else 0.05,
        "reference_losses": [loss + 1, loss] if kernel else None,
        "reference_tokens_per_s": 5000.0 if kernel else None,
        "first_loss_rel_diff_vs_reference": 0.001 if kernel else None,
        "loss_rel_diff_vs_reference": 0.01 if kernel else None,
        "reference_tolerance": gpu_train.REFERENCE_TOLERANCE if kernel else None,
        "matches_reference": within if kernel else None,
        "kernel_path": path,
        "kernel_evidence": None if path is None else "linear_op.kernel_launches()",
        "kernel_launches": None,
    }


def _gpu_work(tmp_path: Path, backend: str = "triton", passed: int = 8, check_ok: bool = True) -> Path:
    """A work folder as a finished GPU run leaves it."""
    work = tmp_path / "work"
    (work / "kernels").mkdir(parents=True)
    (work / "steps.tsv").write_text("".join(f"{s}\t0\t5\t100\t\n" for s in gpu_report.STEPS))
    env = {
        "name": "NVIDIA H200",
        "capability": "sm_90",
        "driver": "570",
        "torch": "2.11",
        "triton": "3.6",
        "cuda": "12",
    }
    (work / "env.stdout").write_text(json.dumps({**env, "reason": None}))
    (work / "gpu_tests.xml").write_text(
        f'<testsuites><testsuite tests="{passed + 1}" failures="0" errors="0" skipped="1"/></testsuites>'
    )
    rows = [
        {"kernel": k, "N": 8192, "K": 8192, "M": m, "pass": "fwd", "speedup_vs_bf16": s, "backend": backend}
        for k, m, s in (("fp6", 1, 2.5), ("fp6", 16, 2.0), ("int4", 1, 3.5), ("int8", 1, 1.8))
    ]
    (work / "kernels" / "kernels-nvidia-h200-2026-12-03.json").write_text(json.dumps({"rows": rows}))
    fp8 = {r: {"step_s": 0.1, "speedup_vs_bf16": 1.4, "loss_rel_diff": 0.01} for r in gpu_report.FP8_RECIPES}
    config = {"hidden": 4096, "layers": 4, "steps": 20, "batch_tokens": 8192}
    (work / "fp8.stdout").write_text(json.dumps({"config": config, "results": {"bf16": {"step_s": 0.14}, **fp8}}))
    formats = {f: _lora_run(f, 10000.0 if f == "bf16" else 9000.0, 7.0, check_ok) for f in gpu_report.LORA_FORMATS}
    checks = [{"check": "int4: every step's loss within 5% of the torch reference's", "ok": check_ok, "detail": "x"}]
    train = {
        "formats": formats,
        "checks": checks,
        "backend": "nccl",
        "model": {"params": 1.1e9},
        "steps": 8,
        "tokens_per_step": 4096,
        "warmup_steps": 2,
        "kernel_autotune": False,
    }
    (work / "train.json").write_text(json.dumps(train))
    (work / "quantizer.stdout").write_text(json.dumps({"runs": []}))
    stream = {"params": 7e9, "load_s": 30.0, "format": "int4", "peak_gpu_mb": 9000.0, "peak_rss_mb_per_rank": [2e3]}
    stream |= {k: 1 for k in ("world_size", "checkpoint_bytes", "quantize_s", "first_step_s", "step_s")}
    (work / "big_model.stdout").write_text(json.dumps({"benchmark": "big_model", "runs": [stream]}))  # its shape
    return work


def test_report_passes_a_good_gpu_run_and_grades_the_targets(tmp_path: Path) -> None:
    report = gpu_report.merge(_gpu_work(tmp_path), tmp_path, "gpu")
    assert report["ok"] is True and report["failures"] == [] and report["complete"] is True
    assert _missing(gpu_report.skeleton("gpu"), report) == [] and _unexplained_nulls(report) == []
    targets = report["targets"]
    assert targets["fp6_gemm_m_le_16"]["measured"] == 2.0 and targets["fp6_gemm_m_le_16"]["met"] is False
    assert targets["int4_gemm_m_1"]["met"] is True and targets["lora_int4_vs_bf16"]["measured"] == pytest.approx(0.9)
    assert targets["fp8_rowwise_vs_bf16"]["met"] is True
    assert report["streaming_load"]["load_s"] == 30.0 and report["device"]["name"] == "NVIDIA H200"


@pytest.mark.parametrize(
    ("change", "step", "words"),
    [
        ({"backend": "reference"}, "bench_kernels", "rows not on the triton backend"),
        ({"passed": 0}, "gpu_tests", "no test of the gpu tier passed"),
        ({"check_ok": False}, "train", "int4: every step's loss within 5% of the torch reference's"),
    ],
)
def test_report_fails_a_gpu_run_whose_kernels_or_loss_are_off(tmp_path: Path, change, step, words) -> None:
    report = gpu_report.merge(_gpu_work(tmp_path, **change), tmp_path, "gpu")
    assert report["ok"] is False and report["failed_steps"] == [step]
    assert words in report["failures"][0]
    assert gpu_report.main(["merge", "--work", str(tmp_path / "work"), "--out", str(tmp_path), "--final"]) == 1


def test_report_counts_a_row_without_backend_as_not_triton(tmp_path: Path) -> None:
    work = _gpu_work(tmp_path)
    path = work / "kernels" / "kernels-nvidia-h200-2026-12-03.json"
    data = json.loads(path.read_text())
    del data["rows"][0]["backend"]
    path.write_text(json.dumps(data))
    assert gpu_report.merge(work, tmp_path, "gpu")["kernels"]["non_triton_rows"] == 1


@pytest.mark.parametrize("name", ["fp8.stdout", "train.json", "big_model.stdout", "quantizer.stdout"])
def test_report_fails_a_step_that_passed_without_output(tmp_path: Path, name: str) -> None:
    work = _gpu_work(tmp_path)
    (work / name).write_text("Traceback: not JSON")
    step = name.split(".")[0]
    report = gpu_report.merge(work, tmp_path, "gpu")
    assert report["failed_steps"] == [step] and "left no output" in report["failures"][0]


def test_report_fails_a_gpu_run_without_a_gpu(tmp_path: Path) -> None:
    work = _gpu_work(tmp_path)
    (work / "env.stdout").write_text(json.dumps({"name": None, "reason": "no CUDA GPU visible"}))
    assert gpu_report.merge(work, tmp_path, "gpu")["failed_steps"] == ["env"]


def test_report_names_what_its_torch_free_copies_mirror() -> None:
    from ds_plugin.precision.fp8 import RECIPES

    assert gpu_report.LORA_FORMATS == gpu_train.FORMATS and gpu_report.FP8_RECIPES == RECIPES
    assert set(gpu_train.KERNEL_FORMATS) < set(gpu_train.FORMATS)


# --------------------------------------------------------------------------------------- gpu_train's verdicts
def _train_report(**int4: Any) -> dict[str, Any]:
    runs = {
        "bf16": {"losses": [8.0, 7.0], "final_loss": 7.0, "adapter_update_norm": 0.5, "kernel_path": None},
        "int4": {
            "losses": [8.1, 7.1],
            "final_loss": 7.1,
            "adapter_update_norm": 0.5,
            "kernel_path": "triton",
            "kernel_reason": None,
            "kernel_launches": {"fwd/int4": 3, "bwd/int4": 3},
            "reference_losses": [8.1, 7.12],
        }
        | int4,
    }
    return {"device_type": "cuda", "formats": runs}


def _failed(report: dict[str, Any]) -> list[str]:
    return [c["check"] for c in gpu_train.checks(report) if not c["ok"]]


def test_train_checks_pass_a_good_run_and_fail_each_fault() -> None:
    first = "int4: first-step loss within 0.5% of the torch reference's"
    every = "int4: every step's loss within 5% of the torch reference's"
    good = _train_report()
    assert _failed(good) == []
    assert good["formats"]["int4"]["matches_reference"] is True
    assert good["formats"]["int4"]["loss_rel_diff_vs_bf16"] == pytest.approx(0.1 / 7.0)  # recorded, not checked
    assert _failed(_train_report(final_loss=7.9, losses=[8.1, 7.9])) == [every]  # 11 % off the reference's 7.12
    assert _failed(_train_report(losses=[8.2, 7.1])) == [first]  # 1.2 % off at the first step
    assert _failed(_train_report(adapter_update_norm=0.0)) == ["int4: the optimizer steps train the adapter"]
    assert _failed(
        _train_report(kernel_path="reference", kernel_reason="no kernel launch recorded in both passes")
    ) == ["int4: the Triton kernels ran forward and backward"]
    assert _failed(_train_report(losses=[8.1, float("nan")], final_loss=float("nan"))) == [
        "int4: losses finite",
        "int4: the optimizer steps train the adapter",
        every,
    ]
    assert _failed(_train_report(reference_losses=None, reference_error="OutOfMemoryError: CUDA")) == [
        "int4: losses match the torch reference's"
    ]


def test_train_checks_fail_a_crashed_run() -> None:
    report = _train_report()
    report["formats"]["bf16"] = {"error": "OutOfMemoryError: CUDA out of memory"}
    assert _failed(report) == ["bf16: the run finished"]
    assert "loss_rel_diff_vs_bf16" not in report["formats"]["int4"]


@pytest.mark.parametrize(
    ("launched", "served", "path"),
    [
        (
            {("fwd", "int4"): 2, ("bwd", "int4"): 2},
            {("fwd", "int4", "triton"): 2, ("bwd", "int4", "triton"): 2},
            "triton",
        ),
        # the backward fell back: not the kernel path
        ({("fwd", "int4"): 2}, {("fwd", "int4", "triton"): 2, ("bwd", "int4", "reference"): 2}, "reference"),
        # launches in both passes, but one call served by the reference (a shape the kernels refused)
        ({("fwd", "int4"): 2, ("bwd", "int4"): 2}, {("fwd", "int4", "reference"): 1}, "reference"),
        # another format's launches are not this one's
        ({("fwd", "int8"): 2, ("bwd", "int8"): 2}, {}, "reference"),
    ],
)
def test_kernel_path_needs_launches_in_both_passes_and_no_reference_call(monkeypatch, launched, served, path) -> None:
    from ds_plugin.quant.frozen import linear_op

    monkeypatch.setattr(linear_op, "kernel_launches", lambda: launched)
    monkeypatch.setattr(linear_op, "backend_calls", lambda: served)
    record = gpu_train._kernel_path("int4", ({}, {}), torch.device("cuda"))
    assert record["kernel_path"] == path, record
    assert (record["kernel_reason"] is None) == (path == "triton")


def test_streaming_figures_read_what_big_model_printed_on_the_gpu() -> None:
    # The first GPU run's own big_model output (kept as "raw" in the committed report): every figure is found.
    committed = json.loads((Path(__file__).resolve().parents[1] / "results" / "gpu_check_h200.json").read_text())
    section = dict.fromkeys(gpu_report.STREAM_FIELDS) | {"raw": None, "reason": "unread"}
    gpu_report.streaming_figures(section, committed["streaming_load"]["raw"])
    assert section["reason"] is None and section["format"] == "int4" and section["load_s"] > 0
    assert section["params"] == committed["streaming_load"]["raw"]["runs"][0]["params"] > 1e9
