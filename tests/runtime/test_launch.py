"""`run_ranks`: what a rank sees when it is forked from the forkserver instead of spawned.

A forked rank inherits the server's memory, so these check what must still come from the caller at call time:
the environment (set after the server started), `env` over it, one intra-op thread, and each rank's own process.
"""

from __future__ import annotations

import os

import pytest

from ds_plugin.launch import run_ranks


def _report(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "pid": os.getpid(),
        "parent": os.getppid(),
        "mark": os.environ.get("DS_PLUGIN_TEST_LAUNCH_MARK"),
        "override": os.environ.get("DS_PLUGIN_TEST_LAUNCH_OVERRIDE"),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "threads": torch.get_num_threads(),
    }


def test_forked_ranks_see_the_callers_environment_now(monkeypatch: pytest.MonkeyPatch) -> None:
    # The first launch starts the server (if this process has none yet) before the variables below exist.
    first = run_ranks(_report, 2)
    monkeypatch.setenv("DS_PLUGIN_TEST_LAUNCH_MARK", "set after the server started")
    monkeypatch.setenv("DS_PLUGIN_TEST_LAUNCH_OVERRIDE", "the caller's")
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    second = run_ranks(_report, 2, env={"DS_PLUGIN_TEST_LAUNCH_OVERRIDE": "env's"})
    assert [r["rank"] for r in second] == [0, 1] and {r["world"] for r in second} == {2}
    assert all(r["mark"] is None for r in first), first
    assert all(r["mark"] == "set after the server started" for r in second), second
    assert all(r["override"] == "env's" for r in second), second
    assert all(r["omp"] == "1" and r["threads"] == 1 for r in first + second), first + second
    pids = [r["pid"] for r in first + second]
    assert len(set(pids)) == 4 and os.getpid() not in pids
    # Forked by the server, not by this process (spawned ranks would be this process's children).
    assert all(r["parent"] != os.getpid() for r in first + second), (os.getpid(), first + second)

    spawned = run_ranks(_report, 1, start_method="spawn")  # one fresh interpreter is enough to tell the two apart
    assert all(r["parent"] == os.getpid() and r["mark"] == "set after the server started" for r in spawned), spawned

    with pytest.raises(ValueError, match="start_method must be 'forkserver' or 'spawn', got 'fork'"):
        run_ranks(_report, 2, start_method="fork")
