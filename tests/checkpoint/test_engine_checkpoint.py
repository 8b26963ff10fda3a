"""The engine's checkpoints in one process: what a load restores (one rule for every caller), and which checkpoint
a restart picks (`latest_checkpoint`) when saves were interrupted or damaged.

The rule (`ds_plugin.checkpoint.engine_state`, DeepSpeed's): the weights always; the optimizer state and the fp16
loss scaler with `load_optimizer_states`; the step counters unless `load_module_only`. The engine API
(`ZeroEngine.load_checkpoint`) and the framework adapters (`load_engine_checkpoint`, which Lightning, Fabric and
Accelerate call with their `optimizer` flag) are both held to it.
"""

from __future__ import annotations

import logging
import shutil
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ds_plugin.checkpoint import MARKER, CheckpointError, latest_checkpoint, load_engine_checkpoint
from ds_plugin.zero import initialize


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _engine(seed: int, **config: Any):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    config = {"zero_optimization": {"stage": 3}, **config}
    return initialize(model, config, lambda p: torch.optim.AdamW(p, lr=0.05))


def _train(engine, steps: int) -> None:
    g = torch.Generator().manual_seed(engine.global_steps)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        engine.backward(engine(x).pow(2).mean())
        engine.step()


def _weights(engine) -> list[torch.Tensor]:
    return [p.full_tensor().clone() for p in engine.module.parameters()]


def test_restart_skips_partial_and_damaged_checkpoints(one_process_group, tmp_path, caplog):
    engine = _engine(0)
    _train(engine, 2)
    engine.save_checkpoint(tmp_path, client_state={"batches": 2})
    at_2 = _weights(engine)
    _train(engine, 2)
    engine.save_checkpoint(tmp_path, client_state={"batches": 4})
    assert (tmp_path / "latest").read_text() == "global_step4"
    assert latest_checkpoint(tmp_path) == tmp_path / "global_step4"

    # A crash while saving step 6 left its temporary directory; step 4 then got damaged after the fact.
    (tmp_path / ".global_step6.partial-0123456789ab").mkdir()
    (tmp_path / "global_step4" / MARKER).write_text("{}")
    with caplog.at_level(logging.WARNING, logger="ds_plugin.checkpoint.layout"):
        assert latest_checkpoint(tmp_path) == tmp_path / "global_step2"
    log = caplog.text
    assert ".global_step6.partial-0123456789ab: left by an interrupted save; never loaded" in log
    assert "skipping" in log and "global_step4" in log
    assert "names 'global_step4', which is not a complete checkpoint" in log

    fresh = _engine(1)
    path, client = fresh.load_checkpoint(tmp_path)
    assert path == tmp_path / "global_step2" and client == {"batches": 2} and fresh.global_steps == 2
    assert all(torch.equal(a, b) for a, b in zip(_weights(fresh), at_2, strict=True))
    # The next save clears what the crash left.
    _train(fresh, 1)
    fresh.save_checkpoint(tmp_path)
    assert not list(tmp_path.glob(".*partial*")) and (tmp_path / "latest").read_text() == "global_step3"


def test_load_from_an_empty_directory_is_a_fresh_start_and_bad_input_is_one_line(one_process_group, tmp_path):
    engine = _engine(0)
    assert engine.load_checkpoint(tmp_path / "nothing-here") == (None, {})
    with pytest.raises(CheckpointError, match="client_state must be JSON"):
        engine.save_checkpoint(tmp_path, client_state={"rng": torch.get_rng_state()})
    with pytest.raises(CheckpointError, match="one plain directory name"):
        engine.save_checkpoint(tmp_path, tag="../elsewhere")
    with pytest.raises(CheckpointError, match="not a directory"):
        engine.load_checkpoint(tmp_path, tag="missing")
    assert not list(tmp_path.iterdir())  # nothing written by the refused saves
    shutil.rmtree(tmp_path)


def _moments(engine) -> list[torch.Tensor | None]:
    """AdamW's first moments, whole: what tells a loaded optimizer state from a fresh one."""
    out = []
    for group in engine.optimizer.param_groups:
        for p in group["params"]:
            m = engine.optimizer.state.get(p, {}).get("exp_avg")
            out.append(None if m is None else (m.full_tensor() if isinstance(m, DTensor) else m).clone())
    return out


def _same(a: list, b: list) -> bool:
    return all(x is not None and y is not None and torch.equal(x, y) for x, y in zip(a, b, strict=True))


FP16 = {"fp16": {"enabled": True, "initial_scale_power": 8}}  # a fresh engine's loss scale: 256
# (load_optimizer_states, load_module_only) -> (step counters restored, optimizer state and loss scale restored)
RULE = {(True, False): (True, True), (False, False): (True, False), (True, True): (False, False)}


@pytest.mark.parametrize(("optimizer", "module_only"), list(RULE))
def test_one_rule_for_counters_and_optimizer(one_process_group, tmp_path, optimizer: bool, module_only: bool):
    engine = _engine(0, **FP16)
    _train(engine, 3)
    scaler = engine.loss_scaler
    scaler.load_state_dict({**scaler.state_dict(), "scale": 4.0})  # not where a fresh engine starts
    saved = {"counters": (3, 3, engine.skipped_steps), "weights": _weights(engine), "moments": _moments(engine)}
    assert engine.global_steps == 3 and engine.micro_steps == 3
    engine.save_checkpoint(tmp_path)
    counters, with_optimizer = RULE[optimizer, module_only]

    for entry in ("engine API", "adapters"):  # ZeroEngine.load_checkpoint / what Lightning, Fabric, Accelerate call
        fresh = _engine(1, **FP16)
        _train(fresh, 1)  # its own optimizer state, counters and (unchanged) loss scale
        before = _moments(fresh)
        if entry == "engine API":
            fresh.load_checkpoint(tmp_path, load_optimizer_states=optimizer, load_module_only=module_only)
        else:
            load_engine_checkpoint(tmp_path / "global_step3", fresh, optimizer=optimizer, module_only=module_only)
        assert all(torch.equal(a, b) for a, b in zip(_weights(fresh), saved["weights"], strict=True)), entry
        steps = (fresh.global_steps, fresh.micro_steps, fresh.skipped_steps)
        assert steps == (saved["counters"] if counters else (1, 1, 0)), (entry, steps)
        assert fresh.loss_scaler.scale == (4.0 if with_optimizer else 256.0), entry
        assert _same(_moments(fresh), saved["moments"] if with_optimizer else before), entry
