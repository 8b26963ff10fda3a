"""ZeroEngine features: stage-agnostic state dicts, optimizer rebuild, no_sync, fp16 loss scaling, bitsandbytes,
stage 1's real sharding, sharded initialisation and one-line errors.

Two spawns (2 and 4 gloo ranks) record numbers; the 4-rank one loads the checkpoint the 2-rank one wrote at
another stage. Setup checks that need no process group are in test_model_setup.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
from _dist import run_ranks
from _tiny import batch, full_params, gpt2, llama, make_optimizer, max_rel, quiet, train_ddp, train_engine, zero_config
from torch import nn

from ds_plugin.config import ConfigError
from ds_plugin.zero.apply import apply_zero
from ds_plugin.zero.init import materialize_, meta_init
from ds_plugin.zero.mesh import ZeroSetupError

# ---------------------------------------------------------------------------------------------- 2 ranks


def _clone(tree):
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    return tree


def _state_dicts(rank: int, world: int, ckpt: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Shard

    from ds_plugin.zero.setup import initialize

    out: dict = {}
    engines = {s: initialize(gpt2(), zero_config(s), make_optimizer("adamw")) for s in (0, 1, 2, 3)}
    for e in engines.values():
        train_engine(e, rank, world, 3)
    msd = {s: e.model_state_dict() for s, e in engines.items()}
    osd = {s: e.optimizer_state_dict() for s, e in engines.items()}
    out["model_keys"] = {s: sorted(sd) for s, sd in msd.items()}
    out["optim_keys"] = {s: sorted(sd["state"]) for s, sd in osd.items()}
    out["group_names"] = {s: sorted(sd["param_groups"][0]["params"]) for s, sd in osd.items()}
    out["placements"] = {
        s: {type(v).__name__ + str(getattr(v, "placements", "")) for v in sd.values()} for s, sd in msd.items()
    }
    full = {s: {k: v.full_tensor() for k, v in sd.items() if isinstance(v, DTensor)} for s, sd in msd.items()}
    out["weights_diff"] = {s: max((full[s][k] - full[3][k]).abs().max().item() for k in full[3]) for s in full}
    exp_avg = {s: {k: v["exp_avg"].full_tensor() for k, v in sd["state"].items()} for s, sd in osd.items()}
    out["exp_avg_diff"] = {s: max((exp_avg[s][k] - exp_avg[3][k]).abs().max().item() for k in exp_avg[3]) for s in osd}
    out["exp_avg_shard0"] = all(
        v["exp_avg"].placements == (Shard(0),) for sd in osd.values() for v in sd["state"].values()
    )
    dcp.save({"model": msd[1], "optim": osd[1]}, checkpoint_id=ckpt)
    out["saved"] = {k: v.clone() for k, v in full[1].items()}
    out["saved_exp_avg"] = {k: v.clone() for k, v in exp_avg[1].items()}
    # Move each trained state to a fresh engine of another stage; both then train on identically.
    for src, dst in ((1, 3), (3, 0), (2, 1)):
        fresh = initialize(gpt2(seed=7), zero_config(dst), make_optimizer("adamw"))
        # Cloned: a loaded optimizer keeps the given tensors (as torch's does), and both engines train on.
        fresh.load_model_state_dict(_clone(engines[src].model_state_dict()))
        fresh.load_optimizer_state_dict(_clone(engines[src].optimizer_state_dict()))
        a = train_engine(fresh, rank, world, 2)["loss"]
        b = train_engine(engines[src], rank, world, 2)["loss"]
        out["moved", src, dst] = max_rel(a, b)
    return out


def _optimizers(rank: int, world: int) -> dict:
    from ds_plugin.zero.setup import initialize

    out: dict = {}
    for stage in (1, 3):
        model = gpt2()
        decay = [p for n, p in model.named_parameters() if p.dim() > 1]
        rest = [p for n, p in model.named_parameters() if p.dim() <= 1]
        user = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=2e-3, weight_decay=0.1)
        engine = initialize(model, zero_config(stage), user)
        opt = engine.optimizer
        out["groups", stage] = [(len(g["params"]), g["weight_decay"], g["lr"]) for g in opt.param_groups]
        out["emptied", stage] = all(not g["params"] for g in user.param_groups)
        out["type", stage] = type(opt).__name__
        ref = gpt2()
        ref_decay = [p for n, p in ref.named_parameters() if p.dim() > 1]
        ref_rest = [p for n, p in ref.named_parameters() if p.dim() <= 1]
        ddp = nn.parallel.DistributedDataParallel(ref)
        ref_opt = torch.optim.AdamW([{"params": ref_decay}, {"params": ref_rest, "weight_decay": 0.0}], lr=2e-3)
        ref_opt.param_groups[0]["weight_decay"] = 0.1
        losses = []
        for step in range(3):
            x = batch(step, rank, world)
            loss = ddp(input_ids=x, labels=x).loss
            loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            losses.append(loss.item())
        out["grouped", stage] = max_rel(train_engine(engine, rank, world, 3)["loss"], losses)
        sgd = initialize(gpt2(), zero_config(stage), make_optimizer("sgd"))
        out["sgd", stage] = max_rel(
            train_engine(sgd, rank, world, 3)["loss"], train_ddp(gpt2(), rank, world, 3, optim="sgd")["loss"]
        )
        # A framework that calls loss.backward() and optimizer.step() itself (no engine.step) trains the same.
        direct = initialize(gpt2(), zero_config(stage), make_optimizer("adamw"))
        losses = []
        for step in range(3):
            x = batch(step, rank, world)
            loss = direct(input_ids=x, labels=x).loss
            loss.backward()
            direct.optimizer.step()
            direct.optimizer.zero_grad()
            losses.append(loss.item())
        out["direct", stage] = max_rel(losses, train_ddp(gpt2(), rank, world, 3)["loss"])
        stepped = torch.optim.SGD(gpt2().parameters(), lr=0.1, momentum=0.9)
        for p in stepped.param_groups[0]["params"]:
            p.grad = torch.zeros_like(p)
        stepped.step()
        try:
            initialize(gpt2(), zero_config(stage), stepped)
            out["stepped", stage] = None
        except ZeroSetupError as e:
            out["stepped", stage] = str(e)
    return out


def _no_sync_fp16_bnb(rank: int, world: int) -> dict:
    from ds_plugin.zero import stage1
    from ds_plugin.zero.setup import initialize

    out: dict = {}
    for stage in (0, 1, 2, 3):
        # no_sync: two half-weighted micro-batches, the first without communication, equal one whole batch.
        whole = initialize(gpt2(), zero_config(stage), make_optimizer("sgd"))
        default_bucket, stage1._BUCKET_NUMEL = stage1._BUCKET_NUMEL, 8_000  # several buckets in the tiny model
        parts = initialize(gpt2(), zero_config(stage), make_optimizer("sgd"))
        x = batch(0, rank, world, per_rank=4)
        whole.backward(whole(input_ids=x, labels=x).loss)
        whole.step()
        state = parts._replicated  # stages 0/1: reductions launched from backward hooks, by bucket
        with parts.no_sync():
            parts.backward(parts(input_ids=x[:2], labels=x[:2]).loss * 0.5)
        silent = all(p.grad is None for p in parts.trainable_parameters()) and not (state and state._launched)
        parts.backward(parts(input_ids=x[2:], labels=x[2:]).loss * 0.5)
        buckets = list(range(len(state._buckets))) if state else []
        launched = state is None or (len(buckets) > 1 and sorted(state._launched) == buckets)
        parts.step()
        # Two synchronised backwards in one step (stages 0/1: the second finds its buckets already launched and
        # has them reduced again at the step) equal one backward of the whole batch.
        twice = initialize(gpt2(), zero_config(stage), make_optimizer("sgd"))
        for half in (x[:2], x[2:]):
            twice.backward(twice(input_ids=half, labels=half).loss * 0.5)
        twice.step()
        stage1._BUCKET_NUMEL = default_bucket
        pw, pp, pt = full_params(whole.module), full_params(parts.module), full_params(twice.module)
        diff = max(max((pw[k] - q[k]).abs().max().item() for k in pw) for q in (pp, pt))
        out["no_sync", stage] = (silent and launched, diff)

        # fp16: an overflow on rank 0 only must skip the step on every rank and halve the scale.
        cfg = zero_config(stage, dtype="fp16")
        cfg["fp16"].update(initial_scale_power=8, hysteresis=1)
        engine = initialize(gpt2(), cfg, make_optimizer("adamw"))
        record = []
        for step in range(3):
            # Measured before forward: stage 2 keeps the fp16 gathered weights registered until backward.
            before = sum(v.float().sum().item() for v in full_params(engine.module).values())
            x = batch(step, rank, world)
            loss = engine(input_ids=x, labels=x).loss
            if step == 1 and rank == 0:
                loss = loss * float("inf")
            engine.backward(loss)
            stepped = engine.step()
            after = sum(v.float().sum().item() for v in full_params(engine.module).values())
            record.append((stepped, engine.loss_scaler.scale, before == after, loss.item()))
        out["fp16", stage] = (record, engine.skipped_steps)

    try:
        import bitsandbytes as bnb

        probe = nn.Parameter(torch.randn(64, 64))
        probe.grad = torch.randn(64, 64)
        bnb.optim.AdamW8bit([probe], min_8bit_size=16).step()
    except Exception as e:  # bitsandbytes without a CPU backend raises many kinds of errors
        out["bnb"] = f"skip: bitsandbytes 8-bit AdamW does not run on this CPU build ({type(e).__name__}: {e})"
        return out
    for stage in (1, 3):
        factory = lambda p: bnb.optim.AdamW8bit(p, lr=1e-3, weight_decay=0.01, min_8bit_size=16)  # noqa: E731
        engine = initialize(gpt2(), zero_config(stage), factory)
        eight = train_engine(engine, rank, world, 5)["loss"]
        ref = train_ddp(gpt2(), rank, world, 5)["loss"]
        try:
            engine.optimizer_state_dict()
            refused = False
        except ZeroSetupError:
            refused = True
        out["bnb", stage] = (type(engine.optimizer).__name__, max_rel(eight, ref), eight[-1] < eight[0], refused)
    return out


def _mixed(rank: int, world: int) -> dict:
    from ds_plugin.zero.setup import initialize

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())
    logging.getLogger("ds_plugin.zero").addHandler(handler)
    logging.getLogger("ds_plugin.zero").setLevel(logging.INFO)
    out: dict = {}
    fp32 = initialize(gpt2(), zero_config(1, gas=2), make_optimizer("adamw"))
    ref_accum = train_engine(fp32, rank, world, 4, per_rank=4)["loss"]
    ref = train_ddp(gpt2(), rank, world, 4)["loss"]
    for stage in (1, 3):
        cfg = {**zero_config(stage, dtype="bf16", gas=2), "data_types": {"grad_accum_dtype": "fp32"}}
        engine = initialize(gpt2(), cfg, make_optimizer("adamw"))
        out["fp32_accum", stage] = max_rel(train_engine(engine, rank, world, 4, per_rank=4)["loss"], ref_accum)
        offload = zero_config(stage, offload_optimizer={"device": "cpu"})
        engine = initialize(gpt2(), offload, make_optimizer("adamw"))
        out["offload", stage] = max_rel(train_engine(engine, rank, world, 4)["loss"], ref)
    out["notices"] = [m for m in records if "offload" in m]
    return out


def _two_ranks(rank: int, world: int, ckpt: str) -> dict:
    quiet()
    return {
        **_state_dicts(rank, world, ckpt),
        **_optimizers(rank, world),
        **_no_sync_fp16_bnb(rank, world),
        **_mixed(rank, world),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[str, list[dict]]:
    ckpt = str(tmp_path_factory.mktemp("zero_ckpt"))
    return ckpt, run_ranks(_two_ranks, 2, timeout=400, ckpt=ckpt)


def test_state_dicts_do_not_depend_on_the_stage(two_ranks):
    _, results = two_ranks
    for r in results:
        assert all(keys == r["model_keys"][3] for keys in r["model_keys"].values())
        assert "lm_head.weight" in r["model_keys"][1]  # tied weights keep both names, as FSDP2 reports them
        assert all(keys == r["optim_keys"][3] for keys in r["optim_keys"].values())
        assert all(names == r["group_names"][3] for names in r["group_names"].values())
        for stage, kinds in r["placements"].items():
            assert kinds == {"DTensor(Shard(dim=0),)"}, f"stage {stage}: {kinds}"
        assert max(r["weights_diff"].values()) < 1e-5
        assert max(r["exp_avg_diff"].values()) < 1e-5
        assert r["exp_avg_shard0"]


@pytest.mark.parametrize(("src", "dst"), [(1, 3), (3, 0), (2, 1)])
def test_state_moves_between_stages(two_ranks, src, dst):
    _, results = two_ranks
    for r in results:
        assert r["moved", src, dst] < 1e-5


@pytest.mark.parametrize("stage", [1, 3])
def test_optimizer_is_rebuilt_with_its_groups(two_ranks, stage):
    _, results = two_ranks
    for r in results:
        assert r["type", stage] == "AdamW"
        (n_decay, wd_decay, lr), (n_rest, wd_rest, _) = r["groups", stage]
        assert (wd_decay, wd_rest, lr) == (0.1, 0.0, 2e-3)
        assert n_decay + n_rest == 28 and n_decay > 0 and n_rest > 0
        assert r["emptied", stage], "the user's optimizer still references the unsharded parameters"
        assert r["grouped", stage] < 1e-5
        assert r["sgd", stage] < 1e-5
        assert "already stepped" in r["stepped", stage] and "\n" not in r["stepped", stage]


@pytest.mark.parametrize("stage", [1, 3])
def test_optimizer_step_called_directly_still_reduces_and_syncs(two_ranks, stage):
    _, results = two_ranks
    for r in results:
        assert r["direct", stage] < 1e-5


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_no_sync_skips_communication_and_the_last_backward_reduces(two_ranks, stage):
    _, results = two_ranks
    for r in results:
        silent, diff = r["no_sync", stage]
        assert silent
        assert diff < 1e-6


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_overflow_on_one_rank_skips_everywhere(two_ranks, stage):
    _, results = two_ranks
    for r in results:
        record, skipped = r["fp16", stage]
        (ok1, scale1, same1, _), (ok2, scale2, same2, _), (ok3, scale3, same3, loss3) = record
        assert (ok1, ok2, ok3) == (True, False, True)
        assert (same1, same2, same3) == (False, True, False)
        assert (scale1, scale2, scale3) == (256.0, 128.0, 128.0)
        assert skipped == 1 and 4.0 < loss3 < 6.0


@pytest.mark.parametrize("stage", [1, 3])
def test_bitsandbytes_8bit(two_ranks, stage):
    _, results = two_ranks
    if isinstance(results[0].get("bnb"), str):
        pytest.skip(results[0]["bnb"])
    for r in results:
        name, rel, learns, refused = r["bnb", stage]
        assert name == "AdamW8bit" and learns and refused
        assert rel < 1e-2  # 8-bit moments track 32-bit AdamW closely over a few steps


@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_with_fp32_accumulation_and_cpu_offload(two_ranks, stage):
    _, results = two_ranks
    for r in results:
        assert r["fp32_accum", stage] < 1e-2
        assert r["offload", stage] < 1e-5
    assert len(results[0]["notices"]) == 2  # one notice per setup that asked for offload: the plan is resolved once


# ---------------------------------------------------------------------------------------------- 4 ranks


def _stage1_sharding(rank: int, world: int) -> dict:
    from torch.distributed.tensor import DTensor, Shard

    from ds_plugin.zero.setup import initialize
    from ds_plugin.zero.stage1 import shard_rows

    out: dict = {}
    for dtype in ("fp32", "bf16"):
        engine = initialize(gpt2(), zero_config(1, dtype=dtype), make_optimizer("adamw"))
        train_engine(engine, rank, world, 1)
        state = engine._replicated
        checks = []
        for master in engine.trainable_parameters():
            exp_avg = engine.optimizer.state[master]["exp_avg"]
            _, rows = shard_rows(master.shape[0], world, rank)
            checks.append(
                (
                    isinstance(exp_avg, DTensor) and exp_avg.placements == (Shard(0),),
                    exp_avg.to_local().numel(),
                    rows * master[0].numel(),
                    master.numel(),
                    master[0].numel(),
                    master.to_local().dtype,
                )
            )
        compute = [(type(p).__name__, tuple(p.shape), p.dtype, p.float().sum().item()) for p in state.params]
        out[dtype] = {"checks": checks, "compute": compute}
    return out


def _sharded_init(rank: int, world: int) -> dict:
    from torch.distributed.tensor import DTensor

    from ds_plugin.zero.init import init_sharded

    out: dict = {}
    for name, build in (("gpt2", gpt2), ("llama", llama)):
        with meta_init():
            model = build()
        on_meta = all(p.is_meta for p in model.parameters())
        full_bytes = sum(p.numel() * 4 for p in model.parameters())
        largest = max(p.numel() * 4 for p in model.parameters())
        apply_zero(model, zero_config(3))
        peak = materialize_(model, seed=3)
        local = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
        sharded = all(isinstance(p, DTensor) for p in model.parameters())
        whole = init_sharded(build, zero_config(1), seed=3)  # the full model, initialised the same way
        a, b = full_params(model), full_params(whole)
        diff = max((a[k] - b[k]).abs().max().item() for k in a)
        x = batch(0, rank, world)
        loss = model(input_ids=x, labels=x).loss.item()
        out[name] = dict(meta=on_meta, full=full_bytes, largest=largest, peak=peak, local=local, sharded=sharded)
        out[name].update(diff=diff, loss=loss, rows=len(a))
    # A plain model initialised by its layers' reset_parameters matches eager construction bit for bit,
    # the zeroed padding row of a sharded embedding included.
    make = lambda: nn.Sequential(  # noqa: E731
        nn.Linear(16, 64), nn.LayerNorm(64), nn.Linear(64, 8), nn.Embedding(10, 8, padding_idx=5)
    )
    torch.manual_seed(11)
    eager = make()
    with meta_init():
        plain = make()
    apply_zero(plain, zero_config(3))
    materialize_(plain, seed=11)
    a, b = full_params(plain), full_params(eager)
    out["plain_diff"] = max((a[k] - b[k]).abs().max().item() for k in a)
    return out


def _load_and_errors(rank: int, world: int, ckpt: str, saved: dict) -> dict:
    import torch.distributed.checkpoint as dcp

    from ds_plugin.zero.setup import initialize

    out: dict = {}
    engine = initialize(gpt2(seed=5), zero_config(3), make_optimizer("adamw"))
    msd, osd = engine.model_state_dict(), engine.optimizer_state_dict()
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    engine.load_model_state_dict(msd)
    engine.load_optimizer_state_dict(osd)
    now = full_params(engine.module)
    out["loaded_diff"] = max((now[k] - v).abs().max().item() for k, v in saved["saved"].items() if k in now)
    exp_avg = {k: v["exp_avg"].full_tensor() for k, v in engine.optimizer_state_dict()["state"].items()}
    out["loaded_exp_avg_diff"] = max((exp_avg[k] - v).abs().max().item() for k, v in saved["saved_exp_avg"].items())

    def error(fn) -> tuple[str, str, bool] | None:
        try:
            fn()
        except (ValueError, ConfigError) as e:
            return type(e).__name__, str(e), e.__cause__ is None and e.__context__ is None
        return None

    class Scalar(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.tensor(1.0))

    out["errors"] = {
        "hpz": error(lambda: apply_zero(gpt2(), zero_config(3, zero_hpz_partition_size=3))),
        "no_params": error(lambda: apply_zero(nn.ReLU(), zero_config(3))),
        "block_types": error(lambda: apply_zero(gpt2(), zero_config(3), block_types=["NoSuchBlock"])),
        "scalar": error(lambda: apply_zero(Scalar(), zero_config(3))),
        "twice": error(lambda: apply_zero(apply_zero(gpt2(), zero_config(2)), zero_config(2))),
    }
    return out


def _four_ranks(rank: int, world: int, ckpt: str, saved: dict) -> dict:
    quiet()
    return {
        "stage1": _stage1_sharding(rank, world),
        "init": _sharded_init(rank, world),
        **_load_and_errors(rank, world, ckpt, saved),
    }


@pytest.fixture(scope="module")
def four_ranks(two_ranks) -> list[dict]:
    ckpt, results = two_ranks
    saved = {"saved": results[0]["saved"], "saved_exp_avg": results[0]["saved_exp_avg"]}
    return run_ranks(_four_ranks, 4, timeout=400, ckpt=ckpt, saved=saved)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_stage1_shards_optimizer_state_and_replicates_params(four_ranks, dtype):
    world = len(four_ranks)
    per_param_total: dict[int, int] = {}
    for r in four_ranks:
        for i, (is_shard, local, expected, numel, row, master_dtype) in enumerate(r["stage1"][dtype]["checks"]):
            assert is_shard and master_dtype == torch.float32
            assert local == expected <= numel / world + row  # numel / W, up to one row of torch.chunk rounding
            per_param_total[i] = per_param_total.get(i, 0) + local
        for kind, _, compute_dtype, _ in r["stage1"][dtype]["compute"]:
            assert kind == "Parameter" and compute_dtype == (torch.bfloat16 if dtype == "bf16" else torch.float32)
    numels = [c[3] for c in four_ranks[0]["stage1"][dtype]["checks"]]
    assert [per_param_total[i] for i in range(len(numels))] == numels  # the shards tile each tensor exactly
    sums = {tuple(c[3] for c in r["stage1"][dtype]["compute"]) for r in four_ranks}
    assert len(sums) == 1, "compute parameters differ between ranks"
    full_shapes = [c[1] for c in four_ranks[0]["stage1"][dtype]["compute"]]
    assert sum(torch.Size(s).numel() for s in full_shapes) == sum(numels)  # every rank holds all of it


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_sharded_init_never_holds_the_full_model(four_ranks, model):
    world = len(four_ranks)
    for r in four_ranks:
        info = r["init"][model]
        assert info["meta"] and info["sharded"]
        assert info["local"] <= info["full"] / world + 64 * 4 * info["rows"]  # padding: < one row per tensor
        assert info["peak"] <= info["largest"] < info["full"]  # one parameter's full tensor at a time
        assert info["diff"] == 0.0  # same weights as the whole model initialised alone, at any world size
        assert 4.0 < info["loss"] < 6.0
    assert four_ranks[0]["init"]["plain_diff"] == 0.0


def test_checkpoint_from_two_ranks_stage1_loads_at_four_ranks_stage3(four_ranks):
    for r in four_ranks:
        assert r["loaded_diff"] == 0.0
        assert r["loaded_exp_avg_diff"] == 0.0


@pytest.mark.parametrize(
    ("case", "kind", "words"),
    [
        ("hpz", "ConfigError", ["zero_hpz_partition_size", "3", "world size 4"]),
        ("no_params", "ZeroSetupError", ["ReLU", "no parameters"]),
        ("block_types", "ZeroSetupError", ["NoSuchBlock", "GPT2Block"]),
        ("scalar", "ZeroSetupError", ["gain", "scalar"]),
        ("twice", "ZeroSetupError", ["already"]),
    ],
)
def test_bad_inputs_give_one_line_errors(four_ranks, case, kind, words):
    for r in four_ranks:
        got = r["errors"][case]
        assert got is not None, f"{case}: no error"
        name, message, bare = got
        assert name == kind and "\n" not in message and bare, message
        assert all(w in message for w in words), message
