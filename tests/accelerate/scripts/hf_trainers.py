"""The HF Trainer and trl's DPOTrainer through `accelerate launch -m ds_plugin.accelerate` (this script never
imports ds_plugin; it only reads `trainer.accelerator.engine` to report what ran).

Parts, in one launch (process start-up dominates on CPU):
* trainer: `transformers.Trainer` with `TrainingArguments(deepspeed=<HF's zero3 "auto" JSON>, bf16=True)`, 10 steps
  with a checkpoint at step 5; a second Trainer resumes from it and must log the same losses for steps 6-10; the
  saved model (bf16: the JSON sets `stage3_gather_16bit_weights_on_model_save`) must hold the fp32 masters rounded
  to bf16, and reload with `from_pretrained` to give the trained model's logits.
* dpo: trl's `DPOTrainer` with a LoRA `peft_config` and no DeepSpeed argument (the launch's --ds-config, which
  stores the frozen base as INT8), 10 steps;
  the saved adapter must reload with `PeftModel.from_pretrained` and give the trained model's logits.

Rank 0 writes `--out` (JSON) with each part's result or its traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

WORDS = ["<pad>", "<eos>", "<unk>", *"abcdefghijklmnopqrstuvwxyz", "yes", "no", "is", "it"]


def tokenizer() -> Any:
    """A word-level tokenizer built in code (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<pad>", "<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def llama(seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                      eos_token_id=1, bos_token_id=1)  # fmt: skip
    return LlamaForCausalLM(cfg)


class Sequences(torch.utils.data.Dataset):
    """Short repeating letter patterns: easy to learn, so the loss falls within 10 steps."""

    def __init__(self, count: int = 64, length: int = 16) -> None:
        gen = torch.Generator().manual_seed(1)
        starts = torch.randint(3, 3 + 26, (count,), generator=gen)
        steps = torch.randint(1, 3, (count,), generator=gen)
        pos = torch.arange(length)
        self.ids = 3 + (starts[:, None] - 3 + steps[:, None] * pos) % 26

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def probe_logits(model: Any) -> torch.Tensor:
    """The model's logits on a fixed input (every rank runs it: the model may be sharded)."""
    ids = torch.tensor([[3, 5, 7, 9, 11, 13]])
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids).logits.float().cpu()
    model.train(was_training)
    return out


def engine_info(trainer: Any) -> dict[str, Any]:
    engine = getattr(trainer.accelerator, "engine", None)
    if engine is None:
        return {"engine": None}
    plan = engine.plan
    return {"engine": type(engine).__name__, "stage": plan.stage, "compute": plan.compute_dtype,
            "accumulation": plan.gradient_accumulation_steps, "clip": plan.gradient_clipping,
            "micro_batch": plan.config.train_micro_batch_size_per_gpu, "global_steps": engine.global_steps,
            "frozen_format": plan.frozen_format}  # fmt: skip


def losses(trainer: Any) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def part_trainer(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    out_dir = Path(args.workdir) / "trainer"
    common = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=1e-2, max_steps=10,
                  lr_scheduler_type="constant", logging_steps=1, save_strategy="steps", save_steps=5, report_to=[],
                  bf16=True, use_cpu=True, seed=0, deepspeed=args.hf_config, disable_tqdm=True)  # fmt: skip
    first = Trainer(model=llama(), args=TrainingArguments(output_dir=str(out_dir), **common), train_dataset=Sequences())
    first.train()
    final = out_dir / "final"
    first.save_model(str(final))
    trained = probe_logits(first.model)
    info = engine_info(first)
    # The fp32 masters, whole (a collective: every rank): the JSON asks for 16-bit weights on save, so the saved file
    # must hold exactly these rounded to bf16 once.
    masters = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
               for k, v in first.accelerator.engine.model_state_dict().items()}  # fmt: skip

    second = Trainer(model=llama(seed=1), args=TrainingArguments(output_dir=str(out_dir), **common),
                     train_dataset=Sequences())  # fmt: skip
    second.train(resume_from_checkpoint=str(out_dir / "checkpoint-5"))
    result: dict[str, Any] = {"losses": losses(first), "resumed": losses(second), **info}
    if dist.get_rank() == 0:
        reloaded = LlamaForCausalLM.from_pretrained(str(final))
        result["reload_max_diff"] = (probe_logits(reloaded) - trained).abs().max().item()
        result["saved_files"] = sorted(p.name for p in final.iterdir())
        from safetensors.torch import load_file

        saved = load_file(final / "model.safetensors")
        result["saved_dtypes"] = sorted({str(t.dtype) for t in saved.values()})
        result["saved_keys_missing"] = sorted(set(masters) - set(saved))
        result["saved_vs_bf16_masters"] = max(
            (saved[k].float() - masters[k].to(torch.bfloat16).float()).abs().max().item() for k in saved
        )
        result["saved_vs_fp32_masters"] = max((saved[k].float() - masters[k]).abs().max().item() for k in saved)
        result["checkpoint_files"] = sorted(p.name for p in (out_dir / "checkpoint-5").iterdir())
    return result


