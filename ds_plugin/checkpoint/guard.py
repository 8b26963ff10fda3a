"""The pickle guard: a checkpoint directory is verified before anything in it is unpickled.

DCP stores `.metadata` with `pickle` and its stock reader runs `pickle.load`, and its stock planner reads non-tensor
values (optimizer hyper-parameters) with `torch.load(weights_only=False)`: either can run code from a crafted
checkpoint. Here (1) nothing is read unless our marker file (`MARKER`) is present, well-formed, has a known format
version, and the `.metadata` bytes match the sha256 and every file the size it records; (2) `.metadata` is then
unpickled by a restricted unpickler (`ds_plugin.checkpoint._safe_pickle`) that only builds DCP's metadata classes
(their Enum members also in the `getattr(Class, "NAME")` form that Python 3.11.0-3.11.4 write), `torch.Size`,
dtypes, layouts and paths, and the metadata may name no file but the checkpoint's own; (3) non-tensor values are
loaded with `torch.load(weights_only=True)` (tensors already are). (1) catches foreign, truncated or edited
checkpoints but not a forger, who can rewrite the marker too; (2) and (3) are what stop code execution even then.
Not covered: a forged checkpoint can still hold wrong numbers or huge shapes.

A name whose save was interrupted mid-swap is read from the copy the swap set aside (see "Crash safety" in
`ds_plugin.checkpoint.io`); the temporary directory of an unfinished save is never read as a checkpoint.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ds_plugin.checkpoint._atomic_dir import interrupted_swap, leftovers, temporary_of
from ds_plugin.checkpoint._safe_pickle import MetadataUnpickler

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MARKER",
    "METADATA",
    "CheckpointError",
    "SafeLoadPlanner",
    "VerifiedReader",
    "one_line",
    "open_verified",
    "read_checkpoint_info",
]

logger = logging.getLogger(__name__)

MARKER = "ds_plugin_checkpoint.json"
FORMAT = "ds_plugin.dcp"
FORMAT_VERSION = 1
METADATA = ".metadata"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message is one line naming the cause and the fix."""


def one_line(exc: BaseException) -> str:
    failures = getattr(exc, "failures", None)
    if isinstance(exc, CheckpointException) and failures:
        # DCP gathers every rank's exception and traceback into one dump; report the first rank's error.
        rank, (inner, _) = next(iter(sorted(failures.items(), key=lambda kv: kv[0])))
        detail = one_line(inner) if isinstance(inner, CheckpointError) else f"{type(inner).__name__}: {one_line(inner)}"
        return f"rank {rank}: {detail}"
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[-1] if lines else type(exc).__name__


def _resolve(root: Path) -> Path:
    """The directory that holds the checkpoint named `root`: `root` itself, or what an interrupted swap set aside."""
    name = temporary_of(root)
    if name is not None:
        raise CheckpointError(
            f"{root} is a temporary directory left by an interrupted save of {name}, an incomplete checkpoint; "
            f"load {root.parent / name} (the next save to it deletes this directory)"
        )
    old = interrupted_swap(root, MARKER)
    if old is None:
        return root
    logger.warning(
        "checkpoint %s is missing: a save with overwrite=True was interrupted after moving it aside to %s; reading it "
        "from there (the next save to %s moves it back)",
        root,
        old.name,
        root.name,
    )
    return old


def _valid_marker(info: dict[str, Any]) -> bool:
    files = info.get("files")
    return (
        isinstance(files, dict)
        and all(isinstance(n, str) and n == Path(n).name and n != ".." and type(v) is int for n, v in files.items())
        and isinstance(info.get("metadata_sha256"), str)
        and isinstance(info.get("extra", {}), dict)
    )


