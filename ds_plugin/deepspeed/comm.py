"""`deepspeed.comm` as scripts call it: thin names over `torch.distributed` (no logging or profiling layer).

Each takes DeepSpeed's keyword arguments; the ones that only feed DeepSpeed's comms profiler (`prof`, `log_name`,
`debug`) are accepted and have no effect (`ds_plugin.runtime.comms_logger` records collectives instead).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ds_plugin.runtime import faults

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_initialized",
]

_PROFILER_ONLY = ("prof", "log_name", "debug")


def _plain(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k not in _PROFILER_ONLY}


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: Any = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """DeepSpeed's `init_distributed`: join the process group the launcher describes (nothing if it has started).

    Without launcher variables and without `rank`/`world_size` it starts a one-process group. The collective timeout
    is ds_plugin's (`DS_PLUGIN_TIMEOUT`, default 10 minutes) unless `timeout` is given.

    Args:
        dist_backend: "nccl" or "gloo"; default "nccl" on CUDA, else "gloo".
        auto_mpi_discovery: no effect (MPI discovery is not built; launch with torchrun or `ds-plugin launch`).
        distributed_port: `MASTER_PORT` when the launcher set none.
        verbose: no effect.
        timeout: a `timedelta` or seconds.
        init_method: where the ranks meet; default the launcher's `MASTER_ADDR`/`MASTER_PORT`.
        dist_init_required: False: do nothing.
        config: no effect.
        rank: this process's rank when no launcher set `RANK`.
        world_size: the number of ranks when no launcher set `WORLD_SIZE`.
    """
    if dist_init_required is False or is_initialized():
        return
    if rank >= 0 and world_size > 0:
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world_size))
        os.environ.setdefault("LOCAL_RANK", str(rank))
    if "RANK" in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    faults.init_distributed(dist_backend, timeout=timeout, init_method=init_method)


def is_initialized() -> bool:
    """Whether the process group has started."""
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Any = None) -> int:
    """This process's rank (0 before the process group starts, as DeepSpeed's scripts expect).

    Args:
        group: a process group; default all ranks.
    """
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    """The number of ranks (1 before the process group starts).

    Args:
        group: a process group; default all ranks.
    """
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    """This process's rank on its node: the launcher's `LOCAL_RANK` (0 without one)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None, **kwargs: Any) -> Any:
    """Wait for every rank.

    Args:
        group: a process group; default all ranks.
        async_op: return a work handle instead of waiting.
        device_ids: as in torch.distributed.barrier.
        kwargs: DeepSpeed's profiler arguments (no effect).
    """
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def all_reduce(
    tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: Any = None, async_op: bool = False, **kwargs: Any
) -> Any:
    """Reduce `tensor` across ranks in place.

    Args:
        tensor: the tensor, the same shape on every rank.
        op: the reduction (`ReduceOp.SUM` by default).
        group: a process group; default all ranks.
        async_op: return a work handle instead of waiting.
        kwargs: DeepSpeed's profiler arguments (no effect).
    """
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op, **_plain(kwargs))


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False, **kwargs: Any) -> Any:
    """Copy `tensor` from rank `src` to every rank, in place.

    Args:
        tensor: the tensor.
        src: the rank whose values everyone gets.
        group: a process group; default all ranks.
        async_op: return a work handle instead of waiting.
        kwargs: DeepSpeed's profiler arguments (no effect).
    """
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op, **_plain(kwargs))


def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False, **kwargs: Any
) -> Any:
    """Every rank's `tensor`, into `tensor_list` (one per rank).

    Args:
        tensor_list: the output tensors.
        tensor: this rank's tensor.
        group: a process group; default all ranks.
        async_op: return a work handle instead of waiting.
        kwargs: DeepSpeed's profiler arguments (no effect).
    """
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op, **_plain(kwargs))
