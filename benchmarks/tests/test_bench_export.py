"""`ds-plugin bench export` at a tiny shape: the streaming export writes the same tensors as the whole-in-memory one."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import export_memory


def test_bench_export_reports_both_exports_equal(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    argv = ["--layers", "2", "--hidden", "64", "--intermediate", "96", "--vocab", "200", "--json", "--out", str(out)]
    assert export_memory.main([*argv, "--workdir", str(tmp_path / "work")]) == 0
    report = json.loads(out.read_text())
    # 2 * 64 * 200 embedding and head, 2 layers of 4 * 64 * 64 + 3 * 64 * 96 weights and 2 norms, the final norm
    assert report["parameters"] == 2 * 64 * 200 + 2 * (4 * 64 * 64 + 3 * 64 * 96 + 2 * 64) + 64
    assert report["checkpoint_bytes"] > 4 * report["parameters"]  # fp32 values, plus DCP's metadata
    streaming, whole = report["streaming"], report["whole_in_memory"]
    assert "error" not in streaming and "error" not in whole, report
    assert report["same_tensors"] is True
    # bf16 values plus each file's header: the two writers' headers differ in length, not by a tensor's worth
    assert abs(streaming["bytes_written"] - 2 * report["parameters"]) < 4096
    assert abs(whole["bytes_written"] - 2 * report["parameters"]) < 4096
    assert report["peak_rss_ratio"] > 0
    assert not list((tmp_path / "work").iterdir())  # the checkpoint and both exports are removed
