"""`ds-plugin bench zero-memory`: per-rank model-state bytes of ZeRO stages 0–3, counted from tensor storage.

Each stage trains the same bf16 GPT-2 with AdamW for a few steps on N gloo ranks. On the last step the
model states are counted at several points ("probes"); the one compared with the ZeRO formula is
`after_backward`: all gradients exist, the optimizer state exists, nothing has been freed by the step yet.

What is counted: the storage bytes (`untyped_storage().nbytes()`, each storage once, so views and aliases
are not double counted; a DTensor counts its local shard) of every
- compute_params: the bf16 weights forward and backward use (stages 0/1: the model's own parameters;
  stages 2/3: FSDP2's all-gathered unsharded parameters, while their storage is allocated);
- master_params: the fp32 master weights (stages 0/1: the engine's master DTensors; 2/3: FSDP2's sharded
  parameters, padding included);
- grads: every `.grad` of those, FSDP2's unsharded and accumulated gradients, the engine's accumulation buffers;
- optimizer_state: every tensor in `optimizer.state` (AdamW's exp_avg, exp_avg_sq, step).
Activations, communication buffers, autograd's internal buffers and process RSS are not model states.

The formula (ZeRO paper, Rajbhandari et al. 2020, section 5) assumes 2Ψ bf16 weights + 2Ψ bf16 grads + 12Ψ fp32 master
and Adam moments per rank, divided by N where the stage shards them.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import subprocess
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ds_plugin.estimate import zero_model_state_bytes
from ds_plugin.launch import run_ranks

__all__ = ["CATEGORIES", "count_model_states", "main", "run", "source_revision"]

CATEGORIES = ("compute_params", "master_params", "grads", "optimizer_state")
# In step order. "backward" is the largest count seen as each compute parameter's gradient lands;
# "after_reduce" (stages 0/1) is the moment the gradients have been reduced into the masters.
PROBES = ("after_forward", "backward", "after_backward", "after_reduce", "in_step")
MEASURED_AT = "after_backward"

FORMULA = "2Ψ bf16 weights + 2Ψ bf16 grads + 12Ψ fp32 master weights and Adam moments (4Ψ + 4Ψ + 4Ψ)"

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


def source_revision() -> dict[str, Any]:
    """The git commit the package ran from, and which engine files differed from it (benchmark provenance)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        modified = git("status", "--porcelain", "--", "ds_plugin/zero", "ds_plugin/precision").splitlines()
    except (OSError, subprocess.SubprocessError):
        return {"commit": None}
    return {"commit": commit or None, "engine_files_modified": [line[3:] for line in modified]}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class _Ledger:
    """Storage bytes by category; a storage is counted once, in the first category that reaches it."""

    def __init__(self) -> None:
        self.bytes = dict.fromkeys(CATEGORIES, 0)
        self.dtypes: dict[str, set[str]] = {c: set() for c in CATEGORIES}
        self._seen: set[int] = set()

    def add(self, category: str, tensor: torch.Tensor | None) -> None:
        if tensor is None:
            return
        local = _local(tensor)
        storage = local.untyped_storage()
        # FSDP2 frees unsharded parameters by resizing their storage to 0: nothing held, nothing counted.
        if storage.nbytes() == 0 or storage.data_ptr() in self._seen:
            return
        self._seen.add(storage.data_ptr())
        self.bytes[category] += storage.nbytes()
        self.dtypes[category].add(str(local.dtype).removeprefix("torch."))

    def snapshot(self) -> dict[str, Any]:
        return {
            "bytes": sum(self.bytes.values()),
            "breakdown": dict(self.bytes),
            "dtypes": {c: sorted(d) for c, d in self.dtypes.items()},
        }


def _fsdp_params(module: torch.nn.Module) -> Iterator[Any]:
    # FSDP2's per-parameter records; private API (torch 2.9–2.13), read only.
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        for group in groups:
            yield from group.fsdp_params


