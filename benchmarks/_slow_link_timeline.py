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

`trace` keeps the first two steps' samples as fractions of the cores and of the link rate over time, and `draw`
charts them, one panel per config (``bench slow-link --timeline --png``).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from typing import Any

__all__ = ["CPU_BUSY", "LINK_BUSY", "Sampler", "draw", "trace", "utilization"]

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


def _fractions(samples: list[Sample], cores: int, link_bytes_per_s: float) -> list[tuple[float, float, float, float]]:
    # (start, length, fraction of the cores, fraction of the link rate on the busier node) per sampled interval. A
    # thread that ended between two samples takes its CPU time with it: never count that as negative time.
    out = []
    for (t0, cpu0, *tx0), (t1, cpu1, *tx1) in itertools.pairwise(samples):
        dt = t1 - t0
        if dt > 0:
            link = max(b - a for a, b in zip(tx0, tx1, strict=True)) / dt / link_bytes_per_s
            out.append((t0, dt, max(0, cpu1 - cpu0) / 1e9 / dt / cores, link))
    return out


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
    for _, dt, cpu, link in _fractions(inside, cores, link_bytes_per_s):
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


def trace(
    samples: list[Sample], window: tuple[float, float], seconds: float, cores: int, link_bytes_per_s: float
) -> list[list[float]]:
    """``[t, cores, link]`` per sampled interval in the first `seconds` of the window: its middle in seconds from
    the window's start, the fraction of the cores busy and of the link rate used (the busier node's), rounded.

    Args:
        samples: `Sampler.stop`'s samples.
        window: (start, end) of the timed steps on the monotonic clock.
        seconds: how much of the window to keep (two median steps, say).
        cores: the cores the ranks share.
        link_bytes_per_s: the link's rate.
    """
    start = window[0]
    inside = [s for s in samples if start <= s[0] <= min(window[1], start + seconds)]
    return [
        [round(t - start + dt / 2, 4), round(cpu, 3), round(link, 3)]
        for t, dt, cpu, link in _fractions(inside, cores, link_bytes_per_s)
    ]


def draw(configs: dict[str, dict[str, Any]], path: str, title: str) -> bool:
    """One panel per config with a trace: the cores' and the link's busy fractions against time; False (and no
    file) when no config has a trace.

    Args:
        configs: the report's per-config entries (those without ``utilization.trace`` are left out).
        path: the PNG to write.
        title: the figure's title.
    """
    shown = {
        name: e["utilization"]["trace"] for name, e in configs.items() if (e.get("utilization") or {}).get("trace")
    }
    if not shown:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(shown), 1, figsize=(10, 1.9 * len(shown) + 0.8), squeeze=False)
    for ax, (name, points) in zip(axes[:, 0], shown.items(), strict=True):
        ts = [p[0] for p in points]
        ax.fill_between(ts, [p[1] for p in points], step="mid", alpha=0.45, color="tab:orange", label="cores busy")
        ax.plot(ts, [p[2] for p in points], drawstyle="steps-mid", color="tab:blue", lw=1, label="link rate used")
        ax.axhline(LINK_BUSY, color="tab:blue", ls=":", lw=0.8)
        ax.axhline(CPU_BUSY, color="tab:orange", ls=":", lw=0.8)
        u = configs[name]["utilization"]
        ax.set_title(
            f"{name}: step {configs[name]['step_s']:.2f} s; per step link alone {u['link_only_s']:.2f} s, cores alone "
            f"{u['cpu_only_s']:.2f} s, both {u['both_s']:.2f} s",
            fontsize=9,
            loc="left",
        )
        ax.set_ylim(0, 1.1)
        ax.set_ylabel("fraction", fontsize=8)
        ax.tick_params(labelsize=8)
    axes[0, 0].legend(fontsize=8, loc="upper right")
    axes[-1, 0].set_xlabel("seconds from the first timed step (two steps shown)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
