"""`host_memory_reuse`: on CPU the engine makes glibc malloc keep freed memory, so steps stop page-faulting; set
to false, it makes glibc hand freed blocks back at once, so resident memory is what is live.

The settings are process-wide and permanent, so each case needs a process of its own: one spawn of four ranks plays
them all, each rank one case (they meet only in `apply_zero`'s collectives, which every rank calls). Rank 0 and 1
count the page faults of a loop that allocates and frees a 64 MiB tensor, without and with reuse; rank 0 also
measures the dead heap a fragmenting pattern leaves resident before `apply_zero` (glibc's defaults) and after it
(the config's false: release); ranks 0, 2 and 3 report what `apply_zero` does with the config key off, absent and on.
Every rank also probes glibc's per-thread malloc cache, which `run_ranks` starts ranks without.
"""

from __future__ import annotations

import logging
import os
import platform
import resource

import pytest
import torch
from torch import nn

from ds_plugin.launch import run_ranks
from ds_plugin.runtime import host_memory
from ds_plugin.runtime.host_memory import (
    THREAD_CACHE_OFF,
    host_memory_reuse_state,
    rank_tunables,
    release_freed_host_memory,
    reuse_freed_host_memory,
    thread_cache_on,
)
from tests._memory import resident_bytes
from tests.zero._tiny import zero_config

glibc_only = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's"
)

_BLOCK = 64 << 20  # over glibc's largest mmap threshold (32 MiB), so by default every allocation is a fresh mmap
# rank -> (count page faults: without reuse / with it asked for directly / not at all, the config's host_memory_reuse)
_CASES = {0: ("plain", False), 1: ("reused", True), 2: (None, None), 3: (None, True)}


def _faults_per_round(reuse: bool, rounds: int = 30) -> dict:
    applied = reuse_freed_host_memory() if reuse else "not asked"
    faults = []
    for _ in range(rounds):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(_BLOCK, dtype=torch.uint8).fill_(1)  # touch every page, then free it
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return {"applied": applied, "faults": faults}


def _resident_mb() -> float:
    return resident_bytes() / 2**20


def _dead_heap_mb() -> float:
    """Resident MiB left after freeing 48 blocks of 4 MiB allocated between small blocks that stay alive."""
    # Freeing a 16 MiB block raises glibc's default mmap threshold to 16 MiB: 4 MiB blocks then come from the heap.
    torch.empty(16 << 20, dtype=torch.uint8).fill_(1)
    before = _resident_mb()
    big, small = [], []
    for _ in range(48):
        big.append(torch.empty(4 << 20, dtype=torch.uint8).fill_(1))
        small.append(torch.empty(64 << 10, dtype=torch.uint8).fill_(1))
    big.clear()
    return _resident_mb() - before - 48 * 64 / 1024


def _case(rank: int, world: int) -> dict:
    from ds_plugin.zero.apply import apply_zero

    count, reuse = _CASES[rank]
    out = {"faults": _faults_per_round(reuse=count == "reused")} if count else {}  # before apply_zero can apply it
    out["thread_cache_on"] = thread_cache_on()
    if rank == 0:
        out["dead_heap_mb_default"] = _dead_heap_mb()
    cfg = zero_config(3)
    if reuse is not None:
        cfg["host_memory_reuse"] = reuse
    apply_zero(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), cfg)
    out["state"] = host_memory_reuse_state()
    if rank == 0:
        out["dead_heap_mb_released"] = _dead_heap_mb()
        out["release_again"] = release_freed_host_memory()
    if rank == 3:
        out["release_after_reuse"] = release_freed_host_memory()
    return out


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    return run_ranks(_case, len(_CASES), timeout=240)


