"""Consolidate a sharded checkpoint into safetensors (the role of DeepSpeed's `zero_to_fp32.py`).

`export_checkpoint(ckpt_dir, out_dir)` reads a ds_plugin checkpoint in this one process (no
torch.distributed), assembles every full weight, and writes `model.safetensors` (or numbered shards plus
`model.safetensors.index.json` past `max_shard_size`). When the checkpoint's `extra` holds a transformers
config (`model_metadata` records it), `config.json` is written too and tied weights are stored once, as
`save_pretrained` does, so `AutoModelForCausalLM.from_pretrained(out_dir)` loads it directly. Frozen weights that
training stored quantized (`quantize_frozen_`) are written dequantized, in the dtype they computed in.
`export_command` is what `ds-plugin export CKPT_DIR OUT_DIR [--dtype]` runs.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch

from ds_plugin.checkpoint import CheckpointError, load_full_state_dict, read_checkpoint_info

__all__ = ["export_checkpoint", "export_command", "export_summary"]

logger = logging.getLogger(__name__)

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
}
_INDEX = "model.safetensors.index.json"


def _parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of fp32, bf16, fp16")
    return _DTYPES[dtype]


def _shards(state: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def _clear_old_weights(out: Path) -> None:
    # A previous export with a different shard count would leave files that transformers could pick up.
    stale = [out / "model.safetensors", out / _INDEX, *out.glob("model-*-of-*.safetensors")]
    for f in stale:
        if f.is_file():
            logger.info("replacing %s", f)
            f.unlink()


def _dequantize(state: dict[str, torch.Tensor], quantized: dict[str, Any], ckpt_dir: Any) -> dict[str, torch.Tensor]:
    # A frozen weight stored as INT8/INT4/NF4 was checkpointed as its components (`<name>.codes`, ...): write the
    # weight they encode, so `from_pretrained` loads a plain model (quantize it again with `quantize_frozen_`).
    from ds_plugin.quant.frozen.codecs import dequantize_weight

    for name, spec in quantized.items():
        prefix = f"{name}."
        parts = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix) and "." not in k[len(prefix) :]}
        if not parts:
            raise CheckpointError(f"checkpoint {ckpt_dir} lists {name!r} as {spec['format']} but holds no component")
        for part in parts:
            del state[prefix + part]
        dtype = getattr(torch, spec["dtype"])
        state[name] = dequantize_weight(parts, spec["format"], int(spec["group_size"]), dtype)
    return state


def _export(
    ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype: torch.dtype | None, max_shard_size: int
) -> tuple[Path, int, int]:
    from safetensors.torch import save_file

    info, _ = read_checkpoint_info(ckpt_dir)
    extra = info.get("extra", {})
    state = load_full_state_dict(ckpt_dir)
    if not state:
        raise CheckpointError(f"checkpoint {ckpt_dir} holds no model tensors")
    state = _dequantize(state, extra.get("quantized_weights", {}), ckpt_dir)
    hf_config = extra.get("hf_config")
    if hf_config is not None:
        # Like save_pretrained: a tied group is stored under its first name and re-tied on load.
        for group in extra.get("tied_weights", []):
            present = [name for name in group if name in state]
            for alias in present[1:]:
                del state[alias]
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    state = {k: v.contiguous() for k, v in state.items()}

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _clear_old_weights(out)
    shards = _shards(state, max_shard_size)
    meta = {"format": "pt"}  # transformers refuses safetensors files without it
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata=meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / fname), metadata=meta)
            weight_map.update(dict.fromkeys(shard, fname))
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / _INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
    if hf_config is not None:
        config = dict(hf_config)
        if extra.get("hf_architecture"):
            config["architectures"] = [extra["hf_architecture"]]
        if dtype is not None:
            config["dtype"] = str(dtype).removeprefix("torch.")
            if "torch_dtype" in config:
                config["torch_dtype"] = config["dtype"]
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out, len(state), sum(t.numel() for t in state.values())


def export_checkpoint(
    ckpt_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int = 5 * 2**30,
) -> Path:
    """Write the checkpoint's full weights as safetensors (plus config.json for transformers models).

    Args:
        ckpt_dir: a checkpoint directory written by `save_checkpoint` (an engine's, a framework's).
        out_dir: the output directory (created; earlier exported weights in it are replaced).
        dtype: cast floating-point weights ("fp32", "bf16", "fp16"); None keeps the saved dtype.
        max_shard_size: bytes per safetensors file before splitting into indexed shards.

    Returns:
        The output directory.
    """
    return _export(ckpt_dir, out_dir, _parse_dtype(dtype), max_shard_size)[0]


def export_summary(ckpt_dir: str, out_dir: str, dtype: str | None = None) -> str:
    """Export like `export_checkpoint` and return the one-line summary `ds-plugin export` prints.

    Args:
        ckpt_dir: the checkpoint directory.
        out_dir: where to write the safetensors.
        dtype: optional cast ("fp32", "bf16", "fp16").

    Raises:
        CheckpointError: not a readable ds_plugin checkpoint (one line).
        OSError: the output cannot be written.
        ValueError: an unknown `dtype`.
    """
    out, n_tensors, n_params = _export(ckpt_dir, out_dir, _parse_dtype(dtype), 5 * 2**30)
    config = " + config.json" if (out / "config.json").is_file() else ""
    return f"exported {n_tensors} tensors ({n_params:,} parameters) from {ckpt_dir} to {out}{config}"


def export_command(ckpt_dir: str, out_dir: str, dtype: str | None = None) -> int:
    """Export and print the summary line on stdout; exit 0, or 2 with one `error: ...` line on stderr.

    `ds-plugin export` uses `export_summary`, and prints its errors in the CLI's own format.

    Args:
        ckpt_dir: the checkpoint directory.
        out_dir: where to write the safetensors.
        dtype: optional cast ("fp32", "bf16", "fp16").
    """
    try:
        summary = export_summary(ckpt_dir, out_dir, dtype)
    except (CheckpointError, ValueError, OSError) as e:
        print(f"error: {' '.join(str(e).splitlines())}", file=sys.stderr)
        return 2
    print(summary)
    return 0
