"""`ds-plugin bench peers --sizes ... --world-sizes ...`: the scaling rows, the chart, and the runs it skips."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import benchmarks._peers_scaling as scaling
from benchmarks import peers

RESULTS = Path(__file__).resolve().parents[1] / "results"

ROW_KEYS = {"size", "params", "world_size", "name", "dtype", "median_step_s", "tokens_per_s_per_rank", "peak_rss_mb"}


@pytest.mark.timeout(600)
def test_tiny_scaling_run(tmp_path, capsys):
    out, png = tmp_path / "peers.json", tmp_path / "peers.png"
    argv = ["--sizes", "16m", "--world-sizes", "1", "2", "--names", "ddp", "ds_plugin_zero3", "--dtypes", "fp32"]
    argv += ["--warmup", "1", "--steps", "1", "--repeats", "1", "--json", "--out", str(out), "--png", str(png)]
    assert peers.main(argv) == 0
    captured = capsys.readouterr()
    assert "roughly" in captured.err  # the duration estimate, before the runs
    report = json.loads(out.read_text())
    assert json.loads(captured.out) == report
    assert [(r["setup"]["size"], r["setup"]["world_size"]) for r in report["reports"]] == [("16m", 1), ("16m", 2)]
    assert report["setup"]["threads_per_rank"] == 1 and report["setup"]["cpus"] == os.cpu_count()
    rows = report["scaling"]
    assert [(r["world_size"], r["name"]) for r in rows] == [
        (1, "ddp"),
        (1, "ds_plugin_zero3"),
        (2, "ddp"),
        (2, "ds_plugin_zero3"),
    ]
    for row in rows:
        assert set(row) == ROW_KEYS, row
        assert row["size"] == "16m" and row["dtype"] == "fp32"
        assert row["params"] == scaling.meta_params("16m") and 16e6 < row["params"] < 17e6  # counted, GPT-2 16.3M
        assert 0 < row["median_step_s"] < 120
        assert row["tokens_per_s_per_rank"] == pytest.approx(4 * 128 / row["median_step_s"], rel=1e-3)
        assert 100 < row["peak_rss_mb"] < 20_000
    for r in report["reports"]:  # the per-(size, world size) reports keep today's keys
        assert {"runs", "comparisons", "setup", "scaling"} <= set(r)
        assert r["comparisons"]["fp32_final_loss"]["agree_to_5_decimals"]
        step = {run["name"]: run["median_step_s"] for run in r["runs"]}
        vs_ddp = r["comparisons"]["zero3_vs_ddp_step_fp32"]
        assert vs_ddp["ratio"] == round(step["ds_plugin_zero3"] / step["ddp"], 3) and vs_ddp["at_most"] == 1.05
        floor = r["compute_floor"]  # one process's forward+backward: about the step of the fastest config or below
        assert floor["what"].endswith("the chunked loss, the logits in column blocks where faster"), floor
        # Timed apart from the runs, so noise can put it a few percent above the fastest step at 1 rank (0.725 s
        # against 0.703 s once, 2026-12-06): the bound catches a floor measured wrongly, not the machine's jitter.
        assert 0 < floor["fp32"] < 1.5 * min(step.values()), floor
        assert r["setup"]["ds_plugin_blocked_logits"].startswith("on"), r["setup"]
    floors = [r["compute_floor"] for r in report["reports"]]
    assert floors[0] == floors[1]  # it does not depend on the world size: measured once per size
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_comparisons_hold_each_target():
    def run(name, dtype, step, rss=1000.0, loss=10.0):
        timing = {"median_step_cpu_s": step, "rep_median_step_s": [step]}
        return {"name": name, "dtype": dtype, "median_step_s": step, "peak_rss_mb": rss, "final_loss": loss} | timing

    runs = [
        run("ddp", "bf16", 1.0),
        run("deepspeed_zero3", "bf16", 1.0, rss=2000.0),
        run("ds_plugin_zero3", "bf16", 0.86, rss=1300.0),  # 0.86x DeepSpeed's step: over 0.85
        run("ds_plugin_zero2", "bf16", 1.02),  # exactly at its target
        run("ddp", "fp32", 2.0, loss=10.5),
        run("ds_plugin_zero1", "fp32", 2.1, loss=10.5 + 4e-6),  # slower than DDP
        {"name": "deepspeed_zero3", "dtype": "fp32", "skipped": "not installed"},
    ]
    got = peers._comparisons(runs)
    assert got["zero3_vs_deepspeed_zero3_step_bf16"] == {"ratio": 0.86, "at_most": 0.85, "met": False}
    assert got["zero3_vs_deepspeed_zero3_peak_rss_bf16"] == {"ratio": 0.65, "at_most": 0.7, "met": True}
    assert got["zero3_vs_ddp_step_bf16"] == {"ratio": 0.86, "at_most": 1.05, "met": True}
    assert got["zero2_vs_ddp_step_bf16"]["met"] is True
    assert got["zero1_vs_ddp_step_fp32"] == {"ratio": 1.05, "at_most": 1.0, "met": False}
    assert not any(k.endswith("_fp32") and "deepspeed" in k for k in got)  # a side that did not run: no entry
    assert got["fp32_final_loss"]["agree_to_5_decimals"] is True
    text = peers._table({"runs": runs, "comparisons": got})  # what `bench peers` prints without --json
    assert "zero3_vs_deepspeed_zero3_step_bf16: 0.860x (at most 0.85x: MISSED)" in text.splitlines()
    assert "zero2_vs_ddp_step_bf16: 1.020x (at most 1.02x: met)" in text.splitlines()
    assert text.splitlines()[-1].startswith("fp32 final losses agree with DDP's")


def test_run_that_would_not_fit_is_skipped_with_a_reason(monkeypatch):
    monkeypatch.setattr(scaling, "available_mb", lambda: 1024.0)  # 1 GB free: no 350m run fits
    report = peers.run(("ddp", "ds_plugin_zero3"), ("fp32",), warmup=0, steps=1, repeats=1, size="350m", world_size=4)
    assert report["setup"]["params"] == 354_823_168 and report["setup"]["oversubscribed"] == (4 > os.cpu_count())
    for row in report["scaling"]:
        assert row["world_size"] == 4 and "median_step_s" not in row
        assert row["reason"].startswith("not run: 4 ranks need ~") and "\n" not in row["reason"]
        assert row["reason"].endswith("more than 90% of the 1.0 GB available")


def test_memory_estimates_cover_the_measured_peaks():
    # The guard starts a run when its estimate fits in 90% of the memory available: an estimate under 90% of what
    # a run really holds could start ranks the machine cannot hold. Checked against every measured row.
    with open(RESULTS / "peers_scaling_cpu.json") as fh:
        report = json.load(fh)
    tokens = report["setup"]["micro_batch"] * report["setup"]["seq"]
    rows = [r for r in report["scaling"] if "peak_rss_mb" in r]
    assert {r["size"] for r in rows} == {"16m", "124m", "350m"} and {r["world_size"] for r in rows} == {1, 2, 4}
    for r in rows:
        est = scaling.estimate_rank_mb(r["name"], r["dtype"], r["size"], r["world_size"], r["params"], tokens)
        assert est >= 0.9 * r["peak_rss_mb"], (r["size"], r["world_size"], r["name"], est, r["peak_rss_mb"])


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--sizes", "1b"], "--sizes"),
        (["--world-sizes", "0"], "--world-sizes"),
        (["--world-sizes", "2", "x"], "--world-sizes"),
    ],
)
def test_bad_sizes_are_one_line(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        peers.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and f"argument {flag}:" in err


def _fake_run(calls):
    def run(names, dtypes, **kw):
        calls.append((kw["size"], kw["world_size"], kw["warmup"], kw["steps"], kw["repeats"]))
        setup = {"size": kw["size"], "model": "m", "world_size": kw["world_size"], "threads_per_rank": 1, "cpus": 2}
        setup |= {"oversubscribed": False, "warmup_steps": kw["warmup"], "timed_steps": kw["steps"], "seq": 128}
        setup |= {"micro_batch": 4, "optimizer": "o", "host_memory_reuse": "on"}
        meta = {"ds_plugin": None, "torch": None, "deepspeed": None, "date": None}
        return {
            "runs": [],
            "comparisons": {},
            "setup": setup,
            "machine": {"load_avg_1min_end": 0},
            "scaling": [],
        } | meta

    return run


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], [("16m", 2, 3, 12, 3)]),  # today's run, unchanged
        (
            ["--sizes", "124m", "350m", "--world-sizes", "1", "4", "--steps", "2", "--repeats", "1"],
            [("124m", 1, 3, 2, 1), ("124m", 4, 3, 2, 1), ("350m", 1, 3, 2, 1), ("350m", 4, 3, 2, 1)],
        ),
        (["--sizes", "350m", "--warmup", "0"], [("350m", 2, 0, 3, 3)]),
    ],
)
def test_flags_pick_the_runs(monkeypatch, capsys, argv, expected):
    calls = []
    monkeypatch.setattr(peers, "run", _fake_run(calls))
    assert peers.main([*argv, "--dtypes", "fp32", "--json"]) == 0
    assert calls == expected
    report = json.loads(capsys.readouterr().out)
    assert ("reports" in report) == (len(expected) > 1)
