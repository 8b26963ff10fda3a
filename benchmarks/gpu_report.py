"""`benchmarks/gpu_check.sh`'s report: the steps' outputs merged into one `gpu_check.json` (and `gpu_check.png`).

    python -m benchmarks.gpu_report env --mode gpu            # device, versions, date as JSON (imports torch)
    python -m benchmarks.gpu_report merge --work DIR --out DIR --mode gpu [--final]

`merge` reads the step table the script writes (`steps.tsv`: name, rc, seconds, limit, reason) and each step's
output in the work folder, and writes `gpu_check.json` with every field of `skeleton()` present: a figure the run
could not measure is null with a "reason" beside it. It runs after every step (without torch: fast), so a run cut
short still leaves the figures of the steps that finished; `--final` also draws the PNG, prints the verdict and
exits 1 when anything failed:

* a step that exited non-zero or ran past its time limit;
* on a GPU: no CUDA device in `env`, a `gpu` tier with no test passed, a kernel benchmark row whose "backend" is
  not "triton" (a missing field counts as not), a LoRA run whose int8/int4/fp6 linears did not launch the kernels;
* in either mode: a failed check of the training step (finite losses, a moving adapter, each kernel format's losses
  within the stated distance of the same format's run on the torch reference).

The Acceptance targets of issue 14/19 are recorded with their measured figure and `met`; a missed target is not a
failure of the check (the figure is the finding), a missing figure is null with its reason.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

# Step names in run order, as gpu_check.sh names them (its GPU_CHECK_STEPS / GPU_CHECK_FAIL_STEP take these).
STEPS = ("env", "gpu_tests", "bench_kernels", "quantizer", "fp8", "train", "big_model")
# benchmarks.gpu_train.FORMATS and ds_plugin.precision.fp8.RECIPES (this module stays torch-free; a test holds
# them equal).
LORA_FORMATS = ("bf16", "int8", "int4", "nf4", "fp6")
FP8_RECIPES = ("tensorwise", "rowwise", "blockwise")
# A kernel format's run again on the torch reference (benchmarks/gpu_train.py): its losses and the match.
REFERENCE_FIELDS = (
    "reference_losses",
    "reference_tokens_per_s",
    "first_loss_rel_diff_vs_reference",
    "loss_rel_diff_vs_reference",
    "reference_tolerance",
    "matches_reference",
)
LORA_FIELDS = (
    "tokens_per_s",
    "step_s",
    "peak_gpu_mb",
    "setup_peak_gpu_mb",
    "losses",
    "final_loss",
    "first_loss_rel_diff_vs_bf16",
    "loss_rel_diff_vs_bf16",
    *REFERENCE_FIELDS,
    "kernel_path",
    "kernel_evidence",
    "kernel_launches",
    "error",
    "reason",
)
STREAM_FIELDS = (
    "params",
    "world_size",
    "format",
    "checkpoint_bytes",
    "load_s",
    "quantize_s",
    "first_step_s",
    "step_s",
    "peak_rss_mb_per_rank",
    "peak_gpu_mb",
)
# (name, what, target, how it is measured): issue 14/19's Acceptance.
TARGETS = (
    ("fp6_gemm_m_le_16", "FP6 GEMM vs bf16 at M <= 16 on Llama-2-70B shapes (slowest row)", 2.2),
    ("int4_gemm_m_1", "INT4 GEMM vs bf16 at M = 1 on Llama-2-70B shapes (slowest row)", 3.0),
    ("lora_int4_vs_bf16", "LoRA step tokens/s, INT4 base vs bf16 base, batch x seq >= 4096", 0.8),
    ("lora_fp6_vs_bf16", "LoRA step tokens/s, FP6 base vs bf16 base, batch x seq >= 4096", 0.8),
    *((f"fp8_{r}_vs_bf16", f"FP8 ({r}) training step vs bf16 at hidden 4096", 1.3) for r in FP8_RECIPES),
)
CPU_REASON = "CPU dry run: measured on a GPU only"


def skeleton(mode: str) -> dict[str, Any]:
    """Every field of gpu_check.json, unmeasured (null, with a reason where a figure belongs).

    Args:
        mode: "gpu" or "dry-run".
    """
    todo = "step did not run"
    return {
        "what": "benchmarks/gpu_check.sh: every GPU check of ds_plugin in one run (see the README's GPU check)",
        "mode": mode,
        "ok": None,
        "complete": None,
        "failed_steps": [],
        "failures": [],
        "date": datetime.date.today().isoformat(),
        "device": {
            "name": None,
            "capability": None,
            "driver": None,
            "torch": None,
            "triton": None,
            "cuda": None,
            "reason": todo,
        },
        "settings": {
            "strict_kernels": os.environ.get("DS_PLUGIN_STRICT_KERNELS"),
            "kernel_autotune": None,
            "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR"),
        },
        "steps": {
            s: {"status": "not run", "rc": None, "seconds": None, "limit_s": None, "reason": todo} for s in STEPS
        },
        "gpu_tests": {"tests": None, "passed": None, "failed": None, "errors": None, "skipped": None, "reason": todo},
        "kernels": {"rows": None, "row_count": None, "non_triton_rows": None, "reason": todo},
        "quantizer": {"result": None, "reason": todo},
        "fp8": {
            "hidden": None,
            "layers": None,
            "steps": None,
            "batch_tokens": None,
            "bf16_step_s": None,
            "recipes": {r: {"step_s": None, "speedup_vs_bf16": None, "loss_rel_diff": None} for r in FP8_RECIPES},
            "reason": todo,
        },
        "lora": {
            "model": None,
            "backend": None,
            "tokens_per_step": None,
            "steps": None,
            "warmup_steps": None,
            "kernel_autotune": None,
            "formats": {f: dict.fromkeys(LORA_FIELDS) | {"reason": todo} for f in LORA_FORMATS},
            "checks": [],
            "reason": todo,
        },
        "streaming_load": dict.fromkeys(STREAM_FIELDS) | {"raw": None, "reason": todo},
        "targets": {
            name: {"what": what, "target": t, "measured": None, "met": None, "reason": todo}
            for name, what, t in TARGETS
        },
        "png": {"file": None, "reason": "drawn at the end of the run"},
    }


# --------------------------------------------------------------------------------------------------- reading steps
def _json(path: Path) -> Any:
    """A step's JSON output; None when missing or not JSON (its log says why)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _steps(report: dict[str, Any], work: Path) -> None:
    table = work / "steps.tsv"
    lines = table.read_text().splitlines() if table.exists() else []
    for line in lines:
        name, rc, seconds, limit, reason = (line.split("\t") + [""] * 5)[:5]
        entry = report["steps"].setdefault(name, {})
        if rc == "skip":
            entry.update(status="skipped", rc=None, seconds=0, limit_s=int(limit), reason=reason)
            continue
        code = int(rc)
        status = "passed" if code == 0 else "timed out" if code in (124, 137) else "failed"
        why = None if code == 0 else f"ran past its {limit} s limit" if status == "timed out" else f"exit status {code}"
        entry.update(status=status, rc=code, seconds=int(seconds), limit_s=int(limit), reason=why)
    report["complete"] = all(e["status"] in ("passed", "skipped") for e in report["steps"].values()) and not any(
        e["status"] == "skipped" and (e["reason"] or "").startswith("not selected") for e in report["steps"].values()
    )


