"""Per-rank model-state memory by the ZeRO paper's formulas (Rajbhandari et al. 2020, section 5).

Model states of mixed-precision Adam with Ψ parameters on N ranks: 2Ψ compute weights + 2Ψ gradients +
12Ψ optimizer state (fp32 master, momentum, variance). Stage 1 shards the 12Ψ, stage 2 also the gradients,
stage 3 also the weights. Activations, buffers and fragmentation are not model states and are not counted.

For LoRA, the frozen base weights carry no gradient and no optimizer state: they cost only their storage
bytes, while the adapters follow the formulas. As ds_plugin stores them: the decoder layers' frozen
``nn.Linear`` weights in the frozen format (bf16, or INT8 / INT4 / NF4 codes and scales, exactly as
``ds_plugin.quant.frozen.codecs.weight_nbytes`` counts them), every other frozen parameter (embeddings, norms,
biases, the output head) in bf16; whole on every rank at stages 0-1, sharded across ranks at stages 2-3 (FSDP2
shards every parameter, frozen ones included; DeepSpeed's stage 2 would keep them whole).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Frozen-weight storage formats the estimate knows. int8/int4/nf4/fp6 are ds_plugin's group-wise formats
# (`ds_plugin.quant.frozen.codecs`).
QUANTIZED_FORMATS = ("int8", "int4", "nf4", "fp6")
FROZEN_FORMATS = ("fp32", "bf16", "fp16", *QUANTIZED_FORMATS)
# ds_plugin.quant.frozen.codecs.DEFAULT_GROUP_SIZE, repeated so the estimate needs no torch import for it
# (tests/test_estimate.py checks that the two agree).
DEFAULT_GROUP_SIZE = {"int8": 128, "int4": 64, "nf4": 64, "fp6": 128}
DEFAULT_LORA_TARGETS = ("q", "k", "v", "o")

# K in the ZeRO paper: optimizer-state bytes per parameter for mixed-precision Adam.
ADAM_STATE_BYTES = 12
COMPUTE_WEIGHT_BYTES = 2
GRAD_BYTES = 2


def frozen_bytes_per_element(fmt: str, group_size: int | None = None) -> float:
    """Bytes per weight element of a frozen-weight format, scales included (ignoring NF4's 8 bytes per row).

    Args:
        fmt: one of FROZEN_FORMATS.
        group_size: elements per scale for int8/int4/nf4/fp6; default DEFAULT_GROUP_SIZE.
    """
    if fmt not in FROZEN_FORMATS:
        raise ValueError(f"--frozen-format {fmt!r} is not one of {', '.join(FROZEN_FORMATS)}")
    if fmt not in QUANTIZED_FORMATS:
        return {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0}[fmt]
    g = group_size or DEFAULT_GROUP_SIZE[fmt]
    # int8: code + a bf16 scale per group; int4: half a byte + bf16 scale + uint8 zero point per group;
    # nf4: half a byte + an int8 double-quantized absmax per group; fp6: 3/4 byte + a bf16 scale per group.
    return {"int8": 1 + 2 / g, "int4": 0.5 + 3 / g, "nf4": 0.5 + 1 / g, "fp6": 0.75 + 2 / g}[fmt]


# Bytes per element at the default group sizes (kept for callers of the old table).
FROZEN_FORMAT_BYTES: dict[str, float] = {f: frozen_bytes_per_element(f) for f in FROZEN_FORMATS}


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


def lora_model_state_bytes(trainable: float, frozen_bytes: float, world_size: int, stage: int) -> float:
    """Per-rank model-state bytes of a LoRA run: the adapters by the ZeRO formula, the frozen base by its storage.

    Args:
        trainable: trainable (adapter) parameter count Ψt.
        frozen_bytes: storage bytes of every frozen parameter, whole model.
        world_size: data-parallel ranks N.
        stage: 0, 1, 2 or 3; the frozen storage is sharded from stage 2 on (FSDP2).
    """
    shards = world_size if stage >= 2 else 1
    return zero_model_state_bytes(trainable, world_size, stage) + frozen_bytes / shards


@dataclass(frozen=True)
class LinearShape:
    """One Linear weight of a decoder layer: (out_features, in_features), and the LoRA target names it answers to.

    Args:
        name: the module's name in the layer (peft's target name).
        out_features: rows N of the weight.
        in_features: columns K of the weight.
        aliases: short target names (q, k, v, o, gate, up, down) that select it.
        quantizable: whether ds_plugin's frozen formats apply (an ``nn.Linear``; GPT-2's Conv1D is not one).
    """

    name: str
    out_features: int
    in_features: int
    aliases: tuple[str, ...] = ()
    quantizable: bool = True


@dataclass(frozen=True)
class ModelShape:
    """What LoRA sizing needs to know about a decoder model."""

    params: int
    hidden_size: int | None = None
    num_layers: int | None = None
    kv_size: int | None = None  # hidden size of k/v projections (GQA); defaults to hidden_size
    linears: tuple[LinearShape, ...] = ()  # one decoder layer's Linear weights (from a model config)


def _selected(linear: LinearShape, targets: Sequence[str]) -> bool:
    return "all-linear" in targets or linear.name in targets or any(a in targets for a in linear.aliases)


def lora_params(shape: ModelShape, rank: int, targets: Sequence[str] = DEFAULT_LORA_TARGETS) -> int:
    """LoRA adapter parameters (peft's A and B) on the chosen projections of every layer.

    Args:
        shape: the model's shape; its `linears` when known, else hidden size and layers (q/k/v/o only).
        rank: LoRA rank r.
        targets: projection names: q, k, v, o, gate, up, down, a module name, or "all-linear".
    """
    if shape.hidden_size is None or shape.num_layers is None:
        raise ValueError(
            "LoRA sizing needs the layer shape: pass --model-config config.json, or --hidden-size and --num-layers"
        )
    if not targets:
        raise ValueError("--lora-targets is empty; name at least one projection (default q,k,v,o)")
    if shape.linears:
        chosen = [lin for lin in shape.linears if _selected(lin, targets)]
        unknown = [t for t in targets if t != "all-linear" and not any(_selected(lin, [t]) for lin in shape.linears)]
        if unknown:
            names = ", ".join(sorted({a for lin in shape.linears for a in (lin.name, *lin.aliases)}))
            raise ValueError(f"--lora-targets {','.join(unknown)}: no such projection; choose from {names}")
        # Each adapted Linear(in, out) adds A (rank x in) and B (out x rank).
        return shape.num_layers * sum(rank * (lin.in_features + lin.out_features) for lin in chosen)
    h, kv = shape.hidden_size, shape.kv_size or shape.hidden_size
    sizes = {"q": h + h, "k": h + kv, "v": h + kv, "o": h + h}
    unknown = [t for t in targets if t not in sizes]
    if unknown:
        raise ValueError(
            f"--lora-targets {','.join(unknown)}: with --params only q, k, v, o are known; pass --model-config"
        )
    return shape.num_layers * sum(rank * sizes[t] for t in targets)


def frozen_base_bytes(shape: ModelShape, fmt: str, group_size: int | None = None) -> dict[str, Any]:
    """Storage bytes of the whole frozen base model (unsharded) with its Linear weights in `fmt`.

    With the decoder layers' Linear shapes known, each quantizable one is counted exactly as
    ``weight_nbytes`` does and everything else in bf16 (fp32 when `fmt` is fp32). Without them, every
    parameter is counted in `fmt` (an underestimate for a quantized format: embeddings stay bf16).

    Args:
        shape: the model's shape.
        fmt: one of FROZEN_FORMATS.
        group_size: elements per scale for int8/int4/nf4/fp6; default DEFAULT_GROUP_SIZE.
    """
    frozen_bytes_per_element(fmt, group_size)  # validates fmt
    if group_size is not None and fmt not in QUANTIZED_FORMATS:
        raise ValueError(f"--frozen-group-size applies to {', '.join(QUANTIZED_FORMATS)}, not {fmt}")
    if group_size is not None and group_size < 1:
        raise ValueError(f"--frozen-group-size {group_size} must be at least 1")
    if not shape.linears or shape.num_layers is None:
        total = frozen_bytes_per_element(fmt, group_size) * shape.params
        return {"bytes": math.ceil(total), "linear_bytes": None, "exact": False}
    other_dtype_bytes = 4 if fmt == "fp32" else 2
    linear_numel = linear_bytes = 0
    for lin in shape.linears:
        numel = lin.out_features * lin.in_features
        linear_numel += numel
        linear_bytes += _weight_bytes(lin, fmt, group_size) if lin.quantizable else numel * other_dtype_bytes
    linear_numel *= shape.num_layers
    linear_bytes *= shape.num_layers
    rest = (shape.params - linear_numel) * other_dtype_bytes
    return {"bytes": linear_bytes + rest, "linear_bytes": linear_bytes, "exact": True}


def _weight_bytes(lin: LinearShape, fmt: str, group_size: int | None) -> int:
    numel = lin.out_features * lin.in_features
    if fmt not in QUANTIZED_FORMATS:
        return math.ceil(frozen_bytes_per_element(fmt) * numel)
    # The quantized layouts live with the formats; imported here so the plain estimate needs no torch.
    from ds_plugin.quant.frozen.codecs import weight_nbytes

    # quantize_frozen_'s rule: the default group is capped at the row width.
    g = group_size or min(DEFAULT_GROUP_SIZE[fmt], lin.in_features)
    try:
        return weight_nbytes((lin.out_features, lin.in_features), fmt, g)
    except ValueError as e:
        raise ValueError(f"{lin.name}: {e}") from None


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
    shape = ModelShape(params=int(total), hidden_size=int(h), num_layers=int(layers), kv_size=int(kv))
    return dataclasses.replace(shape, linears=_layer_linears(cfg.get("model_type"), h, heads * head_dim, kv, inter))


def _layer_linears(model_type: str | None, h: int, q: int, kv: int, inter: int) -> tuple[LinearShape, ...]:
    if model_type == "gpt2":
        # Conv1D, not nn.Linear: peft adapts them, quantize_frozen_ leaves them in bf16. q/k/v are one fused module.
        return (
            LinearShape("c_attn", 3 * h, h, ("q", "k", "v"), quantizable=False),
            LinearShape("attn.c_proj", h, h, ("o",), quantizable=False),
            LinearShape("c_fc", inter, h, ("up",), quantizable=False),
            LinearShape("mlp.c_proj", h, inter, ("down",), quantizable=False),
        )
    attn = (
        LinearShape("q_proj", q, h, ("q",)),
        LinearShape("k_proj", kv, h, ("k",)),
        LinearShape("v_proj", kv, h, ("v",)),
        LinearShape("o_proj", h, q, ("o",)),
    )
    if model_type in ("gpt_neox", "opt", "bloom", "falcon", "phi"):
        return (*attn, LinearShape("fc_in", inter, h, ("up",)), LinearShape("fc_out", h, inter, ("down",)))
    return (
        *attn,
        LinearShape("gate_proj", inter, h, ("gate",)),
        LinearShape("up_proj", inter, h, ("up",)),
        LinearShape("down_proj", h, inter, ("down",)),
    )


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
    lora_targets: Sequence[str] = DEFAULT_LORA_TARGETS,
    frozen_group_size: int | None = None,
) -> dict[str, Any]:
    """The per-rank model-state bytes of stages 0–3, plus the LoRA variant when a rank is given.

    Args:
        shape: parameter count (and layer shape for LoRA).
        world_size: total ranks N.
        nodes: nodes the ranks span (reported; the formulas depend on N only).
        lora_rank: LoRA rank r; trainable = the adapters, frozen = the base model, stored as `frozen_format`.
        frozen_format: storage format of the frozen Linear weights: one of FROZEN_FORMATS.
        lora_targets: the projections LoRA adapts (see `lora_params`).
        frozen_group_size: elements per scale of int8/int4/nf4/fp6; default DEFAULT_GROUP_SIZE (capped at the row).
    """
    if world_size < 1:
        raise ValueError(f"--world-size {world_size} must be at least 1")
    if nodes < 1 or world_size % nodes:
        raise ValueError(f"--nodes {nodes} must divide --world-size {world_size}")
    if frozen_format not in FROZEN_FORMATS:
        raise ValueError(f"--frozen-format {frozen_format!r} is not one of {', '.join(FROZEN_FORMATS)}")
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
        trainable = lora_params(shape, lora_rank, lora_targets)
        frozen = frozen_base_bytes(shape, frozen_format, frozen_group_size)
        out["lora"] = {
            "rank": lora_rank,
            "targets": list(lora_targets),
            "frozen_format": frozen_format,
            "frozen_group_size": (frozen_group_size or DEFAULT_GROUP_SIZE[frozen_format])
            if frozen_format in QUANTIZED_FORMATS
            else None,
            "trainable_params": trainable,
            "frozen_params": shape.params,
            "frozen_bytes": frozen["bytes"],
            "frozen_linear_bytes": frozen["linear_bytes"],
            "frozen_accounting": (
                "per layer: decoder Linear weights in the format (codes + scales), other parameters bf16"
                if frozen["exact"]
                else "approximate: every frozen parameter in the format (embeddings really stay bf16; "
                "give --model-config for per-layer bytes)"
            ),
            "stages": {
                str(s): math.ceil(lora_model_state_bytes(trainable, frozen["bytes"], world_size, s)) for s in range(4)
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
            f"{lo['frozen_params']:,} frozen params, Linear weights stored as {lo['frozen_format']}"
        )
        lines.append(f"frozen accounting: {lo['frozen_accounting']}")
    return "\n".join(lines)


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e8 else f"{n / 1e6:,.2f} MB"
