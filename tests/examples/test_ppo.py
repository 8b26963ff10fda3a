"""RLHF step 3, PPO (examples/_ppo.py, examples/rlhf.py --step ppo).

The arithmetic against values worked out by hand in the comments (not with the code under test); the command-line
checks in this process; then one launch of 2 gloo ranks that runs the first PPO iteration twice, with its engines at
ZeRO-3 and at ZeRO-2 (fp32, greedy rollouts, a random tiny SFT adapter and reward model written here): both must
give the same rollout and the same losses within 1e-5, and the iteration must have trained (a second pass over the
same rollout sees a changed policy and critic; under DS_PLUGIN_TEST_NOOP_STEP=1 it does not, and the test fails).
"""

from __future__ import annotations

import importlib
import json
import math
import sys

import pytest
import torch
from test_examples import EXAMPLES, fails_with_one_line

sys.path.insert(0, str(EXAMPLES))
ppo = importlib.import_module("_ppo")


def t(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_answer_mask_ends_after_the_first_eos():
    answers = torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8], [2, 0, 0, 0], [5, 2, 2, 2]])  # eos 2; the last pads with it
    assert ppo.answer_mask(answers, 2).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]


def test_token_logprobs():
    logits = torch.tensor([[[0.0, math.log(3.0)], [math.log(4.0), 0.0]]])  # p = (1/4, 3/4), then (4/5, 1/5)
    out = ppo.token_logprobs(logits, torch.tensor([[1, 1]]))
    torch.testing.assert_close(out, torch.tensor([[math.log(0.75), math.log(0.2)]]))


def test_kl_rewards():
    # Row 0: -0.1 * (logp - ref) = -0.05 and +0.1 on its two tokens, score 7 clipped to 5 on the last (index 1).
    # Row 1: one token, KL term -0.1 * (0 - 1) = 0.1, score -9 clipped to -5; the padding gets nothing.
    logp, ref = t([-1.0, -2.0, -0.5], [0.0, 3.0, 3.0]), t([-1.5, -1.0, -9.0], [1.0, 0.0, 0.0])
    mask = t([1, 1, 0], [1, 0, 0])
    out = ppo.kl_rewards(logp, ref, torch.tensor([7.0, -9.0]), mask, kl_ctl=0.1, clip_reward_value=5.0)
    torch.testing.assert_close(out, t([-0.05, 5.1, 0.0], [-4.9, 0.0, 0.0]))
    # No KL coefficient: the clipped score alone, on the last answer token.
    out = ppo.kl_rewards(logp, ref, torch.tensor([1.5, 0.25]), mask, kl_ctl=0.0)
    torch.testing.assert_close(out, t([0.0, 1.5, 0.0], [0.25, 0.0, 0.0]))


def test_gae():
    # gamma 1, lam 0.5, V = (1, 2 | 3 is padding), r = (0, 1):
    #   t=1 (last): delta = 1 + 0 - 2 = -1, A = -1;  t=0: delta = 0 + 2 - 1 = 1, A = 1 + 0.5 * -1 = 0.5.
    #   R = A + V = (1.5, 1.0); 0 on the padding.
    adv, ret = ppo.gae(t([1.0, 2.0, 3.0]), t([0.0, 1.0, 7.0]), t([1, 1, 0]), gamma=1.0, lam=0.5)
    torch.testing.assert_close(adv, t([0.5, -1.0, 0.0]))
    torch.testing.assert_close(ret, t([1.5, 1.0, 0.0]))
    # gamma 0.9, lam 0.8, V = (0.5, -0.5), r = (1, 2): t=1: A = 2 - (-0.5) = 2.5;
    #   t=0: delta = 1 + 0.9 * -0.5 - 0.5 = 0.05, A = 0.05 + 0.72 * 2.5 = 1.85; R = (2.35, 2.0).
    adv, ret = ppo.gae(t([0.5, -0.5]), t([1.0, 2.0]), t([1, 1]), gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, t([1.85, 2.5]))
    torch.testing.assert_close(ret, t([2.35, 2.0]))


def test_policy_loss_and_its_gradient():
    # ratio 1.5, A = 1: max(-1.5, -1.2) = -1.2 (clipped: no gradient); ratio 0.5, A = 1: max(-0.5, -0.8) = -0.5
    # (unclipped: d/dlogp = -A * ratio / 3 = -0.5 / 3); ratio 0.5, A = -2: max(1.0, 1.6) = 1.6 (clipped);
    # a padding token with a huge ratio and advantage counts for nothing. Loss = (-1.2 - 0.5 + 1.6) / 3.
    old = t([0.0, 0.0, 0.0, 0.0])
    new = t([math.log(1.5), math.log(0.5), math.log(0.5), 5.0]).requires_grad_(True)
    adv, mask = t([1.0, 1.0, -2.0, 10.0]), t([1, 1, 1, 0])
    loss = ppo.policy_loss(new, old, adv, mask, cliprange=0.2)
    torch.testing.assert_close(loss, torch.tensor(-0.1 / 3))
    loss.backward()
    torch.testing.assert_close(new.grad, t([0.0, -0.5 / 3, 0.0, 0.0]))


