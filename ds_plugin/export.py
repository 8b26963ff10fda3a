"""Consolidate a sharded checkpoint into safetensors (the role of DeepSpeed's `zero_to_fp32.py`).

`export_checkpoint(ckpt_dir, out_dir)` reads a ds_plugin checkpoint in this one process (no
torch.distributed), assembles every full weight, and writes `model.safetensors` (or numbered shards plus
`model.safetensors.index.json` past `max_shard_size`). It streams: each file's header comes from the checkpoint's
metadata and the tensors are read about `READ_BYTES` at a time, so memory stays near a gigabyte plus the largest
tensor, whatever the model's size. The files are put in place only once all are complete (an earlier export in
`out_dir` survives a failed one), after a check that the disk can hold them. When the checkpoint's `extra` holds a
transformers config (`model_metadata` records it), `config.json` is written too and tied weights are stored once,
as `save_pretrained` does, so `AutoModelForCausalLM.from_pretrained(out_dir)` loads it directly. Frozen weights that
training stored quantized (`quantize_frozen_`) are written dequantized, in the dtype they computed in.
`export_command` is what `ds-plugin export CKPT_DIR OUT_DIR [--dtype]` runs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from tqdm import tqdm

from ds_plugin.checkpoint import CheckpointError, load_full_state_dict, read_checkpoint_info
from ds_plugin.checkpoint.engine_state import FROZEN_EXCLUDED
from ds_plugin.checkpoint.safetensors_files import safetensors_header, write_tensor_data
from ds_plugin.runtime.comms_logger import fmt_bytes

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
#: Checkpoint bytes read from disk at a time. The export holds about this much plus one tensor as written, whatever
#: the model's size: a 7B model's fp32 weights (28 GB) pass through a machine with less memory than that.
READ_BYTES = 1 << 30


def _parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of fp32, bf16, fp16")
    return _DTYPES[dtype]


@dataclasses.dataclass
class _Entry:
    """One tensor of the export: its name in the file and what the checkpoint makes it from."""

    name: str
    sources: list[str]  # tensor names under the checkpoint's "model." prefix
    shape: tuple[int, ...]
    dtype: torch.dtype  # as written
    read_bytes: int  # of its sources, as stored
    quantized: dict[str, Any] | None = None  # a frozen weight stored as INT8/INT4/NF4/FP6 components

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _stored_bytes(md: TensorStorageMetadata) -> int:
    return math.prod(md.size) * md.properties.dtype.itemsize


def _plan(metadata: Metadata, extra: dict[str, Any], ckpt_dir: Any, dtype: torch.dtype | None) -> list[_Entry]:
    """The tensors to write, in the checkpoint's order (dequantized weights last), from the metadata alone."""
    from ds_plugin.quant.frozen.codecs import logical_cols

    stored = {
        k.removeprefix("model."): md
        for k, md in metadata.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    if not stored:
        raise CheckpointError(f"checkpoint {ckpt_dir} holds no model tensors")
    missing = extra.get(FROZEN_EXCLUDED)
    if missing:  # a model without its base would load as a broken one
        raise CheckpointError(
            f"checkpoint {ckpt_dir} was saved without its {len(missing)} frozen weights (exclude_frozen_parameters), "
            "so it holds no whole model to export; export a checkpoint saved with them, or save the adapter itself "
            "(save_adapter, or the Trainer's save_model)"
        )

    def cast(t: torch.dtype) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point else t

    # A frozen weight stored as INT8/INT4/NF4 was checkpointed as its components (`<name>.codes`, ...): the file gets
    # the weight they encode, so `from_pretrained` loads a plain model (quantize it again with `quantize_frozen_`).
    quantized: list[_Entry] = []
    for name, spec in extra.get("quantized_weights", {}).items():
        prefix = f"{name}."
        parts = [k for k in stored if k.startswith(prefix) and "." not in k[len(prefix) :]]
        if not parts:
            raise CheckpointError(f"checkpoint {ckpt_dir} lists {name!r} as {spec['format']} but holds no component")
        codes = stored.get(prefix + "codes")
        try:
            if codes is None or len(codes.size) != 2:
                raise ValueError("no 2-D 'codes'")
            shape = (codes.size[0], logical_cols(spec["format"], codes.size[1]))
            out_dtype = cast(getattr(torch, spec["dtype"]))
        except (ValueError, AttributeError, KeyError) as e:
            raise CheckpointError(f"checkpoint {ckpt_dir}: quantized weight {name!r} is malformed ({e})") from None
        quantized.append(_Entry(name, parts, shape, out_dtype, sum(_stored_bytes(stored[k]) for k in parts), spec))
    components = {k for entry in quantized for k in entry.sources}
    plan = [
        _Entry(k, [k], tuple(md.size), cast(md.properties.dtype), _stored_bytes(md))
        for k, md in stored.items()
        if k not in components
    ] + quantized
    if extra.get("hf_config") is not None:
        # Like save_pretrained: a tied group is stored under its first name and re-tied on load.
        names = {entry.name for entry in plan}
        aliases = {alias for group in extra.get("tied_weights", []) for alias in [n for n in group if n in names][1:]}
        plan = [entry for entry in plan if entry.name not in aliases]
    try:
        safetensors_header([(entry.name, entry.dtype, entry.shape) for entry in plan])
    except ValueError as e:
        raise CheckpointError(f"{e}; pass --dtype") from None
    return plan


def _shards(plan: list[_Entry], max_bytes: int) -> list[list[_Entry]]:
    shards: list[list[_Entry]] = [[]]
    size = 0
    for entry in plan:
        if shards[-1] and size + entry.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def _materialize(entry: _Entry, loaded: dict[str, torch.Tensor]) -> torch.Tensor:
    if entry.quantized is None:
        t = loaded.pop(entry.name)
    else:
        from ds_plugin.quant.frozen.codecs import dequantize_weight

        spec = entry.quantized
        prefix = f"{entry.name}."
        parts = {k[len(prefix) :]: loaded.pop(k) for k in entry.sources}
        t = dequantize_weight(parts, spec["format"], int(spec["group_size"]), getattr(torch, spec["dtype"]))
    return t.to(entry.dtype)


def _write_file(path: Path, entries: list[_Entry], ckpt_dir: Any, bar: Any) -> None:
    """Write one safetensors file, reading its tensors from the checkpoint about `READ_BYTES` at a time."""
    with open(path, "wb") as f:
        f.write(safetensors_header([(entry.name, entry.dtype, entry.shape) for entry in entries]))
        i = 0
        while i < len(entries):
            group, size = [], 0
            while i < len(entries) and (not group or size + entries[i].read_bytes <= READ_BYTES):
                group.append(entries[i])
                size += entries[i].read_bytes
                i += 1
            loaded = load_full_state_dict(ckpt_dir, names=[k for entry in group for k in entry.sources])
            for entry in group:
                t = _materialize(entry, loaded)
                if tuple(t.shape) != entry.shape or t.dtype != entry.dtype:  # the header is already written
                    raise CheckpointError(f"{entry.name!r} read as {tuple(t.shape)} {t.dtype}, not {entry.shape}")
                write_tensor_data(f, t)
                bar.update(entry.nbytes)
                del t
            del loaded
        f.flush()
        os.fsync(f.fileno())


def _replace_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.partial-{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _export(
    ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype: torch.dtype | None, max_shard_size: int
) -> tuple[Path, int, int]:
    """Write the export; returns (out_dir, tensors, parameters).

    Memory stays at about `READ_BYTES` plus one tensor: each file's header is computed from the checkpoint's
    metadata, and the tensors are read a group at a time and written in order. The files are written under hidden
    temporary names and put in place only when all are complete, so an export that fails (a full disk, an
    interrupt) leaves an earlier export in `out_dir` as it was; after the new files are in place, the earlier
    export's other weight files (a different shard count) are removed.
    """
    info, metadata = read_checkpoint_info(ckpt_dir)
    extra = info.get("extra", {})
    plan = _plan(metadata, extra, ckpt_dir, dtype)
    shards = _shards(plan, max_shard_size)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    total = sum(entry.nbytes for entry in plan)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    if total > free:
        raise CheckpointError(
            f"exporting needs {fmt_bytes(total)} in {out} but {fmt_bytes(free)} are free there (an earlier "
            "export in it is replaced only once the new one is complete): free some space or pick another OUT_DIR"
        )
    tag = uuid.uuid4().hex[:8]
    partials = [(out / f".{name}.partial-{tag}", out / name) for name in names]
    try:
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="export", disable=None) as bar:
            for (tmp, final), entries in zip(partials, shards, strict=True):
                try:
                    _write_file(tmp, entries, ckpt_dir, bar)
                except OSError as e:
                    raise OSError(e.errno, e.strerror or str(e), str(final)) from e
    except BaseException:
        for tmp, _ in partials:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, final in partials:
        if final.is_file():
            logger.info("replacing %s", final)
        os.replace(tmp, final)
    if len(shards) > 1:
        weight_map = {entry.name: name for name, entries in zip(names, shards, strict=True) for entry in entries}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _replace_text(out / _INDEX, json.dumps(index, indent=2, sort_keys=True))
    # An earlier export with another shard count left files that transformers could pick up.
    stale = [out / "model.safetensors", out / _INDEX, *out.glob("model-*-of-*.safetensors")]
    keep = {out / name for name in names} | ({out / _INDEX} if len(shards) > 1 else set())
    for f in stale:
        if f not in keep and f.is_file():
            logger.info("removing %s (an earlier export's)", f)
            f.unlink()
    hf_config = extra.get("hf_config")
    if hf_config is not None:
        config = dict(hf_config)
        if extra.get("hf_architecture"):
            config["architectures"] = [extra["hf_architecture"]]
        if dtype is not None:
            config["dtype"] = str(dtype).removeprefix("torch.")
            if "torch_dtype" in config:
                config["torch_dtype"] = config["dtype"]
        _replace_text(out / "config.json", json.dumps(config, indent=2, sort_keys=True))
    return out, len(plan), sum(math.prod(entry.shape) for entry in plan)


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
