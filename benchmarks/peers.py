"""`ds-plugin bench peers`: step time, peak RSS and loss of ds_plugin's ZeRO next to DDP, raw FSDP2 and DeepSpeed.

Every run trains the same GPT-2 (n_layer=4, n_embd=256, n_head=4, GPT-2's vocabulary, dropout off; 16.3M
parameters) from the same weights on the same batches (seq 128, micro-batch 4 per rank) with
torch.optim.AdamW, on 2 gloo ranks of one thread each, in bf16 and in fp32:
- ddp: DistributedDataParallel; bf16 = autocast over fp32 weights (gradients reduced in fp32).
- fsdp2: fully_shard per block, then the root, FSDP2's defaults (root kept unsharded after forward);
  bf16 = MixedPrecisionPolicy(param_dtype=bf16), which also reduces in bf16.
- ds_plugin_zero1/2/3: `ds_plugin.initialize` with `"bf16": {"enabled": ...}` (bf16 compute and reduce); the
  loss through the engine's chunked cross-entropy, its default (`--chunked-loss off`: transformers' own, as the
  others compute it); the output layer's logits in column blocks where faster on CPU, its default too
  (`--blocked-logits off`: one matmul, as the others compute them).
- deepspeed_zero1/2/3: DeepSpeed's engine with the same JSON keys, when `deepspeed` is importable.

Each (config, dtype) runs in fresh processes, so peak RSS (`getrusage` maxrss, max over ranks) is its own.
A run is `warmup` untimed steps then `steps` timed ones (forward, backward, optimizer step; a step's time is
the slowest rank's); repetitions go in alternating order so background load on a shared machine falls on
every config alike. Reported: the median step time over all timed steps of all repetitions, each
repetition's median, the peak RSS, and the loss of the last step averaged over ranks. `comparisons` holds each
speed and memory target (TARGETS) whose two sides both ran, per dtype, e.g. `zero3_vs_deepspeed_zero3_step_bf16`:
{"ratio", "at_most", "met"}; and `fp32_final_loss`, every config's fp32 loss next to DDP's. `compute_floor`: per
dtype, the median time of one micro-batch's forward and backward in one process alone (no communication, no
optimizer step, ds_plugin's loss and logits as `--chunked-loss` and `--blocked-logits` say): the part of every
config's step that no framework can save, so a target below it cannot be met on that machine.

Scaling (`--sizes 16m 124m 350m --world-sizes 1 2 4`): the same comparison for each model size (see
`benchmarks._peers_scaling` for the shapes and the per-size default warmup/steps) on each number of ranks. All
configs of one (size, world size) run side by side, in alternating order, exactly as above; every rank has one
thread, so more ranks than cores share them (the report's setup says how many of each). A run whose ranks would
not fit in the memory available when it starts (a rough estimate: `_peers_scaling.estimate_rank_mb`) is skipped
with the reason, as is one that fails; the others still run. Before starting, the rough duration goes to stderr.

Report keys: one (size, world size) gives the report above (`runs`, `comparisons`, `setup`, `machine`, ...) plus
`scaling`, its rows. Several give {"reports": [one such report per (size, world size)], "scaling": [every row],
"setup", "machine", "ds_plugin", "torch", "deepspeed", "date"}. A `scaling` row: size (name), params (counted
on the built model), world_size, name (config), dtype, median_step_s (as in `runs`), tokens_per_s_per_rank
(micro_batch * seq / median_step_s), peak_rss_mb (the largest rank's peak RSS); a run that did not complete has
`reason` instead of the last three.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import statistics
import sys
from typing import Any

import torch

from benchmarks._deepspeed_peer import deepspeed_env, deepspeed_version
from benchmarks._peers_ranks import LR, MICRO_BATCH, NAMES, SEQ, floor_rank, rank_run
from benchmarks._peers_scaling import (
    DEFAULT_STEPS,
    SIZES,
    draw_scaling,
    estimate_seconds,
    meta_params,
    scaling_rows,
    scaling_table,
    will_not_fit,
)
from benchmarks.zero_memory import source_revision
from ds_plugin._argparse import MAX_LOCAL_RANKS, MAX_TIMEOUT_S, ArgumentParser, count, number, output_file
from ds_plugin.launch import run_ranks

__all__ = ["NAMES", "main", "run"]

DTYPES = ("bf16", "fp32")
WORLD = 2


def _one_run(
    name: str,
    dtype: str,
    warmup: int,
    steps: int,
    timeout: float,
    reuse: bool,
    size: str,
    world: int,
    engine_keys: dict[str, Any],
) -> dict[str, Any]:
    env = deepspeed_env() if name.startswith("deepspeed") else {}
    load = os.getloadavg()[0]
    kwargs = {"name": name, "dtype": dtype, "warmup": warmup, "steps": steps, "reuse": reuse, "size": size}
    kwargs["engine_keys"] = engine_keys
    per_rank = run_ranks(rank_run, world, timeout=timeout, env=env, **kwargs)
    return {
        "step_times": [max(ts) for ts in zip(*(r["times"] for r in per_rank), strict=True)],
        "cpu_times": [max(ts) for ts in zip(*(r["cpu_times"] for r in per_rank), strict=True)],
        "peak_rss_mb": max(r["peak_rss_mb"] for r in per_rank),
        "final_loss": per_rank[0]["final_loss"],
        "load_avg_1min": load,
        "params": per_rank[0]["params"],
        "threads": max(r["threads"] for r in per_rank),
        "thread_cache_on": sorted({str(r["thread_cache_on"]) for r in per_rank}),
    }


@functools.cache
def _floor_seconds(
    dtype: str, warmup: int, steps: int, timeout: float, size: str, engine_keys: tuple[tuple[str, Any], ...]
) -> float | str:
    # Cached: the floor does not depend on the world size, so a --world-sizes plan measures it once per size.
    kwargs = {"dtype": dtype, "warmup": warmup, "steps": steps, "size": size, "engine_keys": dict(engine_keys)}
    try:
        return round(run_ranks(floor_rank, 1, timeout=timeout, **kwargs)[0], 4)
    except RuntimeError as exc:
        return "error: " + str(exc).strip().splitlines()[-1][:300]


def _compute_floor(
    dtypes: list[str], warmup: int, steps: int, timeout: float, size: str, engine_keys: dict[str, bool]
) -> dict[str, Any]:
    """Forward + backward of one rank's micro-batch in one process alone: what no framework's step can beat here."""
    floor: dict[str, Any] = {
        "what": "median s of forward+backward of one micro-batch in one process alone (one thread, host memory "
        "reuse, no communication, no optimizer step; bf16: bf16 weights), "
        + ("the chunked loss" if engine_keys["chunked_loss"] else "transformers' loss")
        + (
            ", the logits in column blocks where faster"
            if engine_keys["blocked_logits"]
            else ", the logits in one matmul"
        )
    }
    for dtype in dtypes:
        floor[dtype] = _floor_seconds(dtype, warmup, steps, timeout, size, tuple(sorted(engine_keys.items())))
    return floor


def _summary(name: str, dtype: str, reps: list[dict[str, Any]]) -> dict[str, Any]:
    pooled = [t for r in reps for t in r["step_times"]]
    losses = [r["final_loss"] for r in reps]
    return {
        "name": name,
        "dtype": dtype,
        "median_step_s": round(statistics.median(pooled), 4),
        "peak_rss_mb": round(max(r["peak_rss_mb"] for r in reps), 1),
        "final_loss": losses[0],
        "median_step_cpu_s": round(statistics.median(t for r in reps for t in r["cpu_times"]), 4),
        "rep_median_step_s": [round(statistics.median(r["step_times"]), 4) for r in reps],
        "rep_peak_rss_mb": [round(r["peak_rss_mb"], 1) for r in reps],
        "rep_load_avg_1min": [round(r["load_avg_1min"], 2) for r in reps],
        "final_loss_spread": max(losses) - min(losses),
        "timed_steps": len(pooled),
    }


# The targets each comparison is held to: (ours, baseline, quantity, at most this ratio).
TARGETS = (
    ("ds_plugin_zero3", "deepspeed_zero3", "median_step_s", 0.85),
    ("ds_plugin_zero3", "deepspeed_zero3", "peak_rss_mb", 0.7),
    ("ds_plugin_zero3", "ddp", "median_step_s", 1.05),
    ("ds_plugin_zero2", "ddp", "median_step_s", 1.02),
    ("ds_plugin_zero1", "ddp", "median_step_s", 1.0),
)


def _comparisons(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each target of TARGETS both sides of which ran, per dtype, as `<ours>_vs_<baseline>_<quantity>_<dtype>`:
    {"ratio": ours / baseline, "at_most": the target, "met": ratio <= target}; and the fp32 final losses next to
    DDP's."""
    by = {(r["name"], r["dtype"]): r for r in runs if "median_step_s" in r}
    out: dict[str, Any] = {}
    for dtype in DTYPES:
        for ours, baseline, key, at_most in TARGETS:
            a, b = by.get((ours, dtype)), by.get((baseline, dtype))
            if a and b:
                ratio = round(a[key] / b[key], 3)
                quantity = "step" if key == "median_step_s" else "peak_rss"
                name = f"{ours.removeprefix('ds_plugin_')}_vs_{baseline}_{quantity}_{dtype}"
                out[name] = {"ratio": ratio, "at_most": at_most, "met": ratio <= at_most}
    fp32 = {name: r["final_loss"] for (name, dtype), r in by.items() if dtype == "fp32"}
    if "ddp" in fp32:
        diffs = {name: abs(loss - fp32["ddp"]) for name, loss in fp32.items()}
        out["fp32_final_loss"] = {
            "losses": fp32,
            "max_abs_diff_vs_ddp": max(diffs.values()),
            "agree_to_5_decimals": max(diffs.values()) < 5e-6,
        }
    return out


