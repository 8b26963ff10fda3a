"""The data-parallel device mesh ZeRO shards over.

Every stage uses one 1-D `DeviceMesh` over all data-parallel ranks, so the fp32 master weights and the
optimizer state are `Shard(0)` DTensors on the same mesh whatever the stage: a checkpoint written at one
stage or world size loads at another. hpZ does not need a second mesh: FSDP2 builds the intra-group
process groups itself from `reshard_after_forward=k` (the plan's, see `plan.py`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ds_plugin.runtime.faults import settle_at_exit

__all__ = [
    "ZeroSetupError",
    "data_parallel_mesh",
    "mesh_device",
    "torch_dtype",
]

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
    if dist.is_available() and dist.is_initialized() and "gloo" in str(dist.get_backend()):
        settle_at_exit()  # gloo's worker threads can abort a finished process at exit otherwise
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
