"""FSDP2's collectives on gloo (CPU ranks): overlapped with backward, and faster than gloo's own.

Two things differ from a GPU run, and both cost time on CPU:

- FSDP2 issues a unit's gradient reduce-scatter synchronously on CPU (there are no streams to put it on), so the
  next unit's backward waits for it. `AllReduceScatter` issues it asynchronously and parks its landing in
  `InFlightReductions`, which lands it while the next unit's backward runs.
- gloo's own reduce-scatter and all-gather are slow for large buffers. A ring of point-to-point sends and
  receives (`ring_reduce_scatter`, `ring_all_gather`: world - 1 steps, each rank passing one chunk to
  the next) is the fastest way measured on a 2-core VM, at every size: 13M fp32 elements reduce-scatter in 15 ms
  on 2 ranks (gloo's reduce-scatter 43 ms, its all-reduce 21 ms) and 38 ms on 4 (95, 56 ms), and all-gather in
  18 ms on 2 (gloo's 39 ms, an all-reduce OR-ing the bits 27 ms) and 32 ms on 4 (85, 61 ms); 1M elements 1.2 and
  1.0 ms on 2 ranks (2.2 and 1.5 ms). Each chunk is summed on the one rank that keeps it. Step 0 is issued at
  once and the caller waits on the rest; on 2 ranks step 0 is the whole ring, so it travels while the caller
  computes. Each step posts its receive before its send, so the peer's bytes land in place as they arrive: on
  2 ranks, 39M bf16 elements (GPT-2 124M's tied embedding) all-gather in 24 ms and reduce-scatter in 51 ms
  against 30 and 59 ms with the send posted first (medians of 10 alternating runs; no difference below 4M).
  Across hosts too: on `ds-plugin bench slow-link` (2 hosts x 2 ranks, 1 Gbit/s) a ZeRO-3 step sent 252 MB per
  host over the link with the ring against 353 MB with gloo's collectives, and took 2.6 s against 3.7 s.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ds_plugin.runtime.comms_logger import record_collective, unrecorded
from ds_plugin.zero.cma import ring_link

__all__ = [
    "AllReduceScatter",
    "BufferPool",
    "CommBuffers",
    "DeferredWork",
    "InFlightReductions",
    "RingAllGather",
    "ring",
    "ring_all_gather",
    "ring_reduce_scatter",
]

# Point-to-point tags: every rank makes the same ring calls in the same order (as with any collective), so a
# counter gives each ring's messages the same tag on every rank and keeps rings in flight at once apart.
_TAGS = itertools.count(1)


class DeferredWork(dist.Work):
    """A collective whose caller waits on it later (`async_op=True`): it is in flight, `finish` completes it."""

    def __init__(self, finish) -> None:
        super().__init__()
        self._finish = finish

    def wait(self, timeout=None) -> bool:
        if self._finish is not None:
            self._finish, finish = None, self._finish
            finish()
        return True


def ring(rows: Tensor, group: dist.ProcessGroup, add: bool = False) -> Callable[[], None]:
    """Start a ring over `group` on `rows` (one per rank, rank-major); the returned call completes it.

    Without `add`, an all-gather: this rank's row is filled, and every other row ends as its owner's. With `add`,
    a reduce-scatter: every rank's rows are summed into this rank's own row (the others end as partial sums).
    World - 1 steps; step s sends one row to the next rank and receives one from the previous. Step 0 goes out now,
    the rest when the returned call runs. Between ranks of one host the steps read the peer's memory instead
    (`ds_plugin.zero.cma`); only there may a row be 2-d with contiguous rows (a strided view), gloo's sends need
    each row contiguous.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    tag = next(_TAGS)
    if world == 1:
        return lambda: None
    if add:  # step s adds the partial sum of row rank - s - 2 from the ranks before into this rank's partial sum
        send_row, recv_row = (lambda s: (rank - s - 1) % world), (lambda s: (rank - s - 2) % world)
    else:  # step s passes on the row received at step s - 1 (at step 0, this rank's own)
        send_row, recv_row = (lambda s: (rank - s) % world), (lambda s: (rank - s - 1) % world)
    link = ring_link(group)
    if link is not None:
        return link.ring(rows, world - 1, send_row, recv_row, add, tag)
    nxt, prev = (dist.get_global_rank(group, (rank + k) % world) for k in (1, -1))
    scratch = torch.empty_like(rows[0]) if add else None

    def step(s: int) -> list:
        into = rows[recv_row(s)] if scratch is None else scratch
        with unrecorded():  # the comms logger counts the ring once, as the collective it is
            return [dist.irecv(into, prev, group=group, tag=tag),
                    dist.isend(rows[send_row(s)], nxt, group=group, tag=tag)]  # fmt: skip

    pending = step(0)

    def finish() -> None:
        nonlocal pending
        for s in range(world - 1):
            for work in pending:
                work.wait()
            if add:
                rows[recv_row(s)].add_(scratch)
            pending = step(s + 1) if s + 2 < world else []

    return finish


