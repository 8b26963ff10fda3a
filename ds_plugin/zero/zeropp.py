"""ZeRO++ collectives for FSDP2: qwZ (INT8 weight all-gather) and qgZ (INT4 all-to-all gradient reduction).

Both plug into FSDP2 through `FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter`, so FSDP2 keeps
its own bucketing, prefetching and resharding (and hpZ, which is `reshard_after_forward=k`) while the bytes
on the wire shrink:

- qwZ: each rank quantizes its bf16/fp16/fp32 shard blockwise to INT8 (one fp32 scale per block), the codes
  and scales are all-gathered, and every rank dequantizes into FSDP2's output buffer. Half of bf16's bytes.
- qgZ: the reduce-scatter input (one chunk per destination rank) is quantized blockwise to INT4 per chunk,
  exchanged with all-to-all, dequantized and summed in fp32. With nodes known it takes two hops as in the
  ZeRO++ paper: an all-to-all inside the node first (so each rank holds its node's partial sums for 1/L of
  the destinations), then an all-to-all across nodes among ranks with the same local index. A quarter of
  bf16's bytes cross the node boundary.

Non-float buckets (FSDP2 gathers mixed-dtype parameters as raw bytes) and reduction ops other than SUM/AVG
take the plain collective; each such fallback is counted in `ZeroPPStats` so the comms logger can report it.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist
from torch import Tensor

from ds_plugin.quant.blockwise import (
    dequantize_int4_blockwise,
    dequantize_int8_blockwise,
    quantize_int4_blockwise,
    quantize_int8_blockwise,
)

__all__ = ["QuantizedAllGather", "QuantizedReduceScatter", "ZeroPPStats", "node_groups"]

logger = logging.getLogger(__name__)

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass
class ZeroPPStats:
    """How often each path ran; fallbacks name why, so a benchmark can say which tensors went plain."""

    quantized_all_gathers: int = 0
    quantized_reduce_scatters: int = 0
    fallbacks: dict[str, int] = dataclasses.field(default_factory=dict)

    def fallback(self, reason: str) -> None:
        if reason not in self.fallbacks:
            logger.info("ZeRO++: a collective takes the plain path (%s)", reason)
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1


def _all_gather(output: Tensor, input: Tensor, group: dist.ProcessGroup, async_op: bool = False):
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); 2.11 has only the old.
    # Looked up at call time so the comms logger's wrappers see the call.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def _block_for(numel: int, block_size: int) -> int:
    """The block size actually used for a chunk: never larger than the chunk, always even (INT4 packs pairs)."""
    return max(2, min(block_size, numel + (numel % 2)))


def _padded(numel: int, block: int) -> int:
    return -(-numel // block) * block


class _PlainAlloc:
    """FSDP2's comm protocol also asks the comm object for its buffers."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class QuantizedAllGather(_PlainAlloc):
    """qwZ: FSDP2 all-gather of the weight shards as blockwise INT8 codes plus fp32 scales.

    Args:
        block_size: elements per scale (DeepSpeed uses blocks of a few thousand elements).
        stats: shared counters.
    """

    def __init__(self, block_size: int = 4096, stats: ZeroPPStats | None = None) -> None:
        self.block_size = block_size
        self.stats = stats if stats is not None else ZeroPPStats()

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, async_op: bool = False):
        if input_tensor.dtype not in _FLOATS:
            self.stats.fallback(f"all-gather of {input_tensor.dtype} bucket")
            return _all_gather(output_tensor, input_tensor, group, async_op)
        world = dist.get_world_size(group)
        shard = input_tensor.numel()
        block = _block_for(shard, self.block_size)
        padded = _padded(shard, block)
        src = input_tensor
        if padded != shard:
            # Pad so each rank's blocks start at a block boundary of the gathered buffer.
            src = torch.nn.functional.pad(input_tensor, (0, padded - shard))
        codes, scales = quantize_int8_blockwise(src, block, check_finite=False)
        all_codes = codes.new_empty(world * codes.numel())
        all_scales = scales.new_empty(world * scales.numel())
        _all_gather(all_codes, codes, group)
        _all_gather(all_scales, scales, group)
        full = dequantize_int8_blockwise(all_codes, all_scales, block, (world, padded), output_tensor.dtype)
        output_tensor.view(world, shard).copy_(full[:, :shard])
        self.stats.quantized_all_gathers += 1
        return None


