"""Frozen weights under the engine: no fp32 masters, quantized storage sharded and gathered as codes (gloo ranks).

One spawn per world size (2, and 4 in the `long` tier) runs every case in `CASES` and hands back each case's
result, or its traceback; each test then checks one case (process start-up, not the steps, is what costs on two
cores).

This file holds the parity check of LoRA on a quantized base at ZeRO-3 against one process (every frozen format,
2 and 4 ranks). The Lightning (tests/strategies/scripts/qlora_zeropp.py), Accelerate/trl
(tests/accelerate/scripts/hf_trainers.py) and prompt-learning (test_frozen_peft.py) tests only check that their
path reaches it.
"""

from __future__ import annotations

import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ds_plugin.launch import run_ranks
from tests.zero._tiny import VOCAB, llama, quiet

# One test waits for its world's spawn: allow for all of its cases.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SEQ, PER_RANK = 16, 2
STEPS = 4
QKVO = ["q_proj", "k_proj", "v_proj", "o_proj"]
ZERO3_FORMATS = ("int4", "nf4", "fp6")
# The NF4 run leaves the output head frozen, which ZeRO-3 then keeps whole on every rank; the others train a copy of
# it (modules_to_save), which is sharded like every trainable weight.
FROZEN_HEAD = ("nf4",)


def _lora_llama(fmt: str = "int4") -> nn.Module:
    import peft

    model = llama(seed=0)
    warnings.simplefilter("ignore")
    save = None if fmt in FROZEN_HEAD else ["lm_head"]
    cfg = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=QKVO, modules_to_save=save)
    return peft.get_peft_model(model, cfg)


def _probe() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(99))


def _global_batch(step: int, world: int) -> torch.Tensor:
    # One batch, learned by heart (random tokens hold nothing else to learn in a few steps).
    g = torch.Generator().manual_seed(500)
    return torch.randint(0, VOCAB, (world * PER_RANK, SEQ), generator=g)