def ring_all_gather(output: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """`all_gather_into_tensor` as a ring of sends and receives (exact: bytes are only copied).

    Args:
        output: the gathered result, rank-major, `world` times `input_tensor`'s elements, contiguous.
        input_tensor: this rank's chunk; it may be the output's own row (FSDP2 gathers in place).
        group: the process group (gloo).
        async_op: return a `DeferredWork` to wait on instead of waiting here.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    rows = output.view(world, -1)
    mine = input_tensor.reshape(-1)
    if mine.data_ptr() != rows[rank].data_ptr():
        rows[rank].copy_(mine)
    record_collective("all_gather_into_tensor", group, rows[rank].nbytes, output.nbytes)
    finish = ring(rows, group)
    if async_op:
        return DeferredWork(finish)
    finish()
    return None


def ring_reduce_scatter(input_tensor: Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """Sum `input_tensor` (rank-major chunks) over the group into this rank's own chunk of it, in place.

    Returns `(chunk, work)`: this rank's chunk of `input_tensor` (the sum, once `work` is waited on, or at once
    without `async_op`) and the `DeferredWork` (None without `async_op`). The other chunks hold partial sums.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    rows = input_tensor.view(world, -1)
    record_collective("reduce_scatter_tensor", group, input_tensor.nbytes, rows[rank].nbytes)
    finish = ring(rows, group, add=True)
    if async_op:
        return rows[rank], DeferredWork(finish)
    finish()
    return rows[rank], None


class CommBuffers:
    """FSDP2's custom-collective protocol also asks the comm object for its buffers: plain `torch.empty`, or a
    buffer handed back to `pool` (when one is set) by a reduction that no longer needs it."""

    pool: BufferPool | None = None

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> Tensor:
        if self.pool is not None:
            return self.pool.take(tuple(size), dtype, device)
        return torch.empty(*size, dtype=dtype, device=device)


