"""Stages 0 and 1: replicated compute parameters, fp32 master weights as DTensors on the data-parallel mesh.

Stage 1 (DeepSpeed: optimizer states partitioned) keeps the model's parameters whole on every rank, in the
compute dtype, while the fp32 master weights, and so the optimizer state built on them, are `Shard(0)`
DTensors: the same layout FSDP2 gives stages 2 and 3, so a checkpoint does not depend on the stage. One
optimizer step is: reduce-scatter the gradients into each rank's master shard (half an all-reduce, and all a
rank needs), step the optimizer on the shards, all-gather the updated shards back into the compute
parameters. Stage 0 (plain data parallel) is the same machinery with `Replicate()` masters: gradients are
all-reduced and, in fp32, the masters alias the model's own parameters so nothing is copied.

Gradients are reduced in flat buckets of about `_BUCKET_NUMEL` elements, planned in reverse parameter order
(roughly the order backward produces them). During a backward the engine marks as the last of its step
(`begin_backward(True)`), a bucket's reduction is launched asynchronously as soon as its last gradient has
been accumulated, so it runs while backward computes the rest, as DDP's does. Buckets still unlaunched when
the optimizer steps (a parameter unused this step, a `loss.backward()` called outside the engine, a second
backward in the same step) are reduced then: accumulation micro-steps never communicate, and the result does
not depend on when a bucket went. Python runs once per parameter per backward (a counter) and once per bucket.
On gloo a bucket's reduce-scatter and the all-gather of the updated shards go round a ring of sends and receives
(`gloo_comm.ring_reduce_scatter`, `ring_all_gather`), faster than gloo's own.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from ds_plugin.zero.gloo_comm import ring_all_gather, ring_reduce_scatter
from ds_plugin.zero.mesh import ZeroSetupError, mesh_device

__all__ = ["ReplicatedState", "replicated_state", "shard_rows"]

logger = logging.getLogger(__name__)

#: Elements per gradient bucket (full-gradient elements). Small enough that the reduction of the last layers
#: starts while backward is still far from the first (DDP's 25 MiB default is 6.5M fp32 elements).
_BUCKET_NUMEL = 1 << 22
#: Buckets gathered or reduced at once outside backward (step time): bounds the extra memory.
_IN_FLIGHT = 2
_STATE_ATTR = "_zero_replicated_state"


@dataclasses.dataclass(frozen=True)
class _Slot:
    """One parameter's place in a flat bucket; sharded slots hold `chunk_rows` rows per rank (torch.chunk)."""

    index: int
    offset: int
    rows: int
    chunk_rows: int
    inner: int


@dataclasses.dataclass
class _Bucket:
    sharded: bool
    trainable: bool
    slots: list[_Slot] = dataclasses.field(default_factory=list)
    numel: int = 0  # per-rank region (sharded) or the whole buffer (replicated)


def _rank_chunks(flat: torch.Tensor, world: int, slot: _Slot) -> torch.Tensor:
    # (world, chunk_rows, inner) view of one slot in a rank-major buffer of `world` equal regions.
    region = flat.view(world, -1)[:, slot.offset : slot.offset + slot.chunk_rows * slot.inner]
    return region.unflatten(1, (slot.chunk_rows, slot.inner))


def _into_chunks(full: torch.Tensor, chunks: torch.Tensor, c: int) -> None:
    q, rem = divmod(full.shape[0], c)
    if q:
        chunks[:q].copy_(full[: q * c].view(q, c, -1))
    if rem:
        chunks[q, :rem].copy_(full[q * c :])


def _zero_padding(chunks: torch.Tensor, rows: int, c: int) -> None:
    # The rows past the tensor's end in its last rank chunks (torch.chunk's last shards are short or empty).
    q, rem = divmod(rows, c)
    if q < chunks.shape[0]:
        chunks[q, rem:].zero_()
        chunks[q + 1 :].zero_()


