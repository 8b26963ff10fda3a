"""The one setup path: `initialize` acts on every block of the config it is given (`fp8`, `comms_logger`), and the
plan rejects what the run cannot do before the model is touched. Two gloo ranks, one spawn."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks
from torch import nn

from ds_plugin.config import ConfigError
from ds_plugin.zero.plan import FrameworkSettings, resolve_plan

STEPS = 12


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))


def _train(engine, rank: int) -> list[float]:
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(32, 64, generator=gen)
    y = torch.randn(32, 16, generator=gen)
    losses = []
    for _ in range(STEPS):
        loss = nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _worker(rank: int, world: int) -> dict:
    from ds_plugin import initialize
    from ds_plugin.precision.fp8_linear import Fp8Linear
    from ds_plugin.zero.mesh import ZeroSetupError

    out: dict = {}
    base = {"zero_optimization": {"stage": 3}, "gradient_clipping": 0.0}
    for name, extra in (("plain", {}), ("fp8", {"fp8": {"enabled": True, "recipe": "tensorwise"}})):
        model = _mlp()
        engine = initialize(model, {**base, **extra}, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
        out[name] = {
            "fp8_layers": sum(isinstance(m, Fp8Linear) for m in engine.module.modules()),
            "losses": _train(engine, rank),
            "plan_fp8": None if engine.plan.fp8 is None else engine.plan.fp8.recipe,
        }
    try:
        initialize(nn.Sequential(nn.Linear(10, 3)), {**base, "fp8": {"enabled": True}})
    except ZeroSetupError as e:
        out["fp8_error"] = str(e)

    engine = initialize(_mlp(), {**base, "comms_logger": {"enabled": True}}, optimizer=torch.optim.AdamW)
    _train(engine, rank)
    log = engine.comms_logger
    summary = log.summary()
    log.stop()
    out["comms"] = {
        "steps": sorted(k for k in summary if k != "total"),
        "ops": sorted({op for op, _ in summary["total"]}),
        "gather_bytes": sum(v["bytes"] for (op, _), v in summary["total"].items() if op.startswith("all_gather")),
        "reduce_bytes": sum(
            v["bytes"] for (op, _), v in summary["total"].items() if op.startswith(("reduce_scatter", "all_reduce"))
        ),
        "grad_bytes": 4 * sum(p.numel() for p in _mlp().parameters()),
        "labels": sorted({label for _, label in summary["total"]}),
    }
    out["no_logger"] = initialize(_mlp(), base).comms_logger is None

    # Clip, then skip the step (the "norm not finite" pattern: the optimizer's own zero_grad, not the engine's):
    # the next step must still reduce and unscale its new gradients, as a run that never skipped does.
    fp16 = {"zero_optimization": {"stage": 1}, "fp16": {"enabled": True, "loss_scale": 16}, "gradient_clipping": 0.0}
    weights = []
    for skip_first in (True, False):
        engine = initialize(_mlp(), fp16, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
        if skip_first:
            engine.backward(engine(x).float().square().mean())
            engine.clip_grad_norm_(1e9)
            engine.optimizer.zero_grad()
        engine.backward(engine(x).float().mean())
        engine.clip_grad_norm_(1e9)
        engine.step()
        weights.append(engine.model_state_dict()["0.weight"].full_tensor())
    out["skip_then_step_diff"] = (weights[0] - weights[1]).abs().max().item()
    out["step_size"] = (weights[1] - _mlp().state_dict()["0.weight"]).abs().max().item()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_worker, 2, timeout=240)


def test_initialize_converts_layers_from_the_fp8_block_and_trains(results: list[dict]) -> None:
    for r in results:
        assert r["plain"]["fp8_layers"] == 0 and r["plain"]["plan_fp8"] is None
        # The head (16 outputs) is eligible too: every nn.Linear whose dims are multiples of 16.
        assert r["fp8"]["fp8_layers"] == 3 and r["fp8"]["plan_fp8"] == "tensorwise"
        fp8, plain = r["fp8"]["losses"], r["plain"]["losses"]
        assert fp8[-1] < 0.8 * fp8[0]  # it trains: a no-op step would leave the loss where it started
        assert fp8 != plain  # the FP8 layers are the ones computing
        assert abs(fp8[-1] - plain[-1]) < 0.05 * plain[-1]  # and they train like the bf16/fp32 layers
    assert results[0]["fp8_error"].startswith("fp8: no nn.Linear in Sequential is eligible")
    assert "\n" not in results[0]["fp8_error"]


def test_a_skipped_step_leaves_nothing_behind(results: list[dict]) -> None:
    for r in results:
        assert r["step_size"] > 1e-4  # the step moved the weights
        assert r["skip_then_step_diff"] == 0.0


def test_a_comms_logger_block_switches_the_logger_on(results: list[dict]) -> None:
    for r in results:
        comms = r["comms"]
        assert comms["steps"] == list(range(STEPS))  # the engine closes one logger step per optimizer step
        assert any(op.startswith("all_gather") for op in comms["ops"])
        # Gradients are reduced every step (on gloo FSDP2's reduce-scatter goes round a ring of sends, counted as
        # the reduce-scatter it is): at least each rank's shard of every fp32 gradient, far more than the
        # one-element all-reduces of the overflow check.
        assert comms["reduce_bytes"] >= STEPS * comms["grad_bytes"] // 2
        assert comms["gather_bytes"] > 0 and "dp" in comms["labels"]
        assert r["no_logger"]


def test_the_plan_checks_everything_once_with_one_line_errors() -> None:
    # Batch sizes against the world size (initialize used to skip this), hpZ against the world size, "auto".
    with pytest.raises(ConfigError, match=r"train_batch_size: 30 is not divisible by .* world size 4"):
        resolve_plan({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 2}, world_size=4)
    plan = resolve_plan({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2}, world_size=4)
    assert plan.gradient_accumulation_steps == 4  # DeepSpeed's rule: 32 = 2 x 4 x 4
    with pytest.raises(ConfigError, match="zero_hpz_partition_size: 3 does not divide the world size 4"):
        resolve_plan({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}}, world_size=4)
    with pytest.raises(ConfigError, match='gradient_accumulation_steps: "auto" is not resolved'):
        resolve_plan({"gradient_accumulation_steps": "auto"}, world_size=2)
    # hpZ "auto" is the ranks of one node; a group of the whole world is plain stage 3.
    assert resolve_plan("zeropp", world_size=8, ranks_per_node=4).reshard_after_forward == 4
    assert resolve_plan("zeropp", world_size=4, ranks_per_node=4).reshard_after_forward is True
    # A framework fills "auto" and what the user did not write; a clash with what the user wrote is an error.
    fw = FrameworkSettings(owner="T", precision="bf16", accumulation=2, clip=0.3)
    plan = resolve_plan({"zero_optimization": {"stage": 2}}, world_size=2, framework=fw)
    assert (plan.compute_dtype, plan.gradient_accumulation_steps, plan.gradient_clipping) == ("bf16", 2, 0.3)
    assert plan.reshard_after_forward is False and plan.loss_scaling is None
    fw = FrameworkSettings(owner="T", precision="fp16")
    with pytest.raises(ConfigError, match="T: precision='fp16' trains in fp16 but the config enables bf16"):
        resolve_plan({"bf16": {"enabled": True}}, world_size=2, framework=fw)
    # Offload on a CPU-only run is a no-op, said once in the log; on an accelerator it is on.
    offload = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    assert not resolve_plan(offload, world_size=2, device_type="cpu").offload
    assert resolve_plan(offload, world_size=2, device_type="cuda").offload


def test_auto_precision_leaves_an_auto_clip_to_the_framework() -> None:
    # Resolving "auto" precision used to resolve an "auto" gradient_clipping to DeepSpeed's 1.0 on the way, so a
    # framework's own clipping value then clashed with it (or, without one, clipping was silently on).
    cfg = {"bf16": {"enabled": "auto"}, "gradient_clipping": "auto", "zero_optimization": {"stage": 2}}
    fw = FrameworkSettings(owner="ZeroStrategy", precision="bf16", clip=0.5)
    plan = resolve_plan(cfg, world_size=2, device_type="cpu", framework=fw)
    assert (plan.compute_dtype, plan.gradient_clipping) == ("bf16", 0.5)
    no_clip = FrameworkSettings(owner="ZeroStrategy", precision="bf16")
    assert resolve_plan(cfg, world_size=2, device_type="cpu", framework=no_clip).gradient_clipping == 0.0
