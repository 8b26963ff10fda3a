"""Model sizes, per-size step counts, the time and memory estimates, and the scaling table and chart of
`ds-plugin bench peers --sizes ... --world-sizes ...` (the runs themselves are `benchmarks.peers.run`).

Sizes are GPT-2 shapes with GPT-2's vocabulary (50257) and dropout off; the parameter counts in a report come
from the model each run built (`meta_params` only feeds the estimates printed before a run starts):
- 16m: n_layer=4, n_embd=256, n_head=4 (16.3M; the default, what `bench peers` has always timed);
- 124m: GPT-2 small, n_layer=12, n_embd=768, n_head=12 (124.4M);
- 350m: GPT-2 medium, n_layer=24, n_embd=1024, n_head=16 (354.8M).

Default untimed/timed steps per run (`--warmup`/`--steps` override them for every size): 16m 3/12, 124m 3/6,
350m 3/3 — a run's timed steps then cost roughly the same on every size. Three untimed steps at every size: a
rank's first steps fault its heap in page by page (the high-water mark of every buffer the step frees and
allocates again): at 350m on one rank, ZeRO-1's second step took 1.7x its fifth and ZeRO-3's 2.5x, with 0.24M
and 0.50M page faults (`ru_minflt`), the third and fourth 10-40k, none from the fifth on.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = [
    "DEFAULT_STEPS",
    "SIZES",
    "available_mb",
    "draw_scaling",
    "estimate_rank_mb",
    "estimate_seconds",
    "meta_params",
    "scaling_rows",
    "scaling_table",
    "will_not_fit",
]

SIZES: dict[str, dict[str, int]] = {
    "16m": {"n_layer": 4, "n_embd": 256, "n_head": 4},
    "124m": {"n_layer": 12, "n_embd": 768, "n_head": 12},
    "350m": {"n_layer": 24, "n_embd": 1024, "n_head": 16},
}
VOCAB = 50257
# (warmup, steps) per size when --warmup/--steps are not given.
DEFAULT_STEPS: dict[str, tuple[int, int]] = {"16m": (3, 12), "124m": (3, 6), "350m": (3, 3)}

# Rough cost model of one training step, calibrated on this repository's 2-core Xeon (AVX512-bf16 and AMX): the
# 16m runs of benchmarks/results/peers_cpu.json and one-thread matmuls of each size's shapes. 6 * params * tokens
# FLOPs, at one rate for the LM head (a thin d x 50257 matmul plus the softmax over the vocabulary) and a faster one
# for the blocks (square-ish matmuls; without bf16 units bf16 is emulated and far slower), AdamW streaming ~32
# bytes per local parameter at OPT_GBPS, and the gradients' all-reduce over loopback gloo at COMM_GBPS.
HEAD_GFLOPS = {"bf16": 200.0, "fp32": 70.0}
BLOCK_GFLOPS = {"bf16": 450.0, "fp32": 85.0}
BF16_EMULATED_GFLOPS = 8.0
OPT_BYTES_PER_PARAM, OPT_GBPS, COMM_GBPS = 32.0, 10.0, 2.0
# Seconds per run outside the steps: starting the ranks, imports, building the model, wrapping it; DeepSpeed's
# import and engine set-up cost a few seconds more.
RUN_OVERHEAD_S = 8.0
RUN_OVERHEAD_S_PER_MPARAM = 0.04
DEEPSPEED_OVERHEAD_S = 6.0
# Per-rank memory outside the model states: torch, transformers and the framework imported.
BASE_RANK_MB = 800.0
#: A run starts only if its estimated need is at most this share of the memory available.
FIT_SHARE = 0.9


def meta_params(size: str) -> int:
    """Parameter count of `size`'s GPT-2, built on the meta device (no memory, no time)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(**SIZES[size]))
    return sum(p.numel() for p in model.parameters())


def _step_seconds(name: str, dtype: str, size: str, params: int, tokens: int, world: int, bf16_units: bool) -> float:
    head = VOCAB * SIZES[size]["n_embd"]
    if dtype == "bf16" and not bf16_units:
        compute = 6 * params * tokens / (BF16_EMULATED_GFLOPS * 1e9)
    else:
        compute = 6 * tokens * (head / HEAD_GFLOPS[dtype] + (params - head) / BLOCK_GFLOPS[dtype]) / 1e9
    optimizer = OPT_BYTES_PER_PARAM * params / (1 if name == "ddp" else world) / (OPT_GBPS * 1e9)
    grad_bytes = 2 if dtype == "bf16" and name != "ddp" else 4
    comm = 0.0 if world == 1 else 2 * (world - 1) / world * grad_bytes * params / (COMM_GBPS * 1e9)
    return compute + optimizer + comm


