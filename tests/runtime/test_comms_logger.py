"""Comms logger: exact byte counts for plain collectives (2 and 4 ranks) and for a raw FSDP2 step.

Expected bytes are written out here from the documented convention (ring "wire" bytes per rank) and, for
FSDP2, from the parameter shapes and FSDP2's dim-0 padding — never from the logger's own helpers.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ds_plugin.config import CommsLoggerConfig, from_deepspeed
from ds_plugin.launch import run_ranks
from ds_plugin.runtime.comms_logger import CommsLogger, comms_logger_from_config, get_comms_logger

F32 = 4


def _stats(calls: int, wire: int, inb: int, outb: int) -> dict[str, int]:
    return {"calls": calls, "bytes": wire, "in_bytes": inb, "out_bytes": outb}


def _plain_worker(rank: int, n: int) -> dict:
    warnings.filterwarnings("ignore", category=FutureWarning)  # 2.13 deprecates the *_tensor names used here
    # Groups are made before logging starts: new_group may synchronise internally.
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])] if n == 4 else [dist.new_group([0, 1])]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard")) if n == 4 else None
    mine = pairs[rank // 2]
    only_ar = CommsLogger(CommsLoggerConfig(enabled=True, prof_all=False, prof_ops=("all_reduce",)))
    with CommsLogger(group_labels={(0, 1): "pair01"}) as log, only_ar:
        if n == 4:
            log.label_group(pairs[1], "pair23")
        t = torch.ones(12)  # 48 bytes
        dist.all_reduce(t)
        dist.all_gather_into_tensor(torch.empty(12 * n), t)
        dist.reduce_scatter_tensor(torch.empty(12), torch.ones(12 * n))
        dist.all_to_all_single(torch.empty(4 * n, dtype=torch.float64), torch.ones(4 * n, dtype=torch.float64))
        dist.broadcast(t, src=0)
        work = dist.all_reduce(t, async_op=True)  # the handle must come back unchanged
        assert work is not None and hasattr(work, "wait")
        work.wait()
        gathered = [torch.empty(3, dtype=torch.int64) for _ in range(n)]
        dist.all_gather(gathered, torch.arange(3))
        assert [g.tolist() for g in gathered] == [[0, 1, 2]] * n
        send = dist.isend(torch.ones(5), dst=(rank + 1) % n)
        dist.recv(torch.empty(5), src=(rank - 1) % n)
        send.wait()
        first = log.step()
        with log.region("fwd"):
            dist.all_reduce(torch.ones(8), group=mine)
            with log.region("inner"):
                dist.all_gather_into_tensor(torch.empty(4), torch.ones(2), group=mine)
        dist.barrier()
        log.step()
    assert dist.all_reduce is not None and not hasattr(dist.all_reduce, "_ds_comms_wrapper")
    mesh_res = {}
    if mesh is not None:
        with CommsLogger(max_steps=1) as mlog:  # per-step detail for the last step only; totals for all
            mlog.label_mesh(mesh)
            dist.all_reduce(torch.ones(4), group=mesh.get_group("dp_shard"))
            mlog.step()
            dist.all_reduce(torch.ones(4), group=mesh.get_group("dp_replicate"))
            mlog.step()
        mesh_res = {"summary": mlog.summary(), "groups": mlog.groups()}
    return {
        "mesh": mesh_res,
        "first": first,
        "summary": log.summary(),
        "fwd": log.summary(region="fwd"),
        "inner": log.summary(region="fwd/inner"),
        "regions": log.regions(),
        "only_ar": only_ar.summary()["total"],
        "table": log.table(per_step=True),
    }


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 4])
def test_plain_collectives_exact_bytes(n: int) -> None:
    results = run_ranks(_plain_worker, n)
    w = "pair01" if n == 2 else "world"  # at n=2 the pair group is the whole world: the label given to it wins
    step0 = {
        ("all_reduce", w): _stats(2, 2 * 2 * (n - 1) * 48 // n, 2 * 48, 2 * 48),
        ("all_gather_into_tensor", w): _stats(1, (n - 1) * 48, 48, 48 * n),
        ("reduce_scatter_tensor", w): _stats(1, (n - 1) * 48, 48 * n, 48),
        ("all_to_all_single", w): _stats(1, 32 * n - 32, 32 * n, 32 * n),
        ("broadcast", w): _stats(1, 48, 48, 48),
        ("all_gather", w): _stats(1, (n - 1) * 24, 24, 24 * n),
        ("send", w): _stats(1, 20, 20, 0),
        ("recv", w): _stats(1, 0, 0, 20),
    }
    for rank, res in enumerate(results):
        pair = "pair01" if rank < 2 else "pair23"
        fwd = {
            ("all_reduce", pair): _stats(1, 32, 32, 32),  # group of 2: 2*(2-1)/2 * 32
            ("all_gather_into_tensor", pair): _stats(1, 8, 8, 16),
        }
        assert res["first"] == step0
        assert res["summary"][0] == step0
        assert res["summary"][1] == {**fwd, ("barrier", w): _stats(1, 0, 0, 0)}
        assert res["fwd"]["total"] == fwd
        assert res["inner"]["total"] == {("all_gather_into_tensor", pair): _stats(1, 8, 8, 16)}
        assert res["regions"] == ["", "fwd", "fwd/inner"]
        total_ar = sum(v["bytes"] for (op, _), v in res["summary"]["total"].items() if op == "all_reduce")
        assert sum(v["bytes"] for v in res["only_ar"].values()) == total_ar
        assert {op for op, _ in res["only_ar"]} == {"all_reduce"}
        assert "all_gather_into_tensor" in res["table"] and "calls" in res["table"]
        if n == 4:  # mesh [[0, 1], [2, 3]]: dp_shard groups are rows, dp_replicate groups are columns
            ar = _stats(1, 16, 16, 16)
            assert res["mesh"]["summary"] == {
                1: {("all_reduce", "dp_replicate"): ar},
                "total": {("all_reduce", "dp_replicate"): ar, ("all_reduce", "dp_shard"): ar},
            }
            assert res["mesh"]["groups"] == {
                "dp_shard": [(0, 1) if rank < 2 else (2, 3)],
                "dp_replicate": [(rank % 2, rank % 2 + 2)],
            }


def _padded_shard_numel(p: torch.nn.Parameter, n: int) -> int:
    # FSDP2 pads dim 0 to a multiple of the world size; each rank holds ceil(d0 / n) rows.
    return math.ceil(p.shape[0] / n) * math.prod(p.shape[1:])


def _fsdp_worker(rank: int, n: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    blocks = [model[0], model[2], model[3]]
    shard_numels = [sum(_padded_shard_numel(p, n) for p in b.parameters()) for b in blocks]
    for b in blocks:
        fully_shard(b, reshard_after_forward=True)
    fully_shard(model)  # the root owns no parameters: it adds no all-gather of its own
    x = torch.randn(4, 8)
    with CommsLogger() as log, CommsLogger(CommsLoggerConfig(enabled=True, debug=True)) as dbg:
        for _ in range(2):
            with log.region("forward"):
                loss = model(x).sum()
            with log.region("backward"):
                loss.backward()
            log.step()
        with log.region("dtensor"):
            full = model[0].weight.full_tensor()  # DTensor redistribution: a functional all-gather
    assert full.shape == (6, 8)
    return {
        "shard_numels": shard_numels,
        "fwd": log.summary(region="forward"),
        "bwd": log.summary(region="backward"),
        "dtensor": log.summary(region="dtensor")["total"],
        "debug_ops": sorted({op for op, _ in dbg.summary()["total"]}),
    }


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fsdp_step_counts_match_parameter_sizes() -> None:
    n = 2
    for res in run_ranks(_fsdp_worker, n):
        shard_bytes = [F32 * s for s in res["shard_numels"]]
        ag = _stats(len(shard_bytes), (n - 1) * sum(shard_bytes), sum(shard_bytes), n * sum(shard_bytes))
        rs = _stats(len(shard_bytes), (n - 1) * sum(shard_bytes), n * sum(shard_bytes), sum(shard_bytes))
        for step in (0, 1):
            # Every block is all-gathered in forward and again in backward (it resharded after forward) ...
            assert res["fwd"][step] == {("all_gather_into_tensor", "world"): ag}
            # ... and its gradients are reduce-scattered once.
            assert res["bwd"][step] == {("all_gather_into_tensor", "world"): ag, ("reduce_scatter_tensor", "world"): rs}
        # debug names the code that issued each collective (DeepSpeed's `debug`): FSDP2's collective helpers.
        assert res["debug_ops"] and all(" | torch.distributed." in op for op in res["debug_ops"]), res["debug_ops"]
        weight_shard = F32 * 3 * 8
        assert res["dtensor"] == {
            ("all_gather_into_tensor", "world"): _stats(1, weight_shard, weight_shard, 2 * weight_shard)
        }


def test_from_config_and_uninstall() -> None:
    original = dist.all_reduce
    assert comms_logger_from_config(from_deepspeed({})) is None
    log = comms_logger_from_config(from_deepspeed({"comms_logger": {"enabled": True, "verbose": True}}))
    try:
        assert log is not None and get_comms_logger() is log
        assert comms_logger_from_config(CommsLoggerConfig(enabled=True)) is log
        assert dist.all_reduce is not original and dist.distributed_c10d.all_reduce is dist.all_reduce
        assert log.summary() == {"total": {}}
        assert "bytes (wire)" in log.table()
        log.step()
        assert log.summary() == {0: {}, "total": {}}
    finally:
        log.stop()
    assert get_comms_logger() is None
    assert dist.all_reduce is original