def run(
    names: tuple[str, ...] = NAMES,
    dtypes: tuple[str, ...] = DTYPES,
    *,
    warmup: int = 3,
    steps: int = 12,
    repeats: int = 3,
    timeout: float = 900,
    host_memory_reuse: bool = True,
    size: str = "16m",
    world_size: int = WORLD,
    chunked_loss: bool = True,
    blocked_logits: bool = True,
) -> dict[str, Any]:
    """Run every (config, dtype) `repeats` times in alternating order and return the report dict.

    Args:
        names: configs to run, from NAMES.
        dtypes: "bf16" and/or "fp32".
        warmup: untimed steps per run (the losses compared are after warmup + steps steps).
        steps: timed steps per run.
        repeats: runs per config; odd repetitions go in reverse order.
        timeout: seconds per run (DeepSpeed's first run compiles its CPU op).
        host_memory_reuse: glibc malloc keeps freed memory in every run's ranks, whichever the framework
            (ds_plugin's engine does it by itself on CPU; see `ds_plugin.runtime.host_memory`).
        size: model size, a key of SIZES.
        world_size: gloo ranks per run, one thread each.
        chunked_loss: ds_plugin's runs compute the loss with the engine's chunked cross-entropy (its config's
            `chunked_loss`, on by default); DDP, FSDP2 and DeepSpeed compute transformers' own either way.
        blocked_logits: ds_plugin's runs compute the output layer in column blocks where its first call measures
            that faster (the config's `blocked_logits`, on by default); the others compute one matmul either way.
    """
    ds_version, ds_missing = deepspeed_version()
    engine_keys = {"chunked_loss": chunked_loss, "blocked_logits": blocked_logits}
    combos = [(n, d) for n in names for d in dtypes]
    skipped = {c: ds_missing for c in combos if c[0].startswith("deepspeed") and ds_missing}
    results: dict[tuple[str, str], list[dict[str, Any]]] = {c: [] for c in combos}
    errors: dict[tuple[str, str], str] = {}
    load_start = os.getloadavg()
    params = meta_params(size)
    for rep in range(repeats):
        for combo in combos if rep % 2 == 0 else combos[::-1]:
            if combo in skipped or combo in errors:
                continue
            if rep == 0 and (why := will_not_fit(*combo, size, world_size, params, MICRO_BATCH * SEQ)):
                skipped[combo] = why
                continue
            try:
                results[combo].append(
                    _one_run(*combo, warmup, steps, timeout, host_memory_reuse, size, world_size, engine_keys)
                )
            except RuntimeError as exc:  # one peer failing must not lose the others' numbers
                errors[combo] = str(exc).strip().splitlines()[-1][:500]
    runs = []
    for combo in combos:
        if combo in skipped:
            runs.append({"name": combo[0], "dtype": combo[1], "skipped": skipped[combo]})
        elif combo in errors:
            runs.append({"name": combo[0], "dtype": combo[1], "error": errors[combo]})
        else:
            runs.append(_summary(*combo, results[combo]))
    done = [r for rs in results.values() for r in rs]
    ran = [d for d in dtypes if any(results[c] for c in combos if c[1] == d)]  # so the floor's process fits too
    floor = _compute_floor(ran, warmup, steps, timeout, size, engine_keys)
    params = done[0]["params"] if done else params  # counted on a rank's model; else the same model on meta
    threads = max((r["threads"] for r in done), default=1)  # run_ranks gives every rank one thread
    shape = ", ".join(f"{k}={v}" for k, v in SIZES[size].items())
    report = {
        "runs": runs,
        "comparisons": _comparisons(runs),
        "compute_floor": floor,
        "setup": {
            "model": f"GPT2({shape}, vocab 50257, dropout 0), {params / 1e6:.1f}M params",
            "size": size,
            "params": params,
            "world_size": world_size,
            "threads_per_rank": threads,
            "cpus": os.cpu_count(),
            "oversubscribed": world_size * threads > (os.cpu_count() or 1),
            "host_memory_reuse": "on in every run" if host_memory_reuse else "off in every run",
            "ds_plugin_chunked_loss": "on (the engine's default; the others compute transformers' loss)"
            if chunked_loss
            else "off (transformers' loss in every run)",
            "ds_plugin_blocked_logits": "on (the engine's default; the others compute one matmul)"
            if blocked_logits
            else "off (one matmul in every run)",
            # run_ranks starts every rank, whichever the framework, with glibc's per-thread malloc cache off.
            "glibc_thread_cache_on": sorted({v for r in done for v in r["thread_cache_on"]}),
            "seq": SEQ,
            "micro_batch": MICRO_BATCH,
            "optimizer": f"torch.optim.AdamW(lr={LR})",
            "warmup_steps": warmup,
            "timed_steps": steps,
            "repeats": repeats,
            "step_time": "slowest rank's forward+backward+optimizer step; median over all timed steps of all repeats",
            "step_cpu": "CPU seconds of the busiest rank's process per step (all its threads): less sensitive to "
            "other load on a shared machine than wall time",
            "peak_rss": "getrusage maxrss, max over ranks and repeats, fresh processes per run",
            "final_loss": f"loss of step {warmup + steps}, mean over ranks",
        },
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_avg_1min_start": round(load_start[0], 2),
            "load_avg_1min_end": round(os.getloadavg()[0], 2),
        },
        "ds_plugin": source_revision(),
        "torch": torch.__version__,
        "deepspeed": ds_version,
        "date": datetime.date.today().isoformat(),
    }
    report["scaling"] = scaling_rows(report)
    return report


