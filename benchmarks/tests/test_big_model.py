"""`python -m benchmarks.big_model` at a tiny width and one layer: the report's contract, the streamed load's
shares, a training step that changes the loss, the adapter reloaded bit for bit, and QLoRA's line.

Timings and RSS of a shared CI machine are reported by the benchmark, never asserted.
"""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.big_model import SEVEN_B, llama_tensors, main

pytestmark = [pytest.mark.slow, pytest.mark.long]

KEYS = {"params", "world_size", "format", "checkpoint_bytes", "load_s", "quantize_s", "first_step_s", "step_s",
        "peak_rss_mb_per_rank", "naive_fp32_bytes_per_rank"}  # fmt: skip
TINY = ["--layers", "1", "--hidden", "256", "--intermediate", "688", "--vocab", "1000", "--heads", "4"]


def test_seven_b_shape():
    # The checkpoint the full run writes has Llama-2-7B's parameter count.
    params = sum(math.prod(shape) for _, shape in llama_tensors(SEVEN_B))
    assert params == 6_738_415_616, params


def test_tiny_run(tmp_path, monkeypatch):
    monkeypatch.setenv("BIG_MODEL_DIR", str(tmp_path / "cache"))
    out = tmp_path / "big.json"
    assert main([*TINY, "--json", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["format"] for r in report["runs"]] == ["int4", "nf4"]
    files = list((tmp_path / "cache").glob("*/*.safetensors"))
    assert files, "no checkpoint written"
    for r in report["runs"]:
        assert KEYS <= set(r), r
        assert r["world_size"] == 2 and len(r["peak_rss_mb_per_rank"]) == 2, r
        for peak, phases in zip(r["peak_rss_mb_per_rank"], r["peak_rss_mb_after_phase_per_rank"], strict=True):
            assert list(phases) == ["load", "setup", "forward", "backward", "step1", "step2", "save"], phases
            assert list(phases.values()) == sorted(phases.values()) and phases["save"] <= peak, (phases, peak)
        assert r["checkpoint_bytes"] == sum(f.stat().st_size for f in files) and r["params"] * 2 < r["checkpoint_bytes"]
        assert r["naive_fp32_bytes_per_rank"] == 4 * r["params"], r
        # ZeRO-3: each rank read half the bf16 weights, and the frozen output head (1000 x 256, kept whole on every
        # rank) whole.
        assert all(b == r["params"] + 1000 * 256 for b in r["read_bytes_per_rank"]), r
        assert r["adapter_reloaded"] is True and r["losses"][0] != r["losses"][1], r
    qlora = report["bnb_qlora"]
    assert ("error" in qlora and "\n" not in qlora["error"]) or qlora["step_s"] > 0, qlora
    # The cached checkpoint is reused: a second run writes nothing.
    before = {f: f.stat().st_mtime_ns for f in files}
    assert main([*TINY, "--json", "--format", "nf4", "--no-qlora"]) == 0
    assert {f: f.stat().st_mtime_ns for f in files} == before
