"""Sharded checkpoints on torch.distributed.checkpoint (DCP): atomic, resharding, and guarded.

One directory per checkpoint. Every rank writes its own shards (DCP's FileSystemWriter); rank 0 adds
`ds_plugin_checkpoint.json` (format version, the sha256 of DCP's `.metadata`, the size of every file, and
the caller's small JSON `extra`). A checkpoint saved at world size W loads at any W', including a single
process without torch.distributed (DCP reshards on load).

Crash safety. A save writes `.NAME.partial-<id>` beside NAME, marker last, and renames it to NAME only once
complete, so a crash (even SIGKILL) before that leaves NAME as it was. `overwrite=True` puts the new directory in
place with one atomic step where Linux offers one (`renameat2(RENAME_EXCHANGE)`, through ctypes): NAME holds the
old checkpoint or the new one at every instant, and the old one, now under the temporary name, is deleted after.
Elsewhere (another OS, a filesystem or sandbox without it) it takes two renames: NAME to `.NAME.old-<id>`, then
the new one to NAME, then the old one's marker deleted before the rest of it. A crash between the renames leaves
NAME missing and a `.NAME.old-<id>` with its marker: reads of NAME then read that, with a warning, and the next
save to NAME first moves it back (only readers going through this module see that bridge). Every save to NAME
deletes what crashed saves of NAME left (`.NAME.partial-*`, `.NAME.old-*`), and such a temporary directory is never
read as a checkpoint: it is refused as incomplete. The directory moves are in `ds_plugin.zero._atomic_dir`.

The pickle guard. DCP stores `.metadata` with `pickle` and its stock reader runs `pickle.load`, and its
stock planner reads non-tensor values (optimizer hyper-parameters) with `torch.load(weights_only=False)`:
either can run code from a crafted checkpoint. Here (1) nothing is read unless our marker file is present,
well-formed, has a known format version, and the `.metadata` bytes match the sha256 and every file the size it
records; (2) `.metadata` is then unpickled by a restricted unpickler (`ds_plugin.zero._safe_pickle`) that only
builds DCP's metadata classes (their Enum members also in the `getattr(Class, "NAME")` form that Python
3.11.0-3.11.4 write), `torch.Size`, dtypes, layouts and paths, and the metadata may name no file but the
checkpoint's own; (3) non-tensor values are loaded with `torch.load(weights_only=True)` (tensors already are).
(1) catches foreign, truncated or edited checkpoints but not a forger, who can rewrite the marker too; (2) and (3)
are what stop code execution even then. Not covered: a forged checkpoint can still hold wrong numbers or huge
shapes.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.fsdp import FSDPModule

from ds_plugin.zero._atomic_dir import exchange as _exchange
from ds_plugin.zero._atomic_dir import fsync_dir as _fsync_dir
from ds_plugin.zero._atomic_dir import interrupted_swap as _interrupted_swap
from ds_plugin.zero._atomic_dir import leftovers as _leftovers
from ds_plugin.zero._atomic_dir import remove as _remove
from ds_plugin.zero._atomic_dir import temporary as _temporary
from ds_plugin.zero._atomic_dir import temporary_of as _temporary_of
from ds_plugin.zero._safe_pickle import MetadataUnpickler as _MetadataUnpickler

__all__ = [
    "MARKER",
    "CheckpointError",
    "load_checkpoint",
    "load_fsdp",
    "load_full_state_dict",
    "model_metadata",
    "read_checkpoint_info",
    "save_checkpoint",
    "save_fsdp",
]

logger = logging.getLogger(__name__)

MARKER = "ds_plugin_checkpoint.json"
FORMAT = "ds_plugin.dcp"
FORMAT_VERSION = 1
_METADATA = ".metadata"
# DCP warns when it runs without torch.distributed; here one process is a supported case, not a slip.
_SINGLE_PROCESS_WARNING = ".*assuming the intent is to (save|load) in a single process.*"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message is one line naming the cause and the fix."""


# -- small collective helpers (no-ops without torch.distributed) ------------------------------------------------
def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist_on() else 0


