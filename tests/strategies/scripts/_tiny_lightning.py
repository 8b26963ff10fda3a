"""Shared pieces of the Lightning test scripts: tiny models built offline, data, a loss recorder, the result file.

Every script runs as `python script.py --out RESULT.json --workdir DIR [...]`; Lightning's launcher re-runs it
for the second rank. `run(main)` calls `main(args) -> dict` and rank 0 writes the dict (or the traceback) to
`--out` before the final barrier and `destroy_process_group()`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import ds_plugin  # noqa: F401  (registers zero0..zero3, zero3_offload, zeropp with the Trainer and Fabric)

VOCAB, SEQ = 128, 16


def hf_model(kind: str, seed: int = 0) -> torch.nn.Module:
    """A tiny GPT-2 or Llama from a config (no download), dropout off so runs are deterministic."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        return GPT2LMHeadModel(cfg)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)  # fmt: skip
    return LlamaForCausalLM(cfg)


def token_loader(n: int = 16, batch: int = 2, seed: int = 1) -> DataLoader:
    gen = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randint(0, VOCAB, (n, SEQ), generator=gen)), batch_size=batch)


def regression_loader(n: int = 32, batch: int = 4, seed: int = 1) -> DataLoader:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=gen)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=batch)


CYCLE = 16  # tokens `cycle_loader` uses, of the VOCAB


def cycle_loader(n: int = 16, batch: int = 2) -> DataLoader:
    """Token rows a tiny LM learns in a few steps: each walks one fixed cycle through 16 of the 128 tokens from its
    own start, so every token has one successor and every batch has the same statistics (the loss falls smoothly
    from batch to batch). An untrained model scores about ln(128) = 4.85 on it; learning just which 16 tokens occur
    is worth ln(128 / 16) = 2.1 nats."""
    cycle = torch.randperm(CYCLE, generator=torch.Generator().manual_seed(7))
    starts = torch.arange(n)[:, None] * 5  # 5 is prime to 16: 16 rows in a row start at 16 different places
    return DataLoader(TensorDataset(cycle[(starts + torch.arange(SEQ)) % CYCLE]), batch_size=batch)


def fit_loader(n: int = 16, batch: int = 4) -> DataLoader:
    """A small regression set TinyMLP fits in a few steps: y = x @ w / 4 for one fixed w (unit variance).

    16 rows: on two ranks, two batches of 4 each per epoch, so each optimizer step at `accumulate_grad_batches=2`
    covers the whole set (in whatever order a sampler deals it) and the mean of its recorded losses (means over the
    ranks) is the loss on the set, which a run that never steps repeats exactly.
    """
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(1))
    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(2))
    return DataLoader(TensorDataset(x, x @ w / 4), batch_size=batch)


class CausalLM(pl.LightningModule):
    """A transformers causal LM inside a LightningModule, AdamW with a long warm-up LambdaLR stepping per step
    (so a resumed run depends on the restored scheduler state)."""

    def __init__(self, model: torch.nn.Module, lr: float = 1e-3) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.model(input_ids=batch[0], labels=batch[0]).loss, sync_dist=True)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 8))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class TinyMLP(pl.LightningModule):
    """Three repeated blocks and a head; `training_step` calls `self(x)` (a nested root forward)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(width, width) for _ in range(3)])
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        # y.float(): under bf16 the Trainer casts the whole batch, targets too, and torch < 2.13's mse_loss backward
        # refuses an fp32 input with a bf16 target ("Found dtype BFloat16 but expected Float").
        return torch.nn.functional.mse_loss(self(x).float(), y.float())

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-2)


class LossRecorder(pl.Callback):
    """The mean over ranks of every micro-batch's loss (through the strategy's own reduce)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    @property
    def batches(self) -> int:
        return len(self.losses)

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        loss = outputs["loss"].detach().float()
        self.losses.append(trainer.strategy.reduce(loss, reduce_op="mean").item())


def trainer(strategy: Any, **kwargs: Any) -> pl.Trainer:
    """A quiet two-rank CPU Trainer."""
    defaults = dict(accelerator="cpu", devices=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, num_sanity_val_steps=0)  # fmt: skip
    return pl.Trainer(strategy=strategy, **{**defaults, **kwargs})


def full_weights(t: pl.Trainer, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full fp32 weights on rank 0 for any strategy (ZeRO: gathered; DDP: the module's own)."""
    if hasattr(t.strategy, "full_state_dict"):
        return t.strategy.full_state_dict(module)
    return {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:4]
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _install_test_switches() -> None:
    """tests/_break.py's switches (DS_PLUGIN_TEST_NOOP_STEP), in this process and the ranks Lightning re-runs it as."""
    tests = str(Path(__file__).resolve().parents[2])
    if tests not in sys.path:
        sys.path.append(tests)  # last: nothing the scripts import is shadowed by tests/'s folders
    import _break

    _break.install()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("LOCAL_RANK", 0))


def run(
    main: Callable[[argparse.Namespace], dict[str, Any]], extra: Callable[[argparse.ArgumentParser], None] | None = None
):
    """Parse the common arguments, run `main`, write rank 0's result, then barrier + destroy_process_group."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workdir", type=Path, required=True)
    if extra is not None:
        extra(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    _install_test_switches()
    try:
        result = main(args)
    except BaseException:
        result = {"error": traceback.format_exc()}
    if rank() == 0:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=str))
        os.replace(tmp, args.out)
    if dist.is_initialized():
        if "error" not in result:
            dist.barrier()
        dist.destroy_process_group()
