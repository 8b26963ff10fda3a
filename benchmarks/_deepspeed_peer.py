"""DeepSpeed's own ZeRO on CPU, as a peer for `ds-plugin bench peers` (imported only inside DeepSpeed runs).

DeepSpeed 0.19 runs ZeRO 1/2/3 on CPU with `DS_ACCELERATOR=cpu` over the gloo group the launcher already
initialised. Its first run compiles a small shared-memory op (tens of seconds) into `TORCH_EXTENSIONS_DIR`;
`extension_cache_dir()` is a persistent place for it so later runs load it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["deepspeed_env", "deepspeed_version", "extension_cache_dir", "make_deepspeed_step"]


def extension_cache_dir() -> str:
    """Where DeepSpeed's compiled CPU op is kept between runs (`TORCH_EXTENSIONS_DIR`)."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "ds_plugin_torch_ext")


def deepspeed_env() -> dict[str, str]:
    """Environment every DeepSpeed rank needs on a CPU-only machine."""
    return {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": extension_cache_dir()}


def deepspeed_version() -> tuple[str | None, str | None]:
    """(version, None) when DeepSpeed is installed, else (None, why not) — without importing it."""
    if importlib.util.find_spec("deepspeed") is None:
        return None, "deepspeed is not importable (pip install -c constraints.txt deepspeed==0.19.8)"
    try:
        return importlib.metadata.version("deepspeed"), None
    except importlib.metadata.PackageNotFoundError:
        return "unknown", None


def make_deepspeed_step(
    model: nn.Module, *, stage: int, bf16: bool, micro_batch: int, lr: float, rank: int, world: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Wrap `model` in a DeepSpeed ZeRO engine with AdamW; return `step(x) -> loss` (forward, backward, step).

    Args:
        model: the fp32 model, identical on every rank.
        stage: ZeRO stage 1, 2 or 3.
        bf16: DeepSpeed's bf16 mode (bf16 weights and gradients, fp32 masters) instead of fp32.
        micro_batch: samples per rank per step.
        lr: AdamW learning rate.
        rank: this process's rank (DeepSpeed reads LOCAL_RANK and friends from the environment).
        world: number of ranks.
    """
    os.environ.update(
        {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
    )
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # adopts the already initialised process group
    # torch.optim.AdamW as a client optimizer, the same one every other run steps.
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine_step(engine)


def engine_step(engine: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """`step(x) -> loss` for an engine with DeepSpeed's API (`engine(...)`, `.backward(loss)`, `.step()`): ours
    and DeepSpeed's train through the same three calls, so the peers benchmark times them alike.

    Args:
        engine: a DeepSpeed engine or a ds_plugin `ZeroEngine` around a causal LM.
    """

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = engine(x, labels=x).loss
        engine.backward(loss)
        engine.step()
        return loss

    return step
