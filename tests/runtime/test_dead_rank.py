"""A dead or frozen rank ends the job on its own, with one clear error, and a restart resumes bit-identically.

Each rank is a plain process (`scripts/dead_rank.py`): no launcher watches them, so only ds_plugin's collective
timeout and its `RankFailureError` stand between a dead peer and a hang. Rank 1 dies in the middle of step 5
(after its forward); the checkpoint of step 4 is the newest complete one. The restart (same world size) loads it,
continues the sampler from the saved position, and must end with the same bits as an uninterrupted run.

At 4 ranks one launch runs two jobs side by side, one whose rank 1 freezes (SIGSTOP) and one whose rank 1 is killed
(SIGKILL): the killed job is done while the frozen one waits out its timeout, so the second scenario costs little.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.long

SCRIPT = Path(__file__).parent / "scripts" / "dead_rank.py"
REPO = Path(__file__).parents[2]
# The collective timeout each scenario runs under. A killed peer's sockets break at once, far within 10 minutes; a
# frozen one's stay open, so only the 20 s timeout can end the wait.
TIMEOUT_S = {"kill": 600, "stop": 20}
# The first line of gloo's error, inside the message's parentheses: a broken socket (the killed rank's, or a survivor's
# that gave up before this one) or, with a frozen peer, the timeout.
BROKEN = r"(Read error \[[^]]+\]:\d+: Connection reset by peer|Connection closed by peer \[[^]]+\]:\d+)"
# gloo words a timeout by collective: a reduce-scatter's wait "Timed out waiting ...", an all-reduce's (stages 2/3
# reduce-scatter through one on gloo) "Application timeout caused pair closure".
TIMED_OUT = r"(Timed out waiting \d+ms for (send|recv) operation to complete|Application timeout caused pair closure)"
CAUSE = {"kill": BROKEN, "stop": f"({TIMED_OUT}|{BROKEN})"}


def survivor_error(rank: int, world: int, die: str) -> re.Pattern:
    """The one line every survivor's traceback ends with: its rank, the step rank 1 died in, the cause, the fix."""
    return re.compile(
        rf"ds_plugin\.runtime\.faults\.RankFailureError: rank {rank} of {world}: backward at step 5 failed because "
        rf"another rank died, hung or lost its network \({CAUSE[die]}; collective timeout {TIMEOUT_S[die]} s\)\. "
        r"Restart the job; engine\.load_checkpoint\(save_dir\) resumes from the newest complete checkpoint"
    )


def _start(world: int, mode: str, tmp: Path, timeout_s: float, *extra: str) -> list[subprocess.Popen]:
    tmp.mkdir(exist_ok=True)
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
    ("world", "scenarios"),
    [(2, ("kill",)), (4, ("stop", "kill"))],
    ids=["2-ranks-sigkill", "4-ranks-sigstop-and-sigkill"],
)
def test_dead_rank_ends_the_job_and_a_restart_resumes_bit_identically(tmp_path, world, scenarios):
    start = time.monotonic()
    # Side by side: each job its own rendezvous, checkpoint directory and output; rank 1 dies after step 5's forward.
    jobs = {
        die: _start(world, "train", tmp_path / die, TIMEOUT_S[die], "--die", die, "--die-at", "5") for die in scenarios
    }
    deadline = start + 240 + (TIMEOUT_S["stop"] if "stop" in scenarios else 0)
    for die in sorted(scenarios, key=lambda die: die == "stop"):  # the killed job is over long before the frozen one
        results = _finish(jobs[die], deadline, frozen=1 if die == "stop" else None)
        elapsed = time.monotonic() - start
        if die == "kill":
            assert results[1][0] == -signal.SIGKILL, results[1]
        for rank, (code, text) in enumerate(results):
            if rank == 1:
                continue
            assert code not in (None, 0), f"{die}: rank {rank} did not end on its own:\n{text[-3000:]}"
            last = _last_line(text)
            assert survivor_error(rank, world, die).fullmatch(last), f"{die}: rank {rank}: {last}\n{text[-3000:]}"
        if die == "stop":  # the first survivor to give up did so at its timeout, the others maybe on its broken sockets
            assert any(re.search(TIMED_OUT, _last_line(text)) for _, text in results), results[0][1][-3000:]
            assert elapsed >= TIMEOUT_S[die], elapsed  # they waited for the timeout: a frozen peer gives no other sign
        saved = sorted(p.name for p in (tmp_path / die / "ckpt").iterdir())
        assert saved == ["global_step2", "global_step4", "latest"], (die, saved)
        assert (tmp_path / die / "ckpt" / "latest").read_text() == "global_step4", die

    # The restart (of the first job): fresh processes, the same world size, nothing told but the checkpoint directory.
    job = tmp_path / scenarios[0]
    procs = _start(world, "resume", job, 600)
    results = _finish(procs, time.monotonic() + 240)
    assert all(code == 0 for code, _ in results), results[0][1][-3000:]
    r = json.loads((job / "resume.json").read_text())
    per_epoch = 24 // (2 * world)
    assert r["loaded"] == "global_step4" and r["start_step"] == 4, r
    assert r["position"] == {"epoch": 4 // per_epoch, "batches": 4 % per_epoch}, r
    assert r["steps"] == [8, 8], r
    assert r["changed"] > 1e-4, r  # it trained: the final weights moved from the initial ones
    assert r["bit_identical"] and r["max_abs_diff"] == 0.0, r
