"""`ds-plugin bench peers --sizes ... --world-sizes ...`: the scaling rows, the chart, and the runs it skips."""

from __future__ import annotations

import json
import os

import pytest

import benchmarks._peers_scaling as scaling
from benchmarks import peers

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
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_that_would_not_fit_is_skipped_with_a_reason(monkeypatch):
    monkeypatch.setattr(scaling, "available_mb", lambda: 1024.0)  # 1 GB free: no 350m run fits
    report = peers.run(("ddp", "ds_plugin_zero3"), ("fp32",), warmup=0, steps=1, repeats=1, size="350m", world_size=4)
    assert report["setup"]["params"] == 354_823_168 and report["setup"]["oversubscribed"] == (4 > os.cpu_count())
    for row in report["scaling"]:
        assert row["world_size"] == 4 and "median_step_s" not in row
        assert row["reason"].startswith("not run: 4 ranks need ~") and "\n" not in row["reason"]


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
            [("124m", 1, 2, 2, 1), ("124m", 4, 2, 2, 1), ("350m", 1, 1, 2, 1), ("350m", 4, 1, 2, 1)],
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