class BufferPool:
    """Gradient reduction inputs kept for the next step: a unit's reduce-scatter input (its whole unsharded
    gradient) is handed back once its reduction has landed, and the next request of the same shape takes it.

    A fresh buffer of that size comes from newly mapped memory whenever the heap has no free run that large (the
    previous unit's is still in flight then), and its first write page-faults through all of it: on `ds-plugin bench
    slow-link`'s 2-block model that cost a rank up to 4k page faults a step (~4 ms of the backward). At most `keep`
    buffers are kept per shape: as many as are in flight at once (`InFlightReductions.depth` + 1).
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._free: dict[tuple, list[Tensor]] = collections.defaultdict(list)

    def take(self, size: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        """A buffer of this shape: a kept one, else a new one."""
        free = self._free.get((size, dtype, torch.device(device)))
        return free.pop() if free else torch.empty(*size, dtype=dtype, device=device)

    def give(self, buffer: Tensor) -> None:
        """Hand back a buffer nothing reads or writes any more."""
        free = self._free[(tuple(buffer.shape), buffer.dtype, buffer.device)]
        if len(free) < self.keep and buffer._base is None:
            free.append(buffer)


class RingAllGather(CommBuffers):
    """FSDP2's all-gather on gloo: `ring_all_gather`."""

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, async_op: bool = False):
        return ring_all_gather(output_tensor, input_tensor, group, async_op)


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
    """FSDP2's gradient reduce-scatter on gloo, overlapped with backward, as a ring.

    The input, FSDP2's own staging buffer, is summed in place into this rank's chunk (`ring_reduce_scatter`). SUM
    and AVG (FSDP2's op for fp32/bf16) only: AVG divides after the sum, in the reduction's dtype; any other op takes
    gloo's reduce-scatter as FSDP2 would. qgZ's quantized reduction (`ds_plugin.zero.zeropp`) is a subclass: it
    replaces how the sum is computed (`_start`), and lands the same way. Until `overlap` is called, a reduction
    lands at once.
    """

    def __init__(self) -> None:
        self._params: list[Tensor] = []
        self._in_flight: InFlightReductions | None = None

    def overlap(self, params: list[Tensor], in_flight: InFlightReductions) -> None:
        """Park this unit's reductions in `in_flight`, to land while the next unit's backward runs.

        Args:
            params: the parameters this FSDP2 unit owns (not those of units nested in it).
            in_flight: the queue shared by the model's units. A reduction still lands at once when FSDP2 would read
                the output right away: the op is SUM (FSDP2 then divides the output itself, as for fp16
                gradients), a unit's gradient accumulates into an existing `.grad` (a second backward without
                accumulation steps), or a post-accumulate-grad hook is registered on one of its parameters (it
                would read the gradient before it has landed).
        """
        self._params, self._in_flight = params, in_flight

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, op, async_op: bool = False
    ):
        if not self._sums(input_tensor, op):
            return self._plain(output_tensor, input_tensor, group, op, async_op)
        world = dist.get_world_size(group)
        finish = self._start(input_tensor, group)
        if (
            self._in_flight is None
            or op != dist.ReduceOp.AVG
            or any(p.grad is not None or getattr(p, "_post_accumulate_grad_hooks", None) for p in self._params)
        ):
            _complete_into(output_tensor, finish, op, world, output_tensor.dtype)
            self._hand_back(input_tensor)
            return None
        # FSDP2 goes on at once: it casts the output to the parameters' dtype when that differs (bf16 gradients of
        # fp32 master weights) and views the gradients into the result, so the landing writes there instead.
        cast = any(p.dtype != output_tensor.dtype for p in self._params if p.requires_grad)

        def land() -> None:
            into = self._cast_buffer(output_tensor.numel()) if cast else output_tensor
            # Rounded to the reduction's dtype first, as FSDP2's own cast of the output would see it (qgZ sums in
            # fp32; the ring already sums in that dtype).
            _complete_into(into, finish, op, world, output_tensor.dtype)
            self._hand_back(input_tensor)

        self._in_flight.add(land)
        return None

    def _hand_back(self, input_tensor: Tensor) -> None:
        # The reduction has landed: nothing reads its input (FSDP2's staging buffer) any more.
        if self.pool is not None:
            self.pool.give(input_tensor)

    def _sums(self, input_tensor: Tensor, op) -> bool:
        """Whether this reduction computes the sum itself (`_start`), else `_plain` takes it."""
        return op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)

    def _plain(self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, op, async_op: bool):
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return fn(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

    def _start(self, input_tensor: Tensor, group: dist.ProcessGroup) -> Callable[[], Tensor]:
        """Put the reduction on the wire; the returned call waits for it and gives this rank's chunk of the sum.

        The call may also have an ``into(out, op, world, dtype)`` method that lands the sum straight into `out` as
        `_reduced_into` would (qgZ's, piece by piece as the pieces arrive); landing then uses it."""
        mine, work = ring_reduce_scatter(input_tensor, group, async_op=True)

        def finish() -> Tensor:
            work.wait()
            return mine

        return finish

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


def _complete_into(out: Tensor, finish: Callable[[], Tensor], op, world: int, dtype: torch.dtype) -> None:
    # Completes a reduction `_start` began and writes this rank's chunk into `out` (`_reduced_into`).
    into = getattr(finish, "into", None)
    if into is not None:
        into(out, op, world, dtype)
    else:
        _reduced_into(out, finish(), op, world, dtype)


def _reduced_into(out: Tensor, mine: Tensor, op, world: int, dtype: torch.dtype) -> None:
    # This rank's chunk of the summed input, averaged for AVG, rounded to the reduction's `dtype` (FSDP2's output),
    # then written into `out` (that output, or the buffer FSDP2 cast it into). No temporary the size of the chunk
    # where the dtypes allow: `mine` is the reduction's own buffer (a row of FSDP2's staging buffer, which nothing
    # reads after the reduction, or qgZ's sum), so the average is taken in place, with the same numbers.
    target = out.view(mine.shape)
    if op == dist.ReduceOp.AVG:
        if mine.dtype == dtype == out.dtype:
            torch.div(mine, world, out=target)
            return
        mine.div_(world)
    target.copy_(mine if mine.dtype == dtype else mine.to(dtype))