def _full(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu().clone()


def _train_worker(rank: int, world: int, fmt: str, stage: int, ckpt: str | None, adapter: str | None = None) -> dict:
    torch.set_num_threads(1)
    quiet()
    from ds_plugin import initialize, save_adapter
    from ds_plugin.quant.frozen.quantize import quantized_weights

    model = _lora_llama(fmt)
    cfg = {"zero_optimization": {"stage": stage, "frozen_format": fmt}, "gradient_clipping": 0.0}
    engine = initialize(model, cfg, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    quantized = quantized_weights(engine.module)
    codes_before = {n: {k: t.clone() for k, t in q.parts.items()} for n, q in quantized.items()}
    losses = []
    for step in range(STEPS):
        x = _global_batch(step, world)[rank * PER_RANK : (rank + 1) * PER_RANK]
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    out = {
        "losses": losses,
        "quantized": sorted(quantized),
        "codes_unchanged": all(
            torch.equal(t, quantized[n].parts[k]) for n, parts in codes_before.items() for k, t in parts.items()
        ),
        "trainable": sorted(n for n, p in engine.module.named_parameters() if p.requires_grad),
        "head_sharded": {n: hasattr(p, "to_local") for n, p in engine.module.named_parameters() if "lm_head" in n},
        "head": _full(engine.module.get_output_embeddings().weight),
        "params": {n: _full(p) for n, p in engine.module.named_parameters() if p.requires_grad},
    }
    if adapter:
        save_adapter(engine, adapter)
        with torch.no_grad():
            out["logits"] = engine(input_ids=_probe()).logits.detach().clone()
    if ckpt:
        from ds_plugin.checkpoint import load_checkpoint, model_metadata, save_checkpoint

        extra = model_metadata(engine.module)
        save_checkpoint(ckpt, model_state=engine.model_state_dict(), extra=extra, overwrite=True)
        with torch.no_grad():  # scramble the live state, then load it back
            for q in quantized.values():
                for t in q.parts.values():
                    t.zero_()
            for p in engine.trainable_parameters():
                p.zero_()
        state = engine.model_state_dict()
        load_checkpoint(ckpt, model_state=state)
        engine.load_model_state_dict(state)
        out["reloaded_codes_equal"] = all(
            torch.equal(t, quantized[n].parts[k]) for n, parts in codes_before.items() for k, t in parts.items()
        )
        out["reloaded_params_equal"] = all(
            torch.equal(_full(p), out["params"][n]) for n, p in engine.module.named_parameters() if p.requires_grad
        )
    return out


def _single_process_model(fmt: str) -> nn.Module:
    from ds_plugin import quantize_frozen_

    quiet()
    return quantize_frozen_(_lora_llama(fmt), fmt)


def _single_process(fmt: str, world: int) -> dict:
    """The reference: the same quantized base and adapters, one process, the whole global batch per step."""
    model = _single_process_model(fmt)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    losses = []
    for step in range(STEPS):
        x = _global_batch(step, world)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "before": before, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _reloaded_logits(fmt: str, path: str) -> torch.Tensor:
    import peft

    from ds_plugin import quantize_frozen_

    model = peft.PeftModel.from_pretrained(_lora_llama(fmt).get_base_model(), path)
    quantize_frozen_(model, fmt)
    with torch.no_grad():
        return model(input_ids=_probe()).logits


def _paths(workdir: str | Path, fmt: str) -> tuple[str, str]:
    """Where the ZeRO-3 run in `fmt` saves its checkpoint and its adapter."""
    return str(Path(workdir) / f"{fmt}-ckpt"), str(Path(workdir) / f"{fmt}-adapter")


def _run_case(rank: int, world: int, case: tuple, workdir: str) -> Any:
    kind, *args = case
    if kind == "zero3":
        return _train_worker(rank, world, args[0], 3, *_paths(workdir, args[0]))
    if kind == "lower":
        return _train_worker(rank, world, "int8", args[0], None)
    return {"bytes": _bytes_worker, "no_masters": _no_masters_worker, "refusal": _refusal_worker}[kind](rank, world)


# What each world's one spawn runs, in order.
CASES = {
    2: [*(("zero3", f) for f in ZERO3_FORMATS), ("lower", 1), ("lower", 2), ("bytes",), ("no_masters",), ("refusal",)],
    4: [*(("zero3", f) for f in ZERO3_FORMATS), ("bytes",)],
}


def _all_cases(rank: int, world: int, workdir: str) -> dict[tuple, tuple[str, Any]]:
    import _break  # a fresh (spawned) process: DS_PLUGIN_TEST_NOOP_STEP must be applied here too

    _break.install()
    out = {}
    for case in CASES[world]:
        try:
            out[case] = ("ok", _run_case(rank, world, case, workdir))
        except Exception:  # reported by the case's own test; the next cases still run
            out[case] = ("error", traceback.format_exc())
    return out


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory):
    """`spawned(world, case)` -> (the spawn's workdir, the case's result on each rank); one spawn per world."""
    runs: dict[int, Any] = {}

    def results(world: int, case: tuple) -> tuple[Path, list[Any]]:
        if world not in runs:
            workdir = tmp_path_factory.mktemp(f"world{world}")
            try:
                runs[world] = workdir, run_ranks(_all_cases, world, timeout=840, workdir=str(workdir))
            except RuntimeError as e:  # the spawn itself failed: every test of this world reports it, once run
                runs[world] = e
        if isinstance(runs[world], Exception):
            raise runs[world]
        workdir, by_rank = runs[world]
        for rank, r in enumerate(by_rank):
            if r[case][0] == "error":
                pytest.fail(f"rank {rank} of {world}, case {case}:\n{r[case][1]}", pytrace=False)
        return workdir, [r[case][1] for r in by_rank]

    return results


# The 4-rank spawn (every case again at 4 ranks) is in the `long` tier; 2 ranks run in every bare `pytest`.
WORLDS = [2, pytest.param(4, marks=pytest.mark.long)]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("fmt", ZERO3_FORMATS)
def test_lora_on_a_quantized_base_at_zero3_matches_one_process(spawned, world, fmt, tmp_path):
    workdir, results = spawned(world, ("zero3", fmt))
    ckpt, adapter = _paths(workdir, fmt)
    ref = _single_process(fmt, world)
    mean = [sum(r["losses"][i] for r in results) / world for i in range(STEPS)]
    for got, want in zip(mean, ref["losses"], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (mean, ref["losses"])
    assert ref["losses"][-1] < ref["losses"][0]  # it learns
    r0 = results[0]
    assert len(r0["quantized"]) == 14 and all(r["codes_unchanged"] for r in results)
    assert all("lora_" in n or "modules_to_save" in n for n in r0["trainable"])
    # A frozen head stays whole on every rank (no all-gather at the step's peak); a trained one is sharded.
    if fmt in FROZEN_HEAD:
        assert r0["head_sharded"] == {"base_model.model.lm_head.weight": False}, r0["head_sharded"]
        assert all(torch.equal(r["head"], results[0]["head"]) for r in results)
    else:
        assert r0["head_sharded"]["base_model.model.lm_head.modules_to_save.default.weight"], r0["head_sharded"]
    for n, p in r0["params"].items():
        assert not torch.equal(p, ref["before"][n].float()), n  # every adapter moved
        # Adam divides by sqrt(v): where a gradient is ~0, reduction-order noise moves a step by a fraction of lr.
        torch.testing.assert_close(p, ref["params"][n].float(), rtol=1e-3, atol=1e-3)
    assert all(r["reloaded_codes_equal"] and r["reloaded_params_equal"] for r in results)
    # `ds-plugin export` writes the quantized base as the weights it encodes, by their own names.
    from safetensors.torch import load_file

    from ds_plugin.export import export_checkpoint
    from ds_plugin.quant.frozen.quantize import quantized_weights

    export_checkpoint(ckpt, str(tmp_path / "export"))
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert not any(k.endswith((".codes", ".scales")) for k in exported)
    ref_model = _single_process_model(fmt)
    for name, q in quantized_weights(ref_model).items():
        assert torch.equal(exported[name], q.dequantize()), name
    # The adapter (modules_to_save's head included, where it is trained) saved whole: on a fresh base stored the
    # same way it reproduces what the trained ZeRO-3 model computes.
    torch.testing.assert_close(_reloaded_logits(fmt, adapter), r0["logits"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("stage", [1, 2])
def test_lower_stages_store_the_quantized_base_replicated(spawned, stage):
    _, results = spawned(2, ("lower", stage))
    ref = _single_process("int8", 2)
    mean = [sum(r["losses"][i] for r in results) / 2 for i in range(STEPS)]
    for got, want in zip(mean, ref["losses"], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (mean, ref["losses"])
    assert all(r["codes_unchanged"] for r in results)


FORMATS = ("bf16", "int8", "int4", "nf4", "fp6")


def _bytes_worker(rank: int, world: int) -> dict:
    """Per format: per-rank bytes of the frozen Linear weights and all-gather bytes of one forward, ZeRO-3 bf16."""
    torch.set_num_threads(1)
    from torch.distributed.tensor import DTensor

    from ds_plugin.quant.frozen.quantize import quantized_weights
    from ds_plugin.quant.frozen.tensor import QuantizedWeight
    from ds_plugin.runtime.comms_logger import CommsLogger
    from ds_plugin.zero.apply import apply_zero

    out = {}
    for fmt in FORMATS:
        torch.manual_seed(0)
        # Each frozen Linear is its own ZeRO-3 unit, so every all-gather is one frozen weight.
        model = nn.Sequential(*(nn.Linear(512, 512, bias=False) for _ in range(4)))
        model.requires_grad_(False)
        zero = {"stage": 3} if fmt == "bf16" else {"stage": 3, "frozen_format": fmt}
        apply_zero(model, {"zero_optimization": zero, "bf16": {"enabled": True}}, block_types=[nn.Linear])
        assert len(quantized_weights(model)) == (0 if fmt == "bf16" else 4)
        local = 0
        for p in model.parameters():
            t = p.to_local() if isinstance(p, DTensor) else p
            local += t.nbytes_stored() if isinstance(t, QuantizedWeight) else t.numel() * t.element_size()
        x = torch.randn(2, 512, dtype=torch.bfloat16)
        with CommsLogger() as comms, torch.no_grad():
            y = model(x)
        gathered = sum(s["bytes"] for (op, _), s in comms.summary()["total"].items() if op.startswith("all_gather"))
        out[fmt] = {"local": local, "gathered": gathered, "finite": bool(torch.isfinite(y).all())}
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_frozen_bytes_and_gather_bytes_shrink_with_the_format(spawned, world):
    _, results = spawned(world, ("bytes",))
    for r in results:
        base = r["bf16"]
        assert base["local"] == 4 * 512 * 512 * 2 // world
        for fmt, limit in (("int8", 0.52), ("int4", 0.28), ("nf4", 0.28), ("fp6", 0.40)):
            got = r[fmt]
            assert got["finite"]
            assert got["local"] <= limit * base["local"], (fmt, got["local"] / base["local"])
            assert got["gathered"] <= limit * base["gathered"], (fmt, got["gathered"] / base["gathered"])
            assert got["gathered"] > 0.2 * base["gathered"]  # the codes do travel


def _no_masters_worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    quiet()
    from torch.distributed.tensor import DTensor

    from ds_plugin import initialize

    out = {}
    for stage in range(4):
        model = _lora_llama().to(torch.bfloat16)
        cfg = {"zero_optimization": {"stage": stage}, "bf16": {"enabled": True}}
        engine = initialize(model, cfg, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
        x = _global_batch(0, world)[rank * PER_RANK : (rank + 1) * PER_RANK]
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
        dtypes: dict[str, set[str]] = {"frozen": set(), "trainable": set()}
        frozen_bytes = 0
        for p in engine._params:
            t = p.to_local() if isinstance(p, DTensor) else p
            dtypes["trainable" if p.requires_grad else "frozen"].add(str(t.dtype))
            if not p.requires_grad:
                frozen_bytes += t.numel() * t.element_size()
        out[stage] = {
            "dtypes": {k: sorted(v) for k, v in dtypes.items()},
            "optimizer_params": sum(len(g["params"]) for g in engine.optimizer.param_groups),
            "states": len(engine.optimizer.state),
            "frozen_grads": sum(p.grad is not None for p in engine.module.parameters() if not p.requires_grad),
            "frozen_bytes": frozen_bytes,
            "frozen_numel": sum(p.numel() for p in engine.module.parameters() if not p.requires_grad),
        }
    return out


def test_frozen_parameters_get_no_master_no_gradient_no_optimizer_state(spawned):
    _, results = spawned(2, ("no_masters",))
    for r in results:
        for stage, got in r.items():
            assert got["dtypes"] == {"frozen": ["torch.bfloat16"], "trainable": ["torch.float32"]}, (stage, got)
            # 2 layers x 4 targets x (A, B), and the trainable copy of the head (modules_to_save)
            assert got["optimizer_params"] == got["states"] == 17
            assert got["frozen_grads"] == 0
            # bf16 storage: 2 bytes per frozen element, whole (stages 0/1) or sharded (2/3).
            expected = 2 * got["frozen_numel"] // (1 if stage < 2 else 2)
            assert abs(got["frozen_bytes"] - expected) <= 0.01 * expected, stage


def _refusal_worker(rank: int, world: int) -> dict:
    import dataclasses

    from ds_plugin import quantize_frozen_
    from ds_plugin.zero.apply import _check_quantized_shards, apply_zero
    from ds_plugin.zero.mesh import ZeroSetupError, data_parallel_mesh
    from ds_plugin.zero.plan import plan_for

    out = {}
    uneven = quantize_frozen_(nn.Sequential(nn.Linear(64, 3), nn.Linear(3, 2)).requires_grad_(False), "int8")
    try:
        apply_zero(uneven, {"zero_optimization": {"stage": 3}})
    except ZeroSetupError as e:
        out["uneven"] = str(e)
    even = quantize_frozen_(nn.Sequential(nn.Linear(64, 4)).requires_grad_(False), "int8")
    mesh = data_parallel_mesh(None)
    hpz = dataclasses.replace(plan_for({"zero_optimization": {"stage": 3}}, mesh), reshard_after_forward=2)
    try:
        _check_quantized_shards(even, hpz, mesh)
    except ZeroSetupError as e:
        out["hpz"] = str(e)
    return out


def test_layouts_the_gather_cannot_serve_are_refused_in_one_line(spawned):
    for r in spawned(2, ("refusal",))[1]:
        assert "0.weight: the int8 weight's 3 rows do not split evenly over 2 ranks" in r["uneven"], r
        assert "hpZ" in r["hpz"] and "zero_hpz_partition_size to 1" in r["hpz"]
        assert "\n" not in r["uneven"] + r["hpz"]
