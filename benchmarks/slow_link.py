"""ZeRO-3 vs ZeRO++ step time across a 1 Gbit/s link between two "nodes" (``ds-plugin bench slow-link``).

Two network namespaces joined by a veth pair play two nodes; ``tc`` shapes both ends of the pair to the link
rate with a token bucket (tbf), optionally behind a netem delay. Two ranks run in each namespace (4 ranks, gloo,
one thread each), so traffic between nodes crosses the shaped link while traffic inside a node goes over the
namespace's loopback, unshaped, as NVLink/PCIe would be. Each config trains the same model on the same data in
the same compute dtype (a stack of large MLP blocks fed a tiny batch, so communication dominates); the result is
the median step time after warm-up. The dtype is ``--dtype``'s, or by default bf16 where the CPU has bf16 units and
fp32 where it has not (there a bf16 matmul is emulated, tens of times slower, and would time the emulation instead
of the link); the report's ``dtype`` and ``dtype_reason`` say which and why. In fp32 ZeRO-3 moves four bytes per
weight across the link where bf16 moves two, while ZeRO++'s INT8 weights and INT4 gradients are the same size in
both, so ZeRO++'s lead over ZeRO-3 is larger in fp32: compare speedups only between runs of one dtype.

The configs: ds_plugin's ZeRO-3 (``zero3``), ZeRO-3 + hpZ (``hpz``) and ZeRO++ (``zeropp``), whose weight gathers
run ahead of use (``stage3_prefetch_bucket_size``), and DeepSpeed's own engine on the same three setups
(``deepspeed_zero3``, ``deepspeed_hpz``, ``deepspeed_zeropp``: hpZ over the 2 ranks of a node plus qwZ and qgZ),
with DeepSpeed's defaults otherwise, when ``deepspeed`` is importable. A DeepSpeed config that cannot run here
(ZeRO++'s quantizer op needs CUDA, say) gets an ``error`` and a one-line ``reason`` (the last line of its failing
rank's error) instead of a time; the others still run.

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
import datetime
import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._slow_link_net import (
    ADDRESSES,
    Link,
    SkipBenchmark,
    build_link,
    link_commands,
    qdisc_drops,
    run_cmd,
    stale_namespaces,
    tc_quantity,
)
from benchmarks._slow_link_net import RESOURCES as _RESOURCES
from benchmarks._slow_link_timeline import Sampler, draw, trace, utilization
from benchmarks._slow_link_worker import (
    CONFIGS,
    DEEPSPEED,
    DTYPES,
    floors,
    model_params,
    rate_bytes_per_s,
    summarize,
)
from ds_plugin._argparse import MAX_TIMEOUT_S, ArgumentParser, choice_list, count, number, output_file
from ds_plugin.runtime.host_memory import rank_tunables

__all__ = ["Link", "benchmark", "compare", "error_reason", "link_commands", "main", "parse_args", "stale_namespaces"]

RANKS_PER_NODE = 2
NODES = 2
TARGET_SPEEDUP = 2.5  # ZeRO++ over ds_plugin's own ZeRO-3: `meets_target`
TARGET_ZEROPP_OVER_FASTEST_ZERO3 = 3.0  # the bar: ZeRO++ over the fastest ZeRO-3, ours or DeepSpeed's
ZERO3_CONFIGS = ("zero3", "hpz", "deepspeed_zero3", "deepspeed_hpz")  # candidates for `fastest_zero3`


def _raise_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def _worker_cmd(args: argparse.Namespace, config: str, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "benchmarks._slow_link_worker", "--config", config,
        "--hidden", str(args.hidden), "--layers", str(args.layers), "--batch", str(args.batch),
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--collective-timeout", str(args.timeout),
        "--out", str(out), "--host-memory-reuse", args.host_memory_reuse, "--dtype", args.dtype,
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
        head = run_cmd([*git, "rev-parse", "--short", "HEAD"]).stdout.strip()
        dirty = run_cmd([*git, "status", "--porcelain"]).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


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
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        help="compute dtype of every config (default: bf16 where this CPU has bf16 units, else fp32, said on stderr)",
    )
    args = parser.parse_args(argv)
    if args.dtype is None:
        from ds_plugin.runtime.cpu_bf16 import fast_compute_dtype

        args.dtype, args.dtype_reason = fast_compute_dtype("cpu")
        print(f"bench slow-link: training in {args.dtype} ({args.dtype_reason}; --dtype to choose)", file=sys.stderr)
    else:
        args.dtype_reason = "chosen with --dtype"
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
        dtype=args.dtype,
        dtype_reason=args.dtype_reason,
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
    size = f"{report['model_params'] / 1e6:.0f}M params"
    print(f"{report['ranks']} ranks on {report['nodes']} nodes, {size}, {report['dtype']} ({report['dtype_reason']})")
    for name, entry in report["configs"].items():
        if "step_s" in entry:
            mb, bound = entry["cross_node_mb_per_step_by_node"], entry.get("bound_by")
            window = f" (whole window {entry['window_s_per_step']:.3f} s/step)" if "window_s_per_step" in entry else ""
            print(f"{name:>16}: {entry['step_s']:7.3f} s/step{window}, {mb} MB/step across per node, {bound}-bound")
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
        size = f"{report['model_params'] / 1e6:.0f}M parameters, {report['dtype']}"
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
