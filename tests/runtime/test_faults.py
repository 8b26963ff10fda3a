"""Single-process checks of the fault handling: the timeout setting, and which errors count as a dead peer. (Which
checkpoint a restart picks is tests/checkpoint/test_engine_checkpoint.py.)"""

from __future__ import annotations

from datetime import timedelta

import pytest

from ds_plugin.runtime.faults import RankFailureError, default_timeout, is_peer_failure, peer_failure_guard


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