def test_value_loss():
    # V = 1 against V_old 0.5 +- 0.2 clips to 0.7: max((1 - 2)^2, (0.7 - 2)^2) = 1.69; V = 0 = V_old, R = 1: 1;
    # the padding token is left out. 0.5 * (1.69 + 1) / 2 = 0.6725.
    loss = ppo.value_loss(t([1.0, 0.0, 2.0]), t([0.5, 0.0, 2.0]), t([2.0, 1.0, 0.0]), t([1, 1, 0]), 0.2)
    torch.testing.assert_close(loss, torch.tensor(0.6725))
    # Inside the clip range the clipped term equals the plain one: 0.5 * (0.1^2 + 0.3^2) / 2 = 0.025.
    loss = ppo.value_loss(t([1.1, -0.3]), t([1.0, -0.2]), t([1.0, 0.0]), t([1, 1]), 0.2)
    torch.testing.assert_close(loss, torch.tensor(0.025))


def test_ema_and_sequence_kl():
    ema, param = [torch.tensor([1.0, -2.0])], [torch.tensor([3.0, 2.0])]
    ppo.ema_update_(ema, param, beta=0.75)  # 0.75 * ema + 0.25 * param
    torch.testing.assert_close(ema[0], torch.tensor([1.5, -1.0]))
    kl = ppo.sequence_kl(t([-1.0, -2.0, -3.0]), t([-1.5, -1.0, -9.0]), t([1, 1, 0]))  # 0.5 - 1.0
    torch.testing.assert_close(kl, torch.tensor([-0.5]))