def _from_chunks(chunks: torch.Tensor, full: torch.Tensor, c: int) -> None:
    q, rem = divmod(full.shape[0], c)
    if q:
        full[: q * c].view(q, c, -1).copy_(chunks[:q])
    if rem:
        full[q * c :].copy_(chunks[q, :rem])


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """(start, length) of a rank's dim-0 shard: torch.chunk's split, the one DTensor's Shard(0) and FSDP2 use.

    Args:
        rows: dim-0 size of the full tensor.
        world: number of shards.
        rank: which shard.
    """
    c = math.ceil(rows / world) if rows else 0
    start = min(rank * c, rows)
    return start, max(0, min(c, rows - start))


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple | list):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value


def _cast_inputs(dtype: torch.dtype):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return _cast(args, dtype), _cast(kwargs, dtype)

    return hook


class ReplicatedState:
    """fp32 masters, gradient reduction and parameter sync for a stage 0/1 module.

    Args:
        module: the model; its parameters stay the compute parameters (cast in place to `compute_dtype`).
        mesh: the 1-D data-parallel mesh.
        shard: True for stage 1 (`Shard(0)` masters), False for stage 0 (`Replicate()` masters).
        compute_dtype: dtype of forward/backward.
        reduce_dtype: dtype gradients are communicated in.
        accum_dtype: dtype gradients accumulate in across micro-steps; wider than `compute_dtype` keeps an
            extra buffer per parameter.
        master_device: where masters and optimizer state live (CPU = offload_optimizer); default the mesh's.
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: DeviceMesh,
        *,
        shard: bool,
        compute_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        accum_dtype: torch.dtype,
        master_device: torch.device | None = None,
    ) -> None:
        self.module, self.mesh, self.shard = module, mesh, shard
        self.group = mesh.get_group()
        self.world, self.rank = mesh.size(), mesh.get_local_rank()
        self.device = mesh_device(mesh)
        self.compute_dtype, self.reduce_dtype = compute_dtype, reduce_dtype
        master_device = master_device or self.device
        module.to(self.device)
        named = list(module.named_parameters())
        self.fqns = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.masters = [self._make_master(p, master_device) for p in self.params]
        for p in self.params:
            # Frozen parameters were stored in their final dtype by `apply_zero` and have no master to refresh them.
            if p.requires_grad and p.is_floating_point() and (p.dtype != compute_dtype or not p.is_contiguous()):
                p.data = p.data.to(compute_dtype).contiguous()
        self._buckets = self._plan()
        self._bucket_of = {s.index: b for b, bucket in enumerate(self._buckets) for s in bucket.slots}
        self._ring = dist.get_backend(self.group) == "gloo"
        self._accum: dict[int, torch.Tensor] = {}
        # Reductions launched during the current backward: bucket index -> (bucket, output, work).
        self._launched: dict[int, tuple[_Bucket, torch.Tensor, dist.Work]] = {}
        self._waiting: list[int] = []  # per bucket, gradients still to come in this backward
        self._overlap = False  # whether this backward's hooks launch reductions (`begin_backward`)
        self._stale = False  # a gradient changed after its bucket was launched: reduce everything again
        wider = accum_dtype if accum_dtype.itemsize > compute_dtype.itemsize else None
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._grad_hook(i, wider))
            for i, p in enumerate(self.params)
            if p.requires_grad and i in self._bucket_of
        ]
        if compute_dtype != torch.float32:
            # FSDP2's MixedPrecisionPolicy casts floating inputs to the compute dtype; do the same here.
            self._hooks.append(module.register_forward_pre_hook(_cast_inputs(compute_dtype), with_kwargs=True))
        module.__dict__[_STATE_ATTR] = self

    # ------------------------------------------------------------------ construction

    def _placements(self, p: torch.Tensor) -> tuple[Placement, ...]:
        sharded = self.shard and p.dim() > 0 and p.is_floating_point()
        return (Shard(0),) if sharded else (Replicate(),)

    def _make_master(self, p: nn.Parameter, device: torch.device) -> nn.Parameter:
        if not p.requires_grad:
            # Frozen: no fp32 master, no shard, no optimizer state; the "master" is the parameter itself (a
            # Replicate DTensor over it), which state dicts read and checkpoints load into.
            dt = DTensor.from_local(
                p.detach(),
                self.mesh,
                (Replicate(),),
                run_check=False,
                shape=p.shape,
                stride=_contiguous_stride(p.shape),
            )
            return nn.Parameter(dt, requires_grad=False)
        placements = self._placements(p)
        local = p.detach()
        if isinstance(placements[0], Shard):
            start, length = shard_rows(p.shape[0], self.world, self.rank)
            local = local[start : start + length]
        dtype = torch.float32 if p.is_floating_point() else p.dtype
        # Stage 0 in fp32 on the compute device aliases the model's parameter: no copy, nothing to sync back.
        if dtype != p.dtype or device != p.device or isinstance(placements[0], Shard) or not p.is_contiguous():
            local = local.to(device=device, dtype=dtype, copy=True).contiguous()
        stride = _contiguous_stride(p.shape)
        dt = DTensor.from_local(local, self.mesh, placements, run_check=False, shape=p.shape, stride=stride)
        return nn.Parameter(dt, requires_grad=p.requires_grad)

    def _plan(self) -> list[_Bucket]:
        buckets: dict[tuple[bool, bool], _Bucket] = {}
        done: list[_Bucket] = []
        # Reverse order: backward produces the last layers' gradients first, so their buckets fill first.
        for i, p in reversed(list(enumerate(self.params))):
            if not (p.is_floating_point() and p.requires_grad):
                continue  # frozen parameters are never reduced nor synced: they alias their "masters"
            sharded = isinstance(self.masters[i].placements[0], Shard)
            key = (sharded, p.requires_grad)
            bucket = buckets.setdefault(key, _Bucket(sharded=sharded, trainable=p.requires_grad))
            rows = p.shape[0] if p.dim() else 1
            inner = p.numel() // rows if rows else 0
            chunk_rows = math.ceil(rows / self.world) if sharded else rows
            bucket.slots.append(_Slot(i, bucket.numel, rows, chunk_rows, inner))
            bucket.numel += chunk_rows * inner
            if bucket.numel * (self.world if sharded else 1) >= _BUCKET_NUMEL:
                done.append(buckets.pop(key))
        return done + [b for b in buckets.values() if b.slots]

    def _grad_hook(self, index: int, accum_dtype: torch.dtype | None):
        b = self._bucket_of[index]

        def hook(p: torch.Tensor) -> None:
            if accum_dtype is not None:
                # Accumulate each micro-step's gradient in the wider dtype, as DeepSpeed's grad_accum_dtype does.
                acc = self._accum.get(index)
                if acc is None:
                    self._accum[index] = p.grad.to(accum_dtype)
                else:
                    acc.add_(p.grad)
                p.grad = None
            if not self._overlap:
                return
            if b in self._launched:
                self._stale = True  # a second backward in the step: its gradients were not in the launch
                return
            self._waiting[b] -= 1
            if self._waiting[b] == 0:
                self._launched[b] = self._launch_reduce(self._buckets[b])

        return hook

    def begin_backward(self, sync: bool) -> None:
        """Called by the engine before each backward: whether it is the last of the step (launch reductions).

        Args:
            sync: True at an accumulation boundary outside `no_sync`; False leaves every reduction to the step.
        """
        self._overlap = sync
        if sync:
            self._waiting = [len(bucket.slots) for bucket in self._buckets]

    # ------------------------------------------------------------------ one optimizer step

    def _grad(self, index: int) -> torch.Tensor | None:
        return self._accum.get(index, self.params[index].grad)

    def _launch_reduce(self, bucket: _Bucket) -> tuple[_Bucket, torch.Tensor, dist.Work]:
        fp16 = self.reduce_dtype == torch.float16
        numel = bucket.numel * (self.world if bucket.sharded else 1)
        inp = torch.empty(numel, dtype=self.reduce_dtype, device=self.device)
        for s in bucket.slots:
            g = self._grad(s.index)
            if bucket.sharded:
                chunks = _rank_chunks(inp, self.world, s)
                if g is None:
                    chunks.zero_()  # a parameter unused this step
                else:
                    _into_chunks(g.reshape(s.rows, s.inner), chunks, s.chunk_rows)
                    _zero_padding(chunks, s.rows, s.chunk_rows)
            else:
                part = inp[s.offset : s.offset + s.rows * s.inner]
                if g is None:
                    part.zero_()
                else:
                    part.copy_(g.reshape(-1))
        out = inp
        if fp16:
            inp.div_(self.world)  # pre-divide: a sum of loss-scaled fp16 gradients can overflow
        if bucket.sharded and self._ring:
            # gloo: sum into this rank's region in place (its rank-major layout makes it contiguous).
            out, work = ring_reduce_scatter(inp, self.group, async_op=True)
        elif bucket.sharded:
            out = torch.empty(bucket.numel, dtype=self.reduce_dtype, device=self.device)
            work = dist.reduce_scatter_tensor(out, inp, group=self.group, async_op=True)
        else:
            work = dist.all_reduce(inp, group=self.group, async_op=True)
        return bucket, out, work

    def _finish_reduce(self, bucket: _Bucket, out: torch.Tensor, work: dist.Work) -> None:
        work.wait()
        divide = self.reduce_dtype != torch.float16
        for s in bucket.slots:
            master = self.masters[s.index]
            local = master.to_local()
            n = local.numel()
            # A view of `out` when no cast is needed: the masters' gradients then live in the bucket buffer.
            g = out[s.offset : s.offset + n].view(local.shape).to(device=local.device, dtype=local.dtype)
            if divide:
                g.div_(self.world)
            master.grad = DTensor.from_local(
                g, self.mesh, master.placements, run_check=False, shape=master.shape, stride=master.stride()
            )

    def reduce_gradients(self) -> None:
        """Average the compute gradients over ranks into the masters' `.grad` and free the compute gradients.

        Buckets launched during backward are finished; the rest are reduced now.
        """
        launched = self._take_launched()
        pending = []
        for b, bucket in enumerate(self._buckets):
            if b in launched:
                self._finish_reduce(*launched.pop(b))
                continue
            pending.append(self._launch_reduce(bucket))
            if len(pending) > _IN_FLIGHT:
                self._finish_reduce(*pending.pop(0))
        for item in pending:
            self._finish_reduce(*item)
        self.zero_compute_grads()

    def _take_launched(self) -> dict[int, tuple[_Bucket, torch.Tensor, dist.Work]]:
        # The reductions launched during backward, all of them waited for if any is stale (then none is kept).
        launched, stale = self._launched, self._stale
        self._launched, self._stale, self._overlap = {}, False, False
        if stale:
            for _, _, work in launched.values():
                work.wait()
            return {}
        return launched

    def has_gradients(self) -> bool:
        """Whether a backward has left gradients that `reduce_gradients` has not consumed yet."""
        return bool(self._accum) or bool(self._launched) or any(p.grad is not None for p in self.params)

    @torch.no_grad()
    def sync_params(self, *, include_frozen: bool = False) -> None:
        """Copy the masters into the compute parameters (stage 1: all-gather the updated shards).

        Args:
            include_frozen: also refresh parameters the optimizer does not train (after loading a checkpoint).
        """
        pending: list[tuple[_Bucket, torch.Tensor, dist.Work]] = []
        for bucket in self._buckets:
            if not (bucket.trainable or include_frozen):
                continue
            if not bucket.sharded:
                for s in bucket.slots:
                    local, p = self.masters[s.index].to_local(), self.params[s.index]
                    if local.data_ptr() != p.data_ptr():
                        p.data.copy_(local)
                continue
            inp = torch.empty(bucket.numel, dtype=self.compute_dtype, device=self.device)
            for s in bucket.slots:
                local = self.masters[s.index].to_local().reshape(-1)
                inp[s.offset : s.offset + local.numel()].copy_(local)
            out = torch.empty(self.world * bucket.numel, dtype=self.compute_dtype, device=self.device)
            if self._ring:
                work = ring_all_gather(out, inp, self.group, async_op=True)
            else:
                work = dist.all_gather_into_tensor(out, inp, group=self.group, async_op=True)
            pending.append((bucket, out, work))
            if len(pending) > _IN_FLIGHT:
                self._finish_gather(*pending.pop(0))
        for item in pending:
            self._finish_gather(*item)

    def _finish_gather(self, bucket: _Bucket, out: torch.Tensor, work: dist.Work) -> None:
        work.wait()
        for s in bucket.slots:
            full = self.params[s.index].data.view(s.rows, s.inner)
            _from_chunks(_rank_chunks(out, self.world, s), full, s.chunk_rows)

    def zero_compute_grads(self) -> None:
        """Drop the compute parameters' gradients, the accumulation buffers and any reduction in flight."""
        for _, _, work in self._launched.values():
            work.wait()  # the collective still writes into its buffers
        self._launched, self._stale, self._overlap = {}, False, False
        self._accum.clear()
        for p in self.params:
            p.grad = None

    # ------------------------------------------------------------------ state dicts

    def master_of(self) -> dict[int, nn.Parameter]:
        """id(compute parameter) -> its master DTensor parameter."""
        return {id(p): m for p, m in zip(self.params, self.masters, strict=True)}

    def export(self, value: DTensor) -> DTensor:
        """A master-shaped DTensor in the stage-agnostic checkpoint layout (`Shard(0)` where FSDP2 shards).

        Args:
            value: a master or an optimizer state tensor shaped like one.
        """
        if value.dim() > 0 and value.is_floating_point() and not isinstance(value.placements[0], Shard):
            return value.redistribute(self.mesh, (Shard(0),))
        return value

    def localize(self, value: Any, master: nn.Parameter) -> torch.Tensor:
        """This rank's part of a checkpoint value in the master's layout.

        Args:
            value: a DTensor in any placement or mesh, or a full plain tensor.
            master: the master parameter the value belongs to.
        """
        if isinstance(value, DTensor):
            if value.device_mesh == self.mesh:
                return value.redistribute(self.mesh, master.placements).to_local()
            value = value.full_tensor()
        if tuple(value.shape) != tuple(master.shape):
            raise ZeroSetupError(
                f"checkpoint tensor of shape {tuple(value.shape)} for a {tuple(master.shape)} parameter"
            )
        if isinstance(master.placements[0], Shard):
            start, length = shard_rows(value.shape[0], self.world, self.rank)
            value = value[start : start + length]
        return value

    def model_state_dict(self) -> dict[str, Any]:
        """The model's state dict: masters as DTensors, buffers as plain tensors, the model's own key names."""
        master_of = self.master_of()
        out: dict[str, Any] = {}
        for key, value in self.module.state_dict(keep_vars=True).items():
            master = master_of.get(id(value))
            out[key] = value.detach() if master is None else self.export(master.detach())
        return out

    @torch.no_grad()
    def load_model_state_dict(self, state_dict: dict[str, Any], *, loaded: frozenset[str] = frozenset()) -> None:
        """Load a state dict written by any stage or world size (see `model_state_dict`).

        Args:
            state_dict: key -> DTensor or full tensor; every key of the model must be present.
            loaded: keys already loaded another way (quantized frozen weights), absent from `state_dict`.
        """
        expected = {k: v for k, v in self.module.state_dict(keep_vars=True).items() if k not in loaded}
        missing = sorted(set(expected) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(expected))
        if missing or unexpected:
            raise ZeroSetupError(
                f"model state dict: missing keys {missing[:3]}, unexpected keys {unexpected[:3]}; "
                "load a checkpoint of the same model"
            )
        master_of = self.master_of()
        for key, target in expected.items():
            master = master_of.get(id(target))
            value = state_dict[key]
            if master is None:
                target.copy_(value.full_tensor() if isinstance(value, DTensor) else value)
            else:
                master.to_local().copy_(self.localize(value, master))
        self.sync_params(include_frozen=True)


def replicated_state(module: nn.Module) -> ReplicatedState | None:
    """The stage 0/1 state `apply_zero` attached to a module, or None (not applied, or stage 2/3).

    Args:
        module: the model returned by `apply_zero`.
    """
    return module.__dict__.get(_STATE_ATTR)