@glibc_only
def test_freed_blocks_are_reused_without_page_faults(cases: list[dict]):
    pages = _BLOCK // resource.getpagesize()
    plain, reused = cases[0]["faults"], cases[1]["faults"]
    assert reused["applied"] is None, reused
    # Without it, every round maps the block afresh and faults on each page of it (or on each huge page).
    assert min(plain["faults"]) >= pages / 512, plain
    # With it, the heap first grows to a working size: a freed block is reused only once it has merged with a
    # free neighbour, since the aligned allocation asks a little more than it gave back (1 to 7 of the first
    # rounds faulted, measured). After that the pages come back already mapped.
    faulting = [f >= pages / 100 for f in reused["faults"]]
    assert sum(faulting[-15:]) <= 1, reused
    assert sum(faulting) <= 12, reused


@glibc_only
def test_engine_applies_it_on_cpu_unless_the_config_says_false(cases: list[dict]):
    off, default, on = (cases[rank]["state"] for rank in (0, 2, 3))
    assert default["applied"] is True and on["applied"] is True, (default, on)
    assert default["released"] is False and on["released"] is False, (default, on)
    assert off["applied"] is False and off["released"] is True, off
    # Idempotent, and the two settings exclude each other (the first one asked for stays), each with its reason.
    assert cases[0]["release_again"] is None
    assert "reuse_freed_host_memory() is already in effect" in cases[3]["release_after_reuse"]


@glibc_only
def test_false_hands_freed_blocks_back_to_the_kernel(cases: list[dict]):
    # glibc's defaults keep the freed 4 MiB blocks resident between the live small ones (192 MiB of them); with
    # the config's false they were each their own mapping and went back when freed.
    default, released = cases[0]["dead_heap_mb_default"], cases[0]["dead_heap_mb_released"]
    assert default > 150, default
    assert released < 20, released


@glibc_only
def test_ranks_start_without_the_per_thread_cache(cases: list[dict]):
    assert [c["thread_cache_on"] for c in cases] == [False] * len(_CASES)
    # The probe tells the two apart: this test process started as the user started it.
    if THREAD_CACHE_OFF not in os.environ.get("GLIBC_TUNABLES", "") and thread_cache_on() is not None:
        assert thread_cache_on() is True


def test_rank_tunables_keep_the_users_settings():
    assert rank_tunables(None) == rank_tunables("") == "glibc.malloc.tcache_count=0"
    assert rank_tunables("glibc.malloc.arena_max=2") == "glibc.malloc.arena_max=2:glibc.malloc.tcache_count=0"
    assert rank_tunables("glibc.malloc.tcache_count=7") == "glibc.malloc.tcache_count=7"


def test_thread_cache_note_is_one_line_once(monkeypatch, caplog):
    monkeypatch.setitem(host_memory._STATE, "applied", True)
    monkeypatch.setattr(host_memory, "_NOTED", set())
    monkeypatch.setattr(host_memory, "thread_cache_on", lambda: True)
    with caplog.at_level(logging.INFO, logger=host_memory.__name__):
        host_memory.warn_thread_cache()
        host_memory.warn_thread_cache()
    notes = [r.getMessage() for r in caplog.records if "per-thread" in r.getMessage()]
    assert len(notes) == 1 and f"GLIBC_TUNABLES={THREAD_CACHE_OFF}" in notes[0] and "\n" not in notes[0], notes
    caplog.clear()
    monkeypatch.setattr(host_memory, "_NOTED", set())
    monkeypatch.setattr(host_memory, "thread_cache_on", lambda: False)
    host_memory.warn_thread_cache()
    assert not [r for r in caplog.records if "per-thread" in r.getMessage()]


@pytest.mark.parametrize(("system", "libc", "says"), [("Darwin", ("", ""), "Darwin"), ("Linux", ("musl", ""), "musl")])
def test_other_platforms_get_a_reason_not_an_error(monkeypatch, system, libc, says):
    from ds_plugin.runtime import host_memory

    monkeypatch.setattr(host_memory.platform, "system", lambda: system)
    monkeypatch.setattr(host_memory.platform, "libc_ver", lambda: libc)
    reason = host_memory._mallopt(())
    assert reason is not None and says in reason and "glibc" in reason and "\n" not in reason
