"""FSDP2's collectives on gloo (CPU ranks): overlapped with backward, and on one host faster than gloo's own.

Two things differ from a GPU run, and both cost time on CPU:

- FSDP2 issues a unit's gradient reduce-scatter synchronously on CPU (there are no streams to put it on), so the
  next unit's backward waits for it. `AllReduceScatter` issues it asynchronously and parks its landing in
  `InFlightReductions`, which lands it while the next unit's backward runs.
- On one host the "wire" is memory, and gloo's all-reduce (a pipelined ring) beats its own reduce-scatter and, for
  large buffers, its all-gather. Measured on 2 ranks of a 2-core VM: 13M fp32 elements reduce-scatter in 47 ms and
  as an all-reduce in 33 ms; they all-gather in 46 ms and, as an all-reduce, 27 ms. An all-gather becomes an
  all-reduce by zeroing the output except this rank's chunk and OR-ing the bits (`all_gather_by_or`): exact, -0.0
  and NaN payloads included. An all-reduce moves twice the bytes of either collective, so where ranks sit on
  several hosts (a real link between them) gloo's own collectives are kept.
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "AllGatherByOr",
    "AllReduceScatter",
    "CommBuffers",
    "InFlightReductions",
    "all_gather_by_or",
    "or_gather_pays",
]

#: Output sizes from which an all-gather is faster as an OR all-reduce on one host (same VM, 2 ranks): fp32
#: 16 MB 11.1 -> 8.4 ms, 52 MB 46 -> 27 ms, 104 MB 85 -> 64 ms, but 12 MB 4.3 -> 5.8 ms; bf16 26 MB 11.6 -> 12.6 ms,
#: 52 MB 40.5 -> 26 ms. gloo's all-gather slows down sharply past a size that is smaller for 4-byte elements.
_OR_GATHER_MIN_BYTES = {4: 16 << 20}
_OR_GATHER_MIN_BYTES_OTHER = 32 << 20


def or_gather_pays(output: Tensor) -> bool:
    """Whether `all_gather_by_or` is worth it (and possible) for this all-gather output on one host."""
    nbytes = output.numel() * output.element_size()
    least = _OR_GATHER_MIN_BYTES.get(output.element_size(), _OR_GATHER_MIN_BYTES_OTHER)
    return nbytes >= least and nbytes % 4 == 0 and output.is_contiguous()


def all_gather_by_or(output: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """`all_gather_into_tensor` as an all-reduce: this rank's chunk in a zeroed output, the bits OR-ed.

    Args:
        output: the gathered result, rank-major, `world` times `input_tensor`'s elements (`or_gather_pays`).
        input_tensor: this rank's chunk; it may be the output's own row (FSDP2 gathers in place).
        group: the process group (gloo).
        async_op: return the collective's work instead of waiting for it.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    rows = output.view(world, -1)
    rows[:rank].zero_()
    rows[rank + 1 :].zero_()
    mine = input_tensor.reshape(-1)
    if mine.data_ptr() != rows[rank].data_ptr():  # FSDP2 passes a view of the output's own row: nothing to copy
        rows[rank].copy_(mine)
    return dist.all_reduce(output.view(torch.int32), op=dist.ReduceOp.BOR, group=group, async_op=async_op)


