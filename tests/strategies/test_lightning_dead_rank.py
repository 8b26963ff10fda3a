"""A Lightning run on 4 ranks whose rank 2 freezes (SIGSTOP) or is killed (SIGKILL) mid-step ends by itself, every
other rank with its one-line `RankFailureError`: the frozen job after its 15 s collective timeout, the killed one
at once (its timeout is the default 10 minutes). Both jobs run side by side, 8 plain processes in one launch
(scripts/dead_rank4.py says why not Lightning's launcher), so the killed job costs little beside the frozen one's wait.

The 2-rank SIGKILL through Lightning's launcher, with the restart that resumes bit-identically, is the `killed`
fixture and the resume test of test_lightning_multiprocess.py; the engine API's at 2 and 4 ranks is
tests/runtime/test_dead_rank.py.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
from _launch import SCRIPTS, clean_env

from ds_plugin.checkpoint import read_checkpoint_info

pytestmark = [pytest.mark.slow, pytest.mark.long]

WORLD, DYING_RANK = 4, 2
TIMEOUT_S = {"stop": 15, "kill": 600}  # DS_PLUGIN_TIMEOUT: a killed peer's sockets break at once
# The first line of gloo's error inside the parentheses: a broken socket (the killed rank's, or a survivor's that gave
# up first) or, with a frozen peer, the timeout.
BROKEN = r"(Read error \[[^]]+\]:\d+: Connection reset by peer|Connection closed by peer \[[^]]+\]:\d+)"
TIMED_OUT = r"Timed out waiting \d+ms for (send|recv) operation to complete"
CAUSE = {"kill": BROKEN, "stop": f"({TIMED_OUT}|{BROKEN})"}


def survivor_error(rank: int, die: str) -> re.Pattern:
    """The whole message each survivor's fit raises: its rank, the step rank 2 died in (epoch 1's first of 2 a epoch
    per rank), the cause, the timeout, how to resume."""
    return re.compile(
        rf"rank {rank} of {WORLD}: backward at step 3 failed because another rank died, hung or lost its "
        rf"network \({CAUSE[die]}; collective timeout {TIMEOUT_S[die]} s\)\. Restart the job; "
        r'Trainer\.fit\(\.\.\., ckpt_path="last"\) resumes from the newest complete checkpoint'
    )


def _free_ports(n: int) -> list[int]:
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def _start(die: str, workdir: Path, port: int) -> list[subprocess.Popen]:
    """One job: 4 ranks, each with its output in `rank<N>.log`."""
    workdir.mkdir(exist_ok=True)
    env = {
        **clean_env(),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "DS_PLUGIN_TIMEOUT": str(TIMEOUT_S[die]),
    }
    cmd = [sys.executable, str(SCRIPTS / "dead_rank4.py"), "--die", die, "--workdir", str(workdir)]
    procs = []
    for r in range(WORLD):
        with open(workdir / f"rank{r}.log", "wb") as log:
            env_r = {**env, "LOCAL_RANK": str(r), "NODE_RANK": "0"}
            procs.append(subprocess.Popen(cmd, cwd=workdir, env=env_r, stdout=log, stderr=subprocess.STDOUT))
    return procs


def _run(dies: list[str], tmp: Path, timeout: float = 420.0) -> dict[str, list[int | None]]:
    """Run the jobs side by side; returns each job's exit codes, None for a rank still running at the timeout (all
    are killed then)."""
    jobs = {die: _start(die, tmp / die, port) for die, port in zip(dies, _free_ports(len(dies)), strict=True)}
    deadline = time.monotonic() + timeout
    try:
        for procs in jobs.values():
            for r, p in enumerate(procs):
                if r != DYING_RANK:  # a frozen rank never ends by itself: it is killed below
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass  # a survivor still running: reported by the caller
    finally:
        codes = {die: [p.poll() for p in procs] for die, procs in jobs.items()}
        for procs in jobs.values():
            for p in procs:
                if p.poll() is None:
                    p.kill()  # works on a SIGSTOPped process too
                p.wait(10)
    return codes


def _log(workdir: Path, rank: int) -> str:
    return (workdir / f"rank{rank}.log").read_text(errors="replace")[-3000:]


def test_four_ranks_one_frozen_or_killed_mid_step_end_the_fit_with_rank_failure_error(tmp_path):
    codes = _run(["stop", "kill"], tmp_path)
    # Another process may take a port between _free_ports and rank 0's bind: such a job runs again, once.
    taken = [die for die in ("stop", "kill") if "address already in use" in _log(tmp_path / die, 0).lower()]
    if taken:
        for die in taken:
            shutil.rmtree(tmp_path / die)
        codes |= _run(taken, tmp_path)
    for die in ("stop", "kill"):
        workdir = tmp_path / die
        running = [r for r, code in enumerate(codes[die]) if code is None]
        assert running == ([DYING_RANK] if die == "stop" else []), f"{die}: ranks {running} did not end by themselves"
        if die == "kill":
            assert codes[die][DYING_RANK] == -signal.SIGKILL, _log(workdir, DYING_RANK)
        messages = []
        for r in range(WORLD):
            if r == DYING_RANK:
                continue
            report = workdir / f"rank{r}.json"
            assert report.is_file(), f"{die}: rank {r} reported nothing:\n{_log(workdir, r)}"
            result = json.loads(report.read_text())
            assert result.get("error_type") == "RankFailureError", (die, r, result, _log(workdir, r))
            assert survivor_error(r, die).fullmatch(result["message"]), (die, r, result["message"])
            messages.append(result["message"])
            if die == "stop":
                assert result["seconds"] >= TIMEOUT_S[die], result  # a frozen peer gives no sign before the timeout
        if die == "stop":  # the first survivor to give up did so at its timeout, the others maybe on its sockets
            assert any(re.search(TIMED_OUT, m) for m in messages), messages
        # The checkpoint of the last finished epoch (epoch 0) is complete and verifies.
        info, _ = read_checkpoint_info(workdir / "ckpt" / "last.ckpt")
        assert info["world_size"] == WORLD, info
