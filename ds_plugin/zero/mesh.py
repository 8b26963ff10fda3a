"""The data-parallel device mesh ZeRO shards over, and the checks that need the world size.

Every stage uses one 1-D `DeviceMesh` over all data-parallel ranks, so the fp32 master weights and the
optimizer state are `Shard(0)` DTensors on the same mesh whatever the stage: a checkpoint written at one
stage or world size loads at another. hpZ does not need a second mesh: FSDP2 builds the intra-group
process groups itself from `reshard_after_forward=k`.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ds_plugin.config import ConfigError, TrainingConfig

__all__ = [
    "ZeroSetupError",
    "data_parallel_mesh",
    "mesh_device",
    "reshard_after_forward",
    "resolve_for_world",
    "torch_dtype",
]

logger = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ZeroSetupError(ValueError):
    """A model or argument ZeRO cannot work with. The one-line message names the problem and the fix."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config dtype name.

    Args:
        name: "fp32", "bf16" or "fp16".
    """
    return _DTYPES[name]


def _mesh_device_type() -> str:
    # gloo only moves CPU tensors, so a gloo-only group means a CPU mesh even where an accelerator exists.
    backend = str(dist.get_backend())
    if backend == "gloo" or not torch.accelerator.is_available():
        return "cpu"
    return torch.accelerator.current_accelerator().type


def data_parallel_mesh(mesh: DeviceMesh | None = None) -> DeviceMesh:
    """The 1-D data-parallel mesh ZeRO shards over.

    Args:
        mesh: a mesh to use as is; it must be 1-D (every rank is one data-parallel replica). None builds
            one over the whole world on the accelerator the process group drives (CPU for gloo).

    Raises:
        ZeroSetupError: torch.distributed is not initialized, or the mesh is not 1-D.
    """
    if mesh is not None:
        if mesh.ndim != 1:
            raise ZeroSetupError(
                f"mesh: a {mesh.ndim}-D mesh was given; ZeRO here shards over one data-parallel dimension, "
                "pass a 1-D mesh (e.g. mesh['dp'])"
            )
        return mesh
    if not (dist.is_available() and dist.is_initialized()):
        raise ZeroSetupError(
            "torch.distributed is not initialized; call torch.distributed.init_process_group() first "
            "(one process: init_process_group('gloo', store=torch.distributed.HashStore(), rank=0, world_size=1))"
        )
    return init_device_mesh(_mesh_device_type(), (dist.get_world_size(),), mesh_dim_names=("dp",))


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank's shards live on for a mesh.

    Args:
        mesh: the data-parallel mesh.
    """
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = torch.get_device_module(mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def resolve_for_world(config: TrainingConfig, world_size: int) -> TrainingConfig:
    """Resolve what the config leaves to the world size (an "auto" hpZ group = the ranks of one node).

    Args:
        config: the training config.
        world_size: the data-parallel world size.
    """
    if config.zero_optimization.zero_hpz_partition_size == "auto":
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        config = config.resolve(ranks_per_node=min(per_node, world_size))
    return config


def reshard_after_forward(config: TrainingConfig, world_size: int) -> bool | int:
    """FSDP2's `reshard_after_forward` for the config's stage and hpZ group size.

    Stage 2 keeps gathered weights from forward to backward (False); stage 3 frees them (True); hpZ with
    k > 1 keeps a 1/k secondary shard inside each group of k ranks (the int k), so backward's all-gather
    stays inside a node.

    Args:
        config: the training config (stage 2 or 3).
        world_size: the data-parallel world size.

    Raises:
        ConfigError: the hpZ group size does not divide the world size.
    """
    if config.stage == 2:
        return False
    k = config.zero_optimization.hpz_partition_size
    if k <= 1:
        return True
    if k > world_size or world_size % k:
        raise ConfigError(
            f"zero_optimization.zero_hpz_partition_size: {k} does not divide the world size {world_size}; "
            "use a divisor of the world size (usually the ranks per node) or 1 to turn hpZ off"
        )
    if k == world_size:
        # A secondary group spanning the whole world is the primary one; FSDP2 rejects the int form here.
        logger.info("hpZ partition size %d equals the world size: plain stage 3", k)
        return True
    return k
