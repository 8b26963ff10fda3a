"""ZeRO-3 vs ZeRO++ step time across a 1 Gbit/s link between two "nodes" (``ds-plugin bench slow-link``).

Two network namespaces joined by a veth pair play two nodes; ``tc`` shapes both ends of the pair to the link
rate with a token bucket (tbf), optionally behind a netem delay. Two ranks run in each namespace (4 ranks, gloo,
one thread each), so traffic between nodes crosses the shaped link while traffic inside a node goes over the
namespace's loopback, unshaped, as NVLink/PCIe would be. Each config trains the same model on the same data in
bf16 (a stack of large MLP blocks fed a tiny batch, so communication dominates); the result is the median step
time after warm-up. The configs: ds_plugin's ZeRO-3 (``zero3``), ZeRO-3 + hpZ (``hpz``) and ZeRO++ (``zeropp``),
whose weight gathers run ahead of use (``stage3_prefetch_bucket_size``), and DeepSpeed's own engine on the same
three setups (``deepspeed_zero3``, ``deepspeed_hpz``, ``deepspeed_zeropp``: hpZ over the 2 ranks of a node plus
qwZ and qgZ), with DeepSpeed's defaults otherwise, when ``deepspeed`` is importable. A DeepSpeed config that
cannot run here (ZeRO++'s quantizer op needs CUDA, say) gets an ``error`` and a one-line ``reason`` (the last
line of its failing rank's error) instead of a time; the others still run.

The report's keys besides the per-config entries (``configs``) and the setup:

- ``zero3_step_s``, ``zeropp_step_s``: median step of ds_plugin's ZeRO-3 and ZeRO++ (None if not run or failed).
- ``speedup``: ``zero3_step_s / zeropp_step_s``; ``meets_target``: ``speedup >= target_speedup`` (2.5, the
  build item's first bar, ZeRO++ against ds_plugin's own ZeRO-3; unchanged).
- ``fastest_zero3``: ``{"config", "step_s"}`` of the fastest ZeRO-3 without quantization, ours or DeepSpeed's:
  ``zero3``, ``hpz``, ``deepspeed_zero3``, ``deepspeed_hpz`` (None if none of them has a time).
- ``zeropp_speedup_over_fastest_zero3``: ``fastest_zero3["step_s"] / zeropp_step_s``.
- ``ours_zero3_vs_deepspeed_zero3``: step-time ratio ``zero3_step_s / deepspeed_zero3 step_s`` (below 1: ours
  is faster).
- ``targets``: the issue's acceptance, each True/False, or None when a time it needs is missing:
  ``zero3_at_most_deepspeed_zero3`` (our ZeRO-3's step <= DeepSpeed ZeRO-3's) and
  ``zeropp_3x_fastest_zero3`` (``zeropp_speedup_over_fastest_zero3 >= target_zeropp_over_fastest_zero3``, 3.0).

Each config's entry also has ``phase_s_by_rank`` and ``phase_cpu_s_by_rank``: per rank, the median wall and CPU
seconds of its forward, backward and ``step()`` (a phase whose CPU seconds over all ranks, spread over the cores,
come near its wall time was waiting for the cores, not the link).

With ``--timeline`` each config's entry also has ``utilization`` (:mod:`benchmarks._slow_link_timeline`): per step,
the seconds in which the link alone, the cores alone, both or neither were busy, sampled about every 5 ms, and the
first two steps' samples (``trace``), which ``--png`` charts.

It needs root (network namespaces, tc) and the ``ip``/``tc`` tools of iproute2. Without them it says why and
exits 0 (``{"skipped": reason}`` with ``--json``). The namespaces are always removed: on return, on error, on
SIGINT/SIGTERM/SIGHUP and at interpreter exit; the namespaces of an earlier run that died are removed at start.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._slow_link_timeline import Sampler, draw, trace, utilization
from benchmarks._slow_link_worker import CONFIGS, DEEPSPEED, floors, model_params, rate_bytes_per_s, summarize
from ds_plugin._argparse import MAX_TIMEOUT_S, ArgumentParser, choice_list, count, number, output_file, shown
from ds_plugin.runtime.host_memory import rank_tunables

__all__ = ["Link", "benchmark", "compare", "error_reason", "link_commands", "main", "parse_args", "stale_namespaces"]

NS_PREFIX = "dspsl"
_NS_RE = re.compile(rf"^{NS_PREFIX}-(\d+)-[01]$")
ADDRESSES = ("10.77.0.1", "10.77.0.2")
RANKS_PER_NODE = 2
NODES = 2
TARGET_SPEEDUP = 2.5  # ZeRO++ over ds_plugin's own ZeRO-3: `meets_target`
TARGET_ZEROPP_OVER_FASTEST_ZERO3 = 3.0  # the bar: ZeRO++ over the fastest ZeRO-3, ours or DeepSpeed's
ZERO3_CONFIGS = ("zero3", "hpz", "deepspeed_zero3", "deepspeed_hpz")  # candidates for `fastest_zero3`
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


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
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
                _run(["ip", "netns", "delete", self.namespaces.pop()], check=False)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


_RESOURCES = _Resources()
atexit.register(_RESOURCES.release)


def _raise_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def build_link(link: Link) -> None:
    """Check the tools, remove stale namespaces, build `link`; raises SkipBenchmark when it cannot."""
    if os.geteuid() != 0:
        raise SkipBenchmark("needs root: network namespaces and tc shaping need CAP_NET_ADMIN (run it with sudo)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise SkipBenchmark(f"`{tool}` not found: install iproute2 (apt-get install -y iproute2)")
    try:
        listing = _run(["ip", "netns", "list"]).stdout
        for name in stale_namespaces(listing):
            _run(["ip", "netns", "delete", name], check=False)
        for cmd in link_commands(link):
            if cmd[:3] == ["ip", "netns", "add"]:
                _RESOURCES.namespaces.append(cmd[3])
            _run(cmd)
    except (OSError, subprocess.SubprocessError) as exc:
        _RESOURCES.release()
        detail = getattr(exc, "stderr", None) or str(exc)
        cmd = " ".join(getattr(exc, "cmd", None) or [])
        raise SkipBenchmark(f"cannot build the shaped link ({cmd}): {detail.strip()}") from None


def qdisc_drops(link: Link) -> list[int]:
    """Packets the qdiscs on each end of the link have dropped so far (a queue overflow shows up here)."""
    drops = []
    for ns, ifname in zip(link.namespaces, link.veths, strict=True):
        out = _run(["tc", "-s", "-j", "-n", ns, "qdisc", "show", "dev", ifname], check=False).stdout
        try:
            drops.append(sum(int(q.get("drops", 0)) for q in json.loads(out or "[]")))
        except (ValueError, AttributeError):
            drops.append(-1)  # an iproute2 without JSON output: unknown
    return drops


def _worker_cmd(args: argparse.Namespace, config: str, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "benchmarks._slow_link_worker", "--config", config,
        "--hidden", str(args.hidden), "--layers", str(args.layers), "--batch", str(args.batch),
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--collective-timeout", str(args.timeout),
        "--out", str(out), "--host-memory-reuse", args.host_memory_reuse,
    ]  # fmt: skip


def run_config(args: argparse.Namespace, link: Link, config: str, workdir: Path, port: int) -> dict[str, Any]:
    """Run one config on 4 ranks (2 per namespace) and return rank 0's measurements (or an "error")."""
    out = workdir / f"{config}.json"
    repo_root = str(Path(__file__).resolve().parents[1])
    logs = []
    for rank in range(NODES * RANKS_PER_NODE):
        node, local = divmod(rank, RANKS_PER_NODE)
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(NODES * RANKS_PER_NODE),
            "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(RANKS_PER_NODE),
            "MASTER_ADDR": ADDRESSES[0],
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": link.veths[node],
            "OMP_NUM_THREADS": "1",
            # As ds-plugin launch starts CPU ranks, every config's alike: glibc's per-thread malloc cache off.
            "GLIBC_TUNABLES": rank_tunables(os.environ.get("GLIBC_TUNABLES")),
            "DS_ACCELERATOR": "cpu",
            "PYTHONPATH": os.pathsep.join(p for p in (repo_root, os.environ.get("PYTHONPATH")) if p),
        }
        log = workdir / f"{config}.rank{rank}.log"
        logs.append(log)
        with open(log, "wb") as fh:
            cmd = ["ip", "netns", "exec", link.namespaces[node], *_worker_cmd(args, config, out)]
            proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        _RESOURCES.procs.append(proc)
    procs = list(_RESOURCES.procs)
    # `ip netns exec` execs the worker in place, so each Popen's pid is its rank's python process.
    nodes_first = [procs[node * RANKS_PER_NODE].pid for node in range(NODES)]
    sampler = Sampler([p.pid for p in procs], nodes_first, list(link.veths)) if args.timeline else None
    deadline = time.monotonic() + args.timeout
    failed = None
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        failed = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
        if failed is not None:
            break  # the other ranks would wait in a collective until the gloo timeout
        time.sleep(0.2)
    timed_out = time.monotonic() >= deadline
    codes = [p.poll() for p in procs]
    samples = sampler.stop() if sampler is not None else None
    _RESOURCES.kill_children()
    if out.exists():
        result = json.loads(out.read_text())
        rate = rate_bytes_per_s(link.rate)
        if samples is not None and rate:
            cores = min(os.cpu_count() or 1, len(procs))
            window = tuple(result["timed_window_monotonic"])
            result["utilization"] = utilization(samples, window, args.steps, cores, rate)
            if result["utilization"] is not None:  # the first two steps, for --png
                seconds = 2 * (window[1] - window[0]) / args.steps
                result["utilization"]["trace"] = trace(samples, window, seconds, cores, rate)
        return result
    rank = failed if failed is not None else 0
    reason = f"timed out after {args.timeout:g}s (exit codes {codes})" if timed_out else f"exit codes {codes}"
    text = logs[rank].read_text(errors="replace") if logs[rank].exists() else ""
    return {
        "config": config,
        "error": reason,
        "reason": error_reason(text) or reason,
        "log_tail_rank": rank,
        "log_tail": text[-3000:],
    }


