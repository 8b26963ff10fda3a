"""One rank of ``ds-plugin bench slow-link``: time training steps of one ZeRO config across the shaped link.

Started by :mod:`benchmarks.slow_link` inside a network namespace with the torchrun-style environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``GLOO_SOCKET_IFNAME``). Every rank builds the same model from the same seed and trains on its own fixed
batch, identical for every config, so the configs differ only in how they communicate. Each step runs
between two barriers; rank 0 writes the per-step times of every rank, the bytes its namespace's veth sent
during the timed steps, and the losses, as JSON to ``--out``. `summarize` and `floors` turn that into the
report's entry for the config.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import resource
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ds_plugin.runtime.host_memory import host_memory_reuse_state, reuse_freed_host_memory, thread_cache_on

# Config name -> (ds_plugin preset, DeepSpeed keys merged over it): ds_plugin's configs.
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "zero3": ("zero3", {}),
    "zeropp": ("zeropp", {}),
    # hpZ alone: ZeRO++'s topology trick without quantization, to tell the two apart.
    "hpz": ("zero3", {"zero_optimization": {"zero_hpz_partition_size": "auto"}}),
}
# Config name -> `zero_optimization` keys over DeepSpeed's stage 3 (None: ranks per node): DeepSpeed's own engine,
# the same three setups as ds_plugin's zero3 / hpz / zeropp.
DEEPSPEED: dict[str, dict[str, Any]] = {
    "deepspeed_zero3": {},
    "deepspeed_hpz": {"zero_hpz_partition_size": None},
    "deepspeed_zeropp": {
        "zero_hpz_partition_size": None,
        "zero_quantized_weights": True,
        "zero_quantized_gradients": True,
    },
}
CONFIGS = (*PRESETS, *DEEPSPEED)
#: Compute dtypes a config can train in (fp32 masters either way).
DTYPES = ("bf16", "fp32")
#: The parts of a step timed apart on every rank: the forward (with the loss), the backward, and `step()`.
PHASES = ("forward", "backward", "step")


class Block(nn.Module):
    """``x + down(gelu(up(x)))``: a decoder MLP, the shape that holds most of a transformer's weights."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class MlpStack(nn.Module):
    """A stack of `Block`s in an `nn.ModuleList`, so ZeRO shards each block as its own unit."""

    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(hidden, 4 * hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def model_params(hidden: int, layers: int) -> int:
    """Parameter count of `MlpStack(hidden, layers)`, without building it."""
    return layers * 2 * hidden * 4 * hidden


def _collective_names(model: nn.Module) -> dict[str, str]:
    """Class names of the all-gather / reduce-scatter objects FSDP2 uses (private attributes: report only)."""
    from torch.distributed.fsdp import FSDPModule

    names: dict[str, set[str]] = {"all_gather": set(), "reduce_scatter": set()}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
        if group is None:
            continue
        names["all_gather"].add(type(group._all_gather_comm).__name__)
        names["reduce_scatter"].add(type(group._reduce_scatter_comm).__name__)
    return {kind: ",".join(sorted(found)) or "none" for kind, found in names.items()}


def _ds_plugin_engine(
    name: str, model: nn.Module, ranks_per_node: int, lr: float, reuse: bool = True, dtype: str = "bf16"
) -> tuple[Any, dict[str, Any]]:
    from ds_plugin import initialize
    from ds_plugin.presets import get_preset
    from ds_plugin.zero.plan import resolve_plan
    from ds_plugin.zero.zeropp import zeropp_stats

    preset, overrides = PRESETS[name]
    config = get_preset(preset, bf16={"enabled": dtype == "bf16"}, host_memory_reuse=reuse, **overrides)
    config = resolve_plan(config, world_size=dist.get_world_size(), ranks_per_node=ranks_per_node).config
    engine = initialize(model, config, optimizer=lambda params: torch.optim.AdamW(params, lr=lr))
    info: dict[str, Any] = {
        "hpz_partition_size": config.zero_optimization.hpz_partition_size,
        "collectives": _collective_names(engine.module),
        "stats": zeropp_stats(engine.module),
    }
    return engine, info


def deepspeed_config(name: str, ranks_per_node: int, batch: int, dtype: str = "bf16") -> dict[str, Any]:
    """DeepSpeed's config for the DeepSpeed config `name` (its defaults otherwise, prefetch and overlap included):
    bf16 mode (bf16 weights and gradients, fp32 masters) for ``dtype="bf16"``, plain fp32 for "fp32"."""
    zero = {k: ranks_per_node if v is None else v for k, v in DEEPSPEED[name].items()}
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": dtype == "bf16"},
        "zero_optimization": {"stage": 3, **zero},
        "zero_allow_untested_optimizer": True,
    }


