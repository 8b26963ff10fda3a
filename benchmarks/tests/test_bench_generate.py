"""`ds-plugin bench generate`: its JSON report at a tiny size (times are reported, never asserted)."""

from __future__ import annotations

import json

from benchmarks import generate as bench_generate
from ds_plugin.cli import load_benchmark


def test_json_report_at_a_tiny_size(capsys, tmp_path) -> None:
    out = tmp_path / "generate.json"
    argv = ["--json", "--hidden", "64", "--layers", "2", "--vocab", "256", "--new-tokens", "5", "--repeats", "1"]
    assert bench_generate.main([*argv, "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == report
    assert report["world_size"] == 2 and report["new_tokens"] == 5 and report["model"]["layers"] == 2
    # Greedy fp32: gathering once, gathering per token and the unsharded copy give the same tokens on every rank.
    assert report["tokens_identical"] is True
    for key in ("per_token_gather_s", "gathered_s", "unsharded_s"):
        assert report[key] > 0 and len(report["per_rank"]) == 2
        assert report[key] == max(r[key] for r in report["per_rank"])
    assert report["speedup_vs_per_token"] == report["per_token_gather_s"] / report["gathered_s"]


def test_registered_with_the_cli() -> None:
    assert load_benchmark("generate") is bench_generate
