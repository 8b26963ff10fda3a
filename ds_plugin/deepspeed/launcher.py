"""`ds-plugin launch`: the `deepspeed` command's flags, starting the ranks through torchrun (CPU or GPU).

    ds-plugin launch --num_gpus 2 train.py --deepspeed --deepspeed_config ds_config.json

Each rank runs the script as `deepspeed` runs it: `python script.py --local_rank=<i> <your args>`, with `RANK`,
`LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` set (torchrun sets them; a small entry point,
`ds_plugin.deepspeed._rank_entry`, adds `--local_rank`, which torchrun does not pass). Everything after the script is
passed on unchanged, `--deepspeed_config` included.

Nodes: `--hostfile` (DeepSpeed's format, `host slots=N` per line), narrowed by `--include` / `--exclude`
(`host1:0,1@host2`) or `--num_nodes`, gives the node list; the same command runs on every node (DeepSpeed's
`--no_ssh` mode: nothing is started over ssh), each finding its own `--node_rank` by host name unless given. On one
node, `--include localhost:0,2` picks GPUs (`CUDA_VISIBLE_DEVICES`). Every mistake is one line before any rank starts.
On a node without GPUs the ranks start with glibc's per-thread malloc cache off (`GLIBC_TUNABLES`), which fragments a
CPU rank's heap (`ds_plugin.runtime.host_memory`); a `GLIBC_TUNABLES` that sets `glibc.malloc.tcache_count` stands.
`--bind_cores_to_rank` (with `--bind_core_list`) pins each rank to an equal slice of the cores and sets
`OMP_NUM_THREADS` to its size, as DeepSpeed's numactl binding does; `--enable_each_rank_log DIR` writes each rank's
output to files under DIR (torchrun's layout). The launcher flags with no meaning here are accepted and said so.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

__all__ = ["BIND_CORES_ENV", "LaunchError", "add_launch_arguments", "launch_plan", "run_launch", "without_effect"]

BIND_CORES_ENV = "DS_PLUGIN_BIND_CORES"
"""The cores `--bind_cores_to_rank` shares out; each rank pins itself to its slice (`_rank_entry`)."""


class LaunchError(ValueError):
    """A launch that cannot start: the message says what and how to fix it, in one line."""


# The `deepspeed` command's flags that change nothing here: how each parses, and the reason said on stderr when one is
# given (`-q` is spelled apart: it has a short form).
_ONE_LAUNCHER = "ranks start through torchrun on each node (the same command on every node: nothing uses ssh)"
_SWITCH: dict[str, object] = {"action": "store_true"}
_VALUE: dict[str, object] = {"default": None}
_WITHOUT_EFFECT: dict[str, tuple[dict[str, object], str]] = {
    "force_multi": (_SWITCH, "torchrun runs one node or many the same way"),
    "no_ssh_check": (_SWITCH, _ONE_LAUNCHER),
    "ssh_port": ({"type": int, "default": None}, _ONE_LAUNCHER),
    "launcher": (_VALUE, _ONE_LAUNCHER),
    "launcher_args": (_VALUE, _ONE_LAUNCHER),
    "venv_script": (_VALUE, "every node runs this command in the environment it is started from"),
    "save_pid": (_SWITCH, "torchrun's own process is the one to signal"),
    "log_level": (_VALUE, "the launcher prints only its errors"),
    "quiet": (_SWITCH, "the launcher prints only its errors"),
}


def _parse_cores(text: str) -> list[int]:
    cores: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise LaunchError(f"--bind_core_list {text!r}: write cores as numbers and ranges, e.g. 1,3-5,7")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


def without_effect(args: argparse.Namespace) -> list[str]:
    """One line per given flag that changes nothing here, with the reason."""
    return [
        f"ds-plugin launch: --{name} has no effect here ({why})" for name, (_, why) in _WITHOUT_EFFECT.items()
        if getattr(args, name, None) not in (None, False)
    ]  # fmt: skip


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """The `deepspeed` command's flags, spelled as it spells them (its `--foo_bar` and the `--foo-bar` form).

    Args:
        parser: the `launch` subcommand's parser.
    """

    def flag(name: str, **kwargs: object) -> None:
        parser.add_argument(f"--{name}", f"--{name.replace('_', '-')}", dest=name, **kwargs)

    flag("num_gpus", type=int, default=None, help="ranks on this node (default: its GPUs, 1 without a GPU)")
    flag("num_nodes", type=int, default=None, help="use the first N nodes of the hostfile")
    flag("hostfile", default=None, help="DeepSpeed hostfile: one 'host slots=N' per line")
    parser.add_argument("-i", "--include", default="", help="hosts and GPUs to use, e.g. host1:0,1@host2")
    parser.add_argument("-e", "--exclude", default="", help="hosts and GPUs to leave out, e.g. host1:1")
    flag("master_addr", default=None, help="address of node rank 0 (default: the first host, or 127.0.0.1)")
    flag("master_port", type=int, default=29500, help="port on node rank 0")
    flag("node_rank", type=int, default=None, help="this node's index in the host list (default: found by name)")
    flag("no_ssh", action="store_true", help="accepted: every node runs this same command (nothing uses ssh)")
    flag("no_local_rank", action="store_true", help="do not pass --local_rank to the script")
    flag("module", action="store_true", help="the script is a module name (python -m)")
    flag(
        "bind_cores_to_rank", action="store_true", help="pin each rank to its share of the cores (OMP_NUM_THREADS too)"
    )
    flag("bind_core_list", default=None, help="the cores --bind_cores_to_rank shares out, e.g. 0-7,16-23")
    flag("enable_each_rank_log", default=None, help="write each rank's stdout and stderr to files in this directory")
    flag("autotuning", default="", help="DeepSpeed's autotuner: not part of ds_plugin (refused)")
    flag("no_python", action="store_true", help="run the script without python: refused (ranks run Python scripts)")
    for name, (kwargs, _) in _WITHOUT_EFFECT.items():
        names = ("-q", "--quiet") if name == "quiet" else (f"--{name}", f"--{name.replace('_', '-')}")
        parser.add_argument(*names, dest=name, help="accepted without effect (said when given)", **kwargs)
    parser.add_argument("script", help="the training script (or module, with --module)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")


def _read_hostfile(path: str) -> OrderedDict[str, int]:
    if not Path(path).is_file():
        raise LaunchError(f"--hostfile {path}: no such file; write one 'host slots=N' line per node")
    hosts: OrderedDict[str, int] = OrderedDict()
    for number, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].startswith("slots=") or not parts[1][6:].isdigit():
            raise LaunchError(f"--hostfile {path}: line {number} {line!r} is not 'host slots=N'")
        if parts[0] in hosts:
            raise LaunchError(f"--hostfile {path}: host {parts[0]!r} appears twice; list each node once")
        hosts[parts[0]] = int(parts[1][6:])
    if not hosts:
        raise LaunchError(f"--hostfile {path}: no hosts; write one 'host slots=N' line per node")
    return hosts


def _parse_filter(text: str, flag: str) -> OrderedDict[str, list[int] | None]:
    """`host1:0,1@host2` -> {host1: [0, 1], host2: None (all)}."""
    out: OrderedDict[str, list[int] | None] = OrderedDict()
    for part in filter(None, text.split("@")):
        host, _, slots = part.partition(":")
        if not host:
            raise LaunchError(f"{flag} {text!r}: {part!r} names no host; write host or host:0,1")
        try:
            out[host] = [int(s) for s in slots.split(",")] if slots else None
        except ValueError:
            raise LaunchError(f"{flag} {text!r}: {slots!r} is not a list of GPU indices like 0,1") from None
    return out


def _pool(hosts: OrderedDict[str, int], include: str, exclude: str) -> OrderedDict[str, list[int]]:
    """Host -> the slot (GPU) indices to use, after --include / --exclude."""
    pool = OrderedDict((h, list(range(n))) for h, n in hosts.items())
    if include and exclude:
        raise LaunchError("--include and --exclude are mutually exclusive; use one")
    if include:
        chosen: OrderedDict[str, list[int]] = OrderedDict()
        for host, slots in _parse_filter(include, "--include").items():
            if host not in pool:
                raise LaunchError(f"--include: host {host!r} is not in the host list ({', '.join(pool)})")
            bad = [s for s in slots or [] if s not in pool[host]]
            if bad:
                raise LaunchError(f"--include: {host} has slots 0..{len(pool[host]) - 1}, not {bad}")
            chosen[host] = list(slots) if slots is not None else pool[host]
        return chosen
    for host, slots in _parse_filter(exclude, "--exclude").items():
        if host not in pool:
            raise LaunchError(f"--exclude: host {host!r} is not in the host list ({', '.join(pool)})")
        pool[host] = [] if slots is None else [s for s in pool[host] if s not in slots]
    return OrderedDict((h, s) for h, s in pool.items() if s)


def _cuda_devices() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def _local_slots() -> int:
    return _cuda_devices() or 1


def launch_plan(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The torchrun command line and the environment changes for this node; one-line `LaunchError`s before anything.

    Args:
        args: the parsed `launch` arguments.
    """
    script = args.script
    if not args.module and not Path(script).is_file():
        raise LaunchError(f"{script}: no such script; give the path of the training script (or --module NAME)")
    if args.num_gpus is not None and args.num_gpus < 1:
        raise LaunchError(f"--num_gpus {args.num_gpus}: must be at least 1")
    if args.num_nodes is not None and args.num_nodes < 1:
        raise LaunchError(f"--num_nodes {args.num_nodes}: must be at least 1")
    if args.autotuning:
        raise LaunchError("--autotuning: DeepSpeed's autotuner is not part of ds_plugin; launch without it")
    if args.no_python:
        raise LaunchError("--no_python: ranks run Python scripts here; launch the script itself (or use --module)")
    if args.hostfile:
        hosts = _read_hostfile(args.hostfile)
    else:
        if args.num_nodes not in (None, 1):
            raise LaunchError(f"--num_nodes {args.num_nodes}: needs --hostfile listing the nodes")
        hosts = OrderedDict(localhost=args.num_gpus or _local_slots())
    pool = _pool(hosts, args.include, args.exclude)
    if not pool:
        raise LaunchError("--exclude leaves no host or GPU to run on")
    if args.num_nodes is not None:
        if args.num_nodes > len(pool):
            raise LaunchError(f"--num_nodes {args.num_nodes}: the host list has only {len(pool)} nodes")
        pool = OrderedDict(list(pool.items())[: args.num_nodes])
    counts = {len(s) for s in pool.values()}
    if args.num_gpus is None and len(counts) != 1:
        raise LaunchError("the nodes have different numbers of slots; torchrun starts the same number on each")
    per_node = args.num_gpus or counts.pop()
    names = list(pool)
    node_rank = args.node_rank
    if node_rank is None:
        if len(names) == 1:
            node_rank = 0
        else:
            me = {socket.gethostname(), socket.getfqdn(), socket.gethostname().split(".")[0]}
            found = [i for i, h in enumerate(names) if h in me]
            if not found:
                raise LaunchError(
                    f"this host ({socket.gethostname()}) is not in the host list {names}; pass --node_rank"
                )
            node_rank = found[0]
    if not 0 <= node_rank < len(names):
        raise LaunchError(f"--node_rank {node_rank}: must be in 0..{len(names) - 1}")
    master = args.master_addr or ("127.0.0.1" if len(names) == 1 else names[0])
    cmd = [
        sys.executable,
        "-m",
        "ds_plugin.deepspeed._agent",  # torchrun, a failed rank reported in one line
        f"--nnodes={len(names)}",
        f"--nproc-per-node={per_node}",
        f"--node-rank={node_rank}",
        f"--master-addr={master}",
        f"--master-port={args.master_port}",
    ]
    if args.enable_each_rank_log not in (None, "None"):
        # DeepSpeed's flag: each rank's output in its own files (torchrun's layout under the directory).
        Path(args.enable_each_rank_log).mkdir(parents=True, exist_ok=True)
        cmd += [f"--log-dir={args.enable_each_rank_log}", "--redirects=3"]
    cmd += ["-m", "ds_plugin.deepspeed._rank_entry"]
    if args.no_local_rank:
        cmd.append("--no-local-rank")
    if args.module:
        cmd.append("--module")
    cmd += [script, *args.script_args]
    env: dict[str, str] = {}
    slots = pool[names[node_rank]]
    if args.include or args.exclude:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots[:per_node]))
    if args.bind_cores_to_rank or args.bind_core_list:
        cores = _parse_cores(args.bind_core_list) if args.bind_core_list else sorted(os.sched_getaffinity(0))
        if len(cores) < per_node:
            raise LaunchError(f"--bind_cores_to_rank: {per_node} ranks need at least as many cores, got {len(cores)}")
        env[BIND_CORES_ENV] = ",".join(map(str, cores))
    if not _cuda_devices():
        from ds_plugin.runtime.host_memory import rank_tunables

        env["GLIBC_TUNABLES"] = rank_tunables(os.environ.get("GLIBC_TUNABLES"))
    return cmd, env


def run_launch(args: argparse.Namespace) -> int:
    """Start this node's ranks and wait for them; returns torchrun's exit code.

    Args:
        args: the parsed `launch` arguments.
    """
    cmd, env = launch_plan(args)
    for line in without_effect(args):
        print(line, file=sys.stderr)
    return subprocess.call(cmd, env={**os.environ, **env})
