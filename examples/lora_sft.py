"""LoRA SFT on an INT4 frozen base with ZeRO++, through the Lightning Trainer: a tiny Llama learns to add.

    python examples/lora_sft.py [--steps 600] [--frozen-format int4|nf4|int8] [--model PATH] [--smoke]
        [--data train.jsonl [--eval-data test.jsonl | --eval-fraction 0.1]]

The data is examples/data/arithmetic.jsonl: sums of two digits asked in many wordings ("What is 3 plus 4? ",
"Solve the sum of 3 and 4: ", ...). The held-out rows are twenty operand pairs training never asks (it asks their
commuted twins: "4 plus 3" trained, "3 plus 4" held out), each in eight wordings training never shows either, so
held-out exact match (greedy answer == the reference) and answer loss measure more than rows recalled.
`--data PATH` trains on your own JSON Lines instead: {"prompt", "response"}, Alpaca's {"instruction", "input",
"output"} or chat {"messages": [...]} rows (examples/_recipe_data.py). The base model is built from a config
(nothing is downloaded) and stays frozen, its Linear weights stored as INT4 codes by the strategy
(`frozen_format`) and sharded by ZeRO-3; LoRA adapters on every projection are the only trained weights. Text is
read as bytes, so no tokenizer is needed; `--model PATH` loads a local checkpoint (a causal LM with Llama's
projections) and its tokenizer instead. At the end the adapter is saved with `ds_plugin.save_adapter`: a peft
folder that `PeftModel.from_pretrained` loads onto a base stored the same way (`ds_plugin.quantize_frozen_`), as
the recipe then does itself: the reloaded model's logits on held-out rows must match the engine's (`reload_check`).
Lightning starts the second process by running this script again. On 8 GPUs:
`python examples/lora_sft.py --devices 8 --precision bf16-mixed`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from functools import partial
from pathlib import Path

import _offline  # noqa: F401  (first: keeps the libraries off the Hugging Face Hub)
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from _recipe_common import (
    LORA_TARGETS,
    add_lora_sft_args,
    check_model,
    greedy,
    load_tokenizer,
    lora_sft_model,
    lora_tolerance,
    pad,
    plot_sft,
    reload_check,
    reload_lora,
    save_engine_logits,
    warmup_cosine,
)
from _recipe_data import DATA as DATA_DIR
from _recipe_data import (
    SFT,
    SftExamples,
    add_data_args,
    answer_loss_sums,
    answer_tokens,
    encode,
    load_rows,
    prompt_text,
    same_answer,
    sft_batch,
)
from lightning.pytorch.callbacks import TQDMProgressBar
from torch.utils.data import DataLoader

import ds_plugin
from ds_plugin.strategies import ZeroStrategy

# peft and transformers disagree on deprecated names (is_gradient_checkpointing, past_key_values): not ours.
warnings.filterwarnings("ignore", category=FutureWarning)


def collate(batch: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Right-padded ids, attention mask and labels."""
    return *pad([ids for ids, _ in batch], pad_id), pad([labels for _, labels in batch], -100)[0]


