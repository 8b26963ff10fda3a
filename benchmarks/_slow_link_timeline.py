"""What bounds each moment of a `bench slow-link` step: the link, the cores, both, or neither (``--timeline``).

A step's median time and its two floors (bytes / link rate, CPU seconds / cores) say which resource is the larger,
not whether the two are used at once. `Sampler` reads, every 5 ms or so from the parent process, the CPU time
of every thread of every rank (``/proc/<pid>/task/*/schedstat``, nanoseconds) and the bytes each node has sent
across the link (``/proc/<pid>/net/dev`` of one rank per namespace: that namespace's veth end). `utilization`
then sorts the time inside the ranks' timed steps into four classes, per step:

- ``link_only_s``: the link carries at least half its rate, the cores are below three quarters busy;
- ``cpu_only_s``: the cores are at least three quarters busy, the link below half its rate;
- ``both_s`` and ``neither_s``: the rest.

A step that is all ``link_only_s`` and ``cpu_only_s`` runs its communication and its computation one after the
other; ``both_s`` is the overlap; ``neither_s`` is waiting (latency, a rank that lags). Reading the files costs
this process a little CPU (a few percent of one core), which is why it is opt-in.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from typing import Any

__all__ = ["CPU_BUSY", "LINK_BUSY", "Sampler", "utilization"]

LINK_BUSY = 0.5  # fraction of the link rate (either direction's busier node) from which the link counts as busy
CPU_BUSY = 0.75  # fraction of the cores from which the cores count as busy
INTERVAL_S = 0.005

Sample = tuple[float, int, int, int]  # (monotonic time, CPU ns of all ranks, bytes node 0 sent, bytes node 1 sent)


def _cpu_ns(pid: int) -> int:
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as fh:
                total += int(fh.read().split(None, 1)[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended between the listing and the read
    return total


def _tx_bytes(pid: int, ifname: str) -> int:
    try:
        with open(f"/proc/{pid}/net/dev") as fh:
            for line in fh:
                name, _, counters = line.partition(":")
                if name.strip() == ifname:
                    return int(counters.split()[8])  # receive has 8 fields, then transmit bytes
    except (OSError, ValueError, IndexError):
        pass
    return -1


class Sampler:
    """Samples the ranks' CPU time and the link's bytes on a background thread until `stop`.

    Args:
        pids: every rank's process id (each runs in its node's namespace).
        node_pids: one rank per node, in node order: its ``/proc/<pid>/net/dev`` shows that node's veth.
        ifnames: each node's veth end, in node order.
    """

    def __init__(self, pids: list[int], node_pids: list[int], ifnames: list[str]) -> None:
        self.pids, self.node_pids, self.ifnames = pids, node_pids, ifnames
        self.samples: list[Sample] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slow-link-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            t = time.monotonic()
            tx = [_tx_bytes(pid, ifname) for pid, ifname in zip(self.node_pids, self.ifnames, strict=True)]
            self.samples.append((t, sum(_cpu_ns(pid) for pid in self.pids), *tx))
            self._done.wait(INTERVAL_S)

    def stop(self) -> list[Sample]:
        """Stop sampling; the samples taken, in time order."""
        self._done.set()
        self._thread.join(timeout=5)
        return self.samples


def utilization(
    samples: list[Sample], window: tuple[float, float], steps: int, cores: int, link_bytes_per_s: float
) -> dict[str, Any] | None:
    """Seconds per step in each class (see the module docstring) between two monotonic times.

    Args:
        samples: `Sampler.stop`'s samples.
        window: (start, end) of the timed steps, ``time.monotonic()`` of the ranks (the same clock system-wide).
        steps: timed steps inside the window.
        cores: the cores the ranks share.
        link_bytes_per_s: the link's rate.

    Returns:
        None without at least two samples inside the window (or an unreadable counter); else the four classes per
        step, the mean fraction of the link rate and of the cores used, and how many intervals were sampled and
        their mean length (the 5 ms wait plus the reads).
    """
    start, end = window
    inside = [s for s in samples if start <= s[0] <= end]
    if len(inside) < 2 or steps < 1 or any(min(s[2:]) < 0 for s in inside):
        return None
    classes = {"link_only_s": 0.0, "cpu_only_s": 0.0, "both_s": 0.0, "neither_s": 0.0}
    link_used = cpu_used = 0.0
    for (t0, cpu0, *tx0), (t1, cpu1, *tx1) in itertools.pairwise(inside):
        dt = t1 - t0
        if dt <= 0:
            continue
        # A thread that ended between two samples takes its CPU time with it: never count that as negative time.
        cpu = max(0, cpu1 - cpu0) / 1e9 / dt / cores
        link = max(b - a for a, b in zip(tx0, tx1, strict=True)) / dt / link_bytes_per_s
        link_used += link * dt
        cpu_used += cpu * dt
        busy_link, busy_cpu = link >= LINK_BUSY, cpu >= CPU_BUSY
        key = ("both_s" if busy_cpu else "link_only_s") if busy_link else ("cpu_only_s" if busy_cpu else "neither_s")
        classes[key] += dt
    span = inside[-1][0] - inside[0][0]
    return {
        **{k: round(v / steps, 4) for k, v in classes.items()},
        "link_rate_share": round(link_used / span, 3),
        "cores_share": round(cpu_used / span, 3),
        "intervals": len(inside) - 1,
        "interval_ms": round(span / (len(inside) - 1) * 1e3, 2),
        "thresholds": {"link_busy": LINK_BUSY, "cores_busy": CPU_BUSY},
    }
