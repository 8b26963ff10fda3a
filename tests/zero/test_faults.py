"""Single-process checks of the fault handling: the timeout setting, which errors count as a dead peer, and which
checkpoint a restart picks (`latest_checkpoint`) when saves were interrupted or damaged."""

from __future__ import annotations

import logging
import shutil
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ds_plugin.zero import initialize
from ds_plugin.zero.checkpoint import MARKER, CheckpointError
from ds_plugin.zero.faults import RankFailureError, default_timeout, is_peer_failure, peer_failure_guard
from ds_plugin.zero.resume import latest_checkpoint


def test_default_timeout_is_minutes_and_configurable(monkeypatch):
    monkeypatch.delenv("DS_PLUGIN_TIMEOUT", raising=False)
    assert timedelta(minutes=1) < default_timeout() < timedelta(minutes=30)  # not torch's 30-minute default
    monkeypatch.setenv("DS_PLUGIN_TIMEOUT", "45")
    assert default_timeout() == timedelta(seconds=45)
    for bad in ("0", "-3", "nan", "inf", "ten"):
        monkeypatch.setenv("DS_PLUGIN_TIMEOUT", bad)
        with pytest.raises(ValueError, match=r"DS_PLUGIN_TIMEOUT=.*positive number of seconds"):
            default_timeout()


GLOO_RESET = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1452: Connection reset by "
    "peer. This is typically caused by a remote worker hanging or bugs in the application."
)
GLOO_TIMEOUT = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 20000ms for recv"


def test_peer_failures_are_told_apart_from_bugs():
    assert is_peer_failure(RuntimeError(GLOO_RESET))
    assert is_peer_failure(RuntimeError(GLOO_TIMEOUT))
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"))
    # The same backend reporting a bug on this side (ranks disagreeing on a size) keeps its own error.
    assert not is_peer_failure(RuntimeError("[../third_party/gloo/gloo/allreduce.cc:71] Mismatch in sizes: 16 != 8"))
    assert not is_peer_failure(ValueError("Connection reset by peer"))  # not what a collective raises
    assert not is_peer_failure(RankFailureError("already translated"))


def test_guard_translates_a_dead_peer_into_one_line_and_lets_bugs_through():
    with pytest.raises(RankFailureError) as info:
        with peer_failure_guard("backward", 5, "fit(ckpt_path='last') resumes"):
            raise RuntimeError(GLOO_RESET)
    message = str(info.value)
    assert "\n" not in message and info.value.__suppress_context__  # one line, no chained traceback
    assert message.startswith("this rank: backward at step 5 failed because another rank died")
    assert "Connection reset by peer" in message and "typically caused" not in message  # the cause, not gloo's advice
    assert message.endswith("fit(ckpt_path='last') resumes")
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        with peer_failure_guard("forward"):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _engine(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return initialize(model, {"zero_optimization": {"stage": 3}}, lambda p: torch.optim.AdamW(p, lr=0.05))


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
    with caplog.at_level(logging.WARNING, logger="ds_plugin.zero.resume"):
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
