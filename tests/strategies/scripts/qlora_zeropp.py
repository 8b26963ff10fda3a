"""QLoRA through Lightning: a peft Llama whose frozen base the user stored as NF4 (`quantize_frozen_`), trained
with `Trainer(strategy="zeropp")` on 2 CPU ranks; the adapter is saved with `save_adapter`.

What is Lightning's here: the strategy reaches ZeRO-3 with the base still quantized and sharded, trains the adapter,
and `save_adapter(trainer.strategy.engine, ...)` writes it whole. That a LoRA adapter trained on a quantized base at
ZeRO-3 matches one process and reloads to the trained model's logits is checked once, in
tests/zero/test_frozen_zero.py.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as pl
from _tiny_lightning import CausalLM, LossRecorder, hf_model, rank, run, token_loader, trainer

QKVO = ["q_proj", "k_proj", "v_proj", "o_proj"]


def main(args: argparse.Namespace) -> dict[str, Any]:
    from peft import LoraConfig, get_peft_model

    from ds_plugin import quantize_frozen_, save_adapter
    from ds_plugin.quant.frozen.quantize import quantized_weights

    pl.seed_everything(0, verbose=False)
    model = get_peft_model(
        hf_model("llama", seed=0), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=QKVO)
    )
    quantize_frozen_(model, "nf4")
    module = CausalLM(model, lr=2e-2)
    recorder = LossRecorder()
    t = trainer("zeropp", max_steps=8, callbacks=[recorder])
    t.fit(module, token_loader(n=32))
    path = args.workdir / "qlora_adapter"
    save_adapter(t.strategy.engine, path)
    adapter = t.strategy.full_state_dict(module.model, trainable_only=True)
    out: dict[str, Any] = {
        "losses": recorder.losses,
        "stage": t.strategy.config.stage,
        "quantized": len(quantized_weights(module.model)),
        "sharded": sum(type(p).__name__ == "DTensor" for p in module.model.parameters()),
    }
    if rank() != 0:
        return out
    # The gathered adapter fits a fresh peft model on the NF4 base: every LoRA tensor whole, by its own name.
    fresh = get_peft_model(
        hf_model("llama", seed=0), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=QKVO)
    )
    quantize_frozen_(fresh, "nf4")
    missing = fresh.load_state_dict(adapter, strict=False).missing_keys
    out.update(
        files=sorted(p.name for p in path.iterdir()),
        adapter_keys=len(adapter),
        adapter_loaded=not any("lora_" in k for k in missing),
        lora_b_max=max(v.abs().max().item() for k, v in adapter.items() if "lora_B" in k),
    )
    return out


if __name__ == "__main__":
    run(main)