class LoRASFT(pl.LightningModule):
    def __init__(self, lora_rank: int, lr: float, steps: int, held_out: list[dict], tok, model_path: str | None,
                 frozen_format: str) -> None:  # fmt: skip
        super().__init__()
        self.model = None if model_path else lora_sft_model(lora_rank)  # --model: built in configure_model
        self.lora_rank, self.model_path, self.frozen_format = lora_rank, model_path, frozen_format
        self.lr, self.steps, self.held_out, self.tok = lr, steps, held_out, tok
        self.prompts = [ids[:start] for ids, _, start in (encode(tok, r) for r in held_out)]  # what is answered
        self.new_tokens = answer_tokens(tok, held_out)
        self.losses: list[torch.Tensor] = []
        self.history: list[tuple[int, float]] = []  # (step, held-out exact match)
        self.eval_losses: list[tuple[int, float]] = []  # (step, held-out answer loss)
        self.predictions: dict[int, str] = {}

    def configure_model(self) -> None:
        # --model streams: the empty model is built here; the strategy then allocates each rank's shards and reads
        # only their rows from the checkpoint, quantizing the frozen weights as they come (never a whole copy).
        if self.model is None:
            self.model = lora_sft_model(self.lora_rank, self.model_path, self.frozen_format)

    def forward(self, **batch: torch.Tensor):
        return self.model(**batch)  # through the strategy's root module, which gathers the root's weights

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        ids, mask, labels = batch
        loss = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        self.losses.append(loss.detach())  # averaged over ranks once, at the end
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, indices: list[int], batch_idx: int) -> None:
        # Runs inside the strategy's root forward, so ZeRO-3 has gathered the root's weights for us.
        prompts = [self.prompts[i] for i in indices]
        answers = greedy(self.model, self.tok, prompts, self.model.device, self.new_tokens)
        self._mine.update(zip(indices, answers, strict=True))
        ids, mask, labels = sft_batch(self.tok, [self.held_out[i] for i in indices], self.model.device)
        self._loss += answer_loss_sums(self.model(input_ids=ids, attention_mask=mask).logits, labels)

    def on_validation_epoch_start(self) -> None:
        self._mine: dict[int, str] = {}
        self._loss = torch.zeros(2, device=self.device)  # summed answer loss and token count, this rank's rows

    def on_validation_epoch_end(self) -> None:
        # Every rank answered its share of the held-out rows (the sampler pads the last shares with repeats: the
        # dict keeps one answer per row).
        shares = [None] * dist.get_world_size() if dist.is_initialized() else [self._mine]
        if dist.is_initialized():
            dist.all_gather_object(shares, self._mine)
        self.predictions = {i: a for share in shares for i, a in share.items()}
        correct = sum(same_answer(a, self.held_out[i]["response"]) for i, a in self.predictions.items())
        self.history.append((self.global_step, correct / len(self.predictions)))
        if dist.is_initialized():  # the sampler's repeats count twice here: a few rows in a hundred, at most
            dist.all_reduce(self._loss)
        self.eval_losses.append((self.global_step, (self._loss[0] / self._loss[1]).item()))

    def configure_optimizers(self):
        # Weight decay 0.1: measured single-process, held-out exact match 0.86 after 600 steps, 0.79 without.
        opt = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(self.steps))  # stepped once per step
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_lora_sft_args(parser)
    parser.add_argument("--strategy", default="zeropp", help="a preset (zero2, zero3, zeropp) or a DeepSpeed JSON")
    parser.add_argument("--precision", default="32-true", help="32-true on CPU; bf16-mixed on GPUs")
    parser.add_argument("--devices", default=None, help="default: 2 processes on CPU, every GPU otherwise")
    parser.add_argument("--model", help="a local causal-LM checkpoint and its tokenizer (default: a tiny random Llama)")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/lora_sft"))
    add_data_args(parser, "{prompt, response}, {instruction, input, output} or {messages} rows")
    parser.add_argument("--smoke", action="store_true", help="a short run: 120 steps, one evaluation")
    args = parser.parse_args()
    params = check_model(args.model, lora_targets=LORA_TARGETS)  # a wrong --model: one line, before anything loads
    # A bad data file: one line, before anything loads (Lightning re-runs this script in its second process).
    train_rows, held_out = load_rows(args.data, args.eval_data, args.eval_fraction, SFT, DATA_DIR / "arithmetic.jsonl",
                                     ascii_only=not args.model)  # fmt: skip
    if args.smoke:
        args.steps, args.evals = 120, 1
    base = f"{args.model}, {params:,} parameters" if args.model else "a tiny random Llama"
    tok = load_tokenizer(args.model)  # bytes by default
    start = time.perf_counter()
    # Two processes share two cores: one thread each avoids oversubscription.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    pl.seed_everything(args.seed, verbose=False)

    gpu = torch.cuda.is_available()
    world = int(args.devices) if args.devices else (torch.cuda.device_count() if gpu else 2)
    train = SftExamples(train_rows, args.steps * args.micro_batch * world, tok, seed=args.seed)
    trainer = pl.Trainer(
        # The zeropp preset (ZeRO-3 + qwZ/hpZ/qgZ) with the frozen Linear weights stored in 4 bits.
        strategy=ZeroStrategy(args.strategy, zero_optimization={"frozen_format": args.frozen_format}),
        accelerator="gpu" if gpu else "cpu",
        devices=world,
        precision=args.precision,
        max_steps=args.steps,
        # --evals 0: no held-out evaluation at all, not even the one before training.
        val_check_interval=max(1, args.steps // max(1, args.evals)),
        limit_val_batches=1.0 if args.evals else 0,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=-1 if args.evals else 0,  # the whole held-out set before training: the "before" number
        gradient_clip_val=1.0,
        default_root_dir=args.out_dir,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[TQDMProgressBar(refresh_rate=10)],
    )
    module = LoRASFT(args.lora_rank, args.lr, args.steps, held_out, tok, args.model, args.frozen_format)
    train_loader = DataLoader(train, batch_size=args.micro_batch, collate_fn=partial(collate, pad_id=tok.pad_token_id))
    # Each validation batch is a list of held-out indices; validation_step builds its own prompts from them.
    val_loader = DataLoader(range(len(held_out)), batch_size=25, collate_fn=list)
    trainer.fit(module, train_loader, val_loader)

    engine = trainer.strategy.engine
    losses = torch.stack(module.losses)
    if dist.is_initialized():
        dist.all_reduce(losses, op=dist.ReduceOp.AVG)
    # Collective: every rank calls it, rank 0 gets the whole adapter and writes the files.
    path = ds_plugin.save_adapter(engine, args.out_dir / "adapter")
    # The reload check: the adapter as saved, on a fresh base stored the same way (INT4), must give the engine's own
    # logits on held-out rows, computed with qwZ off (its INT8 rounding of the gathered weights is a communication
    # approximation the saved file does not hold): within 1e-5 in fp32 on a CPU, wider in bf16 (`lora_tolerance`).
    ids, mask, _ = sft_batch(tok, held_out[:4], trainer.strategy.root_device)
    with torch.no_grad(), engine.exact_weight_gathers():
        logits = engine.eval()(input_ids=ids, attention_mask=mask).logits
    tolerance, why = lora_tolerance(args.precision != "32-true", gpu)
    if trainer.is_global_zero:
        save_engine_logits(path, ids, mask, logits, tolerance, why)
    reload_diff = reload_check(lambda: reload_lora(path, args.model, args.frozen_format), path)
    if trainer.is_global_zero:
        seconds = time.perf_counter() - start
        stage = trainer.strategy.config.stage
        print(
            f"\nZeRO stage {stage}, {args.frozen_format} frozen base ({base}); LoRA r={args.lora_rank}, {world} ranks"
        )
        print(f"answer loss {losses[:10].mean():.3f} -> {losses[-10:].mean():.3f} in {args.steps} steps")
        summary = {"recipe": "lora_sft", "metric": "heldout_exact_match", "before": None, "after": None}
        answers = []
        if module.history:  # none with --evals 0
            (_, before), (_, after) = module.history[0], module.history[-1]
            (_, loss0), (_, loss1) = module.eval_losses[0], module.eval_losses[-1]
            answers = [module.predictions[i] for i in range(len(held_out))]  # the last evaluation
            print(f"held-out exact match {before:.2f} -> {after:.2f}, answer loss {loss0:.3f} -> {loss1:.3f} "
                  f"({len(held_out)} rows); e.g.")  # fmt: skip
            for r, a in list(zip(held_out, answers, strict=True))[:4]:
                print(f"  {prompt_text(r)!r} -> {a!r} (want {r['response']!r})")
            summary.update(before=before, after=after, heldout_answer_loss=[loss0, loss1])
            plot_sft(
                losses.tolist(),
                module.history,
                args.out_dir / "lora_sft.png",
                "answer loss (mean over ranks)",
                "LoRA SFT, INT4 base, ZeRO++",
            )
        print(f"adapter saved to {path}; on a fresh base, logits within {reload_diff:.2g} of the engine's")
        summary["seconds"] = round(seconds, 1)
        details = {"history": module.history, "eval_losses": module.eval_losses, "answers": answers,
                   "reload_max_diff": reload_diff}  # fmt: skip
        (args.out_dir / "summary.json").write_text(json.dumps({**summary, **details}))
        print(json.dumps(summary))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