def open_verified(path: str | os.PathLike) -> tuple[Path, dict[str, Any], Metadata]:
    """`read_checkpoint_info`, plus the directory actually read (see `_resolve`)."""
    root = _resolve(Path(path))
    if not root.is_dir():
        left = [] if root.exists() else leftovers(root)
        if left:
            raise CheckpointError(
                f"{root} does not exist: a save to it was interrupted before it finished (its incomplete "
                f"{left[-1].name} is left); save it again"
            )
        raise CheckpointError(f"{root} is not a directory; pass a checkpoint directory written by save_checkpoint")
    marker = root / MARKER
    if not marker.is_file():
        raise CheckpointError(
            f"{root} is not a ds_plugin checkpoint (no {MARKER}: an incomplete save, or another tool's); refusing to "
            "unpickle its .metadata — only load checkpoints written by ds_plugin.checkpoint.save_checkpoint"
        )
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{marker} is unreadable ({one_line(e)}); the checkpoint is corrupted") from e
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise CheckpointError(f"{marker} is not a {FORMAT} marker; the directory was not written by ds_plugin")
    if not isinstance(info.get("version"), int) or info["version"] > FORMAT_VERSION:
        raise CheckpointError(
            f"{root} has checkpoint format version {info.get('version')!r}; this ds_plugin reads up to "
            f"{FORMAT_VERSION} — upgrade ds_plugin"
        )
    if not _valid_marker(info):  # a hand-edited or forged marker: fail in one line, not in a traceback further on
        raise CheckpointError(f"{marker} is malformed (files, metadata_sha256 or extra); the checkpoint is corrupted")
    files = info["files"]
    for name, size in files.items():
        if name == METADATA:  # its sha256 is checked below
            continue
        f = root / name
        actual = f.stat().st_size if f.is_file() else None
        if actual != size:
            raise CheckpointError(
                f"{f} has {actual} bytes, {size} recorded at save time: the checkpoint is truncated or corrupted"
            )
    if not (root / METADATA).is_file():
        raise CheckpointError(f"{root} has no {METADATA}: the checkpoint is incomplete or corrupted")
    data = (root / METADATA).read_bytes()
    if hashlib.sha256(data).hexdigest() != info["metadata_sha256"]:
        raise CheckpointError(
            f"{root / METADATA} does not match the sha256 recorded in {MARKER}: it was modified after the "
            "checkpoint was written; refusing to unpickle it"
        )
    try:
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:
        raise CheckpointError(f"{root / METADATA} refused: {one_line(e)}; refusing to load it") from e
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{root / METADATA} does not hold DCP metadata; the checkpoint is corrupted")
    # DCP opens `root / relative_path` for every item: only the checkpoint's own, size-checked files.
    storage = metadata.storage_data or {}
    stray = [getattr(s, "relative_path", s) for s in (storage.values() if isinstance(storage, dict) else [storage])]
    stray = [p for p in stray if not (isinstance(p, str) and p in files)]
    if stray:
        raise CheckpointError(
            f"{root / METADATA} refers to {repr(stray[0])[:80]}, not a file of this checkpoint: it is corrupted or "
            "forged; refusing to load it"
        )
    return root, info, metadata


def read_checkpoint_info(path: str | os.PathLike) -> tuple[dict[str, Any], Metadata]:
    """Verify a checkpoint directory and return (its marker dict, its DCP metadata), unpickled safely.

    Args:
        path: the checkpoint directory.

    Raises:
        CheckpointError: not our checkpoint, a newer format, modified/truncated files, disallowed pickle, or the
            temporary directory of an unfinished save.
    """
    return open_verified(path)[1:]


class VerifiedReader(FileSystemReader):
    """A FileSystemReader that hands DCP the metadata already verified, instead of `pickle.load`-ing it again."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path)
        self._verified = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = self._verified
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = getattr(self, "load_id", None)
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor values must pass `torch.load(weights_only=True)` first."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except Exception as e:
            raise CheckpointError(f"value {read_item.dest_index.fqn!r} is not plain data; refusing it") from e
        value.seek(0)
        super().load_bytes(read_item, value)
