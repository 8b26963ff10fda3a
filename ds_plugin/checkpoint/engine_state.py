"""The engine's checkpoint: the one save and load behind the engine API, Lightning, Fabric and Accelerate.

One DCP directory (`ds_plugin.checkpoint.io`) holds the engine's sharded weights and optimizer state; its JSON
`extra` holds the engine's step counters and loss scaler (`engine`), the DeepSpeed config, what `ds-plugin export`
needs (`ds_plugin.checkpoint.metadata`), the engine API's `client_state` (the loop's own JSON) and a framework's
state (`framework_state`: epoch, loops, callbacks, schedulers, Fabric's plain entries).

What a load restores is DeepSpeed's rule (`DeepSpeedEngine.load_checkpoint`):

- the weights, always;
- the optimizer state when it is asked for (`optimizer`, DeepSpeed's `load_optimizer_states`), the engine has an
  optimizer and the checkpoint holds its state; the fp16 loss scaler comes back with it, as DeepSpeed keeps it in
  its ZeRO optimizer's state;
- the step counters (global, micro and skipped steps), with or without the optimizer state: only `module_only`
  (DeepSpeed's `load_module_only`, the weights alone) leaves them as they are.

Lightning asks for the optimizer state while fitting, Fabric when the objects to load include the optimizer,
Accelerate and the engine API unless told otherwise: the flags Lightning's and Fabric's own DeepSpeed strategies pass
to DeepSpeed, so the counters come back in every one of them.

The framework's state is `torch.save`d into `extra` as base64 and read back with `weights_only=True`, so the pickle
guard (`ds_plugin.checkpoint.guard`) holds for it too.
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ds_plugin.checkpoint.guard import CheckpointError, read_checkpoint_info
from ds_plugin.checkpoint.io import load_checkpoint, save_checkpoint
from ds_plugin.checkpoint.metadata import export_metadata, strip_prefix, without_hf_config

if TYPE_CHECKING:
    from ds_plugin.zero.engine import ZeroEngine

__all__ = ["FROZEN_EXCLUDED", "LoadedCheckpoint", "client_json", "frozen_keys", "load_engine_checkpoint",
           "save_engine_checkpoint"]  # fmt: skip

#: `extra` key: the names of the frozen weights a checkpoint was saved without (`exclude_frozen`).
FROZEN_EXCLUDED = "frozen_excluded"


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What `load_engine_checkpoint` hands back besides the state it loaded into the engine."""

    path: Path
    """The checkpoint directory read."""
    client_state: dict[str, Any]
    """The engine API's `client_state` (empty when the saver passed none)."""
    framework_state: dict[str, Any]
    """The framework's state (empty when the saver passed none)."""


def frozen_keys(module: torch.nn.Module, model_state: dict[str, Any]) -> set[str]:
    """The keys of `model_state` that hold parameters of `module` that do not require grad (a quantized frozen
    weight's components, ``<name>.codes``, ..., included); buffers are not parameters and are never among them.

    Args:
        module: the engine's model.
        model_state: its state dict, as `ZeroEngine.model_state_dict` gives it.
    """
    frozen = {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k for k in model_state if k in frozen or k.rpartition(".")[0] in frozen}


def _frozen_saved_names(engine: ZeroEngine, model_state: dict[str, Any], saved: dict[str, Any]) -> set[str]:
    """`frozen_keys` under the names the checkpoint stores them by (`saved`: `model_state` renamed, in its order)."""
    frozen = frozen_keys(engine.module, model_state)
    return {name for key, name in zip(model_state, saved, strict=True) if key in frozen}