def count_model_states(engine: Any) -> dict[str, Any]:
    """Model-state storage bytes this rank holds now, by category (see the module docstring).

    Args:
        engine: a `ZeroEngine` (any stage).
    """
    from ds_plugin.zero.stage1 import replicated_state

    ledger = _Ledger()
    replicated = replicated_state(engine.module)
    if replicated is not None:
        for p in replicated.params:
            ledger.add("compute_params", p)
        for m in replicated.masters:
            ledger.add("master_params", m)
        for t in [p.grad for p in replicated.params] + list(replicated._accum.values()):
            ledger.add("grads", t)
        for m in replicated.masters:
            ledger.add("grads", m.grad)
    else:
        for fp in _fsdp_params(engine.module):
            for t in [*fp.all_gather_outputs, *getattr(fp, "_unsharded_inner_tensors", ())]:
                ledger.add("compute_params", t)
            ledger.add("compute_params", getattr(fp, "_sharded_post_forward_param_data", None))  # hpZ
            ledger.add("master_params", fp.sharded_param)
            ledger.add("grads", fp.sharded_param.grad)
            unsharded = getattr(fp, "_unsharded_param", None)
            ledger.add("grads", None if unsharded is None else unsharded.grad)
            ledger.add("grads", getattr(fp, "unsharded_accumulated_grad", None))
    # Anything the walks above missed (parameters outside FSDP2's groups, say) still counts.
    for p in engine.module.parameters():
        ledger.add("master_params" if p.dtype == torch.float32 else "compute_params", p)
        ledger.add("grads", p.grad)
    if engine.optimizer is not None:
        for state in engine.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    ledger.add("optimizer_state", value)
    return ledger.snapshot()


class _Recorder:
    """Counts model states at named points of one training step, keeping the largest count per point."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.probes: dict[str, dict[str, Any]] = {}
        self._handles: list[Any] = []
        self._restore: list[Any] = []

    def probe(self, name: str) -> None:
        snap = count_model_states(self.engine)
        if name not in self.probes or snap["bytes"] > self.probes[name]["bytes"]:
            self.probes[name] = snap

    def arm(self) -> None:
        """Hook the backward and the step of the next training step."""
        from ds_plugin.zero.stage1 import replicated_state

        replicated = replicated_state(self.engine.module)
        if replicated is not None:
            compute = list(replicated.params)
            # reduce_gradients() ends by dropping the compute gradients: just before that, the reduced fp32
            # master gradients and the bf16 compute gradients are both alive. Wrapped on the instance only.
            original = replicated.zero_compute_grads

            def zero_compute_grads() -> None:
                self.probe("after_reduce")
                original()

            replicated.zero_compute_grads = zero_compute_grads
            self._restore.append(lambda: delattr(replicated, "zero_compute_grads"))
        else:
            # FSDP2 keeps one unsharded Parameter per parameter across steps, created at the first all-gather.
            compute = [
                fp._unsharded_param for fp in _fsdp_params(self.engine.module) if hasattr(fp, "_unsharded_param")
            ]
        for p in compute:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(lambda _p: self.probe("backward")))
        self._handles.append(self.engine.optimizer.register_step_pre_hook(lambda *_: self.probe("in_step")))

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        for restore in self._restore:
            restore()
        self._handles.clear()
        self._restore.clear()


def _model(n_layer: int, n_embd: int, vocab: int, seq: int) -> torch.nn.Module:
    import warnings

    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = dict(n_layer=n_layer, n_embd=n_embd, n_head=8, vocab_size=vocab, n_positions=seq)
    return GPT2LMHeadModel(GPT2Config(**cfg, bos_token_id=0, eos_token_id=0))


def _rank_worker(
    rank: int, world: int, *, stages: list[int], n_layer: int, n_embd: int, vocab: int, seq: int, batch: int, steps: int
) -> dict[str, Any]:
    import ds_plugin

    out: dict[str, Any] = {"stages": {}}
    for stage in stages:
        model = _model(n_layer, n_embd, vocab, seq)
        out["params"] = sum(p.numel() for p in model.parameters())
        cfg = {"zero_optimization": {"stage": stage}, "bf16": {"enabled": True}, "gradient_clipping": 0.0}
        engine = ds_plugin.initialize(model, cfg, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))
        recorder = _Recorder(engine)
        gen = torch.Generator().manual_seed(rank)
        # The first step creates the AdamW state; the last one is measured with every model state alive.
        for step in range(steps):
            last = step == steps - 1
            x = torch.randint(0, vocab, (batch, seq), generator=gen)
            loss = engine(x, labels=x).loss
            if last:
                recorder.probe("after_forward")
                recorder.arm()
            engine.backward(loss)
            if last:
                recorder.probe("after_backward")
            engine.step()
        recorder.disarm()
        out["stages"][str(stage)] = recorder.probes
        del engine, model, recorder
        gc.collect()
    return out


def _stage_report(stage: int, per_rank: list[dict[str, Any]], params: int, world: int) -> dict[str, Any]:
    formula = math.ceil(zero_model_state_bytes(params, world, stage))
    # Shards can be uneven: report each probe from the rank that holds the most.
    probes = {}
    for name in PROBES:
        snaps = [r["stages"][str(stage)][name] for r in per_rank if name in r["stages"][str(stage)]]
        if snaps:
            probes[name] = max(snaps, key=lambda s: s["bytes"])
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
        stages: ZeRO stages to measure.
        timeout: seconds for the whole run.
    """
    if steps < 2:
        raise ValueError(f"steps={steps}: need 2 or more, the measured step must find the optimizer state built")
    per_rank = run_ranks(
        _rank_worker,
        world_size,
        timeout=timeout,
        stages=list(stages),
        n_layer=n_layer,
        n_embd=n_embd,
        vocab=vocab,
        seq=seq,
        batch=batch,
        steps=steps,
    )
    params = per_rank[0]["params"]
    return {
        "world_size": world_size,
        "params": params,
        "model": f"GPT2(n_layer={n_layer}, n_embd={n_embd}, vocab={vocab}, tied embeddings), seq={seq}, batch={batch}",
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
        "ds_plugin": source_revision(),
        "torch": torch.__version__,
        "machine": platform.platform(),
        "date": datetime.date.today().isoformat(),
    }


