"""`ds-plugin bench lora-memory` on a tiny Llama: the quantized frozen base shrinks the model states as promised.

Ratios only: timings and RSS of a shared CI machine are reported by the benchmark, never asserted.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.lora_memory import RUNS, main
from ds_plugin.estimate import estimate, shape_from_hf_config

pytestmark = pytest.mark.slow

KEYS = {
    "name",
    "model_state_bytes_per_rank",
    "frozen_linear_bytes_per_rank",
    "frozen_allgather_bytes_per_step",
    "peak_rss_mb",
    "median_step_s",
    "final_loss",
}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_memory") / "lora.json"
    argv = ["--size", "tiny", "--steps", "2", "--no-isolate", "--json", "--out", str(out)]
    assert main(argv) == 0
    assert out.with_suffix(".png").exists() or not _has_matplotlib()
    return json.loads(out.read_text())


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.timeout(120)
def test_contract(report):
    assert report["world_size"] == 2 and report["params"] > 0
    assert [r["name"] for r in report["runs"]] == list(RUNS)
    for r in report["runs"]:
        assert KEYS <= set(r), r["name"]
        assert r["model_state_bytes_per_rank"] == sum(r["breakdown"].values())
        assert r["frozen_linear_bytes_per_rank"] <= r["breakdown"]["frozen_params"]


@pytest.mark.timeout(120)
def test_quantized_frozen_linears_shrink(report):
    runs = {r["name"]: r for r in report["runs"]}
    bf16 = runs["bf16"]["frozen_linear_bytes_per_rank"]
    assert runs["int4"]["frozen_linear_bytes_per_rank"] <= 0.30 * bf16
    assert runs["int8"]["frozen_linear_bytes_per_rank"] <= 0.55 * bf16
    # Only the frozen storage differs between the ZeRO-3 runs: the adapters' fp32 states are the same bytes.
    adapters = {n: runs[n]["model_state_bytes_per_rank"] - runs[n]["breakdown"]["frozen_params"] for n in runs}
    assert adapters["bf16"] == adapters["int8"] == adapters["int4"] == adapters["nf4"]
    # ZeRO-3 gathers the frozen weights as stored: codes and scales, not bf16.
    gathered = runs["bf16"]["frozen_allgather_bytes_per_step"]
    assert 0 < runs["int4"]["frozen_allgather_bytes_per_step"] <= 0.32 * gathered
    assert runs["bnb_qlora"]["frozen_allgather_bytes_per_step"] == 0
    assert all(report["targets"][k]["ok"] for k in report["targets"])


@pytest.mark.timeout(120)
def test_zero3_quantized_at_most_bnb_qlora_per_rank(report):
    runs = {r["name"]: r for r in report["runs"]}
    anchor = runs["bnb_qlora"]["model_state_bytes_per_rank"] / report["world_size"]
    for fmt in ("int4", "nf4"):
        assert runs[fmt]["model_state_bytes_per_rank"] <= 1.05 * anchor, fmt


@pytest.mark.timeout(120)
def test_estimate_matches_measured(report):
    shape = shape_from_hf_config(report["model_config"])
    assert shape.params == report["params"]
    for r in report["runs"]:
        if r["name"] == "bnb_qlora":
            continue
        est = estimate(shape, report["world_size"], lora_rank=16, frozen_format=r["name"])["lora"]
        assert est["trainable_params"] == report["trainable_params"]
        assert abs(r["model_state_bytes_per_rank"] / est["stages"]["3"] - 1) <= 0.05, r["name"]
