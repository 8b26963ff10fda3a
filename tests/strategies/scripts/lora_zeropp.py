"""A peft LoRA GPT-2 inside a LightningModule, trained with `strategy="zeropp"` on 2 CPU ranks; its adapter is
gathered with `ZeroStrategy.full_state_dict(..., trainable_only=True)`, saved with peft's `save_pretrained` and
reloaded onto a fresh base model, which must reproduce the trained model's logits. The strategy saves checkpoints
without the frozen base (`exclude_frozen_parameters=True`); one restored into a new module on the same base gives the
trained weights.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as pl
import torch
from _tiny_lightning import SEQ, VOCAB, CausalLM, LossRecorder, hf_model, max_diff, rank, run, token_loader, trainer
from torch.distributed.checkpoint import FileSystemReader

from ds_plugin.strategies.lightning import ZeroStrategy


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn"], fan_in_fan_out=True)
    return get_peft_model(model, cfg)


def main(args: argparse.Namespace) -> dict[str, Any]:
    from peft import PeftModel

    pl.seed_everything(0, verbose=False)
    module = CausalLM(_lora(hf_model("gpt2", seed=0)), lr=2e-2)
    recorder = LossRecorder()
    t = trainer(ZeroStrategy("zeropp", exclude_frozen_parameters=True), max_steps=8, callbacks=[recorder])
    t.fit(module, token_loader(n=32))
    cfg = t.strategy.config
    adapter = t.strategy.full_state_dict(module.model, trainable_only=True)
    full = t.strategy.full_state_dict(module.model)
    # A checkpoint without the frozen base, restored into a new module built on the same base: the trained model.
    ckpt = args.workdir / "lora.ckpt"
    t.save_checkpoint(ckpt)
    again = CausalLM(_lora(hf_model("gpt2", seed=0)), lr=2e-2)  # the same base, its LoRA as initialised (B = 0)
    t2 = trainer(ZeroStrategy("zeropp", exclude_frozen_parameters=True), max_steps=8)
    t2.fit(again, token_loader(n=32), ckpt_path=ckpt)  # restores step 8 of 8: nothing left to train
    restored = t2.strategy.full_state_dict(again.model)
    out: dict[str, Any] = {
        "losses": recorder.losses,
        "stage": cfg.stage,
        "hpz": cfg.zero_optimization.zero_hpz_partition_size,
        "qwz": cfg.zero_optimization.zero_quantized_weights,
        "qgz": cfg.zero_optimization.zero_quantized_gradients,
        "adapter_keys": sorted(adapter),
        "restored_global_step": t2.global_step,
    }
    if rank() != 0:
        return out
    path = args.workdir / "adapter"
    module.model.save_pretrained(path, state_dict=adapter)
    reloaded = PeftModel.from_pretrained(hf_model("gpt2", seed=0), path).eval()
    fresh_base = dict(hf_model("gpt2", seed=0).named_parameters())
    trained = _lora(hf_model("gpt2", seed=0)).eval()
    trained.load_state_dict(full)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits_diff = (reloaded(input_ids=tokens).logits - trained(input_ids=tokens).logits).abs().max().item()
    reloaded_sd = {k: v for k, v in reloaded.state_dict().items() if k in adapter}
    base = {k: v for k, v in full.items() if "lora_" not in k}
    out.update(
        files=sorted(p.name for p in path.iterdir()),
        reloaded_adapter_diff=max_diff(reloaded_sd, adapter),
        lora_b_max=max(v.abs().max().item() for k, v in adapter.items() if "lora_B" in k),
        base_changed=max(
            (v - fresh_base[k.removeprefix("base_model.model.").replace(".base_layer", "")]).abs().max().item()
            for k, v in base.items()
            if k.removeprefix("base_model.model.").replace(".base_layer", "") in fresh_base
        ),
        logits_diff=logits_diff,
        restored_diff=max_diff(restored, full),
        checkpoint_model_keys=sorted(
            k for k in FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata if k.startswith("model.")
        ),
    )
    return out


if __name__ == "__main__":
    run(main)