def _from_rank0(obj: Any) -> Any:
    """Rank 0's `obj` on every rank, so a decision (or an error) taken on rank 0 is taken by all."""
    if not _dist_on():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _one_line(exc: BaseException) -> str:
    failures = getattr(exc, "failures", None)
    if isinstance(exc, CheckpointException) and failures:
        # DCP gathers every rank's exception and traceback into one dump; report the first rank's error.
        rank, (inner, _) = next(iter(sorted(failures.items(), key=lambda kv: kv[0])))
        detail = (
            _one_line(inner) if isinstance(inner, CheckpointError) else f"{type(inner).__name__}: {_one_line(inner)}"
        )
        return f"rank {rank}: {detail}"
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[-1] if lines else type(exc).__name__


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _resolve(root: Path) -> Path:
    """The directory that holds the checkpoint named `root`: `root` itself, or what an interrupted swap set aside."""
    name = _temporary_of(root)
    if name is not None:
        raise CheckpointError(
            f"{root} is a temporary directory left by an interrupted save of {name}, an incomplete checkpoint; "
            f"load {root.parent / name} (the next save to it deletes this directory)"
        )
    old = _interrupted_swap(root, MARKER)
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


def _read(path: str | os.PathLike) -> tuple[Path, dict[str, Any], Metadata]:
    """`read_checkpoint_info`, plus the directory actually read (see `_resolve`)."""
    root = _resolve(Path(path))
    if not root.is_dir():
        left = [] if root.exists() else _leftovers(root)
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
            "unpickle its .metadata — only load checkpoints written by ds_plugin.zero.checkpoint.save_checkpoint"
        )
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{marker} is unreadable ({_one_line(e)}); the checkpoint is corrupted") from e
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
        if name == _METADATA:  # its sha256 is checked below
            continue
        f = root / name
        actual = f.stat().st_size if f.is_file() else None
        if actual != size:
            raise CheckpointError(
                f"{f} has {actual} bytes, {size} recorded at save time: the checkpoint is truncated or corrupted"
            )
    if not (root / _METADATA).is_file():
        raise CheckpointError(f"{root} has no {_METADATA}: the checkpoint is incomplete or corrupted")
    data = (root / _METADATA).read_bytes()
    if hashlib.sha256(data).hexdigest() != info["metadata_sha256"]:
        raise CheckpointError(
            f"{root / _METADATA} does not match the sha256 recorded in {MARKER}: it was modified after the "
            "checkpoint was written; refusing to unpickle it"
        )
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:
        raise CheckpointError(f"{root / _METADATA} refused: {_one_line(e)}; refusing to load it") from e
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{root / _METADATA} does not hold DCP metadata; the checkpoint is corrupted")
    # DCP opens `root / relative_path` for every item: only the checkpoint's own, size-checked files.
    storage = metadata.storage_data or {}
    stray = [getattr(s, "relative_path", s) for s in (storage.values() if isinstance(storage, dict) else [storage])]
    stray = [p for p in stray if not (isinstance(p, str) and p in files)]
    if stray:
        raise CheckpointError(
            f"{root / _METADATA} refers to {repr(stray[0])[:80]}, not a file of this checkpoint: it is corrupted or "
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
    return _read(path)[1:]


class _VerifiedReader(FileSystemReader):
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


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor values must pass `torch.load(weights_only=True)` first."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except Exception as e:
            raise CheckpointError(f"value {read_item.dest_index.fqn!r} is not plain data; refusing it") from e
        value.seek(0)
        super().load_bytes(read_item, value)


# -- save ------------------------------------------------------------------------------------------------------
def _json_extra(extra: dict[str, Any] | None) -> dict[str, Any]:
    try:
        return json.loads(json.dumps(extra or {}))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"extra must be JSON-serialisable ({_one_line(e)}); store tensors in the state") from e


def _prepare_tmp(final: Path, overwrite: bool) -> tuple[str | None, str | None]:
    """Rank 0: (error, temporary directory name). Repairs and clears what crashed saves of `final` left behind."""
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        old = _interrupted_swap(final, MARKER)
        if old is not None:  # NAME means the previous checkpoint until this save succeeds: put it back first
            os.replace(old, final)
            _fsync_dir(final.parent)
            logger.warning("restored checkpoint %s from %s, set aside by an interrupted save", final, old.name)
        if final.exists() and not overwrite:
            return f"{final} already exists; choose a new directory or pass overwrite=True", None
        for stale in _leftovers(final):
            _remove(stale)
        tmp = _temporary(final, "partial", uuid.uuid4().hex[:12])
        tmp.mkdir()
    except OSError as e:
        return f"cannot create a checkpoint next to {final}: {_one_line(e)}", None
    return None, tmp.name


