"""What `ds-plugin export` needs to know about a model, recorded in a checkpoint's `extra`.

`model_metadata(model)`: the model's class, its tied parameters, its frozen weights stored quantized, and a
transformers config. `export_metadata(module)`: the same for the engine's checkpoints, which may hold a
transformers model inside a framework's module (a LightningModule): its keys are then saved relative to it
(`hf_prefix`), so that the export writes names `from_pretrained` loads.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["export_metadata", "hf_models", "model_metadata", "strip_prefix", "without_hf_config"]

_HF_KEYS = ("hf_prefix", "hf_config", "hf_architecture")


def model_metadata(model: torch.nn.Module) -> dict[str, Any]:
    """What export needs to know about a model: its class, tied parameters, quantized frozen weights, and a
    transformers config.

    Args:
        model: the (possibly fully_shard-ed) model.
    """
    # fully_shard swaps the class for a generated `FSDP<Name>` subclass; report the user's class.
    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    meta: dict[str, Any] = {
        "model_class": f"{cls.__module__}.{cls.__qualname__}",
        "tied_weights": [group for group in names.values() if len(group) > 1],
    }
    from ds_plugin.quant.frozen.quantize import quantized_weights

    # A frozen weight stored quantized is saved as its components; export turns them back into the weight.
    quantized = {
        name: {"format": q.fmt, "group_size": q.group_size, "dtype": str(q.dtype).removeprefix("torch.")}
        for name, q in quantized_weights(model).items()
    }
    if quantized:
        meta["quantized_weights"] = quantized
    config = getattr(model, "config", None)
    if callable(getattr(config, "to_dict", None)):
        meta["hf_config"] = json.loads(json.dumps(config.to_dict(), default=str))
        meta["hf_architecture"] = cls.__name__
    return meta


def hf_models(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, model) of the outermost transformers models inside `module`; empty if transformers is not imported.

    Args:
        module: e.g. a LightningModule holding a `PreTrainedModel` (or a peft model around one), or the model itself
            (name "").
    """
    if "transformers" not in sys.modules:
        return []
    from transformers import PreTrainedModel

    found: list[tuple[str, nn.Module]] = []
    for name, m in module.named_modules():
        if isinstance(m, PreTrainedModel) and not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, m))
    return found


def export_metadata(module: nn.Module) -> dict[str, Any]:
    """`model_metadata` for an engine's checkpoint, with the key names its export will write.

    The module is the one transformers model: its own metadata. One transformers model inside it: that model's
    metadata, keys relative to it (`hf_prefix`). Otherwise (several, none, or peft adapters, whose keys
    `from_pretrained` would not load): the module's metadata without a transformers config.

    Args:
        module: the engine's module (possibly fully_shard-ed).
    """
    models = hf_models(module)
    peft = any(hasattr(m, "peft_config") for m in module.modules())
    if len(models) == 1 and not peft:
        name, hf = models[0]
        if not name:
            return model_metadata(module)
        return {**model_metadata(hf), "hf_prefix": f"{name}."}
    return without_hf_config(model_metadata(module))


def without_hf_config(meta: dict[str, Any]) -> dict[str, Any]:
    """`meta` without what would make the export write a transformers config (its keys are the module's own)."""
    return {k: v for k, v in meta.items() if k not in _HF_KEYS}


def strip_prefix(state: dict[str, Any], prefix: str | None) -> dict[str, Any]:
    """`state` with `prefix` removed from its keys, or `state` itself when there is none or two keys would collide.

    Args:
        state: a model state dict.
        prefix: `hf_prefix` of `export_metadata`, e.g. "model.".
    """
    if not prefix:
        return state
    out = {k.removeprefix(prefix): v for k, v in state.items()}
    return out if len(out) == len(state) else state
