"""The state-dict and checkpoint half of `ZeroEngine` (a mixin): the model's and the optimizer's state keyed by
parameter names at any stage, the step counters, and DeepSpeed's `save_checkpoint` / `load_checkpoint` on top of
them (the directory layout is `ds_plugin.checkpoint.layout`'s)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from ds_plugin.quant.frozen.quantize import load_quantized_parts, quantized_parts_state, quantized_weights
from ds_plugin.runtime.faults import peer_failure_guard
from ds_plugin.zero.mesh import ZeroSetupError
from ds_plugin.zero.optimizer import load_named_optimizer_state_dict, named_optimizer_state_dict

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from ds_plugin.precision.loss_scaler import DynamicLossScaler
    from ds_plugin.zero.optimizer import LocalShards
    from ds_plugin.zero.stage1 import ReplicatedState

__all__ = ["EngineStateDicts"]


class EngineStateDicts:
    """`ZeroEngine`'s state dicts and checkpoints; the attributes below are the engine's."""

    module: nn.Module
    mesh: DeviceMesh
    optimizer: torch.optim.Optimizer | None
    lr_scheduler: Any
    loss_scaler: DynamicLossScaler | None
    global_steps: int
    micro_steps: int
    skipped_steps: int
    resume_hint: str | None
    _replicated: ReplicatedState | None
    _local_shards: LocalShards | None
    _creating_state: bool

    def _names(self) -> dict[int, str]:
        return {id(m): name for m, name in zip(self._replicated.masters, self._replicated.fqns, strict=True)}

    def _to_layout(self, value: Any, master: nn.Parameter) -> DTensor:
        local = self._replicated.localize(value, master).to(master.to_local().device)
        return DTensor.from_local(
            local, self.mesh, master.placements, run_check=False, shape=master.shape, stride=master.stride()
        )

    def model_state_dict(self) -> dict[str, Any]:
        """The model's weights keyed by its own parameter names: `Shard(0)` DTensors, buffers as tensors.

        Trainable weights are the fp32 masters, frozen ones are in their stored dtype, and a frozen weight stored
        quantized appears as its components (`<name>.codes`, `<name>.scales`, ...), sharded by rows.
        """
        if self._replicated is not None:
            return quantized_parts_state(self._replicated.model_state_dict())
        return quantized_parts_state(get_model_state_dict(self.module))

    def load_model_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load weights saved by `model_state_dict` at any stage or world size.

        Args:
            state_dict: name -> DTensor (any placement) or full tensor.
        """
        quantized = frozenset(quantized_weights(self.module))
        if quantized:
            state_dict = load_quantized_parts(self.module, state_dict)
        if self._replicated is not None:
            self._replicated.load_model_state_dict(state_dict, loaded=quantized)
        else:
            # The quantized weights are loaded already; DCP's strict check would miss them.
            set_model_state_dict(self.module, state_dict, options=StateDictOptions(strict=not quantized))

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The optimizer state keyed by parameter names, `Shard(0)` DTensors (creates the state if needed)."""
        if self.optimizer is None:
            raise ZeroSetupError("optimizer_state_dict: the engine has no optimizer")
        if self._local_shards is not None:
            raise ZeroSetupError(
                f"optimizer_state_dict: {type(self.optimizer).__name__} quantizes its state per local shard, which "
                "cannot be resharded; checkpoint the model weights only, or use a torch.optim optimizer"
            )
        if self._replicated is None:
            return get_optimizer_state_dict(self.module, self.optimizer)
        # Creating missing state steps with zero gradients: keep pending gradients out of it.
        self._creating_state = True
        try:
            return named_optimizer_state_dict(self.optimizer, self._names(), self._replicated.export)
        finally:
            self._creating_state = False

    def load_optimizer_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load optimizer state saved by `optimizer_state_dict` at any stage or world size.

        Args:
            state_dict: {"state": {name: {...}}, "param_groups": [...]} as `optimizer_state_dict` returns it.
        """
        if self.optimizer is None:
            raise ZeroSetupError("load_optimizer_state_dict: the engine has no optimizer")
        if self._replicated is not None:
            load_named_optimizer_state_dict(self.optimizer, state_dict, self._names(), self._to_layout)
        else:
            set_optimizer_state_dict(self.module, self.optimizer, state_dict)

    def engine_state_dict(self) -> dict[str, Any]:
        """Step counters, the loss scaler and the LR scheduler: the plain-Python rest of a checkpoint."""
        state = {
            "global_steps": self.global_steps,
            "micro_steps": self.micro_steps,
            "skipped_steps": self.skipped_steps,
            "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
        }
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        return state

    def load_engine_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `engine_state_dict` returned.

        Args:
            state: the dict `engine_state_dict` returned.
        """
        self.global_steps = int(state["global_steps"])
        self.micro_steps = int(state["micro_steps"])
        self.skipped_steps = int(state["skipped_steps"])
        if self.loss_scaler is not None and state.get("loss_scaler"):
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        if self.lr_scheduler is not None and state.get("lr_scheduler"):
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])

    # ------------------------------------------------------------------ DeepSpeed's checkpoint API

    def save_checkpoint(
        self,
        save_dir: str | os.PathLike,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> Path:
        """Save weights, optimizer, counters and `client_state` to `save_dir/<tag>`; a collective: every rank calls it.

        Atomic: a crash mid-save leaves the older checkpoints and `latest` as they were.

        Args:
            save_dir: the run's checkpoint directory.
            tag: the checkpoint's name; default `global_step<N>`.
            client_state: the loop's own state as JSON (epoch, batches consumed, ...), returned by `load_checkpoint`.
            save_latest: point `save_dir/latest` at this checkpoint.
            exclude_frozen_parameters: leave out the weights that do not require grad (LoRA's base): the checkpoint
                holds what training changes; `load_checkpoint` keeps the loading model's own frozen weights, so
                build that model from the same base.
        """
        from ds_plugin.checkpoint.layout import save_engine_dir

        with peer_failure_guard("save_checkpoint", self.global_steps, self.resume_hint):
            return save_engine_dir(
                self, save_dir, tag, client_state, save_latest=save_latest, exclude_frozen=exclude_frozen_parameters
            )

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike,
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[Path | None, dict[str, Any]]:
        """Load `load_dir/<tag>`, by default the newest complete checkpoint; returns (its path, its client_state),
        or (None, {}) when `load_dir` holds no complete checkpoint (a fresh start). Any stage, any world size.

        Args:
            load_dir: the directory `save_checkpoint` wrote into.
            tag: a checkpoint name; default what `ds_plugin.checkpoint.latest_checkpoint` picks (`latest` if it
                is complete; partial or damaged directories are reported and skipped).
            load_optimizer_states: also load the optimizer state and the fp16 loss scaler (the step counters come
                back either way; `ds_plugin.checkpoint.engine_state` has the rule).
            load_module_only: load the weights only (no optimizer, no step counters).
        """
        from ds_plugin.checkpoint.layout import load_engine_dir

        with peer_failure_guard("load_checkpoint", self.global_steps, self.resume_hint):
            return load_engine_dir(
                self, load_dir, tag, load_optimizer_states=load_optimizer_states, load_module_only=load_module_only
            )
