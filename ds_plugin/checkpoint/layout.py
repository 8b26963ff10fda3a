"""DeepSpeed's checkpoint layout for the engine API: `save_dir/<tag>/` per save, and `save_dir/latest` naming one.

`ZeroEngine.save_checkpoint(save_dir, tag, client_state)` writes `save_dir/<tag>` (default tag
`global_step<N>`, as DeepSpeed names it) through `save_engine_checkpoint` — atomic, so a crash mid-save leaves
only a hidden `.<tag>.partial-*` directory beside the older checkpoints — and then replaces `latest` atomically.
`ZeroEngine.load_checkpoint(save_dir)` loads `latest_checkpoint(save_dir)`: the checkpoint `latest` names when it is
complete, else the complete one with the most optimizer steps; partial and damaged directories are reported and
never loaded. `client_state` is the caller's own JSON (epoch, position in the data, ...): JSON keeps a
checkpoint from carrying code, and it is what a loop needs to continue on the same batch. What a load restores
(weights, optimizer, counters) is `ds_plugin.checkpoint.engine_state`'s rule.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ds_plugin.checkpoint.engine_state import client_json, load_engine_checkpoint, save_engine_checkpoint
from ds_plugin.checkpoint.guard import MARKER, CheckpointError, read_checkpoint_info
from ds_plugin.checkpoint.io import from_rank0, on_rank0

if TYPE_CHECKING:
    from ds_plugin.zero.engine import ZeroEngine

__all__ = ["LATEST", "latest_checkpoint", "load_engine_dir", "save_engine_dir"]

logger = logging.getLogger(__name__)

LATEST = "latest"


def _check_tag(tag: str) -> str:
    if not tag or tag != Path(tag).name or tag.startswith(".") or tag == LATEST:
        raise CheckpointError(
            f"checkpoint tag {tag!r} must be one plain directory name (no '/', not hidden, not {LATEST!r})"
        )
    return tag


def _write_latest(root: Path, tag: str) -> None:
    tmp = root / f".{LATEST}.tmp-{uuid.uuid4().hex[:12]}"
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)  # readers see the old tag or the new one, never half a name


def _read_latest(root: Path) -> str | None:
    try:
        return (root / LATEST).read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def latest_checkpoint(save_dir: str | os.PathLike) -> Path | None:
    """The checkpoint a restart should load from `save_dir`, or None when it holds no complete one.

    The one `save_dir/latest` names if it is complete; otherwise the complete checkpoint with the most optimizer
    steps (then the newest). Partial directories of interrupted saves and checkpoints that fail verification are
    logged as warnings and skipped.

    Args:
        save_dir: the directory `ZeroEngine.save_checkpoint` wrote into.
    """
    root = Path(save_dir)
    if not root.is_dir():
        return None
    complete: dict[str, tuple[int, float]] = {}
    for child in sorted(root.iterdir()):
        if not child.is_dir():
            continue
        if child.name.startswith("."):
            if ".partial-" in child.name:
                logger.warning("%s: left by an interrupted save; never loaded (the next save here removes it)", child)
            continue
        try:
            info, _ = read_checkpoint_info(child)
        except CheckpointError as e:
            logger.warning("skipping %s: %s", child, e)
            continue
        engine_state = info.get("extra", {}).get("engine") or {}
        complete[child.name] = (int(engine_state.get("global_steps", -1)), (child / MARKER).stat().st_mtime)
    named = _read_latest(root)
    if named in complete:
        return root / named
    if named is not None and not (root / named).exists():
        try:  # an overwrite interrupted mid-swap: the checkpoint module reads the intact copy it set aside
            read_checkpoint_info(root / named)
            return root / named
        except CheckpointError:
            pass
    if named is not None:
        logger.warning("%s names %r, which is not a complete checkpoint; using the newest complete one", root / LATEST,
                       named)  # fmt: skip
    if not complete:
        return None
    return root / max(complete, key=lambda name: complete[name])


def save_engine_dir(
    engine: ZeroEngine,
    save_dir: str | os.PathLike,
    tag: str | None = None,
    client_state: dict[str, Any] | None = None,
    *,
    save_latest: bool = True,
    exclude_frozen: bool = False,
) -> Path:
    """`ZeroEngine.save_checkpoint`: weights, optimizer, engine counters and `client_state` to `save_dir/<tag>`."""
    root = Path(save_dir)
    tag = _check_tag(tag if tag is not None else f"global_step{engine.global_steps}")
    client = client_json(client_state)  # refused before anything is touched
    if on_rank0():  # the run's own directory: partial saves a crash left behind (any tag) go now
        for stale in root.glob(".*.partial-*") if root.is_dir() else ():
            shutil.rmtree(stale, ignore_errors=True)
    path = save_engine_checkpoint(root / tag, engine, client_state=client, exclude_frozen=exclude_frozen)
    if save_latest:
        err = None
        if on_rank0():
            try:
                _write_latest(root, tag)
            except OSError as e:
                err = f"saved {path} but could not update {root / LATEST}: {e}"
        err = from_rank0(err)
        if err:
            raise CheckpointError(err)
    return path


def load_engine_dir(
    engine: ZeroEngine,
    load_dir: str | os.PathLike,
    tag: str | None = None,
    *,
    load_optimizer_states: bool = True,
    load_module_only: bool = False,
) -> tuple[Path | None, dict[str, Any]]:
    """`ZeroEngine.load_checkpoint`: returns (the directory loaded, its client_state), or (None, {}) if none."""
    root = Path(load_dir)
    if tag is None:
        found = latest_checkpoint(root) if on_rank0() else None
        path = from_rank0(None if found is None else str(found))
        if path is None:
            if on_rank0():
                logger.warning("no complete checkpoint in %s; nothing loaded", root)
            return None, {}
        path = Path(path)
    else:
        path = root / _check_tag(tag)
    loaded = load_engine_checkpoint(path, engine, optimizer=load_optimizer_states, module_only=load_module_only)
    return path, loaded.client_state