def estimate_seconds(
    plan: list[dict[str, Any]], names: tuple[str, ...], dtypes: tuple[str, ...], repeats: int, tokens: int
) -> dict[str, float]:
    """Rough wall time, in seconds per dtype, of every run in `plan` (dicts with params, world_size, warmup, steps).

    A run costs its start-up (ranks, imports, model, wrapper) plus warmup + steps steps; ranks beyond the cores
    slow both down in proportion (one thread per rank). Runs that would not fit in memory now cost nothing.
    """
    from ds_plugin.runtime.cpu_bf16 import fast_compute_dtype

    bf16_units = fast_compute_dtype("cpu")[0] == "bf16"
    cpus = os.cpu_count() or 1
    total = dict.fromkeys(dtypes, 0.0)
    for p in plan:
        share = max(1.0, p["world_size"] / cpus)
        for name in names:
            for dtype in dtypes:
                if will_not_fit(name, dtype, p["size"], p["world_size"], p["params"], tokens):
                    continue
                step = _step_seconds(name, dtype, p["size"], p["params"], tokens, p["world_size"], bf16_units)
                setup = RUN_OVERHEAD_S + RUN_OVERHEAD_S_PER_MPARAM * p["params"] / 1e6
                setup += DEEPSPEED_OVERHEAD_S if name.startswith("deepspeed") else 0.0
                total[dtype] += repeats * share * (setup + (p["warmup"] + p["steps"]) * step)
    return total


def estimate_rank_mb(name: str, dtype: str, size: str, world: int, params: int, tokens: int) -> float:
    """A generous estimate of one rank's peak RSS in MB, to skip runs the machine cannot hold.

    Model-state bytes per parameter: DDP keeps fp32 weights, gradients, its gradient buckets and AdamW's two
    moments whole (20; bf16 autocast adds a bf16 copy). ZeRO-1/2 keep whole weights and gradients and shard the
    optimizer's 12 bytes (8 + 12/N). ZeRO-3 and FSDP2 first hold the fp32 model as built and its shards (4 + 4/N),
    later 16/N sharded, whichever is more, plus 2 for the blocks being gathered (raw FSDP2 with torch's unfused
    AdamW: 24/N and 3, fitted to its measured peaks at 124m and 350m). DeepSpeed on CPU holds about twice
    that (fitted to its peak RSS per rank at 350m in bf16 on 1 and 2 ranks, 2026-12-05: ZeRO-1/2 14.3 and 8.9 GB,
    ZeRO-3 16.1 and 10.6 GB): 10 + 30/N for ZeRO-1/2, 16 + 28/N for ZeRO-3. Activations: fp32 logits and their
    gradients, and about 90 bytes per token per layer per hidden unit. Plus the imports (more for DeepSpeed).
    """
    shape = SIZES[size]
    if name == "ddp":
        per_param = 20.0 + (2.0 if dtype == "bf16" else 0.0)
    elif name == "fsdp2":  # torch's AdamW as a user writes it: foreach temporaries the size of the shards
        per_param = max(4.0 + 4.0 / world, 24.0 / world) + 3.0
    elif name.startswith("deepspeed_zero"):
        per_param = 10.0 + 30.0 / world if name[-1] in "12" else 16.0 + 28.0 / world
    elif name[-1] in "12":  # ds_plugin_zero1/2
        per_param = 8.0 + 12.0 / world
    else:
        per_param = max(4.0 + 4.0 / world, 16.0 / world) + 2.0
    acts = tokens * (VOCAB * 16 + shape["n_layer"] * shape["n_embd"] * 90)
    base = BASE_RANK_MB + (400.0 if name.startswith("deepspeed") else 0.0)
    return base + (per_param * params + acts) / 2**20


def will_not_fit(name: str, dtype: str, size: str, world: int, params: int, tokens: int) -> str | None:
    """Why `world` ranks of this run would not fit in the memory available now (one line), or None if they would."""
    need = world * estimate_rank_mb(name, dtype, size, world, params, tokens)
    free = available_mb()
    if free is None or need <= FIT_SHARE * free:
        return None
    return (
        f"not run: {world} ranks need ~{need / 1024:.1f} GB (rough estimate), more than "
        f"{FIT_SHARE:.0%} of the {free / 1024:.1f} GB available"
    )


