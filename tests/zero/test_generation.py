"""Generation under ZeRO-3 with the model gathered once (`engine.generate`, `gathered_for_generation`).

One spawn of 2 gloo ranks runs every case: a tiny Llama at ZeRO-3 (fp32) and a LoRA model on an INT4-stored frozen
base at ZeRO-3, each trained a step first. Each rank generates from its own prompts. The reference is greedy decoding
by full forward passes through the prepared model (no KV cache; each pass gathers every unit as in training). Unit
gathers are counted by wrapping FSDP2's `foreach_all_gather`, which runs once per unit it gathers.

Plain `generate` on the peft model fails under ZeRO-3 (peft calls the inner model's `generate`, which never enters
the FSDP2 root module, so the root's parameters stay sharded); inside the block it works.
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks
from _tiny import VOCAB, llama, quiet

NEW_TOKENS = 8


class _Count:
    def __init__(self) -> None:
        import torch.distributed.fsdp._fully_shard._fsdp_param_group as group_module

        self.calls, self._module, self._orig = 0, group_module, group_module.foreach_all_gather

    def __enter__(self) -> _Count:
        def counted(*args, **kwargs):
            self.calls += 1
            return self._orig(*args, **kwargs)

        self._module.foreach_all_gather = counted
        return self

    def __exit__(self, *exc) -> None:
        self._module.foreach_all_gather = self._orig


def _greedy_by_forward(model: torch.nn.Module, prompts: torch.Tensor) -> torch.Tensor:
    seq = prompts
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            seq = torch.cat([seq, model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq


def _case(rank: int, model: torch.nn.Module, cfg: dict) -> dict:
    from torch.distributed.fsdp import FSDPModule

    from ds_plugin import gathered_for_generation, initialize

    engine = initialize(model, cfg, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    units = sum(isinstance(m, FSDPModule) for m in engine.module.modules())
    batch = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5 + rank))

    def train_step() -> float:
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        return loss.item()

    out: dict = {"units": units, "losses": [train_step()]}
    engine.eval()
    prompts = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(11 + rank))
    kwargs = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0}
    with _Count() as plain:
        out["plain"] = _greedy_by_forward(engine.module, prompts)
    with _Count() as once:
        out["gathered"] = engine.generate(prompts, **kwargs)
    with _Count() as block, gathered_for_generation(engine.module) as gathered_model:
        out["in_block"] = gathered_model.generate(prompts, **kwargs)
        out["grad_in_block"] = torch.is_grad_enabled()
    out["gathers"] = (plain.calls, once.calls, block.calls)
    engine.train()
    with _Count() as after:
        out["losses"].append(train_step())  # resharded: this step's forward gathers again, and training goes on
    out["gathers_after"] = after.calls
    for _ in range(3):
        out["losses"].append(train_step())
    return out


def _workers(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    quiet()
    import peft

    torch.manual_seed(0)
    results = {"fp32": _case(rank, llama(seed=0), {"zero_optimization": {"stage": 3}})}
    lora = peft.get_peft_model(llama(seed=0), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"]))
    cfg = {"zero_optimization": {"stage": 3, "frozen_format": "int4"}}
    results["int4_lora"] = _case(rank, lora, cfg)
    results["first"] = _generate_first(rank)
    return results


def _generate_first(rank: int) -> dict:
    """A peft model generating before any forward has run through the sharded model (a PPO rollout's first
    step): FSDP2 must still take the root for the root, so that the forwards and training after it work."""
    import peft

    from ds_plugin import initialize

    lora = peft.get_peft_model(llama(seed=0), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    engine = initialize(lora, {"zero_optimization": {"stage": 3}}, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    prompts = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(11 + rank))
    out = {"gathered": engine.eval().generate(prompts, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)}
    out["plain"] = _greedy_by_forward(engine.module, prompts)
    engine.train()
    batch = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5 + rank))
    out["losses"] = []
    for _ in range(3):
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        out["losses"].append(loss.item())
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_workers, 2, timeout=300)


@pytest.mark.parametrize("case", ["fp32", "int4_lora"])
def test_generation_gathers_once_and_matches_decoding_by_full_forwards(ranks, case):
    prompts_differ = not torch.equal(ranks[0][case]["plain"], ranks[1][case]["plain"])
    assert prompts_differ, "each rank generates from its own prompts"
    for r in ranks:
        out = r[case]
        plain, once, block = out["gathers"]
        # The same tokens as greedy decoding by full forward passes (each gathering every unit).
        assert torch.equal(out["gathered"], out["plain"])
        assert torch.equal(out["in_block"], out["plain"])
        assert out["gathered"].shape[1] == 5 + NEW_TOKENS
        # At most once per unit inside the block (the root and the output head may still be gathered from the
        # forward before it); outside it, every token's forward gathers every unit.
        assert 0 < once <= out["units"] and 0 < block <= out["units"], (once, block, out["units"])
        assert plain >= NEW_TOKENS * once, (plain, once)
        assert not out["grad_in_block"]


@pytest.mark.parametrize("case", ["fp32", "int4_lora"])
def test_training_continues_resharded_after_generation(ranks, case):
    for r in ranks:
        out = r[case]
        assert out["gathers_after"] >= out["gathers"][1], "the units stayed gathered after the block"
        losses = out["losses"]
        assert losses[-1] < losses[0] - 0.05, losses  # the same batch, learned: the optimizer still steps


def test_generation_before_any_forward(ranks):
    for r in ranks:
        out = r["first"]
        assert torch.equal(out["gathered"], out["plain"])
        assert out["losses"][-1] < out["losses"][0] - 0.05, out["losses"]