def client_json(client_state: dict[str, Any] | None) -> dict[str, Any]:
    """`client_state` as plain JSON, or one line saying why it is not.

    Args:
        client_state: the loop's own state (epoch, batches consumed, ...).
    """
    try:
        return json.loads(json.dumps(client_state or {}))
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"client_state must be JSON (numbers, strings, lists, dicts): {e}; convert tensors with .tolist()"
        ) from None


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
    optimizer: bool = True,
    model_state: dict[str, Any] | None = None,
    optimizer_state: dict[str, Any] | None = None,
    client_state: dict[str, Any] | None = None,
    framework_state: dict[str, Any] | None = None,
    exclude_frozen: bool = False,
) -> Path:
    """Write the engine's checkpoint directory, replacing one of that name; a collective: every rank calls it.

    Args:
        path: the checkpoint directory (replaced atomically if it exists, as frameworks overwrite their files).
        engine: the engine that trained the model.
        optimizer: include the optimizer state (when the engine has an optimizer).
        model_state: the weights to save; default `engine.model_state_dict()` (Lightning passes the dict its
            hooks saw).
        optimizer_state: the optimizer state to save with `optimizer`; default `engine.optimizer_state_dict()`.
        client_state: the loop's own JSON (the engine API's), returned by `load_engine_checkpoint`.
        framework_state: the rest of a framework's checkpoint (epoch, loops, callbacks, schedulers ...): plain data
            that `torch.load(weights_only=True)` reads back.
        exclude_frozen: leave out the parameters that do not require grad (a quantized one's components too), as
            DeepSpeed's `exclude_frozen_parameters`: a LoRA checkpoint then holds the adapter, not the base. Their
            names are recorded; a load keeps the loading model's own values for them (build it from the same base).

    Returns:
        The checkpoint directory.
    """
    meta = export_metadata(engine.module)
    if model_state is None:
        model_state = engine.model_state_dict()
    saved = strip_prefix(model_state, meta.get("hf_prefix"))
    if meta.get("hf_prefix") and saved is model_state:  # renaming would collide: export writes the module's names
        meta = without_hf_config(meta)
    excluded = _frozen_saved_names(engine, model_state, saved) if exclude_frozen else set()
    saved = {k: v for k, v in saved.items() if k not in excluded}
    if not optimizer or engine.optimizer is None:
        optimizer_state = None
    elif optimizer_state is None:
        optimizer_state = engine.optimizer_state_dict()
    extra = {
        **meta,
        "engine": engine.engine_state_dict(),
        "ds_config": engine.config.to_deepspeed(include_ignored=False),
    }
    if excluded:
        extra[FROZEN_EXCLUDED] = sorted(excluded)
    if client_state is not None:
        extra["client_state"] = client_json(client_state)
    if framework_state is not None:
        extra["framework_state"] = _encode(framework_state)
    return save_checkpoint(path, model_state=saved, optimizer_state=optimizer_state, extra=extra, overwrite=True)


def load_engine_checkpoint(
    path: str | os.PathLike, engine: ZeroEngine, *, optimizer: bool = True, module_only: bool = False
) -> LoadedCheckpoint:
    """Load a checkpoint written by `save_engine_checkpoint` (any stage, any world size) into the engine.

    Restores the weights; the optimizer state and loss scaler with `optimizer`; the step counters unless
    `module_only` (the rule in this module's docstring).

    Args:
        path: the checkpoint directory.
        engine: the engine to load into.
        optimizer: also load the optimizer state and the loss scaler (DeepSpeed's `load_optimizer_states`), when
            the checkpoint has them.
        module_only: load the weights alone, leaving the optimizer and the step counters as they are (DeepSpeed's
            `load_module_only`).
    """
    root = Path(path)
    info, _ = read_checkpoint_info(root)
    extra = info.get("extra", {})
    with_optimizer = optimizer and not module_only and bool(info.get("has_optimizer")) and engine.optimizer is not None
    model_state = engine.model_state_dict()
    optimizer_state = engine.optimizer_state_dict() if with_optimizer else None
    saved_names = strip_prefix(model_state, extra.get("hf_prefix"))  # the same tensors, under the saved names
    excluded = set(extra.get(FROZEN_EXCLUDED) or ())
    if excluded:  # saved without its frozen weights: this model's own values stay, if it holds them frozen too
        trained = sorted(excluded - _frozen_saved_names(engine, model_state, saved_names))
        if trained:
            raise CheckpointError(
                f"checkpoint {root} was saved without its frozen weights (exclude_frozen_parameters), but this model "
                f"trains {trained[0]!r} ({len(trained)} such): freeze the same parameters as the run that saved it"
            )
        saved_names = {k: v for k, v in saved_names.items() if k not in excluded}
    load_checkpoint(root, model_state=saved_names, optimizer_state=optimizer_state)
    engine.load_model_state_dict(model_state)
    if optimizer_state is not None:
        engine.load_optimizer_state_dict(optimizer_state)
    counters = extra.get("engine")
    if counters and not module_only:
        engine.load_engine_state_dict(counters if with_optimizer else {**counters, "loss_scaler": None})
    framework = _decode(extra["framework_state"], root) if "framework_state" in extra else {}
    return LoadedCheckpoint(root, dict(extra.get("client_state") or {}), framework)
