"""`deepspeed.checkpointing` (`ds_plugin.deepspeed.checkpointing`): DeepSpeed's activation checkpointing API, in this
process: `checkpoint` recomputes the block in backward and gives the same outputs and gradients (dropout included),
`configure` reads the config's block and its arguments, acts on `cpu_checkpointing` and reports what has no effect, and
bad input is one line.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import ds_plugin.deepspeed as deepspeed
from ds_plugin.config import ConfigError

checkpointing = deepspeed.checkpointing


@pytest.fixture(autouse=True)
def _fresh_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpointing, "_SETTINGS", checkpointing._Settings())


class Block(nn.Module):
    """Linear -> dropout -> gelu -> Linear, counting its forward calls."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(8, 16), nn.Linear(16, 8), nn.Dropout(0.5)
        self.calls = 0

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        self.calls += 1
        return self.down(nn.functional.gelu(self.drop(self.up(x)))) * scale


def _run(checkpointed: bool) -> dict:
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(1)  # the dropout masks
    out = checkpointing.checkpoint(block, x, 2.0) if checkpointed else block(x, 2.0)
    out.square().sum().backward()
    return {"out": out.detach(), "grads": [x.grad, *(p.grad for p in block.parameters())], "calls": block.calls}


def _same(a: dict, b: dict) -> bool:
    return torch.equal(a["out"], b["out"]) and all(
        torch.equal(g, h) for g, h in zip(a["grads"], b["grads"], strict=True)
    )


def test_checkpoint_recomputes_in_backward_with_the_same_results() -> None:
    plain, checkpointed = _run(False), _run(True)
    assert (plain["calls"], checkpointed["calls"]) == (1, 2)  # the block runs again in backward
    assert _same(plain, checkpointed)  # bit for bit: the RNG state is restored, so dropout repeats its masks
    assert checkpointing.non_reentrant_checkpoint is checkpointing.checkpoint
    assert not checkpointing.is_configured()


def test_configure_reads_the_block_and_its_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    entered = []
    real = torch.autograd.graph.save_on_cpu

    class Spy(real):
        def __enter__(self):
            entered.append(True)
            return super().__enter__()

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Spy)
    block = {"partition_activations": True, "cpu_checkpointing": True, "number_checkpoints": 4, "profile": False}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 8, "activation_checkpointing": block}))
    plain = _run(False)

    with caplog.at_level(logging.WARNING, logger="ds_plugin.deepspeed.checkpointing"):
        checkpointing.configure(None, deepspeed_config=str(path))
    assert checkpointing.is_configured()
    # Each set key without effect is named with its reason; cpu_checkpointing acts, profile is off.
    assert "partition_activations (" in caplog.text and "number_checkpoints (" in caplog.text
    assert "cpu_checkpointing" not in caplog.text and "profile" not in caplog.text
    assert _same(plain, _run(True)) and len(entered) == 1  # the kept inputs go through save_on_cpu

    checkpointing.configure(mpu_=None, deepspeed_config={"activation_checkpointing": block}, checkpoint_in_cpu=False)
    assert _same(plain, _run(True)) and len(entered) == 1  # the argument wins over the block
    checkpointing.configure(None, checkpoint_in_cpu=True, synchronize=True)  # no config: the arguments alone
    assert _same(plain, _run(True)) and len(entered) == 2
    checkpointing.reset()
    checkpointing.set_num_layers(4)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: checkpointing.configure(object()), ValueError, "mpu_ must be None"),
        (
            lambda: checkpointing.configure(None, {"activation_checkpointing": {"cpu_checkpoint": True}}),
            ConfigError,
            "activation_checkpointing.cpu_checkpoint: unknown key; valid keys: partition_activations,",
        ),
        (
            lambda: checkpointing.configure(None, {"activation_checkpointing": {"cpu_checkpointing": "yes"}}),
            ConfigError,
            "activation_checkpointing.cpu_checkpointing: expected true or false, got 'yes'",
        ),
        (
            lambda: checkpointing.configure(None, num_checkpoints=0),
            ConfigError,
            "activation_checkpointing.number_checkpoints: expected a positive integer or null, got 0",
        ),
        (
            lambda: checkpointing.configure(None, {"activation_checkpointing": [1]}),
            ConfigError,
            "activation_checkpointing: expected a dict, got list",
        ),
        (lambda: checkpointing.configure(None, "/nonexistent/ds.json"), ConfigError, "cannot read the config"),
        (lambda: checkpointing.get_cuda_rng_tracker(), NotImplementedError, "tensor and pipeline parallelism"),
        (lambda: checkpointing.model_parallel_cuda_manual_seed(3), NotImplementedError, "torch.manual_seed(3)"),
    ],
)
def test_bad_input_is_one_line(call, error, message) -> None:
    with pytest.raises(error) as info:
        call()
    assert message in str(info.value) and "\n" not in str(info.value)
    assert not checkpointing.is_configured()
