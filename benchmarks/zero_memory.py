"""`ds-plugin bench zero-memory`: per-rank model-state bytes of ZeRO stages 0–3, counted from tensor storage.

Each stage trains the same bf16 GPT-2 with AdamW for a few steps on N gloo ranks. On the last step the
model states are counted at several points ("probes"); the one compared with the ZeRO formula is
`after_backward`: all gradients exist, the optimizer state exists, nothing has been freed by the step yet.
Stage 3 runs with `stage3_max_reuse_distance` 0, so its probes in forward and backward show the layout of a model
too big to keep blocks gathered between the two (under the default every block of this GPT-2 stays gathered).
What is counted is described in `benchmarks._model_states` (storage bytes, each storage once).

The formula (ZeRO paper, Rajbhandari et al. 2020, section 5) assumes 2Ψ bf16 weights + 2Ψ bf16 grads + 12Ψ fp32 master
and Adam moments per rank, divided by N where the stage shards them.

The LoRA case trains the same GPT-2 with peft LoRA (rank 16 on the attention projections `attn.c_attn`, the
fused q/k/v, and `attn.c_proj`, the output) and everything else frozen, at the same stages. Frozen parameters
are counted apart ("frozen_params") and compared with their storage alone: 2 bytes per element in bf16, whole
at stages 0–1, divided by N at stages 2–3 (FSDP2 shards every parameter); the adapters follow the 16Ψ formula.
An fp32 master, a gradient or optimizer state for a frozen parameter would show as 4–14 bytes more per element.
"""

from __future__ import annotations

import datetime
import gc
import json
import math
import os
import platform
from typing import Any

import torch

from benchmarks._model_states import CATEGORIES, COLORS, FROZEN_CATEGORIES, Ledger, Recorder, source_revision
from ds_plugin._argparse import MAX_LOCAL_RANKS, ArgumentParser, count, output_file
from ds_plugin.estimate import lora_model_state_bytes, zero_model_state_bytes
from ds_plugin.launch import run_ranks

__all__ = ["CATEGORIES", "FROZEN_CATEGORIES", "Ledger", "main", "run", "source_revision"]

# In step order. "backward" is the largest count seen as each compute parameter's gradient lands;
# "after_reduce" (stages 0/1) is the moment the gradients have been reduced into the masters.
PROBES = ("after_forward", "backward", "after_backward", "after_reduce", "in_step")
MEASURED_AT = "after_backward"

FORMULA = "2Ψ bf16 weights + 2Ψ bf16 grads + 12Ψ fp32 master weights and Adam moments (4Ψ + 4Ψ + 4Ψ)"
LORA_RANK = 16
# GPT-2's attention projections: c_attn is q, k and v fused, attn.c_proj is o (mlp.c_proj is left frozen).
LORA_TARGETS = ("attn.c_attn", "attn.c_proj")
LORA_FORMULA = (
    "frozen Ψf: 2 bytes each (bf16), whole at stages 0-1, /N at 2-3; trainable adapters Ψt: the ZeRO formula "
    "(2Ψt + 2Ψt + 12Ψt, sharded by stage)"
)

