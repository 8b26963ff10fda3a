"""`save_checkpoint` / `load_checkpoint` for a raw `fully_shard` (or plain) model and optimizer: the tests' way to
checkpoint a model that has no `ZeroEngine` (the engine's own save and load are `ds_plugin.checkpoint.engine_state`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ds_plugin.checkpoint import load_checkpoint, model_metadata, save_checkpoint


def save_fsdp(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
    *,
    overwrite: bool = False,
) -> Path:
    """`save_checkpoint` of the model (and optimizer) with `model_metadata` added; `extra`'s keys win over it."""
    if optimizer is not None:
        model_state, optim_state = get_state_dict(model, optimizer)
    else:
        model_state, optim_state = get_model_state_dict(model), None
    meta = {**model_metadata(model), **(extra or {})}
    return save_checkpoint(path, model_state=model_state, optimizer_state=optim_state, extra=meta, overwrite=overwrite)


def load_fsdp(
    path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Load a checkpoint into a model built like the saved one (sharded at any world size, or not); returns `extra`."""
    if optimizer is None:
        model_state = get_model_state_dict(model)
        extra = load_checkpoint(path, model_state=model_state)
        set_model_state_dict(model, model_state)
        return extra
    model_state, optim_state = get_state_dict(model, optimizer)
    extra = load_checkpoint(path, model_state=model_state, optimizer_state=optim_state)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    return extra
