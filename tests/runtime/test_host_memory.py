"""`host_memory_reuse`: on CPU the engine makes glibc malloc keep freed memory, so steps stop page-faulting.

The setting is process-wide and permanent, so every check runs in fresh spawned processes: the page-fault
counts of a loop that allocates and frees a 64 MiB tensor, with and without it, and what `apply_zero` does with
the config key on and off.
"""

from __future__ import annotations

import platform
import resource

import pytest
import torch
from _dist import run_ranks
from _tiny import zero_config
from torch import nn

from ds_plugin.zero.host_memory import host_memory_reuse_state, reuse_freed_host_memory

glibc_only = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's"
)

_BLOCK = 64 << 20  # over glibc's largest mmap threshold (32 MiB), so by default every allocation is a fresh mmap


def _faults_per_round(rank: int, world: int, *, reuse: bool, rounds: int = 30) -> dict:
    applied = reuse_freed_host_memory() if reuse else "not asked"
    faults = []
    for _ in range(rounds):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(_BLOCK, dtype=torch.uint8).fill_(1)  # touch every page, then free it
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return {"applied": applied, "faults": faults}


@glibc_only
def test_freed_blocks_are_reused_without_page_faults():
    pages = _BLOCK // resource.getpagesize()
    plain = run_ranks(_faults_per_round, 1, reuse=False, timeout=120)[0]
    reused = run_ranks(_faults_per_round, 1, reuse=True, timeout=120)[0]
    assert reused["applied"] is None, reused
    # Without it, every round maps the block afresh and faults on each page of it (or on each huge page).
    assert min(plain["faults"]) >= pages / 512, plain
    # With it, the heap first grows to a working size: a freed block is reused only once it has merged with a
    # free neighbour, since the aligned allocation asks a little more than it gave back (1 to 7 of the first
    # rounds faulted, measured). After that the pages come back already mapped.
    faulting = [f >= pages / 100 for f in reused["faults"]]
    assert sum(faulting[-15:]) <= 1, reused
    assert sum(faulting) <= 12, reused


def _apply_and_report(rank: int, world: int, *, reuse: bool | None) -> dict:
    from ds_plugin.zero.apply import apply_zero

    cfg = zero_config(3)
    if reuse is not None:
        cfg["host_memory_reuse"] = reuse
    apply_zero(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), cfg)
    return host_memory_reuse_state()


@glibc_only
def test_engine_applies_it_on_cpu_unless_the_config_says_false():
    default, on, off = (run_ranks(_apply_and_report, 1, reuse=r, timeout=120)[0] for r in (None, True, False))
    assert default["applied"] is True and on["applied"] is True, (default, on)
    assert off == {"applied": False, "reason": "not requested"}


@pytest.mark.parametrize(("system", "libc", "says"), [("Darwin", ("", ""), "Darwin"), ("Linux", ("musl", ""), "musl")])
def test_other_platforms_get_a_reason_not_an_error(monkeypatch, system, libc, says):
    from ds_plugin.zero import host_memory

    monkeypatch.setattr(host_memory.platform, "system", lambda: system)
    monkeypatch.setattr(host_memory.platform, "libc_ver", lambda: libc)
    reason = host_memory._apply()
    assert reason is not None and says in reason and "glibc" in reason and "\n" not in reason
