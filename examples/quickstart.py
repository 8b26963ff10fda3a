"""Quick start: train a tiny GPT-2 on CPU with 2 processes and watch the loss go down.

    torchrun --standalone --nproc-per-node 2 examples/quickstart.py [--config zero3] [--steps 60]

The model is built from a config (nothing is downloaded); the text is examples/data/tiny_corpus.txt,
read as bytes so no tokenizer is needed. Each rank reads its own slice of every batch.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import GPT2Config, GPT2LMHeadModel

import ds_plugin

DATA = Path(__file__).parent / "data" / "tiny_corpus.txt"


def batches(data: torch.Tensor, seq_len: int, batch: int, rank: int, world: int, seed: int):
    """Endless random windows of the corpus; every rank draws the same global batch and keeps its slice."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq_len - 1, (batch * world,), generator=gen)[rank::world]
        yield torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="zero3", help="a preset name (zero0..zero3, zeropp) or a DeepSpeed JSON")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=8)
    args = parser.parse_args()

    # Two processes share two cores: one thread each avoids oversubscription.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    # Byte-level vocabulary: byte 0 never occurs in the text, so it serves as the bos/eos id.
    gpt2 = GPT2Config(
        vocab_size=256, n_positions=args.seq_len, n_embd=128, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0
    )
    model = GPT2LMHeadModel(gpt2)
    config = ds_plugin.load_config(args.config).replace(gradient_clipping=1.0)
    engine = ds_plugin.initialize(model, config, optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr))

    data = torch.frombuffer(bytearray(DATA.read_bytes()), dtype=torch.uint8).long()
    stream = batches(data, args.seq_len, args.micro_batch, rank, world, seed=1)
    # A live bar on a terminal; in a log file the periodic lines below say the same.
    bar = tqdm(range(args.steps), desc=f"ZeRO-{config.stage} x{world}", disable=rank != 0 or not sys.stderr.isatty())
    first = None
    for step in bar:
        tokens = next(stream)
        logits = engine(tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        engine.backward(loss)
        engine.step()
        # Average over ranks only for the printout.
        shown = loss.detach().clone()
        dist.all_reduce(shown, op=dist.ReduceOp.AVG)
        first = shown.item() if first is None else first
        bar.set_postfix(loss=f"{shown.item():.3f}")
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            tqdm.write(f"step {step:4d}  loss {shown.item():.4f}")
    if rank == 0:
        print(
            f"loss {first:.3f} -> {shown.item():.3f} in {args.steps} steps on {world} ranks (ZeRO stage {config.stage})"
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
