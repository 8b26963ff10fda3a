"""The strategies' checkpoints: one sharded DCP directory per save (`ds_plugin.zero.checkpoint`), holding the
engine's weights, optimizer and counters, the framework's own state, and what `ds-plugin export` needs.

The framework's state (epoch, loops, callbacks, schedulers, Fabric's plain entries) is `torch.save`d into the
marker's JSON `extra` and read back with `weights_only=True`, so the checkpoint module's pickle guard holds for it
too. The keys of the one transformers model inside a LightningModule lose its attribute prefix (recorded as
`hf_prefix`), so `ds-plugin export` writes names `from_pretrained` loads.
"""

from __future__ import annotations

import base64
import io
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

# The unsharded gather lives in the core, beside `save_adapter`; the strategies' `full_state_dict` calls it here.
from ds_plugin.peft_adapters import full_state_dict
from ds_plugin.strategies._model import hf_models
from ds_plugin.zero.checkpoint import CheckpointError, load_checkpoint, model_metadata, read_checkpoint_info
from ds_plugin.zero.checkpoint import save_checkpoint as save_dcp
from ds_plugin.zero.engine import ZeroEngine

__all__ = ["full_state_dict", "load_engine_checkpoint", "remove_checkpoint", "save_engine_checkpoint"]


def _export_metadata(module: nn.Module) -> dict[str, Any]:
    """`model_metadata` of the one transformers model inside (keys then relative to it), else of the module."""
    models = hf_models(module)
    peft = any(hasattr(m, "peft_config") for m in module.modules())
    if len(models) == 1 and models[0][0] and not peft:
        name, hf = models[0]
        return {**model_metadata(hf), "hf_prefix": f"{name}."}
    meta = model_metadata(module)
    meta.pop("hf_config", None)
    meta.pop("hf_architecture", None)
    return meta


def _rename(state: dict[str, Any], prefix: str | None) -> dict[str, Any]:
    """Keys under the transformers model lose its prefix, so `ds-plugin export` writes its own key names."""
    if not prefix:
        return state
    out = {k.removeprefix(prefix): v for k, v in state.items()}
    return out if len(out) == len(state) else state


def _encode(state: Any) -> str:
    buf = io.BytesIO()
    torch.save(state, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _decode(text: str, path: Path) -> Any:
    try:
        return torch.load(io.BytesIO(base64.b64decode(text)), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, ValueError, TypeError) as e:  # TypeError: a forged non-string
        # torch's message suggests `weights_only=False`, which would run whatever a forged checkpoint holds: name
        # the refused global instead, and allow-listing only for the user's own classes in their own checkpoints.
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
        what = found.group(1) if found else f"an object ({lines[0]})"
        raise CheckpointError(
            f"{path}: the framework state holds {what}, which is not plain data; refusing to unpickle it — if this "
            "checkpoint is your own and the class yours, allow it with torch.serialization.add_safe_globals([...])"
        ) from None


def save_engine_checkpoint(
    path: str | os.PathLike,
    engine: ZeroEngine,
    *,
    model_state: dict[str, Any],
    optimizer_state: dict[str, Any] | None,
    framework_state: dict[str, Any],
) -> Path:
    """One DCP checkpoint directory: sharded weights and optimizer, the engine's counters, the framework's state.

    Args:
        path: the checkpoint directory (replaced if it exists, as a framework overwrites its files).
        engine: the engine that trained the model.
        model_state: `engine.model_state_dict()`.
        optimizer_state: `engine.optimizer_state_dict()`, or None for weights only.
        framework_state: the rest of the framework's checkpoint (epoch, loops, callbacks, schedulers ...).
    """
    meta = _export_metadata(engine.module)
    renamed = _rename(model_state, meta.get("hf_prefix"))
    if renamed is model_state:  # no prefix, or renaming would collide: export writes the module's own names
        meta = {k: v for k, v in meta.items() if k not in ("hf_prefix", "hf_config", "hf_architecture")}
    extra = {
        **meta,
        "engine": engine.engine_state_dict(),
        "ds_config": engine.config.to_deepspeed(include_ignored=False),
        "framework_state": _encode(framework_state),
    }
    return save_dcp(
        path,
        model_state=renamed,
        optimizer_state=optimizer_state,
        extra=extra,
        overwrite=True,
    )


def load_engine_checkpoint(path: str | os.PathLike, engine: ZeroEngine, *, optimizer: bool) -> dict[str, Any]:
    """Load a checkpoint written by `save_engine_checkpoint` into the engine; returns the framework's state.

    Args:
        path: the checkpoint directory (any stage, any world size).
        engine: the engine to load into.
        optimizer: also load the optimizer state and step counters (when the checkpoint has them).
    """
    root = Path(path)
    info, _ = read_checkpoint_info(root)
    extra = info.get("extra", {})
    model_state = engine.model_state_dict()
    load_optim = optimizer and bool(info.get("has_optimizer")) and engine.optimizer is not None
    optim_state = engine.optimizer_state_dict() if load_optim else None
    load_checkpoint(root, model_state=_rename(model_state, extra.get("hf_prefix")), optimizer_state=optim_state)
    engine.load_model_state_dict(model_state)
    if optim_state is not None:
        engine.load_optimizer_state_dict(optim_state)
        if extra.get("engine"):
            engine.load_engine_state_dict(extra["engine"])
    return _decode(extra["framework_state"], root) if "framework_state" in extra else {}


def remove_checkpoint(path: str | os.PathLike) -> None:
    """Delete a checkpoint directory (or file); a symlink (`save_last="link"`) loses only the link.

    Args:
        path: what a framework asks to remove (rank 0 only).
    """
    path = Path(path)
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