def _step_reason(report: dict[str, Any], name: str) -> str:
    entry = report["steps"][name]
    if entry["status"] == "skipped":
        return entry["reason"]
    if entry["status"] == "not run":
        return "step did not run"
    return f"the {name} step {entry['status']} ({entry['reason']}); see steps.log" if entry["reason"] else ""


def _env(report: dict[str, Any], work: Path) -> None:
    env = _json(work / "env.stdout")
    if env:
        report["device"].update({k: env.get(k) for k in report["device"]})
        missing = [k for k, v in report["device"].items() if v is None and k != "reason"]
        if missing and not report["device"]["reason"]:
            report["device"]["reason"] = f"not reported: {', '.join(missing)}"
    else:
        report["device"]["reason"] = _step_reason(report, "env") or "env.json missing"


def _gpu_tests(report: dict[str, Any], work: Path) -> None:
    section = report["gpu_tests"]
    try:
        root = ET.parse(work / "gpu_tests.xml").getroot()
    except (OSError, ET.ParseError):
        section["reason"] = _step_reason(report, "gpu_tests") or "pytest wrote no junit XML"
        return
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    section.update(
        tests=count["tests"],
        failed=count["failures"],
        errors=count["errors"],
        skipped=count["skipped"],
        passed=count["tests"] - count["failures"] - count["errors"] - count["skipped"],
        reason=None if report["mode"] == "gpu" else "CPU dry run: the gpu tier skips without a GPU",
    )