class QuantizedReduceScatter(_PlainAlloc):
    """qgZ: FSDP2 reduce-scatter as INT4 quantize -> all-to-all -> dequantize -> fp32 sum.

    Args:
        block_size: elements per scale within each destination chunk.
        intra_group / inter_group: this rank's node group and its same-local-index group across nodes;
            when both are given the reduction takes the paper's two hops, else one all-to-all.
        stats: shared counters.
    """

    def __init__(
        self,
        block_size: int = 4096,
        *,
        intra_group: dist.ProcessGroup | None = None,
        inter_group: dist.ProcessGroup | None = None,
        stats: ZeroPPStats | None = None,
    ) -> None:
        self.block_size = block_size
        self.intra_group = intra_group
        self.inter_group = inter_group
        self.stats = stats if stats is not None else ZeroPPStats()

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, op, async_op: bool = False
    ):
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) or input_tensor.dtype not in _FLOATS:
            self.stats.fallback(f"reduce-scatter with op {op} of {input_tensor.dtype}")
            fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            return fn(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        world = dist.get_world_size(group)
        chunks = input_tensor.view(world, -1)
        two_hop = self.intra_group is not None and self.inter_group is not None
        if two_hop and dist.get_world_size(self.intra_group) * dist.get_world_size(self.inter_group) == world:
            total = self._two_hop(chunks)
        else:
            total = _all_to_all_sum(chunks, self.block_size, group)
        if op == dist.ReduceOp.AVG:
            total /= world
        output_tensor.copy_(total)
        self.stats.quantized_reduce_scatters += 1
        return None

    def _two_hop(self, chunks: Tensor) -> Tensor:
        local = dist.get_world_size(self.intra_group)
        nodes = dist.get_world_size(self.inter_group)
        # Destination rank d = node * local + local_index. Hop 1 sends local peer j the chunks of every node's
        # rank j, so afterwards this rank holds its node's sum for the destinations (n, my_local) of all nodes n.
        by_local = chunks.view(nodes, local, -1).transpose(0, 1).reshape(local, -1)
        partial = _all_to_all_sum(by_local, self.block_size, self.intra_group)
        # Hop 2: send each node's partial sum to the same-local-index rank of that node.
        return _all_to_all_sum(partial.view(nodes, -1), self.block_size, self.inter_group)


def _all_to_all_sum(chunks: Tensor, block_size: int, group: dist.ProcessGroup) -> Tensor:
    """Row i of `chunks` goes to rank i of `group`; returns the fp32 sum of the rows this rank receives."""
    peers, numel = chunks.shape
    block = _block_for(numel, block_size)
    padded = _padded(numel, block)
    if padded != numel:
        chunks = torch.nn.functional.pad(chunks, (0, padded - numel))
    # check_finite=False: an inf/nan block gets a nan scale, so an fp16 overflow survives the trip and the
    # loss scaler still sees it.
    packed, scales = quantize_int4_blockwise(chunks.contiguous(), block, check_finite=False)
    recv_packed = torch.empty_like(packed)
    recv_scales = torch.empty_like(scales)
    dist.all_to_all_single(recv_packed, packed, group=group)
    dist.all_to_all_single(recv_scales, scales, group=group)
    received = dequantize_int4_blockwise(recv_packed, recv_scales, block, (peers, padded), torch.float32)
    return received[:, :numel].sum(dim=0)


def node_groups(ranks_per_node: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's (intra-node, inter-node) groups; collective: every rank must call it.

    Args:
        ranks_per_node: consecutive ranks that share a node; must divide the world size.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if ranks_per_node < 1 or world % ranks_per_node:
        raise ValueError(f"ranks_per_node {ranks_per_node} must divide the world size {world}")
    nodes = world // ranks_per_node
    intra = inter = None
    # new_group must be called by all ranks for every group, in the same order.
    for n in range(nodes):
        g = dist.new_group(list(range(n * ranks_per_node, (n + 1) * ranks_per_node)))
        if rank // ranks_per_node == n:
            intra = g
    for j in range(ranks_per_node):
        g = dist.new_group(list(range(j, world, ranks_per_node)))
        if rank % ranks_per_node == j:
            inter = g
    return intra, inter
