"""A dead or frozen rank ends the job on its own, with one clear error, and a restart resumes bit-identically.

Each rank is a plain process (`scripts/dead_rank.py`): no launcher watches them, so only ds_plugin's collective
timeout and its `RankFailureError` stand between a dead peer and a hang. Rank 1 dies in the middle of step 5
(after its forward); the checkpoint of step 4 is the newest complete one. The restart (same world size) loads it,
continues the sampler from the saved position, and must end with the same bits as an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.long

SCRIPT = Path(__file__).parent / "scripts" / "dead_rank.py"
REPO = Path(__file__).parents[2]


def _start(world: int, mode: str, tmp: Path, timeout_s: float, *extra: str) -> list[subprocess.Popen]:
    store = tmp / f"store-{mode}-{time.monotonic_ns()}"
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(WORLD_SIZE=str(world), OMP_NUM_THREADS="1", DS_PLUGIN_TIMEOUT=str(timeout_s), HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    args = ["--mode", mode, "--store", str(store), "--ckpt", str(tmp / "ckpt"), "--out", str(tmp / f"{mode}.json")]
    return [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), *args, *extra],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]


def _finish(procs: list[subprocess.Popen], deadline: float, frozen: int | None = None) -> list[tuple[int | None, str]]:
    """Each rank's (exit code, output); None for one still running at the deadline. The `frozen` rank is not
    waited for: it is killed once the others have ended (or the deadline passed)."""
    out: dict[int, tuple[int | None, str]] = {}
    try:
        for rank, p in enumerate(procs):
            if rank == frozen:
                continue
            try:
                text, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                text = "(still running at the deadline)"
            out[rank] = (p.returncode, text)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # works on a SIGSTOPped process too
                p.wait(10)
    if frozen is not None:
        out[frozen] = (procs[frozen].returncode, procs[frozen].communicate()[0])
    return [out[rank] for rank in range(len(procs))]


def _last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    return last.removeprefix(f"[rank{last[5:].split(']')[0]}]: ") if last.startswith("[rank") else last  # torch's tag


@pytest.mark.parametrize(
    ("world", "die", "timeout_s"),
    [(2, "kill", 600), (4, "stop", 20)],
    ids=["2-ranks-sigkill", "4-ranks-sigstop"],
)
def test_dead_rank_ends_the_job_and_a_restart_resumes_bit_identically(tmp_path, world, die, timeout_s):
    start = time.monotonic()
    procs = _start(world, "train", tmp_path, timeout_s, "--die", die, "--die-at", "5")
    # SIGKILL: the survivors' sockets to rank 1 break at once, far within the (10-minute) timeout.
    # SIGSTOP: rank 1's sockets stay open, so only the 20 s collective timeout can end the wait.
    results = _finish(procs, start + 150 + timeout_s, frozen=1 if die == "stop" else None)
    elapsed = time.monotonic() - start
    code1, _ = results[1]
    if die == "kill":
        assert code1 == -signal.SIGKILL, results[1]
    for rank, (code, text) in enumerate(results):
        if rank == 1:
            continue
        assert code not in (None, 0), f"rank {rank} did not end on its own:\n{text[-3000:]}"
        last = _last_line(text)
        assert last.startswith("ds_plugin.runtime.faults.RankFailureError: "), text[-3000:]
        assert f"rank {rank} of {world}" in last and "another rank died, hung or lost its network" in last, last
        assert "load_checkpoint" in last, last  # how to resume
        if die == "stop":
            assert f"collective timeout {timeout_s:g} s" in last, last
    if die == "stop":
        assert elapsed >= timeout_s, elapsed  # they waited for the timeout, as a frozen peer gives no other sign
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert saved == ["global_step2", "global_step4", "latest"], saved
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step4"

    # The restart: fresh processes, the same world size, nothing told but the checkpoint directory.
    procs = _start(world, "resume", tmp_path, 600)
    results = _finish(procs, time.monotonic() + 240)
    assert all(code == 0 for code, _ in results), results[0][1][-3000:]
    r = json.loads((tmp_path / "resume.json").read_text())
    per_epoch = 24 // (2 * world)
    assert r["loaded"] == "global_step4" and r["start_step"] == 4, r
    assert r["position"] == {"epoch": 4 // per_epoch, "batches": 4 % per_epoch}, r
    assert r["steps"] == [8, 8], r
    assert r["changed"] > 1e-4, r  # it trained: the final weights moved from the initial ones
    assert r["bit_identical"] and r["max_abs_diff"] == 0.0, r