# Why each stage's count differs from its formula at `after_backward`; the numbers are in the breakdown.
EXPLAIN = {
    0: (
        "replicated: bf16 compute weights (2Ψ) and their bf16 gradients (2Ψ), fp32 masters and AdamW moments "
        "(12Ψ), as the formula assumes. The step then reduces the gradients into fp32 master gradients (4Ψ) "
        "before it drops the bf16 ones: 20Ψ at after_reduce, 18Ψ at in_step (fp32 gradients where the "
        "formula has bf16 ones)."
    ),
    1: (
        "bf16 compute weights and gradients replicated (4Ψ), fp32 masters and AdamW moments sharded (12Ψ/N), "
        "as the formula assumes. The step reduce-scatters into fp32 master gradient shards (4Ψ/N) before it "
        "drops the bf16 gradients: 4Ψ + 16Ψ/N at after_reduce, 2Ψ + 16Ψ/N at in_step."
    ),
    2: (
        "FSDP2 reshards every unit after backward, so the bf16 weights gathered for forward and backward "
        "(the formula's 2Ψ) are already freed here; they are held from forward into backward (after_forward "
        "and backward probes). The gradient shards are fp32 (FSDP2 casts the bf16 reduce-scatter output to "
        "the parameter dtype): 4Ψ/N instead of 2Ψ/N. Total 16Ψ/N, below 2Ψ + 14Ψ/N for N > 1."
    ),
    3: (
        "no bf16 weight shard is kept (the all-gather casts the fp32 shard on the fly), but the gradient "
        "shards are fp32 (4Ψ/N instead of 2Ψ/N): the same 16Ψ/N as the formula, split differently. The "
        "gathered bf16 weights and bf16 gradients of the unit in flight (the largest is the root with the "
        "tied embedding) are the ZeRO paper's temporary buffers: they show in the backward probe."
    ),
}


def _model(n_layer: int, n_embd: int, vocab: int, seq: int, *, lora: bool = False) -> torch.nn.Module:
    import warnings

    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = dict(n_layer=n_layer, n_embd=n_embd, n_head=8, vocab_size=vocab, n_positions=seq)
    model = GPT2LMHeadModel(GPT2Config(**cfg, bos_token_id=0, eos_token_id=0))
    if not lora:
        return model
    import peft

    # fan_in_fan_out: GPT-2's projections are Conv1D, whose weight is (in, out).
    lora_cfg = peft.LoraConfig(
        r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0, target_modules=list(LORA_TARGETS), fan_in_fan_out=True
    )
    return peft.get_peft_model(model, lora_cfg)


def _train_and_probe(engine: Any, rank: int, *, vocab: int, seq: int, batch: int, steps: int, lora: bool) -> Any:
    recorder = Recorder(engine, split_frozen=lora)
    gen = torch.Generator().manual_seed(rank)
    # The first step creates the AdamW state; the last one is measured with every model state alive.
    for step in range(steps):
        last = step == steps - 1
        x = torch.randint(0, vocab, (batch, seq), generator=gen)
        loss = engine(input_ids=x, labels=x).loss
        if last:
            recorder.probe("after_forward")
            recorder.arm()
        engine.backward(loss)
        if last:
            recorder.probe("after_backward")
        engine.step()
    recorder.disarm()
    return recorder.probes


def _rank_worker(
    rank: int,
    world: int,
    *,
    stages: list[int],
    lora_stages: list[int],
    n_layer: int,
    n_embd: int,
    vocab: int,
    seq: int,
    batch: int,
    steps: int,
) -> dict[str, Any]:
    import ds_plugin

    out: dict[str, Any] = {"stages": {}, "lora": {}}
    for lora, todo in ((False, stages), (True, lora_stages)):
        for stage in todo:
            model = _model(n_layer, n_embd, vocab, seq, lora=lora)
            if lora:
                out["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
                out["frozen_params"] = sum(p.numel() for p in model.parameters() if not p.requires_grad)
            else:
                out["params"] = sum(p.numel() for p in model.parameters())
            # Reuse distance 0: stage 3 frees each block after its forward, as it does for the blocks of a 7B model.
            # Under the default (1e9) every block of this small model stays gathered from forward to backward.
            zero = {"stage": stage, "stage3_max_reuse_distance": 0}
            cfg = {"zero_optimization": zero, "bf16": {"enabled": True}, "gradient_clipping": 0.0}
            engine = ds_plugin.initialize(model, cfg, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))
            probes = _train_and_probe(engine, rank, vocab=vocab, seq=seq, batch=batch, steps=steps, lora=lora)
            out["lora" if lora else "stages"][str(stage)] = probes
            del engine, model
            gc.collect()
    return out