# -- the command line: one line and exit code 2, before any process group starts --------------------------------
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ppo-epochs", "0"], "--ppo-epochs 0: must be at least 1"),
        (["--kl-ctl", "-0.1"], "--kl-ctl -0.1: must be at least 0"),
        (["--cliprange", "1.5"], "--cliprange 1.5: must be between 0 and 1"),
        (["--lam", "nan"], "--lam nan: must be between 0 and 1"),
        (["--zero-stage", "1"], "--zero-stage 1: must be 2 or 3"),
        (["--step", "ppo"], "--out-dir {out}: no sft_adapter/ or reward_model/ in it; --step ppo starts from them"),
    ],
)
def test_bad_ppo_arguments(args, message, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    err = fails_with_one_line("rlhf.py", [*args, "--out-dir", str(out)], monkeypatch, capsys)
    assert err.startswith(f"rlhf.py: error: {message.format(out=out)}"), err
    assert not out.exists()


def test_summary_keeps_the_steps_run_earlier(tmp_path):
    rlhf = importlib.import_module("rlhf")
    path = tmp_path / "summary.json"
    recorded = lambda steps: rlhf.recorded_steps(path, {s: len(s) for s in steps}, rlhf.TRAINED_FROM)  # noqa: E731
    record = lambda *steps: path.write_text(json.dumps(recorded(steps)))  # noqa: E731
    record("sft", "reward", "ppo")
    record("dpo")  # DPO after --step all: PPO's record stays (it does not train from DPO)
    assert json.loads(path.read_text()) == {"sft": 3, "reward": 6, "ppo": 3, "dpo": 3}
    record("reward")  # a new reward model: PPO and DPO trained from the old one, so their records go
    assert json.loads(path.read_text()) == {"sft": 3, "reward": 6}


# -- ZeRO-3 and ZeRO-2 give the same first PPO iteration ---------------------------------------------------------
def _first_iteration(rank: int, world: int, out_dir: str) -> dict:
    import _break  # a fresh process: DS_PLUGIN_TEST_NOOP_STEP must be applied here too

    _break.install()
    sys.path.insert(0, str(EXAMPLES))
    import rlhf

    from ds_plugin.peft_adapters import full_state_dict

    flags = ["--step", "ppo", "--out-dir", out_dir, "--greedy", "--answer-tokens", "12", "--actor-lr", "1e-3"]
    args = rlhf.arguments(flags)
    prompts = sorted({r["prompt"] for r in rlhf.rows("pref", "train")})[4 * rank : 4 * rank + 4]
    out = {}
    for stage in (3, 2):
        actor, critic, reward_model = rlhf.ppo_models(args, stage)
        r = rlhf.rollout(actor, reward_model, critic, prompts, args, seed=0)
        losses = [rlhf.ppo_update(actor, critic, r, args) for _ in range(2)]  # two passes over one rollout
        again = rlhf.rollout(actor, reward_model, critic, prompts, args, seed=0)
        keep = ("seq", "answer", "logprobs", "ref_logprobs", "scores", "values", "advantages", "returns")
        out[stage] = {"rollout": {k: r[k] for k in keep}, "losses": losses, "logprobs_after": again["logprobs"],
                      "actor": full_state_dict(actor, trainable_only=True),
                      "critic": full_state_dict(critic, trainable_only=True)}  # fmt: skip
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from ds_plugin.launch import run_ranks

    rlhf = importlib.import_module("rlhf")
    out = tmp_path_factory.mktemp("ppo")
    # A random SFT adapter (B not zero: the merged base differs from the raw one) and a random reward model.
    lora = LoraConfig(r=4, init_lora_weights=False, target_modules="all-linear")
    sft = get_peft_model(rlhf.llama(AutoModelForCausalLM, 128, 4, None), lora)
    sft.save_pretrained(out / "sft_adapter")
    rlhf.llama(AutoModelForSequenceClassification, 64, 2, None).save_pretrained(out / "reward_model")
    return run_ranks(_first_iteration, 2, timeout=300, out_dir=str(out))


@pytest.mark.slow
def test_zero3_and_zero2_give_the_same_first_iteration(ranks):
    close = {"atol": 1e-5, "rtol": 0}
    assert not torch.equal(ranks[0][3]["rollout"]["seq"], ranks[1][3]["rollout"]["seq"]), "each rank its prompts"
    for rank, r in enumerate(ranks):
        z3, z2 = r[3], r[2]
        for key, value in z3["rollout"].items():
            if value.dtype.is_floating_point:
                torch.testing.assert_close(z2["rollout"][key], value, **close, msg=f"rank {rank} {key}")
            else:
                assert torch.equal(z2["rollout"][key], value), (rank, key)  # the same greedy tokens
        torch.testing.assert_close(torch.tensor(z2["losses"]), torch.tensor(z3["losses"]), **close)
        roll = z3["rollout"]
        # A fresh adapter: the actor is its reference, so the KL part of every reward is 0.
        assert torch.equal(roll["logprobs"], roll["ref_logprobs"]), rank
        assert roll["answer"].sum() >= 4 and roll["scores"].abs().min() > 0 and roll["advantages"].abs().max() > 0
    # The losses are means over ranks. The first pass's ratios are all 1 (the rollout's log-probabilities come
    # from the same forward as training's), so its policy loss is minus the mean advantage over answer tokens.
    assert ranks[0][3]["losses"] == ranks[1][3]["losses"]
    rolls = [r[3]["rollout"] for r in ranks]
    expected = sum(-(x["advantages"] * x["answer"]).sum() / x["answer"].sum() for x in rolls) / len(rolls)
    assert abs(ranks[0][3]["losses"][0][0] - expected.item()) < 1e-5, (ranks[0][3]["losses"], expected)


@pytest.mark.slow
def test_the_first_iteration_trains(ranks):
    for r in ranks:
        for stage in (3, 2):
            (actor1, critic1), (actor2, critic2) = r[stage]["losses"]
            # The second pass over the same rollout sees the stepped actor (ratios no longer 1) and critic.
            assert abs(actor2 - actor1) > 1e-4 and abs(critic2 - critic1) > 1e-4, ("did not train", r[stage]["losses"])
            moved = (r[stage]["logprobs_after"] - r[stage]["rollout"]["logprobs"]) * r[stage]["rollout"]["answer"]
            assert moved.abs().max() > 1e-3, "did not train: the actor's log-probabilities did not move"
    # The trained weights (whole, on rank 0): LoRA's B left 0, the same at both stages.
    z3, z2 = ranks[0][3], ranks[0][2]
    lora_b = [v for k, v in z3["actor"].items() if "lora_B" in k]
    assert lora_b and max(v.abs().max().item() for v in lora_b) > 0, "did not train: LoRA B is still 0"
    assert any(k.endswith("score.modules_to_save.default.weight") for k in z3["critic"]), sorted(z3["critic"])
    for name in ("actor", "critic"):
        assert z3[name].keys() == z2[name].keys()
        for key, value in z3[name].items():
            torch.testing.assert_close(z2[name][key], value, atol=1e-5, rtol=0, msg=f"{name} {key}")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