class CommBuffers:
    """FSDP2's custom-collective protocol also asks the comm object for its buffers: plain `torch.empty`."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class AllGatherByOr(CommBuffers):
    """FSDP2's all-gather on one host: `all_gather_by_or` where it pays (`or_gather_pays`), else gloo's own."""

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, async_op: bool = False):
        if or_gather_pays(output_tensor):
            return all_gather_by_or(output_tensor, input_tensor, group, async_op)
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class InFlightReductions:
    """Gradient reductions issued but not yet landed, oldest first, shared by the units of one model.

    Each new reduction lands the ones beyond `depth` (the previous unit's, which had this unit's backward to
    travel in), and whatever is left lands in a callback at the end of backward, before anything reads a
    gradient. Memory: `depth` extra unsharded gradient buffers of one unit each, as FSDP2 holds on a GPU.
    """

    def __init__(self, depth: int = 1) -> None:
        self.depth = depth
        self._pending: collections.deque = collections.deque()
        self._queued = False

    def add(self, land) -> None:
        """Park `land` (a reduction in flight; calling it completes it) and land what is beyond `depth`."""
        self._pending.append(land)
        while len(self._pending) > self.depth:
            self._pending.popleft()()
        if self._queued:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self.drain)
            self._queued = True
        except RuntimeError:  # not inside a backward pass: nothing would come back for it
            self.drain()

    def drain(self) -> None:
        """Land every reduction still in flight."""
        self._queued = False
        while self._pending:
            self._pending.popleft()()


class AllReduceScatter(CommBuffers):
    """FSDP2's gradient reduce-scatter on gloo, overlapped with backward; on one host, as an all-reduce.

    On one host (`by_all_reduce`) the input, FSDP2's own staging buffer, is summed in place and this rank keeps its
    chunk; across hosts gloo's reduce-scatter sums into a chunk-sized buffer. SUM and AVG (FSDP2's op for
    fp32/bf16) only: AVG divides after the sum, in the reduction's dtype; any other op takes gloo's reduce-scatter
    as FSDP2 would.

    Args:
        params: the parameters this FSDP2 unit owns (not those of units nested in it).
        in_flight: where the reduction is parked to land later; None lands it at once. It lands at once anyway
            when FSDP2 would read the output right away: the op is SUM (FSDP2 then divides the output itself, as
            for fp16 gradients), a unit's gradient accumulates into an existing `.grad` (a second backward without
            accumulation steps), or a post-accumulate-grad hook is registered on one of its parameters (it would
            read the gradient before it has landed).
        by_all_reduce: all ranks share one host.
    """

    def __init__(
        self,
        params: list[Tensor] | None = None,
        in_flight: InFlightReductions | None = None,
        *,
        by_all_reduce: bool = True,
    ) -> None:
        self._params = params or []
        self._in_flight = in_flight
        self._by_all_reduce = by_all_reduce

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, op, async_op: bool = False
    ):
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        world = dist.get_world_size(group)
        if self._by_all_reduce:
            work = dist.all_reduce(input_tensor, group=group, async_op=True)
            mine = input_tensor.view(world, -1)[dist.get_rank(group)]
        else:
            mine = torch.empty_like(output_tensor)
            work = dist.reduce_scatter_tensor(mine, input_tensor, group=group, async_op=True)
        if (
            self._in_flight is None
            or op != dist.ReduceOp.AVG
            or any(p.grad is not None or getattr(p, "_post_accumulate_grad_hooks", None) for p in self._params)
        ):
            work.wait()
            _reduced_into(output_tensor, mine, op, world)
            return None
        # FSDP2 goes on at once: it casts the output to the parameters' dtype when that differs (bf16 gradients of
        # fp32 master weights) and views the gradients into the result, so the landing writes there instead.
        cast = any(p.dtype != output_tensor.dtype for p in self._params if p.requires_grad)

        def land() -> None:
            work.wait()
            _reduced_into(self._cast_buffer(output_tensor.numel()) if cast else output_tensor, mine, op, world)

        self._in_flight.add(land)
        return None

    def _cast_buffer(self, numel: int) -> Tensor:
        # The flat buffer FSDP2 cast the reduced chunk into: the storage every gradient of this unit views.
        for p in self._params:
            if p.grad is not None:
                local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                if local.untyped_storage().nbytes() == numel * local.element_size():
                    return local.new_empty(0).set_(local.untyped_storage(), 0, (numel,))
        raise RuntimeError(
            "ds_plugin: FSDP2's gradient buffer for an overlapped reduction was not found: this torch version's "
            f"FSDP2 reduce-scatter is not the one ds_plugin was built against (torch {torch.__version__}); "
            "use torch 2.11-2.13"
        )


def _reduced_into(out: Tensor, mine: Tensor, op, world: int) -> None:
    # This rank's chunk of the summed input, averaged for AVG in the reduction's dtype, into `out` (any float dtype).
    out.view(mine.shape).copy_(mine / world if op == dist.ReduceOp.AVG else mine)