def _max_probes(per_rank: list[dict[str, Any]], key: str, stage: int) -> dict[str, dict[str, Any]]:
    # Shards can be uneven: report each probe from the rank that holds the most.
    probes = {}
    for name in PROBES:
        snaps = [r[key][str(stage)][name] for r in per_rank if name in r[key][str(stage)]]
        if snaps:
            probes[name] = max(snaps, key=lambda s: s["bytes"])
    return probes


def _stage_report(stage: int, per_rank: list[dict[str, Any]], params: int, world: int) -> dict[str, Any]:
    formula = math.ceil(zero_model_state_bytes(params, world, stage))
    probes = _max_probes(per_rank, "stages", stage)
    at = probes[MEASURED_AT]
    peak_name = max(probes, key=lambda n: probes[n]["bytes"])
    return {
        "measured_bytes": at["bytes"],
        "formula_bytes": formula,
        "ratio": round(at["bytes"] / formula, 4),
        "measured_at": MEASURED_AT,
        "breakdown": at["breakdown"],
        "bytes_per_param": {c: round(b / params, 3) for c, b in at["breakdown"].items()},
        "dtypes": at["dtypes"],
        "peak": {
            "at": peak_name,
            "bytes": probes[peak_name]["bytes"],
            "ratio": round(probes[peak_name]["bytes"] / formula, 4),
            "breakdown": probes[peak_name]["breakdown"],
        },
        "probes": {n: {"bytes": s["bytes"], "breakdown": s["breakdown"]} for n, s in probes.items()},
        "explanation": EXPLAIN[stage],
    }


def _lora_stage_report(stage: int, per_rank: list[dict[str, Any]], world: int) -> dict[str, Any]:
    trainable, frozen = per_rank[0]["trainable_params"], per_rank[0]["frozen_params"]
    probes = _max_probes(per_rank, "lora", stage)
    at = probes[MEASURED_AT]
    formula = math.ceil(lora_model_state_bytes(trainable, 2 * frozen, world, stage))
    others = at["bytes"] - at["breakdown"]["frozen_params"]
    shards = world if stage >= 2 else 1
    return {
        "measured_bytes": at["bytes"],
        "formula_bytes": formula,
        "ratio": round(at["bytes"] / formula, 4),
        "measured_at": MEASURED_AT,
        "breakdown": at["breakdown"],
        "frozen": {
            "measured_bytes": at["breakdown"]["frozen_params"],
            "formula_bytes": math.ceil(2 * frozen / shards),
            "bytes_per_frozen_param": round(at["breakdown"]["frozen_params"] * shards / frozen, 4),
        },
        "trainable": {
            "measured_bytes": others,
            "formula_bytes": math.ceil(zero_model_state_bytes(trainable, world, stage)),
        },
        "dtypes": at["dtypes"],
        "probes": {n: {"bytes": s["bytes"], "breakdown": s["breakdown"]} for n, s in probes.items()},
    }


