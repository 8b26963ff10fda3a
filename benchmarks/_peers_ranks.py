"""What one rank of a `ds-plugin bench peers` run does: build the model, wrap it in one framework, time its steps.

`rank_run` trains (forward, backward, optimizer step) under one config of NAMES; `floor_rank` times the model's
forward and backward alone, the report's `compute_floor`. Both time their steps with the same loop, `_timed`.
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from benchmarks._deepspeed_peer import engine_step
from benchmarks._peers_scaling import SIZES

__all__ = ["LR", "MICRO_BATCH", "NAMES", "SEQ", "floor_rank", "rank_run"]

NAMES = (
    "ddp",
    "fsdp2",
    "ds_plugin_zero1",
    "ds_plugin_zero2",
    "ds_plugin_zero3",
    "deepspeed_zero1",
    "deepspeed_zero2",
    "deepspeed_zero3",
)
SEQ = 128
MICRO_BATCH = 4
LR = 1e-3


def _model(size: str = "16m") -> torch.nn.Module:
    import warnings

    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    # Dropout off: every framework then computes the same function, so fp32 losses can be compared.
    return GPT2LMHeadModel(GPT2Config(**SIZES[size], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _batch(step: int, rank: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randint(0, vocab, (MICRO_BATCH, SEQ), generator=gen)


def _ddp_step(model: torch.nn.Module, bf16: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    # DDP has no mixed-precision policy: bf16 runs under autocast.
    return _torch_step(ddp, autocast=bf16)


def _fsdp2_step(model: torch.nn.Module, bf16: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None)
    for block in model.transformer.h:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return _torch_step(model, autocast=False)


def _torch_step(model: torch.nn.Module, *, autocast: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext():
            loss = model(x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def _ds_plugin_step(
    model: torch.nn.Module, stage: int, bf16: bool, reuse: bool, engine_keys: dict[str, Any]
) -> Callable[[torch.Tensor], torch.Tensor]:
    import ds_plugin

    config = {
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16},
        "gradient_clipping": 0.0,
        "host_memory_reuse": reuse,
        **engine_keys,
    }
    return engine_step(ds_plugin.initialize(model, config, optimizer=lambda params: torch.optim.AdamW(params, lr=LR)))


def _make_step(
    name: str, dtype: str, model: torch.nn.Module, rank: int, world: int, reuse: bool, engine_keys: dict[str, Any]
):
    bf16 = dtype == "bf16"
    if name == "ddp":
        return _ddp_step(model, bf16)
    if name == "fsdp2":
        return _fsdp2_step(model, bf16)
    if name.startswith("ds_plugin_zero"):
        return _ds_plugin_step(model, int(name[-1]), bf16, reuse, engine_keys)
    if name.startswith("deepspeed_zero"):
        from benchmarks._deepspeed_peer import make_deepspeed_step

        return make_deepspeed_step(
            model, stage=int(name[-1]), bf16=bf16, micro_batch=MICRO_BATCH, lr=LR, rank=rank, world=world
        )
    raise ValueError(f"unknown config {name!r}; one of {', '.join(NAMES)}")


def _timed(step: Callable[[torch.Tensor], Any], n: int, rank: int, vocab: int) -> tuple[list, list, Any]:
    """Run `step` on batches 0..n-1 of this rank; each call's wall and process-CPU seconds, and the last result."""
    times, cpu, out = [], [], None
    for i in range(n):
        x = _batch(i, rank, vocab)
        start, start_cpu = time.perf_counter(), time.process_time()
        out = step(x)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return times, cpu, out


def rank_run(
    rank: int,
    world: int,
    *,
    name: str,
    dtype: str,
    warmup: int,
    steps: int,
    reuse: bool,
    size: str = "16m",
    engine_keys: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`warmup` + `steps` training steps of config `name` (a member of NAMES); per-step times, peak RSS, loss.

    `engine_keys`: ds_plugin config keys of its runs beyond stage, dtype and memory reuse (`chunked_loss`,
    `blocked_logits`); the engine's defaults where absent.
    """
    import torch.distributed as dist

    from ds_plugin.runtime.host_memory import reuse_freed_host_memory, thread_cache_on

    if reuse:  # every framework alike: ds_plugin's engine would turn it on by itself, the others would not
        reuse_freed_host_memory()
    # Ranks share the parent's stdout, which carries the JSON report: send what they print (DeepSpeed's op
    # loader, for one) to stderr.
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    model = _model(size)
    vocab = model.config.vocab_size
    params = sum(p.numel() for p in model.parameters())  # before any wrapper shards or flattens them
    step = _make_step(name, dtype, model, rank, world, reuse, engine_keys or {})
    times, cpu, loss = _timed(step, warmup + steps, rank, vocab)
    final = loss.detach().float().reshape(1).clone()
    dist.all_reduce(final)
    return {
        "times": times[warmup:],
        "cpu_times": cpu[warmup:],
        "final_loss": float(final) / world,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "params": params,
        "threads": torch.get_num_threads(),
        "thread_cache_on": thread_cache_on(),
    }


def floor_rank(
    rank: int,
    world: int,
    *,
    dtype: str,
    warmup: int,
    steps: int,
    size: str,
    engine_keys: dict[str, Any] | None = None,
) -> float:
    """Median seconds of the model's forward and backward alone (no wrapper, no communication, no optimizer), with
    the engine's loss and output layer as `engine_keys` (`rank_run`'s) choose them."""
    from ds_plugin.config import TrainingConfig
    from ds_plugin.kernels.blocked_logits import use_blocked_logits
    from ds_plugin.kernels.cross_entropy import use_chunked_loss
    from ds_plugin.runtime.host_memory import reuse_freed_host_memory

    reuse_freed_host_memory()
    model = _model(size)
    if dtype == "bf16":
        model.to(torch.bfloat16)  # the weights ds_plugin's bf16 runs compute with
    # A key left out is the engine's default, read from the config class itself.
    keys = {**vars(TrainingConfig()), **(engine_keys or {})}
    if keys["chunked_loss"]:
        use_chunked_loss(model)
    if keys["blocked_logits"]:
        use_blocked_logits(model)

    def forward_backward(x: torch.Tensor) -> None:
        model(x, labels=x).loss.backward()
        model.zero_grad(set_to_none=True)

    times, _, _ = _timed(forward_backward, warmup + steps, rank, model.config.vocab_size)
    return statistics.median(times[warmup:])
