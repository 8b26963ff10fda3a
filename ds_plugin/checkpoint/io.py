"""Sharded checkpoints on torch.distributed.checkpoint (DCP): atomic, resharding, and guarded.

One directory per checkpoint. Every rank writes its own shards (DCP's FileSystemWriter); rank 0 adds
`ds_plugin_checkpoint.json` (format version, the sha256 of DCP's `.metadata`, the size of every file, and
the caller's small JSON `extra`). A checkpoint saved at world size W loads at any W', including a single
process without torch.distributed (DCP reshards on load). Everything read goes through the pickle guard
(`ds_plugin.checkpoint.guard`) first.

Crash safety. A save writes `.NAME.partial-<id>` beside NAME, marker last, and renames it to NAME only once
complete, so a crash (even SIGKILL) before that leaves NAME as it was. `overwrite=True` puts the new directory in
place with one atomic step where Linux offers one (`renameat2(RENAME_EXCHANGE)`, through ctypes): NAME holds the
old checkpoint or the new one at every instant, and the old one, now under the temporary name, is deleted after.
Elsewhere (another OS, a filesystem or sandbox without it) it takes two renames: NAME to `.NAME.old-<id>`, then
the new one to NAME, then the old one's marker deleted before the rest of it. A crash between the renames leaves
NAME missing and a `.NAME.old-<id>` with its marker: reads of NAME then read that, with a warning, and the next
save to NAME first moves it back (only readers going through this package see that bridge). Every save to NAME
deletes what crashed saves of NAME left (`.NAME.partial-*`, `.NAME.old-*`), and such a temporary directory is never
read as a checkpoint: it is refused as incomplete. The directory moves are in `ds_plugin.checkpoint._atomic_dir`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from ds_plugin.checkpoint._atomic_dir import (
    exchange,
    fsync_dir,
    interrupted_swap,
    leftovers,
    remove,
    temporary,
)
from ds_plugin.checkpoint.guard import (
    FORMAT,
    FORMAT_VERSION,
    MARKER,
    METADATA,
    CheckpointError,
    SafeLoadPlanner,
    VerifiedReader,
    one_line,
    open_verified,
)

__all__ = [
    "dist_on",
    "from_rank0",
    "load_checkpoint",
    "load_full_state_dict",
    "on_rank0",
    "remove_checkpoint",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)

# DCP warns when it runs without torch.distributed; here one process is a supported case, not a slip.
_SINGLE_PROCESS_WARNING = ".*assuming the intent is to (save|load) in a single process.*"


# -- small collective helpers (no-ops without torch.distributed) ------------------------------------------------
def dist_on() -> bool:
    """Whether torch.distributed is initialised (every helper here also works in one plain process)."""
    return dist.is_available() and dist.is_initialized()


def on_rank0() -> bool:
    """Whether this process is rank 0 (or the only process)."""
    return not dist_on() or dist.get_rank() == 0


def from_rank0(obj: Any) -> Any:
    """Rank 0's `obj` on every rank, so a decision (or an error) taken on rank 0 is taken by all."""
    if not dist_on():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# -- save ------------------------------------------------------------------------------------------------------
def _json_extra(extra: dict[str, Any] | None) -> dict[str, Any]:
    try:
        return json.loads(json.dumps(extra or {}))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"extra must be JSON-serialisable ({one_line(e)}); store tensors in the state") from e


def _prepare_tmp(final: Path, overwrite: bool) -> tuple[str | None, str | None]:
    """Rank 0: (error, temporary directory name). Repairs and clears what crashed saves of `final` left behind."""
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        old = interrupted_swap(final, MARKER)
        if old is not None:  # NAME means the previous checkpoint until this save succeeds: put it back first
            os.replace(old, final)
            fsync_dir(final.parent)
            logger.warning("restored checkpoint %s from %s, set aside by an interrupted save", final, old.name)
        if final.exists() and not overwrite:
            return f"{final} already exists; choose a new directory or pass overwrite=True", None
        for stale in leftovers(final):
            remove(stale)
        tmp = temporary(final, "partial", uuid.uuid4().hex[:12])
        tmp.mkdir()
    except OSError as e:
        return f"cannot create a checkpoint next to {final}: {one_line(e)}", None
    return None, tmp.name


