"""Model-state bytes counted from tensor storage, shared by `bench zero-memory` and `bench lora-memory`.

What is counted: the storage bytes (`untyped_storage().nbytes()`, each storage once, so views and aliases are
not double counted; a DTensor counts its local shard; a `QuantizedWeight` counts each of its components) of
every
- frozen_params: parameters with `requires_grad=False` (only when the count separates them; otherwise they
  fall into compute_params or master_params by dtype);
- compute_params: the bf16 weights forward and backward use (stages 0/1: the model's own parameters;
  stages 2/3: FSDP2's all-gathered unsharded parameters, while their storage is allocated);
- master_params: the fp32 master weights (stages 0/1: the engine's master DTensors; 2/3: FSDP2's sharded
  parameters, padding included);
- grads: every `.grad` of those, FSDP2's unsharded and accumulated gradients, the engine's accumulation buffers;
- optimizer_state: every tensor in `optimizer.state` (AdamW's exp_avg, exp_avg_sq, step).
Activations, communication buffers, autograd's internal buffers and process RSS are not model states.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ds_plugin.quant.frozen.tensor import QuantizedWeight

__all__ = [
    "CATEGORIES",
    "COLORS",
    "FROZEN_CATEGORIES",
    "Ledger",
    "Recorder",
    "count_model_states",
    "fsdp_params",
    "local",
    "source_revision",
]

CATEGORIES = ("compute_params", "master_params", "grads", "optimizer_state")
FROZEN_CATEGORIES = ("frozen_params", *CATEGORIES)
# One colour per category in every chart.
COLORS = {
    "frozen_params": "tab:gray",
    "compute_params": "tab:blue",
    "master_params": "tab:orange",
    "grads": "tab:green",
    "optimizer_state": "tab:red",
}


def source_revision() -> dict[str, Any]:
    """The git commit the package ran from, and which engine files differed from it (benchmark provenance)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout: benchmarks/..

    def git(*args: str) -> str:
        # rstrip only: `status --porcelain` lines start with a status column that may be a space.
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout.rstrip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        modified = git(
            "status", "--porcelain", "--", "ds_plugin/zero", "ds_plugin/precision", "ds_plugin/quant"
        ).splitlines()
    except (OSError, subprocess.SubprocessError):
        return {"commit": None}
    return {"commit": commit or None, "engine_files_modified": [line[3:] for line in modified]}


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor: a DTensor's local shard, anything else as it is.

    Args:
        t: a tensor or DTensor.
    """
    return t.to_local() if isinstance(t, DTensor) else t


class Ledger:
    """Storage bytes by category; a storage is counted once, in the first category that reaches it.

    Args:
        categories: the category names, in report order.
    """

    def __init__(self, categories: Iterable[str] = CATEGORIES) -> None:
        self.bytes = dict.fromkeys(categories, 0)
        self.dtypes: dict[str, set[str]] = {c: set() for c in self.bytes}
        self._seen: set[int] = set()

    def add(self, category: str, tensor: torch.Tensor | None) -> int:
        """Count `tensor`'s storage under `category` unless a category already holds it; returns the bytes added.

        Args:
            category: one of the ledger's categories.
            tensor: a tensor, DTensor (its local shard), `QuantizedWeight` (its components), or None.
        """
        if tensor is None:
            return 0
        t = local(tensor)
        if isinstance(t, QuantizedWeight):
            # A wrapper subclass has no storage of its own: its bytes are its components' (codes, scales).
            added = sum(self.add(category, part) for part in t.parts.values())
            if added:
                self.dtypes[category].add(t.fmt)
            return added
        storage = t.untyped_storage()
        # FSDP2 frees unsharded parameters by resizing their storage to 0: nothing held, nothing counted.
        if storage.nbytes() == 0 or storage.data_ptr() in self._seen:
            return 0
        self._seen.add(storage.data_ptr())
        self.bytes[category] += storage.nbytes()
        self.dtypes[category].add(str(t.dtype).removeprefix("torch."))
        return storage.nbytes()

    def snapshot(self) -> dict[str, Any]:
        """Total, per-category bytes and dtypes seen so far."""
        return {
            "bytes": sum(self.bytes.values()),
            "breakdown": dict(self.bytes),
            "dtypes": {c: sorted(d) for c, d in self.dtypes.items()},
        }


def fsdp_params(module: torch.nn.Module) -> Iterator[Any]:
    """FSDP2's per-parameter records (`FSDPParam`) of every FSDP module in `module`; private API (torch 2.9-2.13).

    Args:
        module: a model that went through `fully_shard` (nothing is yielded otherwise).
    """
    for group in fsdp_param_groups(module):
        yield from group.fsdp_params


def fsdp_param_groups(module: torch.nn.Module) -> Iterator[Any]:
    """FSDP2's parameter groups (one per `fully_shard` call) in `module`; private API, read only.

    Args:
        module: a model that went through `fully_shard`.
    """
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        yield from groups


def count_model_states(engine: Any, *, split_frozen: bool = False) -> dict[str, Any]:
    """Model-state storage bytes this rank holds now, by category (see the module docstring).

    Args:
        engine: a `ZeroEngine` (any stage).
        split_frozen: count parameters with `requires_grad=False` under "frozen_params" (FROZEN_CATEGORIES)
            before anything else reaches their storage.
    """
    from ds_plugin.zero.stage1 import replicated_state

    ledger = Ledger(FROZEN_CATEGORIES if split_frozen else CATEGORIES)
    replicated = replicated_state(engine.module)
    if split_frozen:
        # First, so that a frozen parameter's storage (and the stage 0/1 "master" that aliases it) lands here.
        # Stages 2/3: the sharded parameter is the stored one; while a unit is gathered, the module's
        # parameters are FSDP2's unsharded copies, which are compute_params like any other gathered weight.
        stored = (
            replicated.params if replicated is not None else [fp.sharded_param for fp in fsdp_params(engine.module)]
        )
        for p in stored:
            if not p.requires_grad:
                ledger.add("frozen_params", p)
    if replicated is not None:
        for p in replicated.params:
            ledger.add("compute_params", p)
        for m in replicated.masters:
            ledger.add("master_params", m)
        for t in [p.grad for p in replicated.params] + list(replicated._accum.values()):
            ledger.add("grads", t)
        for m in replicated.masters:
            ledger.add("grads", m.grad)
    else:
        for fp in fsdp_params(engine.module):
            for t in [*fp.all_gather_outputs, *getattr(fp, "_unsharded_inner_tensors", ())]:
                ledger.add("compute_params", t)
            ledger.add("compute_params", getattr(fp, "_sharded_post_forward_param_data", None))  # hpZ
            ledger.add("master_params", fp.sharded_param)
            ledger.add("grads", fp.sharded_param.grad)
            unsharded = getattr(fp, "_unsharded_param", None)
            ledger.add("grads", None if unsharded is None else unsharded.grad)
            ledger.add("grads", getattr(fp, "unsharded_accumulated_grad", None))
    # Anything the walks above missed (parameters outside FSDP2's groups, say) still counts.
    for p in engine.module.parameters():
        if split_frozen and not p.requires_grad:
            ledger.add("frozen_params", p)
        ledger.add("master_params" if p.dtype == torch.float32 else "compute_params", p)
        ledger.add("grads", p.grad)
    if engine.optimizer is not None:
        for state in engine.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    ledger.add("optimizer_state", value)
    return ledger.snapshot()


class Recorder:
    """Counts model states at named points of one training step, keeping the largest count per point.

    Args:
        engine: a `ZeroEngine`.
        split_frozen: passed to `count_model_states`.
    """

    def __init__(self, engine: Any, *, split_frozen: bool = False) -> None:
        self.engine = engine
        self.split_frozen = split_frozen
        self.probes: dict[str, dict[str, Any]] = {}
        self._handles: list[Any] = []
        self._restore: list[Any] = []

    def probe(self, name: str) -> None:
        """Count now and keep the count as `name` if it is the largest seen there."""
        snap = count_model_states(self.engine, split_frozen=self.split_frozen)
        if name not in self.probes or snap["bytes"] > self.probes[name]["bytes"]:
            self.probes[name] = snap

    def arm(self) -> None:
        """Hook the backward and the step of the next training step."""
        from ds_plugin.zero.stage1 import replicated_state

        replicated = replicated_state(self.engine.module)
        if replicated is not None:
            compute = list(replicated.params)
            # reduce_gradients() ends by dropping the compute gradients: just before that, the reduced fp32
            # master gradients and the bf16 compute gradients are both alive. Wrapped on the instance only.
            original = replicated.zero_compute_grads

            def zero_compute_grads() -> None:
                self.probe("after_reduce")
                original()

            replicated.zero_compute_grads = zero_compute_grads
            self._restore.append(lambda: delattr(replicated, "zero_compute_grads"))
        else:
            # FSDP2 keeps one unsharded Parameter per parameter across steps, created at the first all-gather.
            compute = [fp._unsharded_param for fp in fsdp_params(self.engine.module) if hasattr(fp, "_unsharded_param")]
        for p in compute:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(lambda _p: self.probe("backward")))
        self._handles.append(self.engine.optimizer.register_step_pre_hook(lambda *_: self.probe("in_step")))

    def disarm(self) -> None:
        """Remove every hook `arm` installed."""
        for handle in self._handles:
            handle.remove()
        for restore in self._restore:
            restore()
        self._handles.clear()
        self._restore.clear()
