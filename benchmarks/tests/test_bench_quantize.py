"""`ds-plugin bench quantize`: its JSON report at a tiny size (speeds are printed, never asserted)."""

from __future__ import annotations

import json

import torch

from benchmarks import quantize as bench_quantize
from ds_plugin.cli import load_benchmark


def test_json_report_at_a_tiny_size(capsys) -> None:
    threads = torch.get_num_threads()
    try:
        assert bench_quantize.main(["--json", "--rows", "4", "--repeats", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(capsys.readouterr().out)
    assert report["threads"] == 1
    assert report["weights"]["shapes"] == [[4, 4096], [4, 4096], [4, 11008]]
    rows = report["formats"]
    assert [(r["format"], r["method"]) for r in rows] == list(bench_quantize.CASES)
    bound = {"int8": 0.03, "fp6": 0.06, "int4": 0.25, "nf4": 0.2}  # relative error, Llama-like weights
    for r in rows:
        assert set(r) >= {"format", "mb_per_s", "rel_error", "threads", "bytes", "seconds", "target_mb_per_s"}
        assert r["bytes"] == 2 * 4 * (4096 + 4096 + 11008) and r["threads"] == 1
        assert r["mb_per_s"] > 0 and r["meets_target"] == (r["mb_per_s"] >= r["target_mb_per_s"])
        assert 0 < r["rel_error"] < bound[r["format"]], r
    by_case = {(r["format"], r["method"]): r["rel_error"] for r in rows}
    assert by_case[("int4", "search")] < by_case[("int4", "absmax")]  # the search pays for itself
    assert by_case[("int8", "absmax")] < by_case[("fp6", "absmax")] < by_case[("int4", "search")]


def test_registered_with_the_cli() -> None:
    assert load_benchmark("quantize") is bench_quantize
