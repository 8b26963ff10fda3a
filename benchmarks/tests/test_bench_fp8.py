"""`ds-plugin bench fp8`: says so without a GPU, and its timing loop runs end to end on CPU (moved from
tests/precision/test_fp8.py)."""

from __future__ import annotations

import json

import torch

from benchmarks import fp8 as bench_fp8


def test_bench_skips_without_gpu(monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_fp8.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"skipped": "needs a CUDA GPU"}
    assert bench_fp8.main([]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_bench_runs_tiny_on_cpu() -> None:
    results = bench_fp8.benchmark("cpu", hidden=128, layers=1, steps=4, batch_tokens=128, warmup=1)
    assert set(results) == {"bf16", "tensorwise", "rowwise", "blockwise"}
    for name in ("tensorwise", "rowwise", "blockwise"):
        assert results[name]["step_s"] > 0 and results[name]["speedup_vs_bf16"] > 0
        assert 0 <= results[name]["loss_rel_diff"] < 0.05
