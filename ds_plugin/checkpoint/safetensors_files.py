"""The tensors of a Hugging Face safetensors checkpoint, by name, and their rows read without a memory map.

`SafetensorsCheckpoint` reads only headers (one file, or shards with their index JSON) and checks them: a file the
index names that is not there, a shard missing from a ``-0000k-of-0000n`` series, a header that does not parse or a
tensor whose bytes run past the end of its file is one `CheckpointLoadError` line naming the file and the tensor.
`read_rows` then reads a dim-0 slice with one positional read of the byte range it fills (the rows of a row-major
tensor are contiguous): nothing stays mapped, so the rank's resident memory holds only what it keeps.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct
import weakref
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CheckpointLoadError",
    "LoadStats",
    "SafetensorsCheckpoint",
    "naive_load_bytes",
    "safetensors_header",
    "write_tensor_data",
]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_SHARD_NAME = re.compile(r"-(\d+)-of-(\d+)\.safetensors$")


def safetensors_header(tensors: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> bytes:
    """The bytes a safetensors file starts with, for `tensors` (name, dtype, shape) stored in that order after it.

    The format: a little-endian u64 length, then JSON (padded with spaces to a multiple of 8 bytes) giving each
    tensor's dtype, shape and byte range in the data that follows; `{"format": "pt"}` as the file's metadata, which
    transformers requires. Writing a file this way needs only the tensor being written in memory.

    Raises:
        ValueError: a dtype safetensors cannot store.
    """
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in tensors:
        if dtype not in _NAMES:
            raise ValueError(f"{name}: safetensors cannot store {dtype}")
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_tensor_data(f: Any, t: torch.Tensor) -> None:
    """Append `t`'s bytes (row-major, little-endian as the CPU stores them) to an open binary file: a tensor's data
    in a file begun with `safetensors_header`."""
    f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)


class CheckpointLoadError(ValueError):
    """A checkpoint that cannot be loaded into the model: one line naming the file, the tensor and the fix."""


@dataclasses.dataclass
class LoadStats:
    """What one rank's load did, for reports and tests.

    Args:
        read_bytes: bytes read from the checkpoint files (this rank's rows only, at stages 2/3).
        peak_live_bytes: the most full-precision bytes the loader held at once beyond the shards (rows as read and
            converted), tracked with weak references as they are freed.
        largest_tensor_bytes: the largest such bytes of a single tensor (rows as read plus their conversion).
        quantize_s: seconds spent quantizing on this rank.
        read_s: seconds spent reading on this rank.
    """

    read_bytes: int = 0
    peak_live_bytes: int = 0
    largest_tensor_bytes: int = 0
    quantize_s: float = 0.0
    read_s: float = 0.0
    _live: int = 0

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        self._live += nbytes
        self.peak_live_bytes = max(self.peak_live_bytes, self._live)
        weakref.finalize(tensor, self._free, nbytes)
        return tensor

    def _free(self, nbytes: int) -> None:
        self._live -= nbytes


@dataclasses.dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of the tensor's first byte in the file
    nbytes: int


class SafetensorsCheckpoint:
    """The tensors of a safetensors checkpoint (one file, or shards with their index JSON), by name; headers only.

    Args:
        path: the checkpoint directory (or one .safetensors file).

    Raises:
        CheckpointLoadError: no safetensors weights, an index naming a file that is not there, a shard missing from
            a ``-0000k-of-0000n`` series, or a file whose header is unreadable or whose data is cut short.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.entries: dict[str, _Entry] = {}
        where = self.path
        if where.is_file():
            files = [where]
        elif (where / INDEX).is_file():
            files = self._from_index(where / INDEX)
        elif (where / SINGLE).is_file():
            files = [where / SINGLE]
        else:
            files = sorted(where.glob("*.safetensors"))
            if not files:
                bins = sorted(p.name for p in where.glob("*.bin"))
                hint = (
                    f" (found {bins[0]}: save it again with save_pretrained(safe_serialization=True))" if bins else ""
                )
                raise CheckpointLoadError(f"{where}: no *.safetensors weights{hint}")
            self._check_series(files)
        for file in files:
            self._read_header(file)

    def _from_index(self, index: Path) -> list[Path]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointLoadError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
        files: dict[str, list[str]] = {}
        for tensor, name in weight_map.items():
            files.setdefault(name, []).append(tensor)
        for name, tensors in files.items():
            if not (index.parent / name).is_file():
                more = f" (and {len(tensors) - 1} more)" if len(tensors) > 1 else ""
                raise CheckpointLoadError(
                    f"{index.parent / name}: no such file, named by {index.name} for tensor {tensors[0]}{more}; the "
                    "checkpoint is incomplete: copy the missing shard"
                )
        self._index = weight_map
        return [index.parent / name for name in sorted(files)]

    @staticmethod
    def _check_series(files: list[Path]) -> None:
        found = [m for f in files if (m := _SHARD_NAME.search(f.name))]
        if not found:
            return
        total = int(found[0].group(2))
        have = {int(m.group(1)) for m in found}
        missing = sorted(set(range(1, total + 1)) - have)
        if missing:
            name = _SHARD_NAME.sub(f"-{missing[0]:0{len(found[0].group(1))}d}-of-{found[0].group(2)}.safetensors",
                                   files[0].name)  # fmt: skip
            raise CheckpointLoadError(
                f"{files[0].parent / name}: no such file, shard {missing[0]} of {total}; the checkpoint is "
                "incomplete: copy the missing shard"
            )

    def _read_header(self, file: Path) -> None:
        size = file.stat().st_size
        try:
            with open(file, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > size - 8:
                    raise ValueError(f"header of {length} bytes in a file of {size}")
                header = json.loads(f.read(length))
        except (OSError, ValueError, struct.error) as e:
            raise CheckpointLoadError(
                f"{file}: not a readable safetensors file ({e}); it may be truncated: copy it again"
            ) from None
        start = 8 + length
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            begin, end = meta["data_offsets"]
            if start + end > size:
                raise CheckpointLoadError(
                    f"{file}: tensor {name} ends at byte {start + end} but the file has {size}; the file is "
                    "truncated: copy it again"
                )
            dtype = _DTYPES.get(meta["dtype"])
            if dtype is None:
                raise CheckpointLoadError(f"{file}: tensor {name} has dtype {meta['dtype']}, which is not supported")
            if name in self.entries:
                raise CheckpointLoadError(f"{file}: tensor {name} is also in {self.entries[name].file.name}")
            self.entries[name] = _Entry(file, dtype, tuple(meta["shape"]), start + begin, end - begin)
        # safetensors' own reader validates what the JSON alone does not (offsets that overlap or leave gaps).
        from safetensors import safe_open

        try:
            with safe_open(file, framework="pt"):
                pass
        except Exception as e:  # safetensors raises its own SafetensorError
            raise CheckpointLoadError(f"{file}: safetensors rejects it ({e}); copy it again") from None

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def nbytes(self) -> int:
        """Bytes of all the tensors' data."""
        return sum(e.nbytes for e in self.entries.values())

    def read_rows(self, name: str, start: int, length: int, stats: LoadStats | None = None) -> torch.Tensor:
        """Rows ``start:start+length`` of a tensor, in its file dtype, read with one positional read.

        Args:
            name: the tensor's name in the checkpoint.
            start: first row (dim 0).
            length: number of rows.
            stats: where to count the bytes and track the tensor.
        """
        e = self.entries[name]
        shape = e.shape or (1,)
        row_bytes = e.nbytes // shape[0] if shape[0] else 0
        out = torch.empty((length, *shape[1:]), dtype=e.dtype, device="cpu")
        buf = out.view(-1).view(torch.uint8) if out.numel() else None
        if buf is not None:
            with open(e.file, "rb", buffering=0) as f:
                view = memoryview(buf.numpy())
                got = os.preadv(f.fileno(), [view], e.offset + start * row_bytes)
            if got != buf.numel():
                raise CheckpointLoadError(f"{e.file}: tensor {name}: read {got} of {buf.numel()} bytes; copy it again")
        if stats is not None:
            stats.read_bytes += out.numel() * out.element_size()
            stats.track(out)
        return out.reshape(e.shape) if not e.shape else out


def naive_load_bytes(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> int:
    """Bytes `from_pretrained(path, dtype=dtype)` holds on every rank before sharding: every tensor in `dtype`.

    Args:
        path: the checkpoint directory.
        dtype: the load dtype.
    """
    ckpt = SafetensorsCheckpoint(path)
    return sum(math.prod(e.shape) * dtype.itemsize for e in ckpt.entries.values())