def _kernels(report: dict[str, Any], work: Path) -> None:
    section = report["kernels"]
    files = sorted(glob.glob(str(work / "kernels" / "kernels-*.json")))
    data = _json(Path(files[-1])) if files else None
    if not data or "rows" not in data:
        stdout = (work / "bench_kernels.stdout").read_text() if (work / "bench_kernels.stdout").exists() else ""
        cpu = "needs a CUDA GPU" in stdout
        section["reason"] = "needs a CUDA GPU" if cpu else (_step_reason(report, "bench_kernels") or "no rows")
        return
    rows = data["rows"]
    section.update(
        rows=rows,
        row_count=len(rows),
        non_triton_rows=sum(r.get("backend") != "triton" for r in rows if r.get("kernel") != "gemlite_int4"),
        reason=None,
    )


def _quantizer(report: dict[str, Any], work: Path) -> None:
    data = _json(work / "quantizer.stdout")
    report["quantizer"].update(result=data, reason=None if data else _step_reason(report, "quantizer") or "no JSON")


def _fp8(report: dict[str, Any], work: Path) -> None:
    section, data = report["fp8"], _json(work / "fp8.stdout")
    if not data or "results" not in data:
        section["reason"] = (data or {}).get("skipped") or _step_reason(report, "fp8") or "no JSON"
        return
    results = data["results"]
    section.update({k: data["config"].get(k) for k in ("hidden", "layers", "steps", "batch_tokens")})
    section["bf16_step_s"] = results.get("bf16", {}).get("step_s")
    for recipe, entry in section["recipes"].items():
        entry.update({k: results.get(recipe, {}).get(k) for k in entry})
    section["reason"] = None


def _lora(report: dict[str, Any], work: Path) -> None:
    section, data = report["lora"], _json(work / "train.json")
    if not data:
        section["reason"] = _step_reason(report, "train") or "no JSON"
        return
    for key in ("model", "backend", "tokens_per_step", "steps", "warmup_steps", "kernel_autotune", "checks"):
        section[key] = data.get(key)
    for fmt, entry in section["formats"].items():
        run = data["formats"].get(fmt)
        if run is None:
            entry["reason"] = _step_reason(report, "train") or f"{fmt} not in this run"
            continue
        entry.update({k: run.get(k) for k in LORA_FIELDS if k != "reason"})
        entry["reason"] = _lora_reason(fmt, entry, run)
    section["reason"] = None if len(data["formats"]) == len(LORA_FORMATS) else _step_reason(report, "train")