def available_mb() -> float | None:
    """MemAvailable from /proc/meminfo in MB, or None where there is no such file."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def scaling_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (config, dtype) of a one-(size, world size) report; skipped and failed runs keep a reason."""
    setup = report["setup"]
    tokens = setup["micro_batch"] * setup["seq"]
    rows = []
    for r in report["runs"]:
        row: dict[str, Any] = {
            "size": setup["size"],
            "params": setup["params"],
            "world_size": setup["world_size"],
            "name": r["name"],
            "dtype": r["dtype"],
        }
        if "median_step_s" in r:
            row |= {
                "median_step_s": r["median_step_s"],
                "tokens_per_s_per_rank": round(tokens / r["median_step_s"], 1),
                "peak_rss_mb": r["peak_rss_mb"],
            }
        else:
            row["reason"] = r.get("skipped") or r.get("error")
        rows.append(row)
    return rows


def scaling_table(rows: list[dict[str, Any]]) -> str:
    """The flat scaling table as text, one line per row."""
    lines = [
        f"{'size':<6}{'params':>13}{'world':>6}  {'config':<17}{'dtype':<6}{'median s/step':>14}"
        f"{'tokens/s/rank':>14}{'peak RSS MB':>13}"
    ]
    for r in rows:
        head = f"{r['size']:<6}{r['params'] or 0:>13,}{r['world_size']:>6}  {r['name']:<17}{r['dtype']:<6}"
        if "median_step_s" in r:
            lines.append(
                f"{head}{r['median_step_s']:>14.3f}{r['tokens_per_s_per_rank']:>14.1f}{r['peak_rss_mb']:>13.0f}"
            )
        else:
            lines.append(f"{head}  {r['reason']}")
    return "\n".join(lines)


def draw_scaling(report: dict[str, Any], path: str, names: tuple[str, ...]) -> None:
    """Median step time (top row) and peak RSS per rank (bottom row) against parameter count, one column per
    world size, one line per config (solid bf16, dashed fp32).

    Args:
        report: the several-(size, world size) report `benchmarks.peers.main` writes.
        path: PNG file to write.
        names: configs in their usual order (colours follow it).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    rows = [r for r in report["scaling"] if "median_step_s" in r]
    worlds = sorted({r["world_size"] for r in report["scaling"]})
    sizes = sorted({(r["params"], r["size"]) for r in report["scaling"] if r["params"]})
    fig, axes = plt.subplots(2, len(worlds), figsize=(5 * len(worlds) + 1, 8), squeeze=False, sharex=True, sharey="row")
    colours = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(names)}
    metrics = (("median_step_s", "median step time (s)"), ("peak_rss_mb", "peak RSS per rank (MB)"))
    for col, world in enumerate(worlds):
        for row_i, (key, label) in enumerate(metrics):
            ax = axes[row_i][col]
            for name in names:
                for dtype, style in (("bf16", "-"), ("fp32", "--")):
                    pts = sorted(
                        (r["params"], r[key])
                        for r in rows
                        if r["world_size"] == world and r["name"] == name and r["dtype"] == dtype
                    )
                    if pts:
                        xs, ys = zip(*pts, strict=True)
                        ax.plot(xs, ys, style, marker="o", color=colours[name], label=f"{name} {dtype}")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xticks([p for p, _ in sizes], [f"{s}\n{p / 1e6:.1f}M" for p, s in sizes])
            ax.xaxis.set_minor_locator(NullLocator())
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_locator(NullLocator())
            ax.set_ylabel(label)
            if row_i == len(metrics) - 1:
                ax.set_xlabel("model size (parameters)")
            threads = report["setup"]["threads_per_rank"]
            over = world * threads > report["setup"]["cpus"]
            ax.set_title(
                f"{world} rank{'s' if world > 1 else ''} x {threads} thread"
                + (f" on {report['setup']['cpus']} CPUs (oversubscribed)" if over else "")
            )
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes.flat:  # one legend for all panels, with every (config, dtype) any panel drew
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    if handles:
        fig.legend(handles, labels, loc="center right", fontsize=8, title="config, dtype", title_fontsize=8)
    fig.suptitle(
        f"bench peers scaling: GPT-2 sizes, seq {report['setup']['seq']}, micro-batch {report['setup']['micro_batch']},"
        f" {report['machine']['cpus']} CPUs, torch {report['torch']}, deepspeed {report['deepspeed']}, "
        f"{report['date']}",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0, 1 - 1.7 / fig.get_figwidth() if handles else 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
