"""Per-step losses of every strategy name against `strategy="ddp"`, on 2 CPU ranks, in one launch.

- fp32, tiny GPT-2 and tiny Llama on learnable tokens (`cycle_loader`), AdamW + a per-step LambdaLR: ddp, zero1,
  zero2, zero3.
- a tiny MLP whose `training_step` calls `self(x)`, with `accumulate_grad_batches=2` and `gradient_clip_val`
  (Trainer values -> config), on 16 rows it can fit (`fit_loader`), all of them in every optimizer step: ddp,
  zero0, zero1, zero3_offload, zeropp (with zero2/zero3 above, every name).
- the same MLP clipped by value (`gradient_clip_algorithm="value"`): ddp, zero1, zero3.
- bf16-mixed on zero3 (the config's bf16 block comes from the Trainer's precision).
- sharded initialisation: a GPT-2 built in `configure_model` under `meta_init`, materialised shard by shard.
- the strategy's collectives: reduce, all_gather, broadcast, reduce_boolean_decision, barrier.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import lightning.pytorch as pl
import torch
from _tiny_lightning import (
    CausalLM,
    LossRecorder,
    TinyMLP,
    cycle_loader,
    fit_loader,
    hf_model,
    run,
    token_loader,
    trainer,
)

TIMES: list = []
# The causal LMs train for CausalLM's warm-up (8 steps, lr x 1/8 ... 8/8) at ten times its default lr, so the
# loss on `cycle_loader` falls by about a nat and a half, not by hundredths.
LM_LR, LM_STEPS = 1e-2, 8


def _fit(strategy: str, module: pl.LightningModule, loader: Any, steps: int, **kwargs: Any) -> tuple[list, pl.Trainer]:
    pl.seed_everything(0, verbose=False)
    recorder = LossRecorder()
    t = trainer(strategy, max_steps=steps, callbacks=[recorder], **kwargs)
    start = time.perf_counter()
    t.fit(module, loader)
    TIMES.append((strategy, round(time.perf_counter() - start, 2)))
    return recorder.losses, t


def _config(t: pl.Trainer) -> dict[str, Any]:
    cfg = t.strategy.config
    return {
        "stage": cfg.stage,
        "hpz": cfg.zero_optimization.zero_hpz_partition_size,
        "compute_dtype": cfg.compute_dtype,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "gradient_clipping": cfg.gradient_clipping,
        "micro_batch": cfg.train_micro_batch_size_per_gpu,
        "train_batch_size": cfg.train_batch_size,
        "engine_global_steps": t.strategy.engine.global_steps,
        "engine_micro_steps": t.strategy.engine.micro_steps,
    }


def _collectives(t: pl.Trainer) -> dict[str, Any]:
    s = t.strategy
    me = torch.tensor([float(s.global_rank + 1)])
    gathered = s.all_gather(me)
    s.barrier("collectives")
    return {
        "reduce_sum": s.reduce(me.clone(), reduce_op="sum").item(),
        "reduce_mean": s.reduce(me.clone()).item(),
        "all_gather": gathered.flatten().tolist(),
        "broadcast": s.broadcast({"from": s.global_rank}),
        "any": s.reduce_boolean_decision(s.global_rank == 1, all=False),
        "all": s.reduce_boolean_decision(s.global_rank == 1, all=True),
    }


def main(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"parity": {}, "names": {}, "times": TIMES}
    for kind in ("gpt2", "llama"):
        out["parity"][kind] = {}
        for strategy in ("ddp", "zero1", "zero2", "zero3"):
            losses, t = _fit(strategy, CausalLM(hf_model(kind), lr=LM_LR), cycle_loader(), steps=LM_STEPS)
            out["parity"][kind][strategy] = losses
    for name in ("ddp", "zero0", "zero1", "zero3_offload", "zeropp"):
        losses, t = _fit(name, TinyMLP(), fit_loader(), steps=3, accumulate_grad_batches=2,
                         gradient_clip_val=0.05)  # fmt: skip
        out["names"][name] = {"losses": losses, "config": _config(t) if name != "ddp" else {}}
    out["collectives"] = _collectives(t)
    out["clip_value"] = {}
    for name in ("ddp", "zero1", "zero3"):
        losses, t = _fit(name, TinyMLP(), fit_loader(), steps=3, accumulate_grad_batches=2,
                         gradient_clip_val=0.01, gradient_clip_algorithm="value")  # fmt: skip
        out["clip_value"][name] = {"losses": losses, "config": _config(t) if name != "ddp" else {}}
    losses, t = _fit("zero3", CausalLM(hf_model("gpt2"), lr=LM_LR), cycle_loader(), steps=LM_STEPS,
                     precision="bf16-mixed")  # fmt: skip
    out["bf16"] = {"losses": losses, "config": _config(t), "fp32": out["parity"]["gpt2"]["zero3"]}
    module = MetaCausalLM()
    losses, t = _fit("zero3", module, token_loader(), steps=2)
    weights = t.strategy.full_state_dict(module.model)
    out["meta_init"] = {
        "losses": losses,
        "wte_std": weights["transformer.wte.weight"].std().item() if weights else None,
        "ln_weight": weights["transformer.ln_f.weight"].mean().item() if weights else None,
    }
    return out


class MetaCausalLM(CausalLM):
    """The transformers model is built in `configure_model` without memory: ZeroStrategy materialises its shards."""

    def __init__(self) -> None:
        super().__init__(None)

    def configure_model(self) -> None:
        from ds_plugin.zero.init import meta_init

        if self.model is None:
            with meta_init():
                self.model = hf_model("gpt2")


if __name__ == "__main__":
    run(main)
