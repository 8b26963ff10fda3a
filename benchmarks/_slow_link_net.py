"""The shaped link of ``ds-plugin bench slow-link``: two network namespaces joined by a veth pair, each end shaped
by ``tc`` (tbf, optionally behind netem), and everything needed to undo it (namespaces, the ranks' process
groups) on return, on error and on signals. Also the checked ``tc`` quantities of the command line.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ds_plugin._argparse import shown

__all__ = [
    "ADDRESSES", "NS_PREFIX", "RESOURCES", "Link", "SkipBenchmark", "build_link", "link_commands", "qdisc_drops",
    "run_cmd", "stale_namespaces", "tc_quantity",
]  # fmt: skip

NS_PREFIX = "dspsl"
_NS_RE = re.compile(rf"^{NS_PREFIX}-(\d+)-[01]$")
ADDRESSES = ("10.77.0.1", "10.77.0.2")
_CMD_TIMEOUT_S = 30


class SkipBenchmark(Exception):
    """This machine cannot run the benchmark (not root, no iproute2, no namespaces): a reason, exit code 0."""


@dataclass(frozen=True)
class Link:
    """The shaped link and the names of the namespaces and veth ends that make it.

    Args:
        rate: tbf rate on each end (each direction), in tc's syntax.
        burst: tbf bucket size: bytes that may leave at line speed after an idle spell.
        latency: tbf queue limit as the longest a packet may wait for tokens (longer waits are dropped).
        delay_ms: one-way netem delay in front of the tbf (0: none; needs the sch_netem kernel module).
        tag: makes the names unique to this run (its process id).
    """

    rate: str = "1gbit"
    burst: str = "256kb"
    # 100 ms of queue is 12.5 MB at 1 Gbit/s: room for three TCP flows' small-queue allowance (4 MB each by
    # default). At 20 ms the queue overflowed under ZeRO-3's all-gathers and retransmit timeouts made its steps
    # swing from 11 to 18 s; the queue only fills, and delays, while the link is saturated anyway.
    latency: str = "100ms"
    delay_ms: float = 0.0
    tag: int = field(default_factory=os.getpid)

    @property
    def namespaces(self) -> tuple[str, str]:
        return f"{NS_PREFIX}-{self.tag}-0", f"{NS_PREFIX}-{self.tag}-1"

    @property
    def veths(self) -> tuple[str, str]:
        # Interface names are at most 15 characters: "dsl" + pid (<= 7 digits) + a/b.
        return f"dsl{self.tag}a", f"dsl{self.tag}b"

    def describe(self) -> str:
        delay = f" + netem delay {self.delay_ms:g}ms" if self.delay_ms else ", no added delay"
        return (
            f"{self.rate} tbf (burst {self.burst}, latency {self.latency}) on both ends of a veth pair between "
            f"two network namespaces{delay}"
        )


def link_commands(link: Link) -> list[list[str]]:
    """The ``ip``/``tc`` commands that build `link`, in order (both namespaces must not exist yet).

    Args:
        link: the link to build.
    """
    (ns0, ns1), (if0, if1) = link.namespaces, link.veths
    cmds = [["ip", "netns", "add", ns0], ["ip", "netns", "add", ns1]]
    # Created directly inside the namespaces, so a crash never leaves a veth end in the root namespace.
    cmds.append(["ip", "link", "add", if0, "netns", ns0, "type", "veth", "peer", "name", if1, "netns", ns1])
    for ns, ifname, addr in ((ns0, if0, ADDRESSES[0]), (ns1, if1, ADDRESSES[1])):
        cmds += [
            ["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", ifname],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", ns, "link", "set", ifname, "up"],
        ]
        tbf = ["tbf", "rate", link.rate, "burst", link.burst, "latency", link.latency]
        if link.delay_ms:
            cmds.append(["tc", "-n", ns, "qdisc", "add", "dev", ifname, "root", "handle", "1:", "netem", "delay",
                         f"{link.delay_ms}ms", "limit", "100000"])  # fmt: skip
            cmds.append(["tc", "-n", ns, "qdisc", "add", "dev", ifname, "parent", "1:1", "handle", "10:", *tbf])
        else:
            cmds.append(["tc", "-n", ns, "qdisc", "add", "dev", ifname, "root", *tbf])
    return cmds


def stale_namespaces(listing: str, alive: Any = None) -> list[str]:
    """Namespaces of this benchmark, named in `ip netns list` output, whose run's process is gone.

    Args:
        listing: the output of ``ip netns list``.
        alive: pid -> bool (default: the process exists).
    """
    alive = alive or _pid_alive
    stale = []
    for line in listing.splitlines():
        name = line.split(" ", 1)[0].strip()
        m = _NS_RE.match(name)
        if m and not alive(int(m.group(1))):
            stale.append(name)
    return stale


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only checks that the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def run_cmd(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run `cmd` (a short ip/tc/git call) with a timeout, raising on a non-zero exit when `check`."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    if check and proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd, proc.stdout, proc.stderr)
    return proc


class _Resources:
    """Everything to undo: child process groups and namespaces. `release` is idempotent and signal-safe."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.namespaces: list[str] = []

    def kill_children(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # each child leads its own session
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()

    def release(self) -> None:
        signals = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        old = signal.pthread_sigmask(signal.SIG_BLOCK, signals)  # a second Ctrl-C must not stop the cleanup
        try:
            self.kill_children()
            while self.namespaces:
                # Deleting a namespace deletes the veth end inside it, and with it the pair.
                run_cmd(["ip", "netns", "delete", self.namespaces.pop()], check=False)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


RESOURCES = _Resources()
atexit.register(RESOURCES.release)


def build_link(link: Link) -> None:
    """Check the tools, remove stale namespaces, build `link`; raises SkipBenchmark when it cannot."""
    if os.geteuid() != 0:
        raise SkipBenchmark("needs root: network namespaces and tc shaping need CAP_NET_ADMIN (run it with sudo)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise SkipBenchmark(f"`{tool}` not found: install iproute2 (apt-get install -y iproute2)")
    try:
        listing = run_cmd(["ip", "netns", "list"]).stdout
        for name in stale_namespaces(listing):
            run_cmd(["ip", "netns", "delete", name], check=False)
        for cmd in link_commands(link):
            if cmd[:3] == ["ip", "netns", "add"]:
                RESOURCES.namespaces.append(cmd[3])
            run_cmd(cmd)
    except (OSError, subprocess.SubprocessError) as exc:
        RESOURCES.release()
        detail = getattr(exc, "stderr", None) or str(exc)
        cmd = " ".join(getattr(exc, "cmd", None) or [])
        raise SkipBenchmark(f"cannot build the shaped link ({cmd}): {detail.strip()}") from None


def qdisc_drops(link: Link) -> list[int]:
    """Packets the qdiscs on each end of the link have dropped so far (a queue overflow shows up here)."""
    drops = []
    for ns, ifname in zip(link.namespaces, link.veths, strict=True):
        out = run_cmd(["tc", "-s", "-j", "-n", ns, "qdisc", "show", "dev", ifname], check=False).stdout
        try:
            drops.append(sum(int(q.get("drops", 0)) for q in json.loads(out or "[]")))
        except (ValueError, AttributeError):
            drops.append(-1)  # an iproute2 without JSON output: unknown
    return drops


# tc's units (tc(8), "PARAMETERS"): a bare number is bits/s for a rate, bytes for a size, microseconds for a time.
_TC_UNITS = {
    "rate": {"", "bit", "kbit", "mbit", "gbit", "tbit", "bps", "kbps", "mbps", "gbps", "tbps"}
    | {"kibit", "mibit", "gibit", "tibit", "kibps", "mibps", "gibps", "tibps"},
    "size": {"", "b", "k", "kb", "kbit", "m", "mb", "mbit", "g", "gb", "gbit"},
    "time": {"", "s", "sec", "secs", "ms", "msec", "msecs", "us", "usec", "usecs"},
}
_TC_RE = re.compile(r"([0-9]{1,12}(?:\.[0-9]{1,9})?)([a-z]*)")  # ASCII digits: tc reads no others


def tc_quantity(kind: str) -> Callable[[str], str]:
    """A `type=` for a positive tc rate, size or time ("1gbit", "256kb", "100ms"), checked before `tc` sees it."""
    units = _TC_UNITS[kind]

    def parse(text: str) -> str:
        m = _TC_RE.fullmatch(text.strip().lower())
        if not m or m.group(2) not in units or float(m.group(1)) <= 0:
            example = {"rate": "1gbit", "size": "256kb", "time": "100ms"}[kind]
            raise argparse.ArgumentTypeError(f"{shown(text)} is not a positive tc {kind} such as {example}")
        return m.group(1) + m.group(2)  # as tc reads it: lower case, no spaces

    return parse
