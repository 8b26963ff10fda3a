"""A plain Accelerate training script (it never imports ds_plugin): a tiny GPT-2 learning a byte corpus.

Plain Accelerate (DDP):
    ACCELERATE_USE_CPU=true accelerate launch --config_file examples/with_accelerate/cpu_2proc.yaml \
        examples/with_accelerate/train.py
The same script on ds_plugin's ZeRO engine:
    accelerate launch --config_file examples/with_accelerate/cpu_2proc.yaml -m ds_plugin.accelerate \
        --ds-config examples/with_accelerate/zero3.json examples/with_accelerate/train.py

Written like Accelerate's own examples: `accelerator.prepare`, `accumulate`, `backward`, `clip_grad_norm_`,
`gather_for_metrics`, `save_state`/`load_state` with `skip_first_batches`, and `save_pretrained` with
`accelerator.get_state_dict`. The model is built from a config (nothing is downloaded); the text is
examples/data/tiny_corpus.txt read as bytes, so no tokenizer is needed. `--out` writes the losses as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

DATA = Path(__file__).resolve().parents[1] / "data" / "tiny_corpus.txt"


def linear_warmup_then_decay(optimizer: torch.optim.Optimizer, warmup: int, total: int) -> Any:
    """transformers' `get_linear_schedule_with_warmup`, the same factors. Importing `transformers.optimization` would
    import peft and bitsandbytes, which on some CPUs looks a kernel up on the Hugging Face Hub; examples stay offline.
    """

    def factor(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class ByteWindows(Dataset):
    """Fixed windows of the corpus as byte ids; `labels` are the inputs (the model shifts them)."""

    def __init__(self, data: torch.Tensor, seq_len: int, count: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(data) - seq_len, (count,), generator=gen).tolist()
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.data[self.starts[i] : self.starts[i] + self.seq_len]
        return {"input_ids": ids, "labels": ids}


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """A small GPT-2 (Conv1D layers) or Llama (nn.Linear layers), dropout off, from a config."""
    if args.model == "llama":
        config = LlamaConfig(vocab_size=256, hidden_size=args.width, intermediate_size=2 * args.width,
                             num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=args.seq_len, bos_token_id=0, eos_token_id=0)  # fmt: skip
        return LlamaForCausalLM(config)
    config = GPT2Config(vocab_size=256, n_positions=args.seq_len, n_embd=args.width, n_layer=args.layers, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return GPT2LMHeadModel(config)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixed-precision", default=None, choices=["no", "fp16", "bf16", "fp8"])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=4, help="per process")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--model", default="gpt2", choices=["gpt2", "llama"], help="llama: nn.Linear layers (fp8)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--save-state-at", type=int, default=0, help="save_state after this many optimizer steps")
    parser.add_argument("--resume-from", default=None, help="a save_state folder to resume from")
    parser.add_argument("--resume-step", type=int, default=0, help="optimizer steps done in the resumed folder")
    parser.add_argument("--output-dir", default=None, help="save_pretrained here at the end")
    parser.add_argument("--out", default=None, help="write the losses (and more) as JSON here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(mixed_precision=args.mixed_precision, gradient_accumulation_steps=args.grad_accum)
    set_seed(0)
    model = build_model(args)
    data = torch.frombuffer(bytearray(DATA.read_bytes()), dtype=torch.uint8).long()
    samples = args.steps * args.grad_accum * args.batch_size * accelerator.num_processes
    train_dl = DataLoader(ByteWindows(data, args.seq_len, samples, seed=1), batch_size=args.batch_size)
    eval_dl = DataLoader(ByteWindows(data, args.seq_len, 10, seed=2), batch_size=args.batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = linear_warmup_then_decay(optimizer, warmup=2, total=args.steps)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, eval_dl, scheduler)

    step = 0
    active_dl = train_dl
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        step = args.resume_step
        active_dl = accelerator.skip_first_batches(train_dl, step * args.grad_accum)

    losses, norms, step_times = [], [], []
    model.train()
    start = time.perf_counter()
    for batch in active_dl:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients and args.max_grad_norm > 0:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm).item())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
        if accelerator.sync_gradients:
            step += 1
            step_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            if step == args.save_state_at:
                accelerator.save_state(os.path.join(args.output_dir or ".", "state"))

    model.eval()
    eval_losses = []
    for batch in eval_dl:
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"]).logits
        per_sample = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(), reduction="none"
        ).view(len(logits), -1).mean(1)  # fmt: skip
        eval_losses.append(accelerator.gather_for_metrics(per_sample))
    eval_loss = torch.cat(eval_losses)

    if args.output_dir:
        accelerator.wait_for_everyone()
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(
            os.path.join(args.output_dir, "model"),
            is_main_process=accelerator.is_main_process,
            save_function=accelerator.save,
            state_dict=accelerator.get_state_dict(model),
        )
        accelerator.save_model(model, os.path.join(args.output_dir, "save_model"))
    # Peak resident memory of every process (Linux reports KiB).
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    peak_rss_mib = accelerator.gather(rss).tolist()
    if accelerator.is_main_process and args.out:
        result = {
            "losses": losses,
            "grad_norms": norms,
            "eval_count": len(eval_loss),
            "eval_loss": eval_loss.mean().item(),
            "step_time_s": sorted(step_times)[len(step_times) // 2] if step_times else math.nan,
            "peak_rss_mib": peak_rss_mib,
            "accelerator": type(accelerator).__module__,
            "distributed_type": str(accelerator.distributed_type),
            "num_processes": accelerator.num_processes,
            "mixed_precision": accelerator.mixed_precision,
        }
        Path(args.out).write_text(json.dumps(result))
    accelerator.end_training()


if __name__ == "__main__":
    main()