def run(
    world_size: int = 4,
    *,
    n_layer: int = 4,
    n_embd: int = 512,
    vocab: int = 16384,
    seq: int = 32,
    batch: int = 1,
    steps: int = 2,
    stages: tuple[int, ...] = (0, 1, 2, 3),
    lora_stages: tuple[int, ...] | None = None,
    timeout: float = 600,
) -> dict[str, Any]:
    """Measure every stage on `world_size` ranks and return the report dict.

    Args:
        world_size: gloo ranks N.
        n_layer: GPT-2 layers.
        n_embd: GPT-2 width.
        vocab: vocabulary size (the tied embedding is a large part of Ψ).
        seq: tokens per sample.
        batch: samples per rank per step.
        steps: training steps per stage (at least 2: the last is measured once AdamW has its state).
        stages: ZeRO stages to measure with every parameter trained.
        lora_stages: ZeRO stages to measure the LoRA case at; default `stages`, () for none.
        timeout: seconds for the whole run.
    """
    if steps < 2:
        raise ValueError(f"steps={steps}: need 2 or more, the measured step must find the optimizer state built")
    lora_stages = stages if lora_stages is None else lora_stages
    per_rank = run_ranks(
        _rank_worker,
        world_size,
        timeout=timeout,
        stages=list(stages),
        lora_stages=list(lora_stages),
        n_layer=n_layer,
        n_embd=n_embd,
        vocab=vocab,
        seq=seq,
        batch=batch,
        steps=steps,
    )
    params = per_rank[0].get("params", per_rank[0].get("frozen_params"))
    model = f"GPT2(n_layer={n_layer}, n_embd={n_embd}, vocab={vocab}, tied embeddings), seq={seq}, batch={batch}"
    report: dict[str, Any] = {
        "world_size": world_size,
        "params": params,
        "model": model,
        "dtype": "bf16 mixed precision (bf16 compute and reduce, fp32 masters), AdamW",
        "formula": FORMULA,
        "counted": (
            "storage bytes of compute_params (bf16 weights used by forward/backward), master_params (fp32), "
            "grads and optimizer_state (AdamW exp_avg, exp_avg_sq, step), each storage once, DTensors by local "
            f"shard; measured_bytes at '{MEASURED_AT}' of the last of {steps} steps, on the rank holding the most"
        ),
        "probes": {
            "after_forward": "forward done, backward not started",
            "backward": "largest count as each compute parameter's gradient is accumulated",
            "after_backward": "engine.backward returned, engine.step not called",
            "after_reduce": "stages 0/1: gradients reduced into the fp32 masters, bf16 gradients not yet dropped",
            "in_step": "optimizer.step about to run",
        },
        "stages": {str(s): _stage_report(s, per_rank, params, world_size) for s in stages},
    }
    if lora_stages:
        report["lora"] = {
            "model": f"{model}; peft LoRA r={LORA_RANK} on {', '.join(LORA_TARGETS)}, every other parameter frozen",
            "rank": LORA_RANK,
            "targets": list(LORA_TARGETS),
            "trainable_params": per_rank[0]["trainable_params"],
            "frozen_params": per_rank[0]["frozen_params"],
            "formula": LORA_FORMULA,
            "counted": (
                "as above, with every requires_grad=False parameter's storage counted first, as frozen_params "
                "(bytes_per_frozen_param: frozen bytes per element, times N at stages 2-3)"
            ),
            "stages": {str(s): _lora_stage_report(s, per_rank, world_size) for s in lora_stages},
        }
    report.update(
        {
            "ds_plugin": source_revision(),
            "torch": torch.__version__,
            "machine": platform.platform(),
            "date": datetime.date.today().isoformat(),
        }
    )
    return report


