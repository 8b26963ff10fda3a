"""The training tests can fail: with every optimizer step a no-op (`DS_PLUGIN_TEST_NOOP_STEP=1`, tests/_break.py)
the cheapest of them, one process each, must fail on their own assertions (not be skipped, not error out).

The multi-process ones (tests/strategies/test_lightning_multiprocess.py, the 2- and 4-rank parity) are too slow to
repeat here; they were checked by hand the same way.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from _break import NOOP_STEP

pytestmark = [pytest.mark.slow, pytest.mark.long]  # minutes of CPU on 2 cores: the `long` tier

ROOT = Path(__file__).parents[1]
# node id -> the assertion message it must fail with (one 1-rank parity spawn and one 1-rank Lightning script).
EXPECTED = {
    "tests/zero/test_engine_parity.py::test_fp32_losses_match_ddp[world1-0-gpt2]": "did not learn",
    "tests/zero/test_engine_parity.py::test_bf16_losses_match_ddp[world1-3-llama]": "did not learn",
    "tests/zero/test_engine_parity.py::test_accumulation_equals_concatenated_batch[world1-1]": "did not move",
    "tests/zero/test_engine_parity.py::test_clipping_equals_clip_grad_norm[world1-3]": "did not move",
    "tests/strategies/test_lightning_fp8.py::test_fp8_training_learns_like_fp32": "did not learn",
}


@pytest.mark.timeout(300)
def test_training_tests_fail_when_the_optimizer_never_steps(tmp_path: Path) -> None:
    report = tmp_path / "report.xml"
    env = {**os.environ, NOOP_STEP: "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *EXPECTED]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert report.is_file(), done.stdout[-3000:] + done.stderr[-3000:]
    cases = {f"{c.get('classname')}::{c.get('name')}": c for c in ET.parse(report).iter("testcase")}
    assert len(cases) == len(EXPECTED), (sorted(cases), done.stdout[-3000:])
    for node, message in EXPECTED.items():
        module, name = node.split("::")
        case = cases[f"{module.removesuffix('.py').replace('/', '.')}::{name}"]
        outcome = [child.tag for child in case]
        failure = case.find("failure")
        assert failure is not None, f"{node} did not fail under {NOOP_STEP}=1: {outcome or 'passed'}"
        assert message in (failure.get("message") or ""), f"{node} failed for another reason:\n{failure.text}"
