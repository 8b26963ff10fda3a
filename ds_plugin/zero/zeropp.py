"""ZeRO++ collectives for FSDP2: qwZ (INT8 weight all-gather) and qgZ (INT4 all-to-all gradient reduction).

Both plug into FSDP2 through `FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter`, so FSDP2 keeps
its own bucketing, prefetching and resharding (and hpZ, which is `reshard_after_forward=k`) while the bytes
on the wire shrink:

- qwZ: each rank quantizes its bf16/fp16/fp32 shard blockwise to INT8 (one bf16 scale per block), the codes
  and scales are all-gathered, and every rank dequantizes into FSDP2's output buffer. Half of bf16's bytes.
- qgZ: the reduce-scatter input (one chunk per destination rank) is quantized blockwise to INT4 per chunk,
  exchanged with all-to-all, dequantized and summed in fp32. With nodes known it takes two hops as in the
  ZeRO++ paper: an all-to-all inside the node first (so each rank holds its node's partial sums for 1/L of
  the destinations), then an all-to-all across nodes among ranks with the same local index. A quarter of
  bf16's bytes cross the node boundary.

Both are pipelined over buckets larger than `PIECE_NUMEL` elements: the bucket is cut into block-aligned pieces
whose collectives are issued asynchronously, so one piece crosses the inter-node link while another takes the
intra-node hop or is decoded (bit-identical to doing it in one piece). On CPU that hides the slow link behind the
quantizer's work. On GPUs NCCL runs each piece on its own stream and `wait()` orders the decoding after it (not
yet run on a GPU).

Non-float buckets (FSDP2 gathers mixed-dtype parameters as raw bytes) and reduction ops other than SUM/AVG
take the plain collective; each such fallback is counted in `ZeroPPStats` so the comms logger can report it.

The quantize / dequantize steps come from `ds_plugin.quant.comm.dispatch`: the blockwise format
(`quant/comm/format.py`) in Triton on CUDA, and in torch on CPU, compiled into one loop per step for large buckets
(eager torch there would cost more than a slow link saves).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ds_plugin.quant.comm.dispatch import dequantize_rows_into, dequantize_sum_rows, quantize_rows, use_compiled
from ds_plugin.runtime.comms_logger import record_collective
from ds_plugin.zero.cma import ring_link
from ds_plugin.zero.gloo_comm import AllReduceScatter, CommBuffers, DeferredWork, ring

__all__ = [
    "QuantizedAllGather",
    "QuantizedReduceScatter",
    "ZeroPPStats",
    "exact_weight_gathers",
    "install_zeropp",
    "node_groups",
    "quantized_collectives",
    "zeropp_stats",
]

logger = logging.getLogger(__name__)

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)

#: Elements per pipelined piece of a shard (qwZ) or destination chunk (qgZ). A collective over a bigger bucket
#: is cut into pieces of about this size, whole blocks each, so the first hop of one piece is on the wire while
#: the next hop or the decoding of another runs: on CPU the quantizer's work then overlaps the slow link. 1M, not
#: 2M: `ds-plugin bench slow-link` (1 Gbit/s, 2 nodes of 2 CPU ranks) stepped ZeRO++ in 0.659/0.649 s against
#: 0.687/0.657 s on its 2-block model and 0.591/0.625 against 0.636/0.627 s with 8 blocks (alternating runs); on
#: the link alone, 8.4 MB crossed in 146 ms in 8 pieces, 154 ms in 4 (gloo keeps more of the link busy with more
#: pieces in flight). Smaller pieces cost more CPU than they gained. Not yet measured between GPUs.
PIECE_NUMEL = 1 << 20


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


class QuantizedAllGather(CommBuffers):
    """qwZ: FSDP2 all-gather of the weight shards as blockwise INT8 codes plus bf16 scales.

    Args:
        block_size: elements per scale (DeepSpeed uses blocks of a few thousand elements).
        stats: shared counters.
        intra_group / inter_group: this rank's node group and its same-local-index group across nodes. When
            both are given, a gather over all ranks takes two levels: across nodes first (each shard crosses the
            node boundary once per remote node, the ZeRO++ paper's 0.5x volume), then inside the node. A flat
            ring over both nodes would cross the boundary with (world - 1) / world of the codes instead.
        piece_numel: a shard larger than this is gathered in pieces of about this many elements, pipelined:
            every piece's first-level gather is issued at once, and a piece goes to the second level, and then
            is decoded, while later pieces are still on the wire. The result does not depend on it.
        plain_in_node: on CPU ranks whose node's ranks can read each other's memory (`ds_plugin.zero.cma`), the
            level inside the node moves decoded weights instead of codes: each rank decodes only the rows that
            crossed the nodes to it, and reads the rest, already decoded, from its node's peers. The same bits
            (every rank decodes the same codes the same way), half the decoding with 2 ranks a node: on
            `ds-plugin bench slow-link`, ZeRO++ spent 0.22-0.23 CPU-s per rank per step against 0.23-0.26 s, the
            step unchanged within the noise (0.77-0.78 s against 0.76-0.81 s: it waits on the link). False keeps
            codes on both levels.
    """

    def __init__(
        self,
        block_size: int = 4096,
        stats: ZeroPPStats | None = None,
        *,
        intra_group: dist.ProcessGroup | None = None,
        inter_group: dist.ProcessGroup | None = None,
        piece_numel: int = PIECE_NUMEL,
        plain_in_node: bool = True,
    ) -> None:
        self.block_size = block_size
        self.stats = stats if stats is not None else ZeroPPStats()
        self.intra_group = intra_group
        self.inter_group = inter_group
        self.piece_numel = piece_numel
        self.plain_in_node = plain_in_node

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, async_op: bool = False):
        if input_tensor.dtype not in _FLOATS:
            # A quantized frozen base's codes, already smaller than qwZ's INT8: nothing to gain by quantizing.
            self.stats.fallback(f"all-gather of a {input_tensor.dtype} bucket: not floating point, gathered as it is")
            return _all_gather(output_tensor, input_tensor, group, async_op)
        world = dist.get_world_size(group)
        shard = input_tensor.numel()
        block = _block_for(shard, self.block_size)
        compiled = use_compiled(output_tensor)
        # Blocks never straddle ranks: each shard is quantized as whole blocks (zero-padded locally), and only its
        # real codes travel; receivers pad each rank's codes back the same way.
        codes, scales = quantize_rows(input_tensor.view(1, -1), block, 8, compiled=compiled)
        codes = codes.reshape(-1)
        plain = False
        if self._two_level(group):
            # Inter-node first: row n of the result is node n's shard for this local index. Then inside the node:
            # row j holds local rank j's rows of every node, so rank (n, j) ends at [j, n]: a transposed view of
            # FSDP2's rank-ordered buffer receives it.
            local, nodes = dist.get_world_size(self.intra_group), dist.get_world_size(self.inter_group)
            levels = (self.inter_group, self.intra_group)
            out = output_tensor.view(nodes, local, shard).transpose(0, 1)
            plain = self.plain_in_node and _reads_peers(output_tensor, self.intra_group)
        else:
            levels = (group,)
            out = output_tensor.view(world, shard)
        pieces = _pieces(shard, block, self.piece_numel)
        flights = [_Gathering(codes[a:b], scales[a // block : -(-b // block)], levels[0]) for a, b in pieces]

        def land() -> None:
            if plain:
                self._land_plain_in_node(out, pieces, flights, block, compiled)
            else:
                for (start, end), (piece_codes, piece_scales) in zip(pieces, _land(flights, levels), strict=True):
                    dequantize_rows_into(out[..., start:end], piece_codes, piece_scales, block, compiled=compiled)
            self.stats.quantized_all_gathers += 1

        if async_op:
            # FSDP2 prefetching: the first-level gathers are on the wire; the rest happens when FSDP2 waits.
            return DeferredWork(land)
        land()
        return None

    def _land_plain_in_node(self, out: Tensor, pieces: list, flights: list, block: int, compiled) -> None:
        # Each piece: decode this rank's rows (what crossed the nodes to it), then a ring all-gather inside the node
        # reads the peers' decoded rows out of their memory, while the next piece is decoded.
        me = dist.get_rank(self.intra_group)
        record_collective("all_gather_into_tensor", self.intra_group, out[me].numel() * out.element_size(),
                          out.numel() * out.element_size())  # fmt: skip
        rings = []
        for (start, end), flight in zip(pieces, flights, strict=True):
            piece_codes, piece_scales = flight.wait()
            dequantize_rows_into(out[me, :, start:end], piece_codes, piece_scales, block, compiled=compiled)
            rings.append(ring(out[..., start:end], self.intra_group))
        for finish in rings:
            finish()

    def _two_level(self, group: dist.ProcessGroup) -> bool:
        """Whether `group` is the whole job in rank order (hpZ's backward gathers use a node group instead)."""
        if self.intra_group is None or self.inter_group is None:
            return False
        world = dist.get_world_size(group)
        nodes_x_local = dist.get_world_size(self.intra_group) * dist.get_world_size(self.inter_group)
        return world == nodes_x_local and dist.get_process_group_ranks(group) == list(range(world))


def _reads_peers(t: Tensor, intra_group: dist.ProcessGroup) -> bool:
    """Whether the node's level can move plain data: CPU tensors, and ranks that read each other's memory there."""
    return t.device.type == "cpu" and ring_link(intra_group) is not None


def _pieces(numel: int, block: int, piece_numel: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges that cover ``numel`` elements in order: whole blocks each (but the last), about
    ``piece_numel`` long; one range when ``numel`` is not larger. Block-aligned cuts keep every block's scale,
    so a pipelined collective is bit-identical to an unpipelined one."""
    step = max(block, piece_numel // block * block)
    return [(start, min(start + step, numel)) for start in range(0, numel, step)] or [(0, numel)]


class _Gathering:
    """An asynchronous all-gather of one piece's codes and scales over one group, as one collective.

    The codes and scales travel in one byte buffer per rank (codes first): a second, tiny collective per piece cost
    a slow link ~12 ms per 8.4 MB gathered (1 Gbit/s between two network namespaces of 2 ranks each: 8.4 MB of INT8
    codes per rank in 4 pieces crossed in 154 ms alone, 166 ms with each piece's scales gathered apart).
    """

    def __init__(self, codes: Tensor, scales: Tensor, group: dist.ProcessGroup) -> None:
        self.size = dist.get_world_size(group)
        self.dtypes = (codes.dtype, scales.dtype)
        self.split = codes.numel() * codes.element_size()
        self.sent = codes.new_empty(self.split + scales.numel() * scales.element_size(), dtype=torch.uint8)
        _bundle_into(self.sent, codes, scales)  # alive until the gather lands (the work holds it too)
        self.gathered = self.sent.new_empty(self.size * self.sent.numel())
        self.work = _all_gather(self.gathered, self.sent, group, async_op=True)

    def wait(self) -> tuple[Tensor, Tensor]:
        """The gathered codes and scales, each concatenated in the group's rank order."""
        self.work.wait()
        rows = self.gathered.view(self.size, -1)
        codes = rows[:, : self.split].contiguous().view(self.dtypes[0]).view(-1)
        return codes, rows[:, self.split :].contiguous().view(self.dtypes[1]).view(-1)


def _bundle_into(buffer: Tensor, codes: Tensor, scales: Tensor) -> None:
    """Write the bytes of ``codes`` (int8 / uint8, any strides) then those of ``scales`` into flat uint8 ``buffer``."""
    split = codes.numel()
    buffer[:split].view(codes.dtype).view(codes.shape).copy_(codes)
    buffer[split:].copy_(scales.reshape(-1).view(torch.uint8))


def _land(flights: list[_Gathering], levels: tuple):
    """Yield each piece's codes and scales gathered over `levels` (one or two groups, first to last), in order.

    Every piece's first-level gather was issued up front (`flights`); a piece is passed to the second level as
    soon as its first lands, and is yielded (to be decoded by the caller) while the pieces after it are still
    travelling.
    """
    for k in range(len(flights)):
        for group in levels[1:]:
            flights[k] = _Gathering(*flights[k].wait(), group)
        if k:
            yield flights[k - 1].wait()
    yield flights[-1].wait()


class QuantizedReduceScatter(AllReduceScatter):
    """qgZ: FSDP2 reduce-scatter as INT4 quantize -> all-to-all -> dequantize -> fp32 sum.

    On CPU ranks it lands like the ring reduction it replaces (`AllReduceScatter.overlap`): the part that must
    cross the slow link (the single all-to-all, or the second hop) is still on the wire when FSDP2 goes on with
    the next unit's backward, and is decoded when that unit's reduction is issued.

    Args:
        block_size: elements per scale within each destination chunk.
        intra_group / inter_group: this rank's node group and its same-local-index group across nodes;
            when both are given the reduction takes the paper's two hops, else one all-to-all.
        stats: shared counters.
        piece_numel: as for `QuantizedAllGather`.
        plain_in_node: on CPU ranks whose node's ranks can read each other's memory (`ds_plugin.zero.cma`), sum
            the first hop plain instead of through INT4: a ring reduce-scatter that reads the peers' rows and adds
            them in the input's dtype. Only the hop across nodes is quantized then (DeepSpeed quantizes both), which
            costs less CPU and rounds once less: on `ds-plugin bench slow-link`, 0.23-0.26 CPU-s per rank per step
            against 0.28-0.33 s, the step 0.79-0.80 s against 0.89 s. False keeps the INT4 first hop everywhere.

    The input, FSDP2's staging buffer, is overwritten (as by the ring reduction).
    """

    def __init__(
        self,
        block_size: int = 4096,
        *,
        intra_group: dist.ProcessGroup | None = None,
        inter_group: dist.ProcessGroup | None = None,
        stats: ZeroPPStats | None = None,
        piece_numel: int = PIECE_NUMEL,
        plain_in_node: bool = True,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.intra_group = intra_group
        self.inter_group = inter_group
        self.stats = stats if stats is not None else ZeroPPStats()
        self.piece_numel = piece_numel
        self.plain_in_node = plain_in_node

    def _sums(self, input_tensor: Tensor, op) -> bool:
        return op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) and input_tensor.dtype in _FLOATS

    def _plain(self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, op, async_op: bool):
        self.stats.fallback(f"reduce-scatter with op {op} of {input_tensor.dtype}")
        return super()._plain(output_tensor, input_tensor, group, op, async_op)

    def _start(self, input_tensor: Tensor, group: dist.ProcessGroup) -> Callable[[], Tensor]:
        world = dist.get_world_size(group)
        chunks = input_tensor.view(world, -1)
        self.stats.quantized_reduce_scatters += 1
        two_hop = self.intra_group is not None and self.inter_group is not None
        if two_hop and dist.get_world_size(self.intra_group) * dist.get_world_size(self.inter_group) == world:
            return self._two_hop(chunks)
        return _Exchange(chunks, _block_for(chunks.shape[-1], self.block_size), group).sum

    def _two_hop(self, chunks: Tensor) -> Callable[[], Tensor]:
        local = dist.get_world_size(self.intra_group)
        nodes = dist.get_world_size(self.inter_group)
        numel = chunks.shape[-1]
        block = _block_for(numel, self.block_size)
        compiled = use_compiled(chunks)
        # Destination rank d = node * local + local_index. Hop 1 sends local peer j the chunks of every node's
        # rank j, so afterwards this rank holds its node's sum for the destinations (n, my_local) of all nodes n.
        # A transposed view, not a copy: the quantizer reads it in place and writes codes in the order sent.
        by_local = chunks.view(nodes, local, numel).transpose(0, 1)
        pieces = _pieces(numel, block, self.piece_numel)
        if self.plain_in_node and _reads_peers(chunks, self.intra_group):
            return self._plain_in_node(by_local, pieces, block, compiled)
        # Every piece's hop 1 (inside the node, fast) goes out first; then, piece by piece, hop 1 is summed and
        # hop 2 (each node's partial sum to the same-local-index rank of that node, across the slow link) goes
        # out. Hop 2 is waited for and decoded only in `finish`, piece by piece while later pieces still travel.
        hop1 = [_Exchange(by_local[..., a:b], block, self.intra_group, compiled) for a, b in pieces]
        hop2: list[_Exchange] = []
        for k in range(len(pieces)):
            hop2.append(_Exchange(hop1[k].sum(), block, self.inter_group, compiled))
            hop1[k] = None  # summed: its buffers can go

        return _Landing(hop2, pieces, numel, chunks.device)

    def _plain_in_node(self, by_local: Tensor, pieces: list, block: int, compiled: bool) -> Callable[[], Tensor]:
        # Hop 1 without INT4: the node's ranks can read each other's memory (`cma.ring_link`), so the in-node sum is
        # a ring reduce-scatter that reads each peer's rows straight out of its memory and adds them, exact in the
        # reduction's dtype: cheaper on a CPU than quantizing, and one rounding fewer. Hop 2 is unchanged.
        me = dist.get_rank(self.intra_group)
        record_collective("reduce_scatter_tensor", self.intra_group, by_local.numel() * by_local.element_size(),
                          by_local[me].numel() * by_local.element_size())  # fmt: skip
        rings = [ring(by_local[..., a:b], self.intra_group, add=True) for a, b in pieces]
        hop2 = []
        for (a, b), finish in zip(pieces, rings, strict=True):
            finish()
            hop2.append(_Exchange(by_local[me][:, a:b], block, self.inter_group, compiled))

        return _Landing(hop2, pieces, by_local.shape[-1], by_local.device)


class _Landing:
    """qgZ's second hop in flight, one `_Exchange` per piece; each piece is waited for and decoded in turn while
    later pieces still travel."""

    def __init__(self, hop2: list, pieces: list, numel: int, device: torch.device) -> None:
        self.hop2, self.pieces, self.numel, self.device = hop2, pieces, numel, device

    def __call__(self) -> Tensor:
        """This rank's fp32 sum, whole."""
        total = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        for (start, end), exchange in zip(self.pieces, self.hop2, strict=True):
            exchange.sum(out=total[start:end])
        return total

    def into(self, out: Tensor, op, world: int, dtype: torch.dtype) -> None:
        """Land each piece straight into its slice of `out` as `gloo_comm._reduced_into` lands a whole sum (divided
        by `world` for AVG, rounded to `dtype`), the division and rounding done while decoding: that work runs while
        later pieces are still on the wire, not after the last one lands (on `bench slow-link`'s 2-block model, ~10 ms
        of a step's backward per rank), and no fp32 sum the size of the chunk is allocated. Same numbers: every step
        is elementwise. `out` not fp32 (bf16 gradients of bf16 weights) takes each rounded piece through a scratch."""
        flat = out.view(-1)
        divide = world if op == dist.ReduceOp.AVG else 1
        scratch = None
        if out.dtype != torch.float32:
            scratch = torch.empty(
                max(end - start for start, end in self.pieces), dtype=torch.float32, device=out.device
            )
        for (start, end), exchange in zip(self.pieces, self.hop2, strict=True):
            into = flat[start:end] if scratch is None else scratch[: end - start]
            exchange.sum(out=into, divide=divide, round_to=dtype)
            if scratch is not None:
                flat[start:end].copy_(into)  # exact: already rounded to `dtype`, `out`'s dtype


class _Exchange:
    """A quantized all-to-all in flight: `chunks[i]` goes to rank i of `group` as INT4 codes and bf16 scales.

    The quantization blocks follow the last dim: a block never spans two destination chunks. This rank's own chunk
    never crosses the wire and is summed exact (which removes 1/peers of the rounding noise), so it is not
    quantized at all: its slot in the send buffer is zeros. Inf/nan blocks get a nan scale, so an fp16 overflow
    survives the trip and the loss scaler still sees it.
    """

    def __init__(self, chunks: Tensor, block: int, group: dist.ProcessGroup, compiled: bool | None = None) -> None:
        self.chunks, self.block, self.compiled = chunks, block, compiled
        self.peers, self.me = chunks.shape[0], dist.get_rank(group)
        if self.peers == 1:  # nothing to exchange
            return
        others = [i for i in range(self.peers) if i != self.me]
        # One row of bytes per destination, its packed codes then its scales (one collective, as `_Gathering`).
        rows = {i: quantize_rows(chunks[i], block, 4, compiled=compiled) for i in others}
        codes, scales = rows[others[0]]
        self.packed_shape, self.split = codes.shape, codes.numel()
        send = chunks.new_empty((self.peers, self.split + scales.numel() * scales.element_size()), dtype=torch.uint8)
        send[self.me].zero_()
        for i, (codes, scales) in rows.items():
            _bundle_into(send[i], codes, scales)
        self.received = torch.empty_like(send)
        self.sent = send  # the work holds it too; kept here so its lifetime is plain to see
        self.work = dist.all_to_all_single(self.received, send, group=group, async_op=True)

    def sum(self, out: Tensor | None = None, divide: int = 1, round_to: torch.dtype = torch.float32) -> Tensor:
        """Wait for the exchange; the fp32 sum of what this rank received, shaped ``chunks[0]`` (written into `out`
        when given, which is returned); divided by `divide` and rounded to `round_to` as `dequantize_sum_rows`
        does."""
        if self.peers == 1:
            total = self.chunks[0].float() / divide
            total = total.to(round_to).float()
            return total if out is None else out.copy_(total)
        self.work.wait()
        packed = self.received[:, : self.split].contiguous().view(self.peers, *self.packed_shape)
        scales = self.received[:, self.split :].contiguous().view(torch.bfloat16).view(-1)
        own = self.chunks[self.me]
        return dequantize_sum_rows(
            packed, scales, own, self.me, self.block, compiled=self.compiled, out=out, divide=divide, round_to=round_to
        )


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


class _PlainAllGather(CommBuffers):
    """FSDP2's own all-gather, bit for bit: what `exact_weight_gathers` puts in qwZ's place for a while."""

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, async_op: bool = False):
        return _all_gather(output_tensor, input_tensor, group, async_op)


_STATS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_WEIGHT_GATHERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # FSDP unit -> its qwZ all-gather
_GRADIENT_REDUCTIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # FSDP unit -> its qgZ reduction


def zeropp_stats(model: torch.nn.Module) -> ZeroPPStats | None:
    """The ZeRO++ counters of a model `install_zeropp` handled, else None."""
    return _STATS.get(model)


def quantized_collectives(unit: torch.nn.Module) -> tuple[QuantizedAllGather | None, QuantizedReduceScatter | None]:
    """The qwZ all-gather and qgZ reduce-scatter `install_zeropp` gave one FSDP2 unit (None where it gave none)."""
    return _WEIGHT_GATHERS.get(unit), _GRADIENT_REDUCTIONS.get(unit)


def install_zeropp(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    *,
    weights_block: int | None,
    gradients_block: int | None,
    ranks_per_node: int,
) -> ZeroPPStats | None:
    """Swap FSDP2's collectives for qwZ / qgZ on every sharded module of `model`.

    Collective: every rank must call it (the node groups of the two-level collectives are created here).

    Args:
        model: a model `fully_shard` has been applied to (ZeRO stage 3).
        mesh: the 1-D data-parallel mesh the model is sharded over.
        weights_block: qwZ's elements per INT8 scale; None leaves the weight all-gather alone.
        gradients_block: qgZ's elements per INT4 scale; None leaves the gradient reduce-scatter alone.
        ranks_per_node: ranks on one node; with several nodes the collectives take two levels (inside a node,
            across nodes), so each byte crosses the node boundary once.
    """
    from torch.distributed.fsdp import FSDPModule

    if weights_block is None and gradients_block is None:
        return None
    stats = ZeroPPStats()
    intra = inter = None
    world = mesh.size()
    if world == dist.get_world_size() and 1 < ranks_per_node < world and world % ranks_per_node == 0:
        intra, inter = node_groups(ranks_per_node)
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        if weights_block is not None:
            gather = QuantizedAllGather(weights_block, stats, intra_group=intra, inter_group=inter)
            module.set_custom_all_gather(gather)
            _WEIGHT_GATHERS[module] = gather
        if gradients_block is not None:
            reduction = QuantizedReduceScatter(gradients_block, intra_group=intra, inter_group=inter, stats=stats)
            module.set_custom_reduce_scatter(reduction)
            _GRADIENT_REDUCTIONS[module] = reduction
    _STATS[model] = stats
    return stats


@contextlib.contextmanager
def exact_weight_gathers(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """A block in which qwZ is off: every weight all-gather of `model` is FSDP2's plain one, so a forward computes
    with the weights exactly as the shards hold them (qwZ rounds each gathered shard to INT8 blocks). For a check
    against a copy of the weights saved or loaded elsewhere, which nothing rounds. Every unit is resharded on entry
    (a unit kept gathered since the last forward, the root or an hpZ secondary shard, holds rounded weights) and on
    exit (the next forward gathers through qwZ again). Call it on every rank; a model without qwZ is unchanged.

    Args:
        model: a model `install_zeropp` handled, or one holding it (any other: the block changes nothing).
    """
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    swapped = [(m, _WEIGHT_GATHERS[m]) for m in units if m in _WEIGHT_GATHERS]
    if not swapped:
        yield model
        return
    plain = _PlainAllGather()
    for module in units:
        module.reshard()
    for module, _ in swapped:
        module.set_custom_all_gather(plain)
    try:
        yield model
    finally:
        for module in units:
            module.reshard()
        for module, gather in swapped:
            module.set_custom_all_gather(gather)