def draw(report: dict[str, Any], path: str) -> None:
    """Three panels, median wall and CPU step time and peak RSS, one bar per config and dtype.

    Args:
        report: what `run` returned.
        path: PNG file to write.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in report["runs"] if "median_step_s" in r]
    names = [n for n in NAMES if any(r["name"] == n for r in runs)]
    dtypes = [d for d in DTYPES if any(r["dtype"] == d for r in runs)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (
        ("median_step_s", "median step time, wall (s)"),
        ("median_step_cpu_s", "median step CPU time (s)"),
        ("peak_rss_mb", "peak RSS (MB)"),
    )
    width = 0.8 / max(1, len(dtypes))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for i, dtype in enumerate(dtypes):
            vals = {r["name"]: r[key] for r in runs if r["dtype"] == dtype}
            xs = [k + (i - (len(dtypes) - 1) / 2) * width for k in range(len(names))]
            ax.bar(xs, [vals.get(n, 0) for n in names], width, label=dtype)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"{report['setup']['model']}, {report['setup']['world_size']} rank(s) x {report['setup']['threads_per_rank']} "
        "thread, "
        f"torch {report['torch']}, deepspeed {report['deepspeed']}, {report['date']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _table(report: dict[str, Any]) -> str:
    lines = [
        f"{'config':<18}{'dtype':<6}{'median s/step':>14}{'CPU s/step':>11}{'peak RSS MB':>13}{'final loss':>12}"
        "  repeats (s)"
    ]
    for r in report["runs"]:
        if "median_step_s" not in r:
            lines.append(f"{r['name']:<18}{r['dtype']:<6}  {r.get('skipped') or r.get('error')}")
            continue
        lines.append(
            f"{r['name']:<18}{r['dtype']:<6}{r['median_step_s']:>14.3f}{r['median_step_cpu_s']:>11.3f}"
            f"{r['peak_rss_mb']:>13.0f}"
            f"{r['final_loss']:>12.6f}  {r['rep_median_step_s']}"
        )
    for name, c in report["comparisons"].items():
        if "ratio" in c:
            lines.append(f"{name}: {c['ratio']:.3f}x (at most {c['at_most']}x: {'met' if c['met'] else 'MISSED'})")
    floor = report.get("compute_floor", {})
    if any(d in floor for d in DTYPES):
        found = ", ".join(
            f"{d} {floor[d]:.3f} s" if isinstance(floor[d], float) else f"{d} {floor[d]}" for d in DTYPES if d in floor
        )
        lines.append(f"compute floor (one process alone, forward+backward only): {found}")
    losses = report["comparisons"].get("fp32_final_loss")
    if losses:
        agree = "agree" if losses["agree_to_5_decimals"] else "DIFFER"
        diff = losses["max_abs_diff_vs_ddp"]
        lines.append(f"fp32 final losses {agree} with DDP's to 5 decimals (max diff {diff:.2e})")
    return "\n".join(lines)


def _combined(reports: list[dict[str, Any]], repeats: int) -> dict[str, Any]:
    """The report of several (size, world size) runs: each one's report, and all their scaling rows."""
    first, last = reports[0], reports[-1]
    setup = first["setup"]
    return {
        "reports": reports,
        "scaling": [row for r in reports for row in r["scaling"]],
        "setup": {
            "sizes": {r["setup"]["size"]: r["setup"]["model"] for r in reports},
            "world_sizes": list(dict.fromkeys(r["setup"]["world_size"] for r in reports)),
            "threads_per_rank": max(r["setup"]["threads_per_rank"] for r in reports),
            "cpus": setup["cpus"],
            "oversubscribed_world_sizes": sorted(
                {r["setup"]["world_size"] for r in reports if r["setup"]["oversubscribed"]}
            ),
            "steps": {
                r["setup"]["size"]: {"warmup": r["setup"]["warmup_steps"], "timed": r["setup"]["timed_steps"]}
                for r in reports
            },
            "repeats": repeats,
            "seq": setup["seq"],
            "micro_batch": setup["micro_batch"],
            "optimizer": setup["optimizer"],
            "host_memory_reuse": setup["host_memory_reuse"],
            "tokens_per_s_per_rank": "micro_batch * seq / median_step_s",
            "peak_rss_mb": "getrusage maxrss of the largest rank, max over repeats, fresh processes per run",
        },
        "machine": {**first["machine"], "load_avg_1min_end": last["machine"]["load_avg_1min_end"]},
        **{k: first[k] for k in ("ds_plugin", "torch", "deepspeed", "date")},
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of `ds-plugin bench peers`."""
    parser = ArgumentParser(prog="ds-plugin bench peers", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the JSON report only")
    parser.add_argument("--names", nargs="+", choices=NAMES, default=list(NAMES), help="configs to run")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=DTYPES,
        help="default: bf16 and fp32 where the CPU has bf16 units, else fp32 only (bf16 is emulated there)",
    )
    parser.add_argument(
        "--sizes", nargs="+", choices=tuple(SIZES), help="GPT-2 sizes to time, each in its own runs (default: 16m)"
    )
    parser.add_argument(
        "--world-sizes",
        nargs="+",
        type=count(1, MAX_LOCAL_RANKS),
        help=f"gloo ranks per run, one thread each (default: {WORLD})",
    )
    per_size = DEFAULT_STEPS.items()
    parser.add_argument(
        "--warmup",
        type=count(0),
        help=f"untimed steps per run (default per size: {', '.join(f'{k} {w}' for k, (w, _) in per_size)})",
    )
    parser.add_argument(
        "--steps",
        type=count(),
        help=f"timed steps per run (default per size: {', '.join(f'{k} {n}' for k, (_, n) in per_size)})",
    )
    parser.add_argument("--repeats", type=count(), default=3, help="runs per config, in alternating order")
    parser.add_argument(
        "--timeout", type=number(0, MAX_TIMEOUT_S, above_minimum=True), default=900, help="seconds per run"
    )
    parser.add_argument("--out", type=output_file, help="also write the JSON report to this file")
    parser.add_argument(
        "--png",
        type=output_file,
        help="also draw the chart to this PNG file (needs matplotlib); with several sizes or world sizes, step time "
        "and peak RSS per rank against model size",
    )
    parser.add_argument(
        "--host-memory-reuse",
        choices=("on", "off"),
        default="on",
        help="glibc malloc keeps freed memory in every run, whichever the framework (on; see README)",
    )
    parser.add_argument(
        "--chunked-loss",
        choices=("on", "off"),
        default="on",
        help="ds_plugin's runs compute the loss in row chunks, the engine's default (on); off: transformers' own "
        "loss, as DDP, FSDP2 and DeepSpeed compute it",
    )
    parser.add_argument(
        "--blocked-logits",
        choices=("on", "off"),
        default="on",
        help="ds_plugin's runs compute the output layer's logits in column blocks where the first call measures "
        "that faster, the engine's default (on); off: one matmul, as DDP, FSDP2 and DeepSpeed compute it",
    )
    args = parser.parse_args(argv)
    if args.dtypes is None:
        from ds_plugin.runtime.cpu_bf16 import fast_compute_dtype

        picked, why = fast_compute_dtype("cpu")
        args.dtypes = list(DTYPES) if picked == "bf16" else ["fp32"]
        print(f"bench peers: timing {' and '.join(args.dtypes)} ({why}; --dtypes to choose)", file=sys.stderr)
    sizes = list(dict.fromkeys(args.sizes or ["16m"]))
    worlds = list(dict.fromkeys(args.world_sizes or [WORLD]))
    plan = [
        {
            "size": size,
            "params": meta_params(size),
            "world_size": world,
            "warmup": DEFAULT_STEPS[size][0] if args.warmup is None else args.warmup,
            "steps": DEFAULT_STEPS[size][1] if args.steps is None else args.steps,
        }
        for size in sizes
        for world in worlds
    ]
    names, dtypes = tuple(args.names), tuple(args.dtypes)
    eta = estimate_seconds(plan, names, dtypes, args.repeats, MICRO_BATCH * SEQ)
    per_dtype = ", ".join(f"{d} ~{t / 60:.0f} min" for d, t in eta.items())
    print(
        f"bench peers: {len(plan) * len(names) * len(dtypes) * args.repeats} runs, roughly "
        f"{sum(eta.values()) / 60:.0f} min on {os.cpu_count()} CPUs ({per_dtype}; a rough estimate)",
        file=sys.stderr,
    )
    reports = []
    for p in plan:
        if len(plan) > 1:
            print(f"bench peers: {p['size']} on {p['world_size']} rank(s)", file=sys.stderr)
        reports.append(
            run(
                names,
                dtypes,
                warmup=p["warmup"],
                steps=p["steps"],
                repeats=args.repeats,
                timeout=args.timeout,
                host_memory_reuse=args.host_memory_reuse == "on",
                size=p["size"],
                world_size=p["world_size"],
                chunked_loss=args.chunked_loss == "on",
                blocked_logits=args.blocked_logits == "on",
            )
        )
    report = reports[0] if len(reports) == 1 else _combined(reports, args.repeats)
    text = json.dumps(report, indent=2)
    for path in filter(None, (args.out, args.png)):  # missing folders were allowed while parsing
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    if args.png:
        if len(reports) == 1:
            draw(report, args.png)
        else:
            draw_scaling(report, args.png, NAMES)
    if args.json:
        print(text)
    elif len(reports) == 1:
        print(_table(report))
    else:
        print("\n\n".join([*(_table(r) for r in reports), scaling_table(report["scaling"])]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