_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)\b(?::.*)?$")


def error_reason(log: str) -> str | None:
    """The one line that says why a rank failed: the last exception line of its log (None if there is none).

    Args:
        log: the rank's output; torch's "[rankN]:" prefixes are dropped.
    """
    lines = [_RANK_PREFIX.sub("", line).strip() for line in log.splitlines()]
    found = [line for line in lines if _EXC_LINE.match(line)]
    return found[-1][:500] if found else None


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    mem_gib = None
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
        kib = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
        mem_gib = round(kib / 2**20, 1)
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem_gib, "kernel": platform.release()}


def _commit() -> str | None:
    """The ds_plugin checkout's git commit ("-dirty" with uncommitted changes), or None outside a checkout."""
    git = ["git", "-C", str(Path(__file__).resolve().parents[1])]
    try:
        head = _run([*git, "rev-parse", "--short", "HEAD"]).stdout.strip()
        dirty = _run([*git, "status", "--porcelain"]).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's command line."""
    parser = ArgumentParser(prog="ds-plugin bench slow-link", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--hidden", type=count(), default=2048, help="model width; each block is h->4h->h (2048)")
    parser.add_argument("--layers", type=count(), default=2, help="MLP blocks (2: 67M parameters at h=2048)")
    parser.add_argument("--batch", type=count(), default=8, help="rows per rank per step; tiny so compute is small (8)")
    parser.add_argument("--steps", type=count(), default=5, help="timed steps per config (5)")
    parser.add_argument("--warmup", type=count(0), default=2, help="untimed steps first (2)")
    # tc's syntax is checked here: a typo would otherwise surface as a skipped run, or break the report's floors.
    parser.add_argument("--rate", type=tc_quantity("rate"), default="1gbit", help="link rate per direction (1gbit)")
    parser.add_argument("--burst", type=tc_quantity("size"), default="256kb", help="tbf burst, tc syntax (256kb)")
    parser.add_argument(
        "--latency", type=tc_quantity("time"), default="100ms", help="tbf queue limit, tc syntax (100ms)"
    )
    # A minute one-way is past any WAN link the benchmark models.
    parser.add_argument("--delay-ms", type=number(0, 60_000), default=0.0, help="one-way netem delay in ms (0: none)")
    parser.add_argument(
        "--timeout",
        type=number(0, MAX_TIMEOUT_S, above_minimum=True),
        default=600.0,
        help="seconds per config before its ranks die",
    )
    parser.add_argument(
        "--configs",
        type=choice_list(CONFIGS),
        default=",".join(CONFIGS),
        help=f"comma-separated, from {', '.join(CONFIGS)}",
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="sample the ranks' CPU and the link's bytes about every 5 ms and report, per config, the seconds per step "
        "the link alone, the cores alone, both or neither were busy (`utilization`; costs this process a little CPU)",
    )
    parser.add_argument(
        "--png",
        type=output_file,
        help="with --timeline: chart the cores' and the link's busy fractions over two steps of each config (needs "
        "matplotlib)",
    )
    parser.add_argument(
        "--host-memory-reuse",
        choices=("on", "off"),
        default="on",
        help="glibc malloc keeps freed memory in every rank of every config, DeepSpeed's too (on; see README)",
    )
    args = parser.parse_args(argv)
    if args.png and not args.timeline:
        parser.error("--png charts the --timeline samples: add --timeline")
    if args.png and importlib.util.find_spec("matplotlib") is None:  # said now, not after minutes of runs
        parser.error("--png needs matplotlib: pip install -e '.[bench]'")
    return args


def _deepspeed_importable() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def benchmark(args: argparse.Namespace, link: Link) -> dict[str, Any]:
    """Build the link, run every config, return the report; the link is gone when this returns."""
    import torch

    report: dict[str, Any] = {}
    configs: dict[str, Any] = {}
    commit = _commit()  # before the runs: the ranks import the code as it is now
    build_link(link)
    try:
        with tempfile.TemporaryDirectory(prefix=f"ds_plugin_slow_link_{os.getpid()}_") as tmp:
            for i, config in enumerate(args.configs):
                if config in DEEPSPEED and not _deepspeed_importable():
                    configs[config] = {"skipped": "deepspeed is not importable (pip install deepspeed)"}
                    continue
                load_before, drops_before = os.getloadavg()[0], qdisc_drops(link)
                entry = configs[config] = summarize(run_config(args, link, config, Path(tmp), 29500 + i))
                # The 1-minute load average says whether other processes competed for the cores.
                entry["load_average_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
                entry["qdisc_drops_by_node"] = [b - a for a, b in zip(drops_before, qdisc_drops(link), strict=True)]
                if "step_s" in entry:
                    entry.update(floors(entry, link.rate))
    finally:
        _RESOURCES.release()
    z3, zpp = configs.get("zero3", {}).get("step_s"), configs.get("zeropp", {}).get("step_s")
    report.update(
        zero3_step_s=z3,
        zeropp_step_s=zpp,
        speedup=z3 / zpp if z3 and zpp else None,
        target_speedup=TARGET_SPEEDUP,
        link=link.describe(),
        ranks=NODES * RANKS_PER_NODE,
        nodes=NODES,
        ranks_per_node=RANKS_PER_NODE,
        model="MlpStack: blocks x + down(gelu(up(x))), up h->4h, down 4h->h, no bias",
        model_params=model_params(args.hidden, args.layers),
        hidden=args.hidden,
        layers=args.layers,
        batch_rows_per_rank=args.batch,
        optimizer="AdamW (torch.optim, lr 1e-4)",
        dtype="bf16",
        device="cpu",
        steps=args.steps,
        warmup=args.warmup,
        threads_per_rank=1,
        host_memory_reuse=args.host_memory_reuse,
        timeline=args.timeline,
        torch=torch.__version__,
        ds_plugin_commit=commit,
        python=platform.python_version(),
        machine=_machine(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        configs=configs,
    )
    if report["speedup"] is not None:
        report["meets_target"] = report["speedup"] >= TARGET_SPEEDUP
    report.update(compare(configs))
    return report


def compare(configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The report's cross-engine keys (see the module docstring) from the per-config entries.

    Args:
        configs: config name -> entry; an entry with a ``step_s`` counts, one without (failed, skipped) does not.
    """
    steps = {name: e["step_s"] for name, e in configs.items() if isinstance(e.get("step_s"), (int, float))}
    timed = [name for name in ZERO3_CONFIGS if name in steps]
    fastest = min(timed, key=lambda name: steps[name]) if timed else None
    zpp, ours, theirs = steps.get("zeropp"), steps.get("zero3"), steps.get("deepspeed_zero3")
    over_fastest = steps[fastest] / zpp if fastest and zpp else None
    ratio = ours / theirs if ours and theirs else None
    bar = TARGET_ZEROPP_OVER_FASTEST_ZERO3
    return {
        "fastest_zero3": {"config": fastest, "step_s": steps[fastest]} if fastest else None,
        "zeropp_speedup_over_fastest_zero3": over_fastest,
        "ours_zero3_vs_deepspeed_zero3": ratio,
        "target_zeropp_over_fastest_zero3": bar,
        "targets": {
            "zero3_at_most_deepspeed_zero3": None if ratio is None else ours <= theirs,
            "zeropp_3x_fastest_zero3": None if over_fastest is None else over_fastest >= bar,
        },
    }


def _print_text(report: dict[str, Any]) -> None:
    print(f"link: {report['link']}")
    print(f"{report['ranks']} ranks on {report['nodes']} nodes, {report['model_params'] / 1e6:.0f}M params, bf16")
    for name, entry in report["configs"].items():
        if "step_s" in entry:
            mb, bound = entry["cross_node_mb_per_step_by_node"], entry.get("bound_by")
            print(f"{name:>16}: {entry['step_s']:7.3f} s/step, {mb} MB/step across per node, {bound}-bound")
            if entry.get("phase_s_by_rank"):
                walls, cpus = entry["phase_s_by_rank"], entry["phase_cpu_s_by_rank"]
                split = ", ".join(f"{k} {max(walls[k]):.3f} / {sum(cpus[k]):.3f} s" for k in walls)
                print(f"{'':>16}  wall (slowest rank) / CPU (all ranks): {split}")
            if entry.get("utilization"):
                u = entry["utilization"]
                print(
                    f"{'':>16}  per step: link alone {u['link_only_s']:.3f} s, cores alone {u['cpu_only_s']:.3f} s, "
                    f"both {u['both_s']:.3f} s, neither {u['neither_s']:.3f} s"
                )
        else:
            print(f"{name:>16}: {entry.get('skipped') or entry.get('reason') or entry.get('error')}")
    if report["speedup"] is not None:
        print(f"ZeRO++ speedup over ZeRO-3: {report['speedup']:.2f}x (target {TARGET_SPEEDUP}x)")
    fastest, targets = report.get("fastest_zero3"), report.get("targets", {})
    if fastest:
        print(f"fastest ZeRO-3: {fastest['config']} {fastest['step_s']:.3f} s/step")
    if report.get("zeropp_speedup_over_fastest_zero3") is not None:
        x, bar = report["zeropp_speedup_over_fastest_zero3"], report["target_zeropp_over_fastest_zero3"]
        print(f"ZeRO++ speedup over the fastest ZeRO-3: {x:.2f}x (target {bar}x)")
    if report.get("ours_zero3_vs_deepspeed_zero3") is not None:
        print(f"our ZeRO-3 step / DeepSpeed ZeRO-3 step: {report['ours_zero3_vs_deepspeed_zero3']:.2f}")
    print("targets: " + ", ".join(f"{k} {v}" for k, v in targets.items()))


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a summary, or JSON with ``--json``; returns the exit code.

    Args:
        argv: command-line arguments (default: ``sys.argv[1:]``).
    """
    args = parse_args(argv)
    link = Link(rate=args.rate, burst=args.burst, latency=args.latency, delay_ms=args.delay_ms)
    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, _raise_exit) for s in handled}
    try:
        report = benchmark(args, link)
    except SkipBenchmark as exc:
        print(json.dumps({"skipped": str(exc)}) if args.json else f"ds-plugin bench slow-link skipped: {exc}")
        return 0
    finally:
        _RESOURCES.release()
        for s, handler in previous.items():
            signal.signal(s, handler)
    if args.png:
        os.makedirs(os.path.dirname(os.path.abspath(args.png)), exist_ok=True)  # allowed while parsing
        size = f"{report['model_params'] / 1e6:.0f}M parameters"
        title = f"bench slow-link: {args.rate} link between {NODES} nodes of {RANKS_PER_NODE} ranks, {size}"
        if not draw(report["configs"], args.png, title):
            print("no config has a timeline to chart (too few samples in its timed steps)", file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_text(report)
    # A DeepSpeed config that cannot run here is a finding (its `reason`), not a failure of the benchmark.
    failed = [name for name, entry in report["configs"].items() if "error" in entry and name not in DEEPSPEED]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
