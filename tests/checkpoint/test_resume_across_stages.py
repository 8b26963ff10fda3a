"""A checkpoint saved at (4 ranks, stage 3) resumes at (2 ranks, stage 1) and at 1 rank: the next 5 losses equal
the uninterrupted run's (fp32, 1e-5). The global batch is the same at every world size; each rank takes its slice."""

from __future__ import annotations

import pytest
import torch

from ds_plugin.launch import run_ranks
from tests.zero._tiny import gpt2, make_optimizer, quiet, zero_config

pytestmark = pytest.mark.slow

GLOBAL, SEQ, BEFORE, AFTER = 8, 32, 4, 5


def _global_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, 128, (GLOBAL, SEQ), generator=g)


def _train(engine, rank: int, world: int, steps: range) -> list[float]:
    import torch.distributed as dist

    losses = []
    for step in steps:
        x = _global_batch(step).chunk(world)[rank]
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def _first(rank: int, world: int, ckpt: str) -> list[float]:
    quiet()
    from ds_plugin.checkpoint import save_checkpoint
    from ds_plugin.zero.setup import initialize

    engine = initialize(gpt2(), zero_config(3), make_optimizer("adamw"))
    _train(engine, rank, world, range(BEFORE))
    save_checkpoint(
        ckpt,
        model_state=engine.model_state_dict(),
        optimizer_state=engine.optimizer_state_dict(),
        extra={"engine": engine.engine_state_dict()},
    )
    return _train(engine, rank, world, range(BEFORE, BEFORE + AFTER))


def _resume(rank: int, world: int, ckpt: str, stage: int) -> list[float]:
    quiet()
    from ds_plugin.checkpoint import load_checkpoint
    from ds_plugin.zero.setup import initialize

    engine = initialize(gpt2(seed=123), zero_config(stage), make_optimizer("adamw"))  # other init: must be overwritten
    model_state, optim_state = engine.model_state_dict(), engine.optimizer_state_dict()
    extra = load_checkpoint(ckpt, model_state=model_state, optimizer_state=optim_state)
    engine.load_model_state_dict(model_state)
    engine.load_optimizer_state_dict(optim_state)
    engine.load_engine_state_dict(extra["engine"])
    return _train(engine, rank, world, range(BEFORE, BEFORE + AFTER))


@pytest.mark.timeout(600)
def test_resume_at_other_world_size_and_stage(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    uninterrupted = run_ranks(_first, 4, timeout=300, ckpt=ckpt)[0]
    for world, stage in ((2, 1), (1, 3)):
        resumed = run_ranks(_resume, world, timeout=300, ckpt=ckpt, stage=stage)[0]
        for a, b in zip(resumed, uninterrupted, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (world, stage, resumed, uninterrupted)