def _lora_reason(fmt: str, entry: dict[str, Any], run: dict[str, Any]) -> str | None:
    """Why a format's null figures are null, one clause per kind."""
    if entry["error"]:
        return f"the run failed: {entry['error']}"
    missing = {k for k in LORA_FIELDS if k not in ("reason", "error") and entry[k] is None}
    reasons = []
    if missing & {"peak_gpu_mb", "setup_peak_gpu_mb"}:
        reasons.append("GPU memory: CPU run")
        missing -= {"peak_gpu_mb", "setup_peak_gpu_mb"}
    if missing & {"kernel_path", "kernel_evidence", "kernel_launches"}:
        why = run.get("kernel_reason") or (
            "no launch counter in this checkout" if entry["kernel_path"] else "no kernel path recorded"
        )
        reasons.append(f"kernels: {why}")
        missing -= {"kernel_path", "kernel_evidence", "kernel_launches"}
    elif run.get("kernel_reason"):
        reasons.append(f"kernels: {run['kernel_reason']}")
    bf16_fields = {"first_loss_rel_diff_vs_bf16", "loss_rel_diff_vs_bf16"}
    if missing & bf16_fields:
        reasons.append(
            "loss distance: the bf16 run is the reference" if fmt == "bf16" else "loss distance: no bf16 run"
        )
        missing -= bf16_fields
    if missing & set(REFERENCE_FIELDS):
        if fmt in ("bf16", "nf4"):
            why = "no kernel: this run is on the torch reference itself"
        else:
            why = run.get("reference_error") or "no reference run"
        reasons.append(f"torch-reference run: {why}")
        missing -= set(REFERENCE_FIELDS)
    if missing:
        reasons.append(f"not recorded: {', '.join(sorted(missing))}")
    return "; ".join(reasons) or None


def _streaming(report: dict[str, Any], work: Path) -> None:
    section, data = report["streaming_load"], _json(work / "big_model.stdout")
    if not isinstance(data, dict):
        section["reason"] = _step_reason(report, "big_model") or "no JSON"
        return
    streaming_figures(section, data)


def streaming_figures(section: dict[str, Any], data: dict[str, Any]) -> None:
    """Fill the streaming-load section from benchmarks/big_model.py's JSON (its first run: the one format asked for).

    Args:
        section: the report's "streaming_load" (every `STREAM_FIELDS` key, "raw", "reason").
        data: what big_model printed: {"runs": [{params, load_s, ...}], ...}.
    """
    runs = data.get("runs") or [{}]
    section.update({k: runs[0].get(k) for k in STREAM_FIELDS}, raw=data)
    missing = [k for k in STREAM_FIELDS if section[k] is None]
    section["reason"] = f"not printed by benchmarks/big_model.py: {', '.join(missing)}" if missing else None


# ----------------------------------------------------------------------------------------------------- verdicts
def _slowest(rows: list[dict[str, Any]] | None, kernel: str, pick) -> float | None:
    picked = [
        r["speedup_vs_bf16"] for r in rows or () if r.get("kernel") == kernel and r.get("pass") == "fwd" and pick(r)
    ]
    return min(picked) if picked else None


def _targets(report: dict[str, Any]) -> None:
    rows = report["kernels"]["rows"]
    lora = report["lora"]["formats"]

    def ratio(fmt: str) -> float | None:
        a, b = lora[fmt]["tokens_per_s"], lora["bf16"]["tokens_per_s"]
        return a / b if a and b else None

    measured = {
        "fp6_gemm_m_le_16": (_slowest(rows, "fp6", lambda r: r["M"] <= 16), report["kernels"]["reason"]),
        "int4_gemm_m_1": (_slowest(rows, "int4", lambda r: r["M"] == 1), report["kernels"]["reason"]),
        "lora_int4_vs_bf16": (ratio("int4"), report["lora"]["reason"]),
        "lora_fp6_vs_bf16": (ratio("fp6"), report["lora"]["reason"]),
        **{
            f"fp8_{r}_vs_bf16": (report["fp8"]["recipes"][r]["speedup_vs_bf16"], report["fp8"]["reason"])
            for r in FP8_RECIPES
        },
    }
    for name, entry in report["targets"].items():
        value, why = measured[name]
        if report["mode"] != "gpu":
            value, why = None, CPU_REASON
        entry.update(
            measured=value, met=None if value is None else value >= entry["target"], reason=None if value else why
        )