def _deepspeed_engine(
    name: str, model: nn.Module, ranks_per_node: int, lr: float, batch: int, dtype: str
) -> tuple[Any, dict[str, Any]]:
    import deepspeed

    ds_config = deepspeed_config(name, ranks_per_node, batch, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    zero = ds_config["zero_optimization"]
    info = {"deepspeed": deepspeed.__version__, "hpz_partition_size": zero.get("zero_hpz_partition_size", 1)}
    return engine, {**info, "deepspeed_zero_optimization": zero}


def _tx_bytes(ifname: str) -> int:
    # Inside `ip netns exec` /sys shows this namespace's interfaces.
    return int(Path(f"/sys/class/net/{ifname}/statistics/tx_bytes").read_text())


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    """Train `args.steps` steps of one config; rank 0 returns the measurements, the other ranks None."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, per_node = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    ifname = os.environ["GLOO_SOCKET_IFNAME"]
    torch.set_num_threads(1)
    reuse = args.host_memory_reuse == "on"
    if reuse:  # for every config alike, DeepSpeed's included (ds_plugin's engine would also do it itself)
        reuse_freed_host_memory()
    timeout = timedelta(seconds=args.collective_timeout)
    if args.config in DEEPSPEED:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    torch.manual_seed(0)
    model = MlpStack(args.hidden, args.layers)
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(args.batch, args.hidden, generator=gen)
    target = torch.randn(args.batch, args.hidden, generator=gen)
    if args.config in DEEPSPEED:
        engine, info = _deepspeed_engine(args.config, model, per_node, args.lr, args.batch, args.dtype)
        if args.dtype == "bf16":  # DeepSpeed's bf16 engine takes inputs in the model's dtype
            x = x.to(torch.bfloat16)
    else:
        engine, info = _ds_plugin_engine(args.config, model, per_node, args.lr, reuse, args.dtype)
    times: list[float] = []
    cpu_times: list[float] = []
    phases: list[list[tuple[float, float]]] = []
    losses: list[float] = []
    tx_start = faults_start = 0
    window_start = 0.0
    for step in range(args.warmup + args.steps):
        dist.barrier()
        if step == args.warmup:
            tx_start = _tx_bytes(ifname)
            faults_start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            window_start = time.monotonic()
        marks = [(time.perf_counter(), time.process_time())]
        loss = F.mse_loss(engine(x).float(), target)
        marks.append((time.perf_counter(), time.process_time()))
        engine.backward(loss)
        marks.append((time.perf_counter(), time.process_time()))
        engine.step()
        marks.append((time.perf_counter(), time.process_time()))
        dist.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - marks[0][0])
            cpu_times.append(time.process_time() - marks[0][1])
            # (wall, CPU) seconds of the forward, the backward and `step()` (clipping and the optimizer).
            phases.append([(b[0] - a[0], b[1] - a[1]) for a, b in itertools.pairwise(marks)])
        losses.append(loss.item())
    window_end = time.monotonic()
    # Only each namespace's first rank reads its veth; the other rank shares the same counter.
    sent = _tx_bytes(ifname) - tx_start if local_rank == 0 else 0
    usage = resource.getrusage(resource.RUSAGE_SELF)
    stats = info.pop("stats", None)
    mine = {
        "times": times,
        "cpu_times": cpu_times,
        "phases": phases,
        "tx_bytes": sent,
        "stats": None if stats is None else vars(stats),
        "faults_per_step": (usage.ru_minflt - faults_start) / max(1, args.steps),
        "max_rss_mb": usage.ru_maxrss / 1024,  # Linux reports KiB
    }
    info["host_memory_reuse_rank0"] = host_memory_reuse_state()
    info["glibc_thread_cache_on_rank0"] = thread_cache_on()
    if stats is not None:  # ds_plugin's ZeRO++: say whether its quantizers ran compiled or eager
        from ds_plugin.quant.comm.fused import compile_report

        info["quantizer_rank0"] = compile_report()
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return None
    return {
        "config": args.config,
        "dtype": args.dtype,
        "step_times_by_rank": [r["times"] for r in everyone],
        "cpu_times_by_rank": [r["cpu_times"] for r in everyone],
        "phases_by_rank": [r["phases"] for r in everyone],
        "cross_node_tx_bytes_by_node": [r["tx_bytes"] for r in everyone[::per_node]],
        # Page faults say whether freed memory was being mapped afresh every step; peak RSS what reuse costs.
        "page_faults_per_step_by_rank": [round(r["faults_per_step"]) for r in everyone],
        "max_rss_mb_by_rank": [round(r["max_rss_mb"]) for r in everyone],
        "losses": losses,
        # The timed steps on the system-wide monotonic clock, for `bench slow-link --timeline`'s samples.
        "timed_window_monotonic": [window_start, window_end],
        "zeropp_stats_rank0": everyone[0]["stats"],
        **info,
    }


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """Median step time (per step, the slowest rank's) and link bytes per step from one config's raw result."""
    if "error" in raw:
        return raw
    per_step = [max(ts) for ts in zip(*raw["step_times_by_rank"], strict=True)]
    steps = len(per_step)
    dropped = (
        "step_times_by_rank", "cpu_times_by_rank", "phases_by_rank", "cross_node_tx_bytes_by_node",
        "timed_window_monotonic",
    )  # fmt: skip
    out = {k: v for k, v in raw.items() if k not in dropped}
    out.update(
        step_s=statistics.median(per_step),
        step_s_min=min(per_step),
        step_s_max=max(per_step),
        step_s_all=[round(t, 4) for t in per_step],
        # CPU seconds each rank spent per step: far below step_s means waiting (the link, or other processes).
        cpu_s_per_step_by_rank=[round(statistics.median(ts), 3) for ts in raw["cpu_times_by_rank"]],
        cross_node_mb_per_step_by_node=[round(b / steps / 1e6, 2) for b in raw["cross_node_tx_bytes_by_node"]],
    )
    if "timed_window_monotonic" in raw:
        # The whole timed window per step, the barriers that open each step included: `step_s` leaves those out,
        # so work a change starts across the step boundary (a gather for the next forward issued in `step()`) would
        # shorten `step_s` without shortening training. For code that does not, the two agree.
        start, end = raw["timed_window_monotonic"]
        out["window_s_per_step"] = round((end - start) / steps, 4)
    if "phases_by_rank" in raw:
        # Where each rank's step went: median wall and CPU seconds of its forward, backward and `step()`. A phase whose
        # CPU seconds, summed over the ranks and spread over the cores, come near its wall time is bound by the cores.
        for key, index in (("phase_s_by_rank", 0), ("phase_cpu_s_by_rank", 1)):
            out[key] = {
                name: [round(statistics.median(step[k][index] for step in rank), 3) for rank in raw["phases_by_rank"]]
                for k, name in enumerate(PHASES)
            }
    return out


_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def rate_bytes_per_s(rate: str) -> float | None:
    """A tc rate in bits ("1gbit", "100mbit") as bytes per second; None for a form this does not parse."""
    m = re.fullmatch(r"([0-9.]+)\s*([a-z]*bit)", rate.strip().lower())
    if not m or m.group(2) not in _RATE_UNITS:
        return None
    return float(m.group(1)) * _RATE_UNITS[m.group(2)] / 8


def floors(entry: dict[str, Any], rate: str) -> dict[str, Any]:
    """Lower bounds on one config's step time: the link's (bytes one node sends / rate) and the cores'.

    The CPU floor is every rank's CPU time per step spread over all cores; the larger floor is what bounds
    the step, whichever of the link or the CPU that is.

    Args:
        entry: a `summarize` result.
        rate: the link's rate, in tc's syntax.
    """
    bytes_per_s = rate_bytes_per_s(rate)
    link_s = max(entry["cross_node_mb_per_step_by_node"]) * 1e6 / bytes_per_s if bytes_per_s else None
    cpu_s = sum(entry["cpu_s_per_step_by_rank"]) / min(os.cpu_count() or 1, len(entry["cpu_s_per_step_by_rank"]))
    out: dict[str, Any] = {"link_floor_s": None if link_s is None else round(link_s, 3), "cpu_floor_s": round(cpu_s, 3)}
    if link_s is not None:
        out["bound_by"] = "link" if link_s >= cpu_s else "cpu"
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks._slow_link_worker")
    parser.add_argument("--config", choices=CONFIGS, required=True)
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--collective-timeout", type=float, default=300.0)
    parser.add_argument("--out", required=True, help="rank 0 writes its JSON here")
    parser.add_argument("--host-memory-reuse", choices=("on", "off"), default="on")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16", help="compute dtype, every config alike (bf16)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    if result is not None:
        tmp = Path(args.out + ".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, args.out)
    # The barrier lets every rank finish its last collective before the group goes away (without it
    # gloo ranks sometimes abort at exit).
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
