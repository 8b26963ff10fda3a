"""`quantize_frozen_(model, fmt)`: store the frozen Linear weights of a model (LoRA's base) as INT8, INT4, NF4 or FP6.

The technique half of the frozen-weight storage (the format half is :class:`QuantizedWeight`). It picks the
frozen ``nn.Linear`` layers — peft's ``base_layer``s in particular — and swaps each weight for a
:class:`QuantizedWeight`; trainable parameters, biases and every other module are left alone. The output head
(``lm_head``, the model's output embeddings, or a Linear tied to an embedding) stays in high precision by default,
as bitsandbytes does: its error lands straight on the logits. So do the modules peft adds (adapters,
``modules_to_save`` copies, prompt encoders), even when an adapter loaded for inference is frozen.

Everything is checked before anything is converted, so an error leaves the model as it was.

The helpers below turn quantized weights into plain tensors for checkpoints (``quantized_parts_state``) and back
(``load_quantized_parts``): a checkpoint holds each component (codes, scales) under ``<weight name>.<part>``,
sharded by rows like the weight, so it reloads at any world size, bit for bit.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ds_plugin.quant.frozen.codecs import DEFAULT_GROUP_SIZE, FORMATS, check_weight
from ds_plugin.quant.frozen.tensor import FrozenStorageStats, QuantizedWeight

__all__ = [
    "FROZEN_FORMATS",
    "check_shardable",
    "default_group_size",
    "frozen_storage_stats",
    "is_output_head",
    "load_quantized_parts",
    "peft_adapter_modules",
    "quantize_frozen_",
    "quantized_parts_state",
    "quantized_weights",
]

logger = logging.getLogger(__name__)

FROZEN_FORMATS = FORMATS

FilterFn = Callable[[nn.Module, str], bool]

_STATS_ATTR = "_ds_plugin_frozen_stats"


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"frozen format {fmt!r} is not one of {', '.join(FORMATS)}")


def _tied_to_embedding(model: nn.Module) -> set[int]:
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}


def is_output_head(model: nn.Module, name: str, module: nn.Module) -> bool:
    """Whether a Linear is the model's output head (kept in high precision by default): a causal LM's ``lm_head``
    (or whatever ``get_output_embeddings`` gives), or ``score``, transformers' head of a decoder's
    sequence-classification model (a reward model: one row per label, too few to shard over ranks anyway;
    transformers' bitsandbytes integration keeps it unquantized too). Inside peft's wrappers as well.

    Args:
        model: the whole model.
        name: the Linear's qualified name in ``model``.
        module: the Linear.
    """
    if {"lm_head", "score"} & set(name.split(".")):
        return True
    get_out = getattr(model, "get_output_embeddings", None)
    if callable(get_out):
        try:
            head = get_out()
        except (AttributeError, NotImplementedError):
            head = None
        if head is module or (head is not None and getattr(head, "weight", None) is module.weight):
            return True
    return id(module.weight) in _tied_to_embedding(model)


def peft_adapter_modules(model: nn.Module) -> set[int]:
    """ids of the modules peft added to ``model``: adapters (``lora_A`` ...), ``modules_to_save`` copies, prompt
    encoders. An adapter loaded for inference is frozen too, yet it is not the base: it must stay as trained.

    Args:
        model: any module (a model without peft layers gives an empty set; peft is not imported for it).
    """
    if "peft" not in sys.modules:
        return set()
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    ids: set[int] = set()
    for m in model.modules():
        if isinstance(m, BaseTunerLayer):
            base = {id(x) for x in m.get_base_layer().modules()}
            ids |= {id(x) for x in m.modules() if id(x) not in base and x is not m}
        elif isinstance(m, ModulesToSaveWrapper):
            ids |= {id(x) for x in m.modules_to_save.modules()}
    prompt = getattr(model, "prompt_encoder", None)
    if isinstance(prompt, nn.Module):
        ids |= {id(x) for x in prompt.modules()}
    return ids


def _default_filter(model: nn.Module) -> FilterFn:
    tied = _tied_to_embedding(model)
    adapters = peft_adapter_modules(model)

    def keep(module: nn.Module, name: str) -> bool:
        w = module.weight
        if w.requires_grad or id(w) in tied or id(module) in adapters:
            return False
        return not is_output_head(model, name, module)

    return keep


def default_group_size(fmt: str, cols: int) -> int:
    """The group size ``quantize_frozen_`` uses for a weight with ``cols`` input columns when none is given.

    The format's default (``DEFAULT_GROUP_SIZE``) where it divides the width; otherwise the largest common
    divisor of the two (a finer grouping: a little more scale overhead, never a worse fit), e.g. 32 for a
    96-wide weight and a default of 64.

    Args:
        fmt: "int8", "int4", "nf4" or "fp6".
        cols: the weight's K.
    """
    default = DEFAULT_GROUP_SIZE[fmt]
    return default if cols % default == 0 else math.gcd(cols, default)


def quantized_weights(model: nn.Module) -> dict[str, QuantizedWeight]:
    """Name -> quantized weight, for every :class:`QuantizedWeight` parameter in ``model`` (sharded or not).

    Args:
        model: any module.
    """
    out = {}
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if isinstance(local, QuantizedWeight):
            out[name] = local
    return out


def frozen_storage_stats(model: nn.Module) -> FrozenStorageStats | None:
    """The counters (ZeRO-3 gathers, gathered bytes) of a model ``quantize_frozen_`` went over, else None.

    Args:
        model: the model passed to ``quantize_frozen_``.
    """
    return model.__dict__.get(_STATS_ATTR)


@torch.no_grad()
def quantize_frozen_(
    model: nn.Module,
    fmt: str,
    *,
    group_size: int | None = None,
    filter_fn: FilterFn | None = None,
    method: str = "default",
    process_group: Any = None,
) -> nn.Module:
    """Store the weights of ``model``'s frozen ``nn.Linear`` layers in ``fmt``, in place; returns the model.

    Call it after freezing (``requires_grad_(False)``, or peft's ``get_peft_model``), before ``initialize`` /
    ``apply_zero`` (which call it for you when the config names ``zero_optimization.frozen_format``).

    Args:
        model: the model; its Linear weights must be materialised (not on the meta device).
        fmt: "int8" (blockwise absmax), "int4" (group-wise, searched scales), "nf4" (QLoRA's codebook,
            double-quantized scales) or "fp6" (e3m2 codes, bf16 absmax scale per group of 128).
        group_size: elements per scale along a row; default per format and width (``default_group_size``).
        filter_fn: ``(module, name) -> bool`` choosing which ``nn.Linear`` layers to convert, replacing the
            default (frozen, not the output head, not a module peft added).
        method: the format's quantization method ("absmax" for plain INT4 scales; see ``quantize_weight``).
        process_group: ranks that hold the same model (``apply_zero`` passes its mesh's): each quantizes a share
            of every weight's rows and they exchange the codes, so the conversion costs 1/world per rank.

    Raises:
        ValueError: an unknown format, a chosen weight that is trainable, on the meta device, or whose width the
            group size does not divide (fp6 also needs a group that is a multiple of 16); nothing is converted then.
    """
    _check_format(fmt)
    choose = filter_fn or _default_filter(model)
    chosen: list[tuple[str, nn.Linear]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or isinstance(module.weight, QuantizedWeight):
            continue
        if not choose(module, name):
            continue
        w = module.weight
        label = f"{name}.weight" if name else "weight"
        if w.requires_grad:
            raise ValueError(
                f"{label} is trainable; only frozen weights can be stored as {fmt} (freeze it with "
                "requires_grad_(False), or leave it out with filter_fn)"
            )
        if w.is_meta:
            raise ValueError(f"{label} is on the meta device; materialize the model before quantize_frozen_")
        if isinstance(w, DTensor):
            raise ValueError(f"{label} is already sharded; call quantize_frozen_ before apply_zero / initialize")
        try:
            check_weight(fmt, tuple(w.shape), default_group_size(fmt, w.shape[1]) if group_size is None else group_size)
        except ValueError as e:
            raise ValueError(f"{label}: {e}") from None
        chosen.append((name, module))
    stats = model.__dict__.setdefault(_STATS_ATTR, FrozenStorageStats())
    done: dict[int, nn.Parameter] = {}
    before = after = 0
    for _, module in chosen:
        w = module.weight
        if id(w) not in done:
            g = default_group_size(fmt, w.shape[1]) if group_size is None else group_size
            q = QuantizedWeight.from_float(w, fmt, g, method=method, stats=stats, process_group=process_group)
            done[id(w)] = nn.Parameter(q, requires_grad=False)
            before += w.numel() * w.element_size()
            after += q.nbytes_stored()
        module.weight = done[id(w)]  # a weight shared by two layers stays shared
    if chosen:
        logger.info(
            "stored %d frozen Linear weights as %s: %.1f MB -> %.1f MB", len(done), fmt, before / 2**20, after / 2**20
        )
    else:
        logger.warning("quantize_frozen_: no frozen nn.Linear to store as %s (freeze the base model first)", fmt)
    return model


def check_shardable(model: nn.Module, world_size: int) -> None:
    """Refuse quantized weights whose rows do not split evenly over ``world_size`` ranks (ZeRO-3 shards rows).

    Args:
        model: the model about to be sharded.
        world_size: ranks the weights are sharded over.

    Raises:
        ValueError: one line naming the first such weight and the fixes.
    """
    for name, q in quantized_weights(model).items():
        if q.shape[0] % world_size:
            raise ValueError(
                f"{name}: the {q.fmt} weight's {q.shape[0]} rows do not split evenly over {world_size} ranks, which "
                "ZeRO stages 2/3 need to shard its codes; leave it out with filter_fn, or use a world size that "
                "divides it"
            )


def quantized_parts_state(state: dict[str, Any]) -> dict[str, Any]:
    """A model state dict with every quantized weight replaced by its components, ``<name>.<part>``.

    Each component is a DTensor sharded by rows like the weight (``Shard(0)``), or a plain tensor when the
    weight is one, so checkpoints reshard them like any other tensor.

    Args:
        state: the model state dict (DTensors at any stage, or plain tensors).
    """
    out: dict[str, Any] = {}
    for key, value in state.items():
        local = value.to_local() if isinstance(value, DTensor) else value
        if not isinstance(local, QuantizedWeight):
            out[key] = value
            continue
        for part, tensor in local.parts.items():
            if isinstance(value, DTensor):
                shape = torch.Size((value.shape[0], *tensor.shape[1:]))
                stride = torch.empty(shape, device="meta").stride()
                dt = DTensor.from_local(
                    tensor, value.device_mesh, value.placements, run_check=False, shape=shape, stride=stride
                )
                if not isinstance(value.placements[0], Shard):
                    dt = dt.redistribute(value.device_mesh, (Shard(0),))
                out[f"{key}.{part}"] = dt
            else:
                out[f"{key}.{part}"] = tensor
    return out


@torch.no_grad()
def load_quantized_parts(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """Copy the components ``quantized_parts_state`` wrote back into the model's quantized weights.

    Args:
        model: the model (sharded or not) whose quantized weights receive the components.
        state: a state dict in ``quantized_parts_state``'s form.

    Returns:
        The rest of ``state``: the entries that are not components of a quantized weight.
    """
    rest = dict(state)
    params = dict(model.named_parameters())
    for name, q in quantized_weights(model).items():
        param = params[name]
        for part, target in q.parts.items():
            key = f"{name}.{part}"
            if key not in rest:
                raise KeyError(f"state dict has no {key!r} for the {q.fmt} weight {name!r}")
            value = rest.pop(key)
            if isinstance(value, DTensor):
                if isinstance(param, DTensor) and value.device_mesh == param.device_mesh:
                    value = value.redistribute(param.device_mesh, param.placements).to_local()
                else:
                    value = value.full_tensor()
            if isinstance(param, DTensor) and tuple(value.shape) != tuple(target.shape):
                from ds_plugin.zero.stage1 import shard_rows

                mesh = param.device_mesh
                start, length = shard_rows(value.shape[0], mesh.size(), mesh.get_local_rank())
                value = value[start : start + length]
            if target.data_ptr() != value.data_ptr():
                target.copy_(value)
        rest.pop(name, None)
    return rest
