"""Per-rank model-state memory by the ZeRO paper's formulas (Rajbhandari et al. 2020, section 5).

Model states of mixed-precision Adam with Ψ parameters on N ranks: 2Ψ compute weights + 2Ψ gradients +
12Ψ optimizer state (fp32 master, momentum, variance). Stage 1 shards the 12Ψ, stage 2 also the gradients,
stage 3 also the weights. Activations, buffers and fragmentation are not model states and are not counted.

For LoRA, the frozen base weights carry no gradient and no optimizer state: they cost only their storage
bytes (bf16, or a quantized format), sharded across ranks in stage 3, while the adapters follow the formulas.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Bytes per element of each frozen-weight storage format, scales included:
# int8/int4 carry one fp32 scale per block of 4096 (qwZ-style) elements; nf4 is bitsandbytes' 64-element
# blocks with double-quantized absmax (≈ 4.127 bits); fp6 e3m2 carries one fp16 scale per output row,
# which is negligible for real layer widths and counted here as 0.
FROZEN_FORMAT_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "int8": 1.0 + 4 / 4096,
    "int4": 0.5 + 4 / 4096,
    "nf4": 4.127 / 8,
    "fp6": 6 / 8,
}

# K in the ZeRO paper: optimizer-state bytes per parameter for mixed-precision Adam.
ADAM_STATE_BYTES = 12
COMPUTE_WEIGHT_BYTES = 2
GRAD_BYTES = 2


def zero_model_state_bytes(params: float, world_size: int, stage: int) -> float:
    """Per-rank model-state bytes of mixed-precision Adam at a ZeRO stage.

    Args:
        params: trainable parameter count Ψ.
        world_size: data-parallel ranks N.
        stage: 0, 1, 2 or 3.
    """
    p, n = float(params), float(world_size)
    if stage == 0:
        return (COMPUTE_WEIGHT_BYTES + GRAD_BYTES + ADAM_STATE_BYTES) * p
    if stage == 1:
        return (COMPUTE_WEIGHT_BYTES + GRAD_BYTES) * p + ADAM_STATE_BYTES * p / n
    if stage == 2:
        return COMPUTE_WEIGHT_BYTES * p + (GRAD_BYTES + ADAM_STATE_BYTES) * p / n
    if stage == 3:
        return (COMPUTE_WEIGHT_BYTES + GRAD_BYTES + ADAM_STATE_BYTES) * p / n
    raise ValueError(f"stage {stage} is not a ZeRO stage; use 0, 1, 2 or 3")


def frozen_state_bytes(frozen_params: float, world_size: int, stage: int, fmt: str) -> float:
    """Per-rank bytes of frozen (non-trainable) weights: storage only, sharded in stage 3."""
    per = FROZEN_FORMAT_BYTES[fmt] * float(frozen_params)
    return per / world_size if stage == 3 else per


@dataclass(frozen=True)
class ModelShape:
    """What LoRA sizing needs to know about a decoder model."""

    params: int
    hidden_size: int | None = None
    num_layers: int | None = None
    kv_size: int | None = None  # hidden size of k/v projections (GQA); defaults to hidden_size


def lora_params(shape: ModelShape, rank: int) -> int:
    """LoRA adapter parameters on the attention projections q, k, v, o of every layer (peft's A and B)."""
    if shape.hidden_size is None or shape.num_layers is None:
        raise ValueError(
            "LoRA sizing needs the layer shape: pass --model-config config.json, or --hidden-size and --num-layers"
        )
    h, kv = shape.hidden_size, shape.kv_size or shape.hidden_size
    # Each adapted Linear(in, out) adds A (rank x in) and B (out x rank).
    per_layer = rank * (h + h) + 2 * rank * (h + kv) + rank * (h + h)
    return per_layer * shape.num_layers


def shape_from_hf_config(cfg: Mapping[str, Any]) -> ModelShape:
    """Parameter count and shape of a decoder from a transformers config.json dict.

    Counts embeddings, attention, MLP and norms for Llama-, GPT-2-, Mistral-, Qwen-style configs; a config
    that names none of the usual size keys is an error.
    """

    def get(*names: str, default: Any = None) -> Any:
        for n in names:
            if cfg.get(n) is not None:
                return cfg[n]
        return default

    h = get("hidden_size", "n_embd", "d_model")
    layers = get("num_hidden_layers", "n_layer", "num_layers")
    vocab = get("vocab_size")
    if h is None or layers is None or vocab is None:
        raise ValueError("model config lacks hidden_size/num_hidden_layers/vocab_size; is it a decoder LM config?")
    heads = get("num_attention_heads", "n_head", default=1)
    kv_heads = get("num_key_value_heads", default=heads)
    head_dim = get("head_dim", default=h // heads)
    kv = kv_heads * head_dim
    inter = get("intermediate_size", "n_inner", "ffn_dim", default=4 * h)
    gated = cfg.get("model_type") not in ("gpt2", "gpt_neox", "opt", "bloom", "falcon", "phi")
    bias = cfg.get("model_type") in ("gpt2", "opt", "bloom", "phi")
    attn = h * (heads * head_dim) + 2 * h * kv + (heads * head_dim) * h
    mlp = (3 if gated else 2) * h * inter
    norms = 2 * h * (2 if bias else 1)
    biases = (heads * head_dim + 2 * kv + h + inter + h) if bias else 0
    per_layer = attn + mlp + norms + biases
    embed = vocab * h
    positions = get("n_positions", "max_position_embeddings", default=0) * h if cfg.get("model_type") == "gpt2" else 0
    tied = cfg.get("tie_word_embeddings", True)
    final_norm = h * (2 if bias else 1)
    total = layers * per_layer + embed + positions + final_norm + (0 if tied else vocab * h)
    return ModelShape(params=int(total), hidden_size=int(h), num_layers=int(layers), kv_size=int(kv))


def load_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """Read a transformers config.json (a file, or a directory holding one)."""
    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    with open(p) as fh:
        return json.load(fh)


def estimate(
    shape: ModelShape,
    world_size: int,
    *,
    nodes: int = 1,
    lora_rank: int | None = None,
    frozen_format: str = "bf16",
) -> dict[str, Any]:
    """The per-rank model-state bytes of stages 0–3, plus the LoRA variant when a rank is given.

    Args:
        shape: parameter count (and layer shape for LoRA).
        world_size: total ranks N.
        nodes: nodes the ranks span (reported; the formulas depend on N only).
        lora_rank: LoRA rank r; trainable = the adapters, frozen = the base weights in `frozen_format`.
        frozen_format: storage format of frozen base weights: one of FROZEN_FORMAT_BYTES.
    """
    if world_size < 1:
        raise ValueError(f"--world-size {world_size} must be at least 1")
    if nodes < 1 or world_size % nodes:
        raise ValueError(f"--nodes {nodes} must divide --world-size {world_size}")
    if frozen_format not in FROZEN_FORMAT_BYTES:
        raise ValueError(f"--frozen-format {frozen_format!r} is not one of {', '.join(FROZEN_FORMAT_BYTES)}")
    out: dict[str, Any] = {
        "params": shape.params,
        "world_size": world_size,
        "nodes": nodes,
        "stages": {str(s): math.ceil(zero_model_state_bytes(shape.params, world_size, s)) for s in range(4)},
        "assumes": "mixed-precision Adam: 2 B weights + 2 B grads + 12 B optimizer state per trainable parameter",
    }
    if lora_rank is not None:
        if lora_rank < 1:
            raise ValueError(f"--lora-rank {lora_rank} must be at least 1")
        trainable = lora_params(shape, lora_rank)
        frozen = shape.params
        out["lora"] = {
            "rank": lora_rank,
            "frozen_format": frozen_format,
            "trainable_params": trainable,
            "frozen_params": frozen,
            "stages": {
                str(s): math.ceil(
                    zero_model_state_bytes(trainable, world_size, s)
                    + frozen_state_bytes(frozen, world_size, s, frozen_format)
                )
                for s in range(4)
            },
        }
    return out


def format_table(result: Mapping[str, Any]) -> str:
    """A human-readable table of an `estimate` result (decimal GB, as the ZeRO paper)."""
    lines = [
        f"params {result['params']:,}  world size {result['world_size']}  nodes {result['nodes']}",
        f"({result['assumes']})",
        "",
        f"{'stage':<8}{'per-rank model states':>24}" + (f"{'LoRA + frozen':>20}" if "lora" in result else ""),
    ]
    for s in range(4):
        row = f"{s:<8}{_gb(result['stages'][str(s)]):>24}"
        if "lora" in result:
            row += f"{_gb(result['lora']['stages'][str(s)]):>20}"
        lines.append(row)
    if "lora" in result:
        lo = result["lora"]
        lines.append("")
        lines.append(
            f"LoRA rank {lo['rank']}: {lo['trainable_params']:,} trainable adapter params; "
            f"{lo['frozen_params']:,} frozen params stored as {lo['frozen_format']}"
        )
    return "\n".join(lines)


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e8 else f"{n / 1e6:,.2f} MB"