def _finalize(tmp: Path, final: Path, info: dict[str, Any]) -> str | None:
    """Rank 0: write the marker and move the finished directory into place. Returns an error or None."""
    try:
        info["metadata_sha256"] = _sha256(tmp / _METADATA)
        info["files"] = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file()}
        with open(tmp / MARKER, "w") as f:
            json.dump(info, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if not (final.exists() or final.is_symlink()):
            os.replace(tmp, final)
            _fsync_dir(final.parent)
        elif _exchange(tmp, final):  # `final` now holds the new checkpoint and `tmp` the old one
            _fsync_dir(final.parent)
            _remove(tmp)
        else:  # two renames; a crash between them is bridged by `_interrupted_swap`
            old = _temporary(final, "old", tmp.name.rsplit("-", 1)[1])
            os.replace(final, old)
            os.replace(tmp, final)
            _fsync_dir(final.parent)
            if not old.is_symlink():  # first the marker: a half-deleted old directory must never look restorable
                (old / MARKER).unlink(missing_ok=True)
            _remove(old)
    except OSError as e:
        return f"cannot finish checkpoint {final}: {_one_line(e)}"
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
        "world_size": dist.get_world_size() if _dist_on() else 1,
        "torch_version": torch.__version__,
        "has_optimizer": optimizer_state is not None,
        "extra": _json_extra(extra),
    }
    err, tmp_name = _from_rank0(_prepare_tmp(final, overwrite) if _rank() == 0 else (None, None))
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
            dcp.save(state, storage_writer=FileSystemWriter(tmp), no_dist=not _dist_on())
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"saving {final} failed: {_one_line(e)}") from e
    err = _from_rank0(_finalize(tmp, final, info) if _rank() == 0 else None)
    if err:
        raise CheckpointError(err)
    if _rank() == 0:
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
    reader, planner = _VerifiedReader(root, metadata), _SafeLoadPlanner(allow_partial_load=partial)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        try:
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=no_dist)
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as e:
            raise CheckpointError(f"loading {root} failed: {_one_line(e)}") from e


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
    root, info, metadata = _read(path)
    extra = info.get("extra", {})
    state: dict[str, Any] = {"model": model_state}
    if optimizer_state is not None:
        if not info.get("has_optimizer"):
            raise CheckpointError(f"checkpoint {root} holds no optimizer state; load it with optimizer_state=None")
        state["optim"] = optimizer_state
    partial = _check_keys(root, state, metadata, extra)
    _dcp_load(root, state, metadata, no_dist=not _dist_on(), partial=partial)
    return extra


def load_full_state_dict(path: str | os.PathLike, prefix: str = "model") -> dict[str, torch.Tensor]:
    """Every tensor under `prefix` as a full (unsharded) CPU tensor, read in this process alone.

    Args:
        path: the checkpoint directory.
        prefix: "model" for the weights, "optim" for the optimizer state.
    """
    root, _, metadata = _read(path)
    head = prefix + "."
    inner = {
        k[len(head) :]: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for k, md in metadata.state_dict_metadata.items()
        if k.startswith(head) and isinstance(md, TensorStorageMetadata)
    }
    _dcp_load(root, {prefix: inner}, metadata, no_dist=True)
    return inner


# -- raw FSDP2 / plain models ----------------------------------------------------------------------------------
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


def save_fsdp(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
    *,
    overwrite: bool = False,
) -> Path:
    """`save_checkpoint` for a raw `fully_shard` (or plain) model and optimizer, with `model_metadata` added.

    Args:
        path: the checkpoint directory.
        model: the model.
        optimizer: its optimizer, or None for weights only.
        extra: more JSON-able metadata (its keys win over `model_metadata`'s).
        overwrite: as in `save_checkpoint`.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is not None:
        model_state, optim_state = get_state_dict(model, optimizer)
    else:
        model_state, optim_state = get_model_state_dict(model), None
    meta = {**model_metadata(model), **(extra or {})}
    return save_checkpoint(path, model_state=model_state, optimizer_state=optim_state, extra=meta, overwrite=overwrite)


def load_fsdp(
    path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Load a checkpoint into a raw `fully_shard` (or plain) model and optimizer; returns the `extra` dict.

    Args:
        path: the checkpoint directory.
        model: a model built like the saved one, sharded at any world size (or not at all).
        optimizer: its optimizer, or None to load the weights only.
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    if optimizer is None:
        model_state = get_model_state_dict(model)
        extra = load_checkpoint(path, model_state=model_state)
        set_model_state_dict(model, model_state)
        return extra
    model_state, optim_state = get_state_dict(model, optimizer)
    extra = load_checkpoint(path, model_state=model_state, optimizer_state=optim_state)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    return extra
