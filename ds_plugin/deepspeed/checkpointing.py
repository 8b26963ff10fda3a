"""`deepspeed.checkpointing`: DeepSpeed's activation checkpointing API on torch's own checkpoint.

    import ds_plugin.deepspeed as deepspeed
    deepspeed.checkpointing.configure(None, deepspeed_config="ds_config.json")  # its "activation_checkpointing"
    hidden = deepspeed.checkpointing.checkpoint(layer, hidden, mask)

`checkpoint(function, *args)` keeps only the function's inputs and runs it again during backward to rebuild what
backward needs (`torch.utils.checkpoint`, non-reentrant, with the RNG state restored, so dropout draws the same
masks). It works on every ZeRO stage: under stage 3 the recomputation gathers the block's weights as its backward
does anyway.

`configure` reads the config's `activation_checkpointing` block, or its own arguments (which win), as DeepSpeed does.
`cpu_checkpointing` (`checkpoint_in_cpu`) keeps the checkpointed inputs in host memory until backward, and
`synchronize_checkpoint_boundary` (`synchronize`) synchronizes the GPU at each checkpoint's start and end. The others
are reported, with the reason, when set: `partition_activations` splits the inputs across a model-parallel group,
which ds_plugin does not have; `contiguous_memory_optimization` and `number_checkpoints` copy them into a
preallocated buffer, where here PyTorch's caching allocator holds them (`PYTORCH_CUDA_ALLOC_CONF=
expandable_segments:True` is its remedy for fragmentation); `profile` times DeepSpeed's own checkpoint code. The
model-parallel RNG helpers (`get_cuda_rng_tracker`, `model_parallel_cuda_manual_seed`) belong to tensor parallelism
and are refused in one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint

from ds_plugin._schema import ConfigError

__all__ = [
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "reset",
    "set_num_layers",
]

logger = logging.getLogger(__name__)

BLOCK = "activation_checkpointing"
# The block's keys (DeepSpeed 0.19.8's `DeepSpeedActivationCheckpointingConfig`) -> why a set one has no effect here;
# None: it acts.
KEYS: dict[str, str | None] = {
    "partition_activations": "it splits checkpoints across a model-parallel group, and ds_plugin has none",
    "contiguous_memory_optimization": "PyTorch's caching allocator holds checkpoints (fragmentation: "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)",
    "number_checkpoints": "it sizes the contiguous buffer of contiguous_memory_optimization",
    "cpu_checkpointing": None,
    "synchronize_checkpoint_boundary": None,
    "profile": "it times DeepSpeed's own checkpoint code",
}
_NO_MODEL_PARALLEL = "tensor and pipeline parallelism are not part of ds_plugin"


@dataclasses.dataclass
class _Settings:
    configured: bool = False
    cpu_checkpointing: bool = False
    synchronize: bool = False


_SETTINGS = _Settings()


def configure(
    mpu_: Any,
    deepspeed_config: str | os.PathLike | Mapping[str, Any] | None = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Set how `checkpoint` runs, from the config's `activation_checkpointing` block and these arguments.

    Args:
        mpu_: DeepSpeed's model-parallel unit: must be None (one-line error otherwise).
        deepspeed_config: a DeepSpeed config (a .json/.yaml path or a dict); only its `activation_checkpointing`
            block is read.
        partition_activations, contiguous_checkpointing, num_checkpoints, checkpoint_in_cpu, synchronize,
            profile: override the block's `partition_activations`, `contiguous_memory_optimization`,
            `number_checkpoints`, `cpu_checkpointing`, `synchronize_checkpoint_boundary`, `profile` when not None.
    """
    if mpu_ is not None:
        raise ValueError(f"deepspeed.checkpointing.configure: mpu_ must be None ({_NO_MODEL_PARALLEL})")
    values = dict(_block(deepspeed_config))
    given = {  # the block's key each argument overrides
        "partition_activations": partition_activations,
        "contiguous_memory_optimization": contiguous_checkpointing,
        "number_checkpoints": num_checkpoints,
        "cpu_checkpointing": checkpoint_in_cpu,
        "synchronize_checkpoint_boundary": synchronize,
        "profile": profile,
    }
    values.update({key: value for key, value in given.items() if value is not None})
    for key, value in values.items():
        _check(key, value)
    ignored = {key: KEYS[key] for key, value in values.items() if KEYS[key] is not None and value}
    if ignored:
        logger.warning(
            "deepspeed.checkpointing: no effect here: %s", "; ".join(f"{k} ({why})" for k, why in ignored.items())
        )
    _SETTINGS.configured = True
    _SETTINGS.cpu_checkpointing = bool(values.get("cpu_checkpointing", False))
    _SETTINGS.synchronize = bool(values.get("synchronize_checkpoint_boundary", False))


def _block(config: str | os.PathLike | Mapping[str, Any] | None) -> Mapping[str, Any]:
    """The `activation_checkpointing` block of a config given as a path or a dict ({} when it has none)."""
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        from ds_plugin._config_file import read_config_file

        config = read_config_file(Path(config))
        if not isinstance(config, Mapping):
            raise ConfigError(f"deepspeed.checkpointing.configure: the config is a {type(config).__name__}, not a dict")
    block = config.get(BLOCK) or {}
    if not isinstance(block, Mapping):
        raise ConfigError(f"{BLOCK}: expected a dict, got {type(block).__name__}")
    return block


def _check(key: str, value: Any) -> None:
    if key not in KEYS:
        raise ConfigError(f"{BLOCK}.{key}: unknown key; valid keys: {', '.join(KEYS)}")
    if key == "number_checkpoints":
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ConfigError(f"{BLOCK}.{key}: expected a positive integer or null, got {value!r}")
    elif not isinstance(value, bool):
        raise ConfigError(f"{BLOCK}.{key}: expected true or false, got {value!r}")


def is_configured() -> bool:
    """Whether `configure` has run (`checkpoint` works either way, with the defaults until then)."""
    return _SETTINGS.configured


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)``, keeping only ``args`` for backward: what it computed inside is recomputed there.

    Args:
        function: the part of the model to checkpoint (a module or any callable).
        args: its positional arguments (tensors and anything else).
    """
    _boundary()
    offload = (
        torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
        if _SETTINGS.cpu_checkpointing
        else contextlib.nullcontext()
    )
    with offload:
        outputs = torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
    _boundary()
    return outputs


non_reentrant_checkpoint = checkpoint


def _boundary() -> None:
    if _SETTINGS.synchronize and torch.cuda.is_available():
        torch.cuda.synchronize()


def reset() -> None:
    """DeepSpeed frees its contiguous checkpoint buffers here; there are none to free."""


def set_num_layers(nlayers: int) -> None:
    """DeepSpeed sizes its contiguous checkpoint buffers by this; there are none to size.

    Args:
        nlayers: the number of checkpointed layers.
    """


def get_cuda_rng_tracker() -> Any:
    """DeepSpeed's model-parallel RNG tracker: refused (tensor parallelism is not part of ds_plugin)."""
    raise NotImplementedError(
        f"deepspeed.checkpointing.get_cuda_rng_tracker: {_NO_MODEL_PARALLEL}; dropout outside tensor-parallel "
        "regions needs no tracker"
    )


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """DeepSpeed's model-parallel seeding: refused (tensor parallelism is not part of ds_plugin).

    Args:
        seed: the seed.
    """
    raise NotImplementedError(
        f"deepspeed.checkpointing.model_parallel_cuda_manual_seed: {_NO_MODEL_PARALLEL}; seed with "
        f"torch.manual_seed({seed})"
    )
