"""qwZ / qgZ collectives against exact torch collectives, on 4 gloo ranks (2 "nodes" x 2)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ds_plugin.launch import run_ranks
from ds_plugin.zero.zeropp import QuantizedAllGather, QuantizedReduceScatter, node_groups


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
            # Across nodes first, then inside: the same codes and scales end in the same places.
            two_level = torch.empty_like(exact)
            QuantizedAllGather(block_size=256, intra_group=intra, inter_group=inter)(two_level, x, dist.group.WORLD)
            results[f"ag_two_level_equal_{dtype}_{shard}"] = torch.equal(two_level, got)
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
            # reduce-scatter: one hop and two hops, SUM and AVG, against the exact reduction.
            g = torch.randn(world * shard, generator=gen).to(dtype)
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                ref = g.float().clone()
                dist.all_reduce(ref)
                ref = ref.view(world, shard)[rank] / (world if op == dist.ReduceOp.AVG else 1)
                for name, comm in (
                    ("one_hop", QuantizedReduceScatter(block_size=256)),
                    ("two_hop", QuantizedReduceScatter(block_size=256, intra_group=intra, inter_group=inter)),
                ):
                    out = torch.empty(shard, dtype=dtype)
                    comm(out, g, dist.group.WORLD, op)
                    rel = ((out.float() - ref).norm() / ref.norm()).item()
                    results[f"rs_{name}_{op}_{dtype}_{shard}"] = rel
                    if name == "two_hop":  # pipelined in pieces of two blocks: the same bits
                        piecewise = torch.empty_like(out)
                        QuantizedReduceScatter(block_size=256, intra_group=intra, inter_group=inter, piece_numel=512)(
                            piecewise, g, dist.group.WORLD, op
                        )
                        results[f"rs_pieces_equal_{op}_{dtype}_{shard}"] = torch.equal(piecewise, out)
    return results


@pytest.mark.timeout(180)
def test_quantized_collectives_match_exact():
    for res in run_ranks(_worker, 4, timeout=170):
        for key, value in res.items():
            if isinstance(value, bool):
                assert value, key
            else:
                # INT4 with 256-element blocks on Gaussian data: ~10% relative error per hop is expected.
                assert value < 0.25, (key, value)


def _one_rank(rank: int, world: int) -> bool:
    g = torch.randn(100).bfloat16()
    out = torch.empty_like(g)
    QuantizedReduceScatter(block_size=64)(out, g, dist.group.WORLD, dist.ReduceOp.SUM)
    return torch.equal(out, g)  # nothing crosses a wire, so nothing is quantized


@pytest.mark.timeout(60)
def test_one_rank_reduce_scatter_is_exact():
    assert run_ranks(_one_rank, 1, timeout=50) == [True]
