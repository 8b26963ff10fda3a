"""`save_adapter(engine, path)`: write a peft adapter trained under any ZeRO stage, whole, on the first rank.

peft's own ``save_pretrained`` reads ``model.state_dict()``. Under ZeRO-3 that holds each rank's *shard* of every
parameter, and at stages 0-1 it holds the compute copies (bf16 in a bf16 run) rather than the fp32 masters the
optimizer steps — which is how adapters saved under ZeRO-3 come out empty or truncated (trl 4416, peft 2450 and
2892, ``modules_to_save`` written as size-0 tensors). Here the engine's state dict (the fp32 masters, any stage)
is gathered into full tensors for the trainable parameters only, and handed to peft's ``save_pretrained`` as its
``state_dict``, so the files are exactly what peft writes for an unsharded model and ``PeftModel.from_pretrained``
reads them back onto a fresh base (quantized with ``quantize_frozen_`` or not).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

__all__ = ["full_state_dict", "save_adapter", "saved_weights_dtype"]

logger = logging.getLogger(__name__)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@torch.no_grad()
def full_state_dict(
    engine: Any, module: nn.Module | None = None, *, trainable_only: bool = False, dtype: torch.dtype | None = None
) -> dict:
    """Full (unsharded) CPU tensors on rank 0, an empty dict elsewhere; a collective: every rank calls it.

    Trainable weights are the fp32 masters at every stage; a quantized frozen weight appears as its components
    (``<name>.codes``, ...), as in ``engine.model_state_dict()``.

    Args:
        engine: the ``ZeroEngine`` holding the model (``trainer.strategy.engine`` in Lightning).
        module: a submodule of the engine's model; keys are then relative to it (e.g. for ``save_pretrained``).
        trainable_only: only parameters that require grad (an adapter's weights).
        dtype: cast the model's floating-point parameters and buffers to it as each is gathered, so rank 0 never
            holds the fp32 copy of the whole model (at a 7B model 28 GB, against 14 GB in bf16). The components of
            a quantized frozen weight (``.codes``, ``.scales``, ...) keep their dtypes: they are not weights.
    """
    root = engine.module
    prefix = ""
    if module is not None and module is not root:
        names = [name for name, m in root.named_modules() if m is module]
        if not names:
            raise ValueError(f"full_state_dict: the {type(module).__name__} is not part of the trained model")
        prefix = f"{names[0]}."
    trainable = {name for name, p in root.named_parameters() if p.requires_grad}
    # Every name a weight is saved under (a shared module's too: peft's `word_embeddings` is the base's embedding).
    castable = {name for name, _ in root.named_parameters(remove_duplicate=False)}
    castable |= {name for name, _ in root.named_buffers(remove_duplicate=False)}
    rank0 = _rank() == 0
    out: dict[str, torch.Tensor] = {}
    for key, value in engine.model_state_dict().items():
        if not key.startswith(prefix) or (trainable_only and key not in trainable):
            continue
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if rank0:
            cast = dtype if dtype is not None and full.is_floating_point() and key in castable else full.dtype
            out[key[len(prefix) :]] = full.detach().to("cpu", dtype=cast, copy=True)
    return out


def saved_weights_dtype(engine: Any) -> torch.dtype | None:
    """The dtype a whole-model save (the HF Trainer's `save_model`, Accelerate's `get_state_dict`) gives the weights
    in: the compute dtype when the config sets `stage3_gather_16bit_weights_on_model_save` and computes in fp16/bf16
    (DeepSpeed's 16-bit weights), else None: the fp32 master weights as they are.

    Args:
        engine: the ``ZeroEngine`` holding the model.
    """
    from ds_plugin.zero.mesh import torch_dtype

    plan = engine.plan
    return torch_dtype(plan.compute_dtype) if plan.save_16bit_weights and plan.compute_dtype != "fp32" else None


def _is_peft(module: nn.Module) -> bool:
    # peft's outer model; its tuner (`base_model`) and the wrapped transformers model carry `peft_config` too.
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


def _peft_model(engine: Any, module: nn.Module | None) -> nn.Module:
    if module is not None:
        if not _is_peft(module):
            raise TypeError(f"save_adapter: {type(module).__name__} is not a peft model (peft.get_peft_model)")
        return module
    found = [m for m in engine.module.modules() if _is_peft(m)]
    if len(found) != 1:
        what = "no peft model" if not found else f"{len(found)} peft models"
        raise TypeError(
            f"save_adapter: the trained {type(engine.module).__name__} holds {what}; wrap the model with "
            "peft.get_peft_model before setup, or pass module= to choose one"
        )
    return found[0]


def save_adapter(engine: Any, path: str | os.PathLike, *, module: nn.Module | None = None, **save_kwargs: Any) -> Path:
    """Save the peft adapter of the engine's model to ``path``, whole; every rank must call it.

    Args:
        engine: the ``ZeroEngine`` (``initialize``'s result, or ``trainer.strategy.engine`` in Lightning).
        path: the adapter directory (``PeftModel.from_pretrained(base, path)`` reads it).
        module: the peft model inside the engine's model; default the only one there (a LightningModule's
            ``self.model``, or the engine's model itself).
        save_kwargs: passed to peft's ``save_pretrained`` (``selected_adapters``, ``safe_serialization`` ...).

    Raises:
        TypeError: no peft model (or more than one, without ``module``) in the engine's model.
        ValueError: the model has no trainable parameter to save.
    """
    model = _peft_model(engine, module)
    state = full_state_dict(engine, model, trainable_only=True)
    if not state and _rank() == 0:
        raise ValueError("save_adapter: the model has no trainable parameter; nothing would be saved")
    path = Path(path)
    # Prompt learning (P-Tuning, prefix tuning) saves what its prompt encoder computes, not a state dict: under
    # ZeRO-2/3 the encoder's weights are shards until gathered, and the encoder lives in the root's unit.
    prompt_learning = any(getattr(c, "is_prompt_learning", False) for c in model.peft_config.values())
    root = engine.module
    gather = prompt_learning and isinstance(root, FSDPModule)
    if gather:
        root.unshard()
    try:
        if _rank() == 0:
            model.save_pretrained(str(path), state_dict=state, **save_kwargs)
            logger.info("saved adapter (%d tensors) to %s", len(state), path)
    finally:
        if gather:
            root.reshard()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return path