def _stacked(ax: Any, section: dict[str, Any], categories: tuple[str, ...], title: str) -> None:
    stages = list(section)
    mib = 1 << 20
    xs = list(range(len(stages)))
    bottom = [0.0] * len(stages)
    for cat in categories:
        vals = [section[s]["breakdown"][cat] / mib for s in stages]
        ax.bar([x - 0.2 for x in xs], vals, 0.4, bottom=bottom, color=COLORS[cat], label=f"measured: {cat}")
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    formula = [section[s]["formula_bytes"] / mib for s in stages]
    ax.bar([x + 0.2 for x in xs], formula, 0.4, color="lightgray", edgecolor="black", label="formula")
    if all("peak" in section[s] for s in stages):
        peak = [section[s]["peak"]["bytes"] / mib for s in stages]
        ax.scatter([x - 0.2 for x in xs], peak, marker="_", s=400, color="black", label="peak over probes", zorder=3)
    ax.set_xticks(xs, [f"stage {s}" for s in stages])
    ax.set_ylabel("model-state MiB per rank")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def draw(report: dict[str, Any], path: str) -> None:
    """Bar charts: measured bytes by category (stacked) next to the formula, per stage; the LoRA case beside.

    Args:
        report: what `run` returned.
        path: PNG file to write.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lora = report.get("lora")
    fig, axes = plt.subplots(1, 2 if lora else 1, figsize=(14 if lora else 8, 4.5), squeeze=False)
    n = report["world_size"]
    title = f"ZeRO model states, {report['params'] / 1e6:.1f}M params, {n} ranks, bf16 AdamW"
    _stacked(axes[0][0], report["stages"], CATEGORIES, title)
    if lora:
        title = (
            f"LoRA r={lora['rank']}: {lora['trainable_params'] / 1e6:.2f}M trainable, "
            f"{lora['frozen_params'] / 1e6:.1f}M frozen (bf16), {n} ranks"
        )
        _stacked(axes[0][1], lora["stages"], FROZEN_CATEGORIES, title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _table(report: dict[str, Any]) -> str:
    lines = [
        f"params {report['params']:,}  world size {report['world_size']}  ({report['formula']})",
        f"{'stage':<6}{'measured MiB':>14}{'formula MiB':>13}{'ratio':>8}{'peak MiB':>10}  peak at",
    ]
    for s, r in report["stages"].items():
        lines.append(
            f"{s:<6}{r['measured_bytes'] / 2**20:>14.2f}{r['formula_bytes'] / 2**20:>13.2f}{r['ratio']:>8.3f}"
            f"{r['peak']['bytes'] / 2**20:>10.2f}  {r['peak']['at']}"
        )
    lora = report.get("lora")
    if lora:
        lines += [
            "",
            f"LoRA r={lora['rank']}: {lora['trainable_params']:,} trainable, {lora['frozen_params']:,} frozen "
            f"({lora['formula']})",
            f"{'stage':<6}{'measured MiB':>14}{'formula MiB':>13}{'ratio':>8}{'frozen MiB':>12}{'B/frozen elt':>14}",
        ]
        for s, r in lora["stages"].items():
            lines.append(
                f"{s:<6}{r['measured_bytes'] / 2**20:>14.2f}{r['formula_bytes'] / 2**20:>13.2f}{r['ratio']:>8.3f}"
                f"{r['frozen']['measured_bytes'] / 2**20:>12.2f}{r['frozen']['bytes_per_frozen_param']:>14.3f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `ds-plugin bench zero-memory`."""
    parser = ArgumentParser(prog="ds-plugin bench zero-memory", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=count(1, MAX_LOCAL_RANKS), default=4)
    parser.add_argument("--json", action="store_true", help="print the JSON report only")
    parser.add_argument("--n-layer", type=count(), default=4)
    parser.add_argument("--n-embd", type=count(), default=512, help="GPT-2 width, a multiple of its 8 heads")
    parser.add_argument("--vocab", type=count(), default=16384)
    parser.add_argument("--seq", type=count(), default=32)
    parser.add_argument("--batch", type=count(), default=1)
    # The measured step must find the optimizer state built: 2 or more.
    parser.add_argument("--steps", type=count(2), default=2)
    parser.add_argument("--no-lora", action="store_true", help="skip the LoRA case")
    parser.add_argument("--out", type=output_file, help="also write the JSON report to this file")
    parser.add_argument("--png", type=output_file, help="also draw the chart to this PNG file (needs matplotlib)")
    args = parser.parse_args(argv)
    if args.n_embd % 8:  # the model has 8 heads; the ranks would fail on it after starting up
        parser.error(f"argument --n-embd: {args.n_embd} is not a multiple of the 8 attention heads")
    report = run(
        args.world_size,
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        vocab=args.vocab,
        seq=args.seq,
        batch=args.batch,
        steps=args.steps,
        lora_stages=() if args.no_lora else None,
    )
    text = json.dumps(report, indent=2)
    for path in filter(None, (args.out, args.png)):  # missing folders were allowed while parsing
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    if args.png:
        draw(report, args.png)
    print(text if args.json else _table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