def _finalize(tmp: Path, final: Path, info: dict[str, Any]) -> str | None:
    """Rank 0: write the marker and move the finished directory into place. Returns an error or None."""
    try:
        info["metadata_sha256"] = _sha256(tmp / METADATA)
        info["files"] = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file()}
        with open(tmp / MARKER, "w") as f:
            json.dump(info, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        if not (final.exists() or final.is_symlink()):
            os.replace(tmp, final)
            fsync_dir(final.parent)
        elif exchange(tmp, final):  # `final` now holds the new checkpoint and `tmp` the old one
            fsync_dir(final.parent)
            remove(tmp)
        else:  # two renames; a crash between them is bridged by `interrupted_swap`
            old = temporary(final, "old", tmp.name.rsplit("-", 1)[1])
            os.replace(final, old)
            os.replace(tmp, final)
            fsync_dir(final.parent)
            if not old.is_symlink():  # first the marker: a half-deleted old directory must never look restorable
                (old / MARKER).unlink(missing_ok=True)
            remove(old)
    except OSError as e:
        return f"cannot finish checkpoint {final}: {one_line(e)}"
    return None


def save_checkpoint(
    path: str | os.PathLike,
    *,
    model_state: dict[str, Any],
    optimizer_state: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a sharded checkpoint directory atomically; a collective: every rank calls it.

    Args:
        path: the checkpoint directory to create (all ranks must see the same filesystem).
        model_state: the model state dict (DTensor shards, or plain tensors in one process).
        optimizer_state: the optimizer state dict keyed by parameter names (DCP's `get_state_dict` form).
        extra: small JSON-able metadata (step, loss-scaler state, config, `model_metadata(model)`).
        overwrite: replace an existing directory of that name (swapped in, then the old one removed).

    Returns:
        The checkpoint directory.
    """
    final = Path(path).absolute()
    info = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "world_size": dist.get_world_size() if dist_on() else 1,
        "torch_version": torch.__version__,
        "has_optimizer": optimizer_state is not None,
        "extra": _json_extra(extra),
    }
    err, tmp_name = from_rank0(_prepare_tmp(final, overwrite) if on_rank0() else (None, None))
    if err:
        raise CheckpointError(err)
    tmp = final.parent / tmp_name
    state: dict[str, Any] = {"model": model_state}
    if optimizer_state is not None:
        state["optim"] = optimizer_state
    try:
        # DCP gathers every rank's write result to rank 0, which writes .metadata last: when it returns on
        # rank 0, all shards are on disk (fsynced), so the rename below needs no further barrier.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
            dcp.save(state, storage_writer=FileSystemWriter(tmp), no_dist=not dist_on())
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        if on_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"saving {final} failed: {one_line(e)}") from e
    err = from_rank0(_finalize(tmp, final, info) if on_rank0() else None)
    if err:
        raise CheckpointError(err)
    if on_rank0():
        logger.info("saved checkpoint %s", final)
    return final


# -- load ------------------------------------------------------------------------------------------------------
def _global_shape(value: Any) -> tuple[int, ...] | None:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None  # a DTensor's shape is global


# An optimizer hyper-parameter that a newer torch added (AdamW's `decoupled_weight_decay` ...): a checkpoint
# from an older torch lacks it, and the optimizer's current value is the right one to keep.
_OPTIONAL_KEY = re.compile(r"optim\.param_groups\.\d+\.(?!params$)[^.]+")


def _check_keys(root: Path, state: dict[str, Any], metadata: Metadata, extra: dict[str, Any]) -> bool:
    """Fail with one line, before DCP does with a multi-rank dump, when the checkpoint is another model's.

    Returns whether some optional keys are absent (so the load must allow a partial state).
    """
    try:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    except ImportError:  # private helper moved: DCP's own (wrapped) error still applies
        return False
    flat, _ = flatten_state_dict(state)
    saved = metadata.state_dict_metadata
    hint = f" ({extra['model_class']})" if extra.get("model_class") else ""
    optional = [k for k in flat if k not in saved and _OPTIONAL_KEY.fullmatch(k)]
    missing = [k for k in flat if k not in saved and k not in optional]
    unexpected = [k for k in saved if k.startswith("model.") and k not in flat]
    if missing or unexpected:
        k = (missing or unexpected)[0]
        where = "has no entry for" if missing else "has an entry the model lacks:"
        raise CheckpointError(
            f"checkpoint {root} {where} {k!r} ({len(missing)} missing, {len(unexpected)} unexpected keys): it was "
            f"saved from a different model — build the model the checkpoint was saved from{hint}"
        )
    for k, value in flat.items():
        md = saved.get(k)
        shape = _global_shape(value)
        if isinstance(md, TensorStorageMetadata) and shape is not None and tuple(md.size) != shape:
            raise CheckpointError(
                f"{k!r} has shape {tuple(md.size)} in checkpoint {root} but {shape} in the model: build the model "
                f"with the checkpoint's config{hint}"
            )
        if isinstance(md, BytesStorageMetadata) and shape is not None:
            raise CheckpointError(f"{k!r} is a tensor in the model but not in checkpoint {root}{hint}")
    if optional:
        logger.warning("checkpoint %s predates %s; keeping the optimizer's current value", root, ", ".join(optional))
    return bool(optional)


def _dcp_load(root: Path, state: dict[str, Any], metadata: Metadata, no_dist: bool, partial: bool = False) -> None:
    reader, planner = VerifiedReader(root, metadata), SafeLoadPlanner(allow_partial_load=partial)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        try:
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=no_dist)
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as e:
            raise CheckpointError(f"loading {root} failed: {one_line(e)}") from e


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model_state: dict[str, Any],
    optimizer_state: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load a checkpoint in place into the given state dicts, resharding as needed; returns its `extra`.

    Tensors (DTensor shards or plain tensors) are filled in place; non-tensor entries (optimizer
    hyper-parameters) are replaced inside the dicts, so pass the dicts back to `set_state_dict` (or the
    engine's `load_*_state_dict`) afterwards. Works with or without torch.distributed initialised.

    Args:
        path: the checkpoint directory.
        model_state: the model state dict to fill (same keys as at save time).
        optimizer_state: the optimizer state dict to fill, or None to skip the optimizer.
    """
    root, info, metadata = open_verified(path)
    extra = info.get("extra", {})
    state: dict[str, Any] = {"model": model_state}
    if optimizer_state is not None:
        if not info.get("has_optimizer"):
            raise CheckpointError(f"checkpoint {root} holds no optimizer state; load it with optimizer_state=None")
        state["optim"] = optimizer_state
    partial = _check_keys(root, state, metadata, extra)
    _dcp_load(root, state, metadata, no_dist=not dist_on(), partial=partial)
    return extra


def load_full_state_dict(
    path: str | os.PathLike, prefix: str = "model", names: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor under `prefix` (or the named ones) as a full (unsharded) CPU tensor, read in this process alone.

    Args:
        path: the checkpoint directory.
        prefix: "model" for the weights, "optim" for the optimizer state.
        names: only these tensors (names under `prefix`), in this order; DCP reads only their bytes, so a
            checkpoint larger than memory can be read a few tensors at a time. None: all of them.
    """
    root, _, metadata = open_verified(path)
    head = prefix + "."
    tensors = {
        k[len(head) :]: md
        for k, md in metadata.state_dict_metadata.items()
        if k.startswith(head) and isinstance(md, TensorStorageMetadata)
    }
    if names is not None:
        names = list(names)
        missing = [n for n in names if n not in tensors]
        if missing:
            raise CheckpointError(f"checkpoint {root} holds no tensor {prefix}.{missing[0]}")
        tensors = {n: tensors[n] for n in names}
    inner = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype) for k, md in tensors.items()}
    _dcp_load(root, {prefix: inner}, metadata, no_dist=True)
    return inner


def remove_checkpoint(path: str | os.PathLike) -> None:
    """Delete a checkpoint directory (or file); a symlink (Lightning's `save_last="link"`) loses only the link.

    Unlike the clean-up of a save's temporary directories, a failure here raises: the caller asked for it.

    Args:
        path: what a framework asks to remove (rank 0 only).
    """
    remove(Path(path), ignore_errors=False)
