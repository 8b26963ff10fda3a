"""`ds-plugin bench lora-memory`: LoRA at ZeRO-3 on a ~100M Llama, frozen base bf16/int8/int4/nf4, vs bnb QLoRA.

The model: a `LlamaForCausalLM` built from a config in code (random init, tied embeddings, nothing downloaded),
in bf16, with peft LoRA (rank 16, alpha 32) on q/k/v/o and everything else frozen. Each run trains it with AdamW
for a few steps on the same fixed token batch, in fresh processes (so its peak RSS is its own):
- bf16 / int8 / int4 / nf4: `ds_plugin.initialize` at ZeRO-3 on N gloo ranks (one thread each), bf16, with
  `zero_optimization.frozen_format` set to the format (bf16: not set). The frozen decoder Linear weights are
  then stored as the format's codes and scales, sharded by rows; embeddings and norms stay bf16.
- bnb_qlora, the anchor: one process (N threads, the same cores) with the decoder's Linear layers replaced by
  `bitsandbytes.nn.Linear4bit` (NF4, double-quantized absmax, blocks of 64, bf16 compute; QLoRA's settings),
  peft's LoRA on top (peft's bnb layers), the whole global batch per step. `prepare_model_for_kbit_training`
  is not called: it would upcast the embeddings and norms to fp32.

Per run (max over ranks, except losses):
- model_state_bytes_per_rank: storage bytes of parameters (a quantized weight's components, bnb's packed
  weight and its quant_state tensors included), gradients and optimizer state, each storage once
  (`benchmarks._model_states`), after the last step's backward, before its optimizer step;
- frozen_linear_bytes_per_rank: the part of it that is frozen Linear weights (the output head is tied to the
  embedding and counted with it);
- frozen_allgather_bytes_per_step: bytes the last step's ZeRO-3 all-gathers delivered of frozen Linear weights
  (every rank's shard, as `frozen_storage_stats` counts them; for bf16, the frozen weights' share of the
  all-gathers, counted the same way); 0 for the single process;
- peak_rss_mb: `getrusage` max RSS in MiB; it includes building the whole bf16 model on every rank before
  ZeRO-3 shards it (the quantizer needs every weight), and the Python, torch and transformers imports;
- median_step_s: median time of the steps after the first; final_loss: the last step's loss (global batch).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
from typing import Any

import torch

from benchmarks._lora_workers import (
    FORMATS,
    LORA_RANK,
    LORA_TARGETS,
    LR,
    bnb_worker,
    model_config,
    shared_worker,
    zero_worker,
)
from benchmarks._model_states import COLORS, FROZEN_CATEGORIES, source_revision
from ds_plugin._argparse import MAX_LOCAL_RANKS, ArgumentParser, choice_list, count, output_file
from ds_plugin.launch import run_ranks

__all__ = ["PRESETS", "RUNS", "check_targets", "main", "model_config", "run"]

PRESETS = {
    "100m": {"hidden": 768, "layers": 12, "intermediate": 2048, "heads": 12, "vocab": 16384},
    "tiny": {"hidden": 128, "layers": 2, "intermediate": 256, "heads": 4, "vocab": 512},
}
RUNS = (*FORMATS, "bnb_qlora")
DEFAULT_OUT = os.path.join("benchmarks", "results", "lora_memory_cpu.json")
# The lead's targets: frozen Linear bytes vs the bf16 run's, and total model states vs bnb's per-rank share.
LINEAR_LIMITS = {"int4": 0.30, "int8": 0.55}
ANCHOR_LIMIT = 1.05


def _median_after_first(times: list[float]) -> float:
    return statistics.median(times[1:] if len(times) > 1 else times)


def _summarise(name: str, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    top = max(per_rank, key=lambda r: r["states"]["bytes"])
    steps = len(per_rank[0]["times"])
    # A step ends with collectives, so its time is the slowest rank's.
    step_times = [max(r["times"][i] for r in per_rank) for i in range(steps)]
    return {
        "name": name,
        "model_state_bytes_per_rank": top["states"]["bytes"],
        "frozen_linear_bytes_per_rank": max(r["frozen_linear_bytes"] for r in per_rank),
        "frozen_allgather_bytes_per_step": max(r["frozen_allgather_bytes"] for r in per_rank),
        "peak_rss_mb": round(max(r["peak_rss_mb"] for r in per_rank), 1),
        "median_step_s": round(_median_after_first(step_times), 3),
        "final_loss": round(statistics.fmean(r["losses"][-1] for r in per_rank), 4),
        "ranks": len(per_rank),
        "breakdown": top["states"]["breakdown"],
        "dtypes": top["states"]["dtypes"],
        "frozen_storage_stats_bytes_per_step": per_rank[0]["stats_allgather_bytes"],
        "allgather_bytes_per_step": per_rank[0]["allgather_bytes"],
        "baseline_rss_mb": round(max(r["baseline_rss_mb"] for r in per_rank), 1),
        "step_s": [round(t, 3) for t in step_times],
        "losses": [round(statistics.fmean(r["losses"][i] for r in per_rank), 4) for i in range(steps)],
    }


def check_targets(report: dict[str, Any]) -> dict[str, Any]:
    """The lead's targets, from a report: frozen Linear bytes vs bf16, total model states vs bnb QLoRA / N.

    Args:
        report: what `run` returned (runs that are missing are left out).
    """
    runs = {r["name"]: r for r in report["runs"]}
    out: dict[str, Any] = {}
    if "bf16" in runs:
        for fmt, limit in LINEAR_LIMITS.items():
            if fmt in runs:
                ratio = runs[fmt]["frozen_linear_bytes_per_rank"] / runs["bf16"]["frozen_linear_bytes_per_rank"]
                out[f"{fmt}_frozen_linear_vs_bf16"] = {"ratio": round(ratio, 4), "limit": limit, "ok": ratio <= limit}
    if "bnb_qlora" in runs:
        anchor = runs["bnb_qlora"]["model_state_bytes_per_rank"] / report["world_size"]
        for fmt in ("int4", "nf4"):
            if fmt in runs:
                ratio = runs[fmt]["model_state_bytes_per_rank"] / anchor
                out[f"{fmt}_model_states_vs_bnb_per_rank"] = {
                    "ratio": round(ratio, 4),
                    "limit": ANCHOR_LIMIT,
                    "ok": ratio <= ANCHOR_LIMIT,
                }
    return out


def _estimates(report: dict[str, Any]) -> dict[str, Any]:
    from ds_plugin.estimate import estimate, shape_from_hf_config

    shape = shape_from_hf_config(report["model_config"])
    out = {}
    for r in report["runs"]:
        if r["name"] in FORMATS:
            est = estimate(shape, report["world_size"], lora_rank=LORA_RANK, frozen_format=r["name"])
            predicted = est["lora"]["stages"]["3"]
            out[r["name"]] = {
                "bytes": predicted,
                "measured_over_estimate": round(r["model_state_bytes_per_rank"] / predicted, 4),
            }
    return out


def run(
    world_size: int = 2,
    *,
    size: str = "100m",
    hidden: int | None = None,
    layers: int | None = None,
    seq: int = 16,
    batch: int = 1,
    steps: int = 3,
    runs: tuple[str, ...] = RUNS,
    isolate: bool = True,
    timeout: float = 900,
) -> dict[str, Any]:
    """Every run in fresh processes, one after the other; returns the report dict.

    Args:
        world_size: gloo ranks N of the ZeRO-3 runs (and threads of the bnb process).
        size: a PRESETS name; `hidden` / `layers` override its width and depth.
        hidden: hidden size (heads scale with it: 64 per head; MLP width 8/3 x, rounded to 64).
        layers: decoder layers.
        seq: tokens per sample.
        batch: samples per rank per step (the bnb process takes all N ranks' samples).
        steps: training steps per run (at least 2: the last is measured once AdamW has its state).
        runs: which of RUNS to do.
        isolate: each run in fresh processes (its own peak RSS); False runs them all in one set of processes,
            which saves the start-ups for tiny configs (tests); peak RSS is then the largest so far.
        timeout: seconds per run before its processes are killed.
    """
    if steps < 2:
        raise ValueError(f"steps={steps}: need 2 or more, the measured step must find the optimizer state built")
    unknown = set(runs) - set(RUNS)
    if unknown or size not in PRESETS:
        raise ValueError(f"unknown run {sorted(unknown)} or size {size!r}; runs: {RUNS}, sizes: {sorted(PRESETS)}")
    shape = dict(PRESETS[size])
    if hidden is not None:
        shape.update(hidden=hidden, heads=max(1, hidden // 64), intermediate=max(64, round(hidden * 8 / 3 / 64) * 64))
    if layers is not None:
        shape["layers"] = layers
    config = model_config(seq=seq, **shape)
    load = os.getloadavg()[0]
    common: dict[str, Any] = {"config": config, "seq": seq, "batch": batch, "steps": steps}
    per_run: dict[str, list[dict[str, Any]]] = {}
    if not isolate:
        shared = run_ranks(
            shared_worker, world_size, timeout=timeout * len(runs), start_method="spawn", runs=tuple(runs), **common
        )
        per_run = {name: [r[name] for r in shared if name in r] for name in runs}
    for name in runs if isolate else ():
        if name == "bnb_qlora":
            per_run[name] = run_ranks(bnb_worker, 1, timeout=timeout, start_method="spawn", ranks=world_size, **common)
        else:
            per_run[name] = run_ranks(
                zero_worker, world_size, timeout=timeout, start_method="spawn", fmt=name, **common
            )
    summaries = [_summarise(name, per_run[name]) for name in runs]
    first = per_run[runs[0]][0]
    report: dict[str, Any] = {
        "params": first["params"],
        "world_size": world_size,
        "runs": summaries,
        "trainable_params": first["trainable_params"],
        "model": (
            f"LlamaForCausalLM from model_config (random init, bf16), peft LoRA r={LORA_RANK} alpha={2 * LORA_RANK} "
            f"on {', '.join(LORA_TARGETS)}; AdamW lr {LR}; seq {seq}, {batch} sample(s) per rank, the same batch "
            "every step"
        ),
        "model_config": config,
        "steps": steps,
        "isolated_processes": isolate,
        "measured_at": "after the last step's backward, before its optimizer step; the rank holding the most",
        "units": {"bytes": "bytes", "peak_rss_mb": "MiB", "median_step_s": "seconds"},
    }
    report["targets"] = check_targets(report)
    report["estimate_stage3"] = _estimates(report)
    report.update(
        ds_plugin=source_revision(),
        torch=torch.__version__,
        bitsandbytes=_version("bitsandbytes"),
        peft=_version("peft"),
        transformers=_version("transformers"),
        machine=platform.platform(),
        cpus=os.cpu_count(),
        load_average_at_start=round(load, 2),
        date=datetime.date.today().isoformat(),
    )
    return report


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def draw(report: dict[str, Any], path: str) -> None:
    """Two panels: model-state bytes per rank by category per run; frozen Linear and all-gather bytes.

    Args:
        report: what `run` returned.
        path: PNG file to write.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 1 << 20
    runs = report["runs"]
    names = [r["name"] for r in runs]
    xs = list(range(len(runs)))
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    bottom = [0.0] * len(runs)
    for cat in FROZEN_CATEGORIES:
        vals = [r["breakdown"].get(cat, 0) / mib for r in runs]
        left.bar(xs, vals, 0.6, bottom=bottom, color=COLORS[cat], label=cat)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    if "bnb_qlora" in names:
        share = runs[names.index("bnb_qlora")]["model_state_bytes_per_rank"] / report["world_size"] / mib
        left.axhline(share, color="black", linestyle="--", linewidth=1, label=f"bnb QLoRA / {report['world_size']}")
    left.set_xticks(xs, [n if n == "bnb_qlora" else f"{n}\nZeRO-3" for n in names])
    left.set_ylabel("model-state MiB per rank (bnb: its one process)")
    left.set_title(
        f"LoRA r={LORA_RANK} on a {report['params'] / 1e6:.0f}M Llama, {report['world_size']} ranks", fontsize=9
    )
    left.legend(fontsize=7)
    w = 0.4
    right.bar(
        [x - w / 2 for x in xs],
        [r["frozen_linear_bytes_per_rank"] / mib for r in runs],
        w,
        label="frozen Linear MiB per rank",
    )
    right.bar(
        [x + w / 2 for x in xs],
        [r["frozen_allgather_bytes_per_step"] / mib for r in runs],
        w,
        label="frozen all-gather MiB per step",
    )
    right.set_xticks(xs, names)
    right.set_title("frozen Linear weights: stored per rank, all-gathered per step", fontsize=9)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _table(report: dict[str, Any]) -> str:
    lines = [
        f"params {report['params']:,} (+{report['trainable_params']:,} LoRA)  world size {report['world_size']}",
        f"{'run':<11}{'states MiB/rank':>16}{'frozen lin MiB':>15}{'gather MiB/step':>16}{'peak RSS MiB':>13}"
        f"{'step s':>8}{'loss':>8}",
    ]
    for r in report["runs"]:
        lines.append(
            f"{r['name']:<11}{r['model_state_bytes_per_rank'] / 2**20:>16.2f}"
            f"{r['frozen_linear_bytes_per_rank'] / 2**20:>15.2f}"
            f"{r['frozen_allgather_bytes_per_step'] / 2**20:>16.2f}{r['peak_rss_mb']:>13.0f}{r['median_step_s']:>8.2f}"
            f"{r['final_loss']:>8.3f}"
        )
    for key, t in report["targets"].items():
        lines.append(f"{key}: {t['ratio']:.4f} (limit {t['limit']}) {'ok' if t['ok'] else 'MISSED'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `ds-plugin bench lora-memory`."""
    parser = ArgumentParser(prog="ds-plugin bench lora-memory", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the JSON report only")
    parser.add_argument("--world-size", type=count(1, MAX_LOCAL_RANKS), default=2)
    parser.add_argument("--size", choices=sorted(PRESETS), default="100m", help="model preset")
    parser.add_argument("--hidden", type=count(), help="hidden size (overrides the preset; 64 per head)")
    parser.add_argument("--layers", type=count(), help="decoder layers (overrides the preset)")
    parser.add_argument("--seq", type=count(), default=16)
    parser.add_argument("--batch", type=count(), default=1, help="samples per rank per step")
    # The measured step must find the optimizer state built: 2 or more.
    parser.add_argument("--steps", type=count(2), default=3)
    parser.add_argument(
        "--runs", type=choice_list(RUNS), default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}"
    )
    parser.add_argument(
        "--no-isolate", action="store_true", help="all runs in one set of processes (fast; peak RSS cumulative)"
    )
    parser.add_argument(
        "--out", type=output_file, default=DEFAULT_OUT, help="JSON report file (the PNG goes beside it)"
    )
    parser.add_argument("--png", type=output_file, help="chart file (default: --out with .png)")
    args = parser.parse_args(argv)
    runs = tuple(args.runs)
    if args.hidden is not None:
        # `run` gives the model hidden // 64 heads; rotary embeddings need an even head size.
        heads = max(1, args.hidden // 64)
        if args.hidden % heads or (args.hidden // heads) % 2:
            parser.error(f"argument --hidden: {args.hidden} does not split into {heads} heads of an even size")
    report = run(
        args.world_size,
        size=args.size,
        hidden=args.hidden,
        layers=args.layers,
        seq=args.seq,
        batch=args.batch,
        steps=args.steps,
        runs=runs,
        isolate=not args.no_isolate,
    )
    text = json.dumps(report, indent=2)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        fh.write(text + "\n")
    png = args.png or os.path.splitext(args.out)[0] + ".png"
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    try:
        draw(report, png)
    except ImportError:
        print("no chart: matplotlib is not installed (pip install 'ds_plugin[bench]')", file=sys.stderr)
    print(text if args.json else _table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
