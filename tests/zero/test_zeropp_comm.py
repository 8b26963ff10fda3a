"""qwZ / qgZ collectives against exact torch collectives, on 4 gloo ranks (2 "nodes" x 2)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds_plugin.launch import run_ranks
from ds_plugin.zero.cma import ring_link
from ds_plugin.zero.zeropp import QuantizedAllGather, QuantizedReduceScatter, node_groups

BLOCK = 256  # the quantization block these tests ask for
INT4_MAX = 7  # INT4 codes -7..7: a block's step is its largest magnitude / 7


def _half_steps(v: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Per element of `v` (rows along the last dim): the most INT4 round-to-nearest can move it, half of its block's
    step. Blocks of `block` start every `block` elements of a row; the scale travels as bf16 rounded up (at most
    2**-7 larger)."""
    n = v.shape[-1]
    blocks = F.pad(v.abs(), (0, -n % block)).unflatten(-1, (-1, block))
    half = blocks.amax(-1, keepdim=True) / INT4_MAX * (1 + 2**-7) / 2
    return half.expand_as(blocks).flatten(-2)[..., :n]


def _reduce_scatter_bounds(parts: torch.Tensor, rank: int, local: int = 2) -> dict[str, torch.Tensor]:
    """How far qgZ's sum for this rank's chunk may be from the exact one, per element, for one hop and two hops.

    `parts[s]` is what rank s sends here (float64). A rank's own part is summed exact, every other one is rounded
    once per hop it crosses. One hop: every other rank's part, once. Two hops (`local` ranks a node): in hop 1 the
    rank of node m with this rank's local index sums its node's parts (its own exact); in hop 2 that partial sum,
    from every other node, is rounded again, its blocks' largest magnitude at most the exact partial's plus hop 1's
    error.
    """
    world, j, node = parts.shape[0], rank % local, rank // local
    one_hop = sum(_half_steps(parts[s]) for s in range(world) if s != rank)
    two_hop = torch.zeros_like(parts[0])
    plain = torch.zeros_like(parts[0])  # hop 1 summed plain (in the input's dtype), only hop 2 rounded to INT4
    for m in range(world // local):
        members = range(m * local, (m + 1) * local)
        hop1 = sum((_half_steps(parts[s]) for s in members if s != m * local + j), torch.zeros_like(parts[0]))
        two_hop += hop1
        partial = parts[list(members)].sum(0).abs()
        plain += partial * 2**-8  # the partial sum rounded to the input's dtype (bf16: half a spacing, 2**-9)
        if m != node:
            two_hop += _half_steps(partial + hop1)
            plain += _half_steps(partial * (1 + 2**-8))
    return {"one_hop": one_hop, "two_hop": two_hop, "two_hop_plain_in_node": plain}


def _worker(rank: int, world: int) -> dict:
    results = {}
    intra, inter = node_groups(2)
    gen = torch.Generator().manual_seed(100 + rank)
    for dtype in (torch.float32, torch.bfloat16):
        for shard in (1, 7, 300, 5000):
            # all-gather: error per element bounded by half a quantization step of its block.
            x = torch.randn(shard, generator=gen).to(dtype)
            exact = torch.empty(world * shard, dtype=dtype)
            dist.all_gather_into_tensor(exact, x)  # the reference: the exact collective
            got = torch.empty_like(exact)
            QuantizedAllGather(block_size=256)(got, x, dist.group.WORLD)
            # Across nodes first, then inside: the same codes and scales end in the same places. Inside the node the
            # default moves decoded rows where the ranks read each other's memory (`cma`), codes otherwise: the same
            # bits either way.
            two_level = torch.empty_like(exact)
            QuantizedAllGather(block_size=256, intra_group=intra, inter_group=inter)(two_level, x, dist.group.WORLD)
            results[f"ag_two_level_equal_{dtype}_{shard}"] = torch.equal(two_level, got)
            codes_in_node = torch.empty_like(exact)
            QuantizedAllGather(block_size=256, intra_group=intra, inter_group=inter, plain_in_node=False)(
                codes_in_node, x, dist.group.WORLD
            )
            results[f"ag_two_level_codes_in_node_equal_{dtype}_{shard}"] = torch.equal(codes_in_node, got)
            # hpZ's backward gather runs in the node group: it must stay one level, inside the node.
            in_node = torch.empty(2 * shard, dtype=dtype)
            QuantizedAllGather(block_size=256, intra_group=intra, inter_group=inter)(in_node, x, intra)
            node = rank // 2
            mine = got[2 * node * shard : 2 * (node + 1) * shard]
            results[f"ag_in_node_{dtype}_{shard}"] = torch.equal(in_node, mine)
            # Pipelined in pieces of two blocks (the last one ragged): the same bits, one level and two.
            for name, kwargs, ref in (
                ("flat", {}, got),
                ("two_level", {"intra_group": intra, "inter_group": inter}, two_level),
            ):
                piecewise = torch.empty_like(exact)
                QuantizedAllGather(block_size=256, piece_numel=512, **kwargs)(piecewise, x, dist.group.WORLD)
                results[f"ag_pieces_{name}_equal_{dtype}_{shard}"] = torch.equal(piecewise, ref)
            blocks = exact.float().view(world, shard)
            step = blocks.abs().amax(dim=1, keepdim=True) / 127
            err = (got.float().view(world, shard) - blocks).abs()
            # Half a step of INT8 rounding (the scale travels as bf16 rounded up: at most 2**-7 larger), plus the
            # output dtype's own rounding (bf16: 2**-8 relative).
            out_eps = 2**-8 if dtype == torch.bfloat16 else 1e-6
            bound = step * 0.5 * (1 + 2**-7) * 1.0001 + blocks.abs() * out_eps + 1e-7
            results[f"ag_{dtype}_{shard}"] = bool((err <= bound).all())
            # reduce-scatter: one hop and two hops, SUM and AVG, against the exact reduction, element by element.
            g = torch.randn(world * shard, generator=gen).to(dtype)
            every = [torch.empty(world * shard) for _ in range(world)]
            dist.all_gather(every, g.float())  # exact: what every rank sends, to bound what quantizing it may cost
            parts = torch.stack([e.double().view(world, shard)[rank] for e in every])
            exact = parts.sum(0)
            bounds = _reduce_scatter_bounds(parts, rank)
            # The default takes hop 1 plain where the node's ranks read each other's memory (`cma`), as here.
            bounds["two_hop"] = bounds["two_hop_plain_in_node" if ring_link(intra) is not None else "two_hop"]
            bounds["two_hop_int4_in_node"] = _reduce_scatter_bounds(parts, rank)["two_hop"]
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                div = world if op == dist.ReduceOp.AVG else 1
                for name, comm in (
                    ("one_hop", QuantizedReduceScatter(block_size=BLOCK)),
                    ("two_hop", QuantizedReduceScatter(block_size=BLOCK, intra_group=intra, inter_group=inter)),
                    (
                        "two_hop_int4_in_node",
                        QuantizedReduceScatter(
                            block_size=BLOCK, intra_group=intra, inter_group=inter, plain_in_node=False
                        ),
                    ),
                ):
                    out = torch.empty(shard, dtype=dtype)
                    comm(out, g.clone(), dist.group.WORLD, op)  # a reduction consumes its input (FSDP2's staging)
                    err = (out.double() - exact / div).abs()
                    # The rounding bound, fp32 sums (a few 2**-24 of the terms), and the output dtype's rounding
                    # of the result (bf16: half a spacing, at most 2**-8 of it).
                    bound = (bounds[name] + 1e-6 * parts.abs().sum(0)) / div
                    bound += (exact.abs() / div + bound) * (2**-8 if dtype == torch.bfloat16 else 0.0)
                    # (within the bound everywhere, the largest share of the bound used: for the message)
                    results[f"rs_{name}_{op}_{dtype}_{shard}"] = (
                        bool((err <= bound).all()),
                        (err / bound).max().item(),
                    )
                    if shard >= 300:  # INT4 cannot carry Gaussian values exactly: it did quantize
                        results[f"rs_{name}_inexact_{op}_{dtype}_{shard}"] = bool(err.max() > 0)
                    if name == "two_hop":  # pipelined in pieces of two blocks: the same bits
                        piecewise = torch.empty_like(out)
                        QuantizedReduceScatter(
                            block_size=BLOCK, intra_group=intra, inter_group=inter, piece_numel=2 * BLOCK
                        )(piecewise, g.clone(), dist.group.WORLD, op)
                        results[f"rs_pieces_equal_{op}_{dtype}_{shard}"] = torch.equal(piecewise, out)
                    if op == dist.ReduceOp.SUM:
                        # Two reductions in flight at once, as the CPU engine lands one while it issues the next:
                        # each is the same sum as when it ran alone.
                        first = comm._start(g.clone(), dist.group.WORLD)
                        second = comm._start(g.flip(0), dist.group.WORLD)
                        alone = torch.empty_like(out)
                        comm(alone, g.flip(0), dist.group.WORLD, op)
                        results[f"rs_in_flight_{name}_{dtype}_{shard}"] = torch.equal(
                            first().to(dtype), out
                        ) and torch.equal(second().to(dtype), alone)
    return results


@pytest.mark.timeout(180)
def test_quantized_collectives_match_exact():
    for res in run_ranks(_worker, 4, timeout=170):
        for key, value in res.items():
            if isinstance(value, bool):
                assert value, key
            else:  # reduce-scatter: every element within the rounding bound of the hops it crossed
                within, used = value
                assert within, f"{key}: an element's error is {used:.3f} times its rounding bound"


def _one_rank(rank: int, world: int) -> bool:
    g = torch.randn(100).bfloat16()
    out = torch.empty_like(g)
    QuantizedReduceScatter(block_size=64)(out, g, dist.group.WORLD, dist.ReduceOp.SUM)
    return torch.equal(out, g)  # nothing crosses a wire, so nothing is quantized


@pytest.mark.timeout(60)
def test_one_rank_reduce_scatter_is_exact():
    assert run_ranks(_one_rank, 1, timeout=50) == [True]


def _exact_gathers(rank: int, world: int) -> dict:
    import copy

    from ds_plugin import initialize

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(64, 8)))
    whole = copy.deepcopy(model)
    x = torch.randn(4, 64)
    # ZeRO-3 + qwZ with the inner Sequential a unit of its own; the root stays gathered after a forward.
    config = {"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}
    engine = initialize(model, config, block_types=(torch.nn.Sequential,))
    with torch.no_grad():
        want = whole(x)
        quantized = engine(x)
        with engine.exact_weight_gathers():
            exact = engine(x)
        again = engine(x)
    return {
        "qwZ rounds": bool((quantized - want).abs().max() > 0),
        "exact inside the block": torch.equal(exact, want),
        "qwZ again after it": torch.equal(again, quantized),
    }


@pytest.mark.timeout(120)
def test_exact_weight_gathers():
    # The reload checks compare a saved copy with the engine's logits computed inside this block: the weights as
    # the shards hold them, bit for bit, however the last forward left the units gathered.
    for res in run_ranks(_exact_gathers, 2, timeout=110):
        assert all(res.values()), res
