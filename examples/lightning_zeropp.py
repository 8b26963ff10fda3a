"""Train a tiny GPT-2 with ZeRO++ through the Lightning Trainer, on CPU with 2 processes.

    python examples/lightning_zeropp.py [--strategy zeropp] [--max-steps 40] [--precision bf16-mixed]

`import ds_plugin` is what makes `Trainer(strategy="zeropp")` work: it registers the names zero0, zero1, zero2,
zero3, zero3_offload and zeropp with Lightning, which has no other way to discover them. Lightning starts the
second process by running this script again, so everything below happens in both processes and the training
sits under `if __name__ == "__main__"`.

The model is built from a config (nothing is downloaded); the text is examples/data/tiny_corpus.txt, read as
bytes so no tokenizer is needed. Checkpoints are sharded directories (one per checkpoint, every rank writes its
shards); `ds-plugin export runs/lightning_zeropp/checkpoints/last.ckpt tiny-gpt2` turns one into a folder that
`GPT2LMHeadModel.from_pretrained("tiny-gpt2")` loads.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel

import ds_plugin  # noqa: F401  (first: registers the ZeRO strategy names with Lightning)

DATA = Path(__file__).parent / "data" / "tiny_corpus.txt"


class ByteWindows(Dataset):
    """Fixed windows of the corpus bytes; the distributed sampler Lightning adds gives each rank its share."""

    def __init__(self, seq_len: int, count: int, seed: int = 1) -> None:
        self.data = torch.frombuffer(bytearray(DATA.read_bytes()), dtype=torch.uint8).long()
        gen = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(self.data) - seq_len - 1, (count,), generator=gen).tolist()
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[self.starts[i] : self.starts[i] + self.seq_len]


class TinyGPT(pl.LightningModule):
    """A byte-level GPT-2; ZeroStrategy shards it (each GPT2Block is its own ZeRO unit) before training."""

    def __init__(self, seq_len: int, lr: float) -> None:
        super().__init__()
        self.save_hyperparameters()  # plain numbers only: a resumed checkpoint loads them with weights_only
        config = GPT2Config(vocab_size=256, n_positions=seq_len, n_embd=128, n_layer=4, n_head=4)
        self.model = GPT2LMHeadModel(config)

    def training_step(self, tokens: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        # Runs on the sharded parameters; the strategy's ZeRO engine steps this optimizer.
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 10))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="zeropp", help="zero0, zero1, zero2, zero3, zero3_offload or zeropp")
    parser.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, bf16-true, 16-mixed or 16-true")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    # Two processes share two cores: one thread each avoids oversubscription.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    pl.seed_everything(0)  # the same initial weights on both ranks (the strategy also broadcasts rank 0's)

    trainer = pl.Trainer(
        strategy=args.strategy,  # the registered name; ZeroStrategy("ds_config.json") takes a DeepSpeed config
        accelerator="cpu",
        devices=2,
        precision=args.precision,  # fills the config's fp16/bf16 block
        max_steps=args.max_steps,
        accumulate_grad_batches=2,  # fills gradient_accumulation_steps
        gradient_clip_val=1.0,  # fills gradient_clipping; the engine clips by the global norm
        default_root_dir="runs/lightning_zeropp",
        callbacks=[
            ModelCheckpoint(dirpath="runs/lightning_zeropp/checkpoints", save_last=True, every_n_train_steps=20)
        ],
        logger=False,
        log_every_n_steps=5,
    )
    model = TinyGPT(args.seq_len, args.lr)
    loader = DataLoader(ByteWindows(args.seq_len, count=4096), batch_size=8)
    # ckpt_path="last" resumes from runs/lightning_zeropp/checkpoints/last.ckpt when an earlier run left one.
    trainer.fit(model, loader, ckpt_path="last")

    zero = trainer.strategy.config.zero_optimization  # the DeepSpeed config, resolved against this Trainer
    loss = trainer.callback_metrics.get("loss")
    if trainer.is_global_zero and loss is not None:
        print(
            f"ZeRO stage {zero.stage} (hpZ group {zero.zero_hpz_partition_size}, qwZ {zero.zero_quantized_weights}, "
            f"qgZ {zero.zero_quantized_gradients}): loss {loss.item():.3f} after {trainer.global_step} steps; "
            "checkpoints in runs/lightning_zeropp/checkpoints"
        )


if __name__ == "__main__":
    main()