def part_dpo(args: argparse.Namespace) -> dict[str, Any]:
    from datasets import Dataset
    from peft import LoraConfig, PeftModel
    from trl import DPOConfig, DPOTrainer

    letters = "abcdefghijklmnopqrstuvwxyz"
    rows = {"prompt": [f"{letters[i % 26]} {letters[(i + 1) % 26]} is it" for i in range(32)]}
    rows["chosen"] = [" yes"] * 32
    rows["rejected"] = [" no"] * 32
    out_dir = Path(args.workdir) / "dpo"
    config = DPOConfig(output_dir=str(out_dir), per_device_train_batch_size=2, learning_rate=2e-2, max_steps=10,
                       lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], seed=0,
                       use_cpu=True, beta=0.1, max_length=32, disable_tqdm=True, dataset_num_proc=None)  # fmt: skip
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
    trainer = DPOTrainer(model=llama(), args=config, train_dataset=Dataset.from_dict(rows),
                         processing_class=tokenizer(), peft_config=lora)  # fmt: skip
    trainer.train()
    # A Trainer checkpoint of a peft model holds the adapter, not the frozen base (as with DeepSpeed).
    trainer._save_optimizer_and_scheduler(str(out_dir / "checkpoint"))
    adapter = out_dir / "adapter"
    trainer.save_model(str(adapter))
    trained = probe_logits(trainer.model)
    result: dict[str, Any] = {"losses": losses(trainer), "model": type(trainer.model).__name__, **engine_info(trainer)}
    trainer._load_optimizer_and_scheduler(str(out_dir / "checkpoint"))  # the resume path: the base stays as built
    result["checkpoint_reload_diff"] = (probe_logits(trainer.model) - trained).abs().max().item()
    if dist.get_rank() == 0:
        reloaded = PeftModel.from_pretrained(llama(), str(adapter))
        result["reload_max_diff"] = (probe_logits(reloaded) - trained).abs().max().item()
        base_diff = (probe_logits(llama()) - trained).abs().max().item()
        result["base_max_diff"] = base_diff  # the adapter must have changed the model
        result["saved_files"] = sorted(p.name for p in adapter.iterdir())
        from torch.distributed.checkpoint import FileSystemReader

        engine_dir = out_dir / "checkpoint" / "ds_plugin_engine"
        stored = FileSystemReader(str(engine_dir)).read_metadata().state_dict_metadata
        result["checkpoint_model_keys"] = sorted(k for k in stored if k.startswith("model."))
        result["trainable"] = sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad)
        extra = json.loads((engine_dir / "ds_plugin_checkpoint.json").read_text())["extra"]
        result["checkpoint_frozen_excluded"] = len(extra.get("frozen_excluded", []))
    return result


PARTS = {"trainer": part_trainer, "dpo": part_dpo}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--hf-config", required=True, help="a user's HF-style DeepSpeed JSON for the Trainer part")
    parser.add_argument("--parts", default=",".join(PARTS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    result: dict[str, Any] = {}
    for name in args.parts.split(","):
        try:
            result[name] = PARTS[name](args)
        except Exception:
            result[name] = {"error": traceback.format_exc()}
            break  # the other rank may be stuck in a collective: end the launch
    if not dist.is_initialized() or dist.get_rank() == 0:
        tmp = Path(args.out + ".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, args.out)
    if any("error" in r for r in result.values()):
        os._exit(1)  # do not wait in a barrier for a rank that may have failed differently


if __name__ == "__main__":
    main()