def _failures(report: dict[str, Any]) -> None:
    failures: list[tuple[str, str]] = []
    for name, entry in report["steps"].items():
        if entry["status"] in ("failed", "timed out"):
            failures.append((name, f"{name}: {entry['reason']}"))
    if report["mode"] == "gpu":
        if report["steps"]["env"]["status"] == "passed" and not report["device"]["name"]:
            failures.append(("env", "env: no CUDA device"))
        tests = report["gpu_tests"]
        if tests["tests"] is not None and not tests["passed"]:
            failures.append(("gpu_tests", "gpu_tests: no test of the gpu tier passed"))
        if report["kernels"]["non_triton_rows"]:
            failures.append(
                (
                    "bench_kernels",
                    f"bench_kernels: {report['kernels']['non_triton_rows']} rows not on the triton backend",
                )
            )
    # A step that exited 0 but left nothing the report could read has measured nothing: on a GPU that is a failure.
    unread = {
        "bench_kernels": report["kernels"]["rows"],
        "quantizer": report["quantizer"]["result"],
        "fp8": report["fp8"]["bf16_step_s"],
        "train": report["lora"]["model"],
        "big_model": report["streaming_load"]["raw"],
    }
    for name, value in unread.items():
        expected = report["mode"] == "gpu" or name == "train"
        if expected and value is None and report["steps"][name]["status"] == "passed":
            failures.append((name, f"{name}: exited 0 but left no output the report could read (see steps.log)"))
    for check in report["lora"]["checks"] or ():
        if not check["ok"]:
            failures.append(("train", f"train: {check['check']}: {check['detail']}"))
    report["failures"] = [why for _, why in failures]
    report["failed_steps"] = list(dict.fromkeys(name for name, _ in failures))
    report["ok"] = not failures


def merge(work: Path, out: Path, mode: str) -> dict[str, Any]:
    """Build the report from a work folder and write ``out/gpu_check.json``; returns it.

    Args:
        work: the script's work folder (steps.tsv and the steps' outputs).
        out: the output folder.
        mode: "gpu" or "dry-run".
    """
    report = skeleton(mode)
    report["settings"]["kernel_autotune"] = {
        "gpu_tests": "off (first-guess tiling)",
        "bench_kernels": "on",
        "quantizer": "off (first-guess tiling)",
        "train": "off (first-guess tiling)",
    }
    _steps(report, work)
    for read in (_env, _gpu_tests, _kernels, _quantizer, _fp8, _lora, _streaming):
        read(report, work)
    _targets(report)
    _failures(report)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    return report