def draw(report: dict[str, Any], path: str) -> None:
    """Bar chart: measured bytes by category (stacked) next to the formula, per stage.

    Args:
        report: what `run` returned.
        path: PNG file to write.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = list(report["stages"])
    mib = 1 << 20
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bottom = [0.0] * len(stages)
    xs = list(range(len(stages)))
    for cat in CATEGORIES:
        vals = [report["stages"][s]["breakdown"][cat] / mib for s in stages]
        ax.bar([x - 0.2 for x in xs], vals, 0.4, bottom=bottom, label=f"measured: {cat}")
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    formula = [report["stages"][s]["formula_bytes"] / mib for s in stages]
    peak = [report["stages"][s]["peak"]["bytes"] / mib for s in stages]
    ax.bar([x + 0.2 for x in xs], formula, 0.4, color="lightgray", edgecolor="black", label="ZeRO formula")
    ax.scatter([x - 0.2 for x in xs], peak, marker="_", s=400, color="black", label="peak over the probes", zorder=3)
    ax.set_xticks(xs, [f"stage {s}" for s in stages])
    ax.set_ylabel("model-state MiB per rank")
    ax.set_title(f"ZeRO model states, {report['params'] / 1e6:.1f}M params, {report['world_size']} ranks, bf16 AdamW")
    ax.legend(fontsize=8)
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
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `ds-plugin bench zero-memory`."""
    parser = argparse.ArgumentParser(prog="ds-plugin bench zero-memory", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--json", action="store_true", help="print the JSON report only")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", help="also write the JSON report to this file")
    parser.add_argument("--png", help="also draw the chart to this PNG file (needs matplotlib)")
    args = parser.parse_args(argv)
    report = run(
        args.world_size,
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        vocab=args.vocab,
        seq=args.seq,
        batch=args.batch,
        steps=args.steps,
    )
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    if args.png:
        draw(report, args.png)
    print(text if args.json else _table(report))
    return 0