# --------------------------------------------------------------------------------------------------------- chart
def plot(report: dict[str, Any], path: Path) -> str | None:
    """Draw the one PNG (kernel speedups, LoRA tokens/s and memory, LoRA losses, FP8 speedups); the reason when not.

    Args:
        report: a merged report.
        path: the PNG to write.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed here"
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (kern, tps), (loss, fp8) = axes
    rows = report["kernels"]["rows"] or []
    for fmt in sorted({r.get("kernel") for r in rows} - {None}):
        ms = sorted({r["M"] for r in rows if r.get("kernel") == fmt and r.get("pass") == "fwd"})
        kern.plot(ms, [_slowest(rows, fmt, lambda r, m=m: r["M"] == m) for m in ms], marker="o", label=fmt)
    kern.axhline(1.0, color="grey", lw=0.8)
    kern.set(xscale="log", title="GEMM vs bf16, slowest 70B shape (fwd)", xlabel="M", ylabel="speedup")
    _empty(kern, not rows, report["kernels"]["reason"])
    formats = report["lora"]["formats"]
    measured = [f for f in LORA_FORMATS if formats[f]["tokens_per_s"]]
    tps.bar(measured, [formats[f]["tokens_per_s"] for f in measured])
    if formats["bf16"]["tokens_per_s"]:
        tps.axhline(0.8 * formats["bf16"]["tokens_per_s"], color="grey", lw=0.8)  # the 0.8x-of-bf16 target
    for i, f in enumerate(measured):
        mem = formats[f]["peak_gpu_mb"]
        tps.annotate("" if mem is None else f"{mem / 1024:.1f} GiB", (i, formats[f]["tokens_per_s"]), ha="center")
    tps.set(title=f"LoRA step ({report['mode']}): tokens/s, peak memory", ylabel="tokens/s")
    _empty(tps, not measured, report["lora"]["reason"])
    for f in measured:
        loss.plot(formats[f]["losses"], label=f)
    loss.set(title="LoRA loss, same seed and data", xlabel="step", ylabel="loss")
    _empty(loss, not measured, report["lora"]["reason"])
    recipes = [r for r in FP8_RECIPES if report["fp8"]["recipes"][r]["speedup_vs_bf16"]]
    fp8.bar(recipes, [report["fp8"]["recipes"][r]["speedup_vs_bf16"] for r in recipes])
    fp8.axhline(1.3, color="grey", lw=0.8)
    fp8.set(title="FP8 step vs bf16 (hidden 4096)", ylabel="speedup")
    _empty(fp8, not recipes, report["fp8"]["reason"])
    for ax in (kern, loss):
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    device = report["device"]["name"] or "no GPU"
    fig.suptitle(f"gpu_check {report['mode']}: {device}, torch {report['device']['torch']}, {report['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def _empty(ax: Any, empty: bool, reason: str | None) -> None:
    if empty:
        ax.text(0.5, 0.5, f"not measured:\n{reason}", ha="center", va="center", wrap=True, transform=ax.transAxes)


# ----------------------------------------------------------------------------------------------------------- env
def environment(mode: str) -> dict[str, Any]:
    """Device name, capability, driver, torch/triton/CUDA versions (torch imported here).

    Args:
        mode: "gpu" or "dry-run" (only recorded in the reason when no GPU is visible).
    """
    import torch

    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": None, "reason": None}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["reason"] = "triton is not installed"
    if not torch.cuda.is_available():
        env.update(name=None, capability=None, driver=None, reason="no CUDA GPU visible")
        return env
    env["name"] = torch.cuda.get_device_name(0)
    env["capability"] = "sm_{}{}".format(*torch.cuda.get_device_capability(0))
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        env["driver"] = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["driver"] = None
    return env


def main(argv: list[str] | None = None) -> int:
    """`env` or `merge`; `merge --final` exits 1 when anything failed.

    Args:
        argv: command-line arguments (default: ``sys.argv[1:]``).
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_report", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="print the device and versions as JSON")
    env.add_argument("--mode", choices=("gpu", "dry-run"), default="gpu")
    m = sub.add_parser("merge", help="merge the steps' outputs into gpu_check.json")
    m.add_argument("--work", type=Path, required=True)
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--mode", choices=("gpu", "dry-run"), default="gpu")
    m.add_argument("--final", action="store_true", help="also draw the PNG, print the verdict, exit 1 on a failure")
    args = parser.parse_args(argv)
    if args.command == "env":
        info = environment(args.mode)
        print(json.dumps(info))
        if args.mode == "gpu" and info["name"] is None:
            print(
                "gpu_check: no CUDA GPU is visible; on a CPU machine run `bash benchmarks/gpu_check.sh --dry-run`",
                file=sys.stderr,
            )
            return 1
        return 0
    report = merge(args.work, args.out, args.mode)
    if not args.final:
        return 0
    why = plot(report, args.out / "gpu_check.png")
    report["png"] = {"file": None if why else "gpu_check.png", "reason": why}
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    for entry in report["targets"].values():
        if entry["met"] is not None:
            print(f"target {entry['what']}: {entry['measured']:.2f} (target {entry['target']}) {_met(entry['met'])}")
    for why in report["failures"]:
        print(f"FAILED {why}")
    return 0 if report["ok"] else 1


def _met(met: bool) -> str:
    return "met" if met else "MISSED"


if __name__ == "__main__":
    sys.exit(main())
