"""PPO's arithmetic as DeepSpeed-Chat's step 3 does it (`dschat/rlhf/ppo_trainer.py`), as plain torch functions, and
the per-token readings of the actor and the critic it works on.

`examples/rlhf.py --step ppo` imports it as `_ppo`. Every tensor here covers the answer only: row i's sampled tokens
are columns 0 .. n_i - 1 (its end-of-sequence token, when it produced one, is the last of them), `mask` is 1 there
and 0 on the padding after it, and column t of `logprobs`, `values`, ... belongs to answer token t: its
log-probability given everything before it, the critic's value of the state it was chosen in.

DeepSpeed-Chat's constants are the defaults: kl_ctl 0.1, clip_reward_value 5, cliprange 0.2, cliprange_value 0.2,
gamma 1.0, lam 0.95. As there, advantages are not whitened, and an optional EMA of the actor is kept (beta 0.992).
One difference: DeepSpeed-Chat adds the reward-model score at index `start + n` of its shifted arrays, one past the
last answer token for an answer that stopped before the length limit (a padding position, which its policy loss
masks out but GAE still reads); here it goes on the last answer token itself, where the reward model read it.
"""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token) under `logits` ([B, T, V], the model's output at the position before each token), in fp32."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[..., None])[..., 0]


def answer_mask(answers: torch.Tensor, eos_id: int) -> torch.Tensor:
    """1 on each row's answer tokens up to and including its first `eos_id`, 0 after it (all 1 without one).

    Found from the end-of-sequence token rather than from padding: a tokenizer may pad with EOS."""
    after_eos = (answers == eos_id).long().cumsum(1) - (answers == eos_id).long()  # EOS seen strictly before t
    return (after_eos == 0).to(torch.float32)


def kl_rewards(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    scores: torch.Tensor,
    mask: torch.Tensor,
    kl_ctl: float = 0.1,
    clip_reward_value: float = 5.0,
) -> torch.Tensor:
    """Per-token rewards: -kl_ctl * (logprob - ref_logprob) on every answer token (a per-token estimate of the KL
    to the reference, as a penalty), plus the reward model's score clipped to +-clip_reward_value on each row's last
    answer token; 0 on the padding."""
    rewards = -kl_ctl * (logprobs - ref_logprobs) * mask
    last = (mask.sum(1).long() - 1).clamp(min=0)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last] += scores.clamp(-clip_reward_value, clip_reward_value).to(rewards.dtype)
    return rewards


def gae(
    values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation, from each row's last token back to its first: with
    delta_t = r_t + gamma * V_{t+1} - V_t (V = 0 after the last answer token: the episode ends there),
    A_t = delta_t + gamma * lam * A_{t+1}; returns R_t = A_t + V_t. Both are 0 on the padding.

    Returns:
        (advantages, returns), no gradient.
    """
    values, rewards = (values * mask).detach(), (rewards * mask).detach()
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(running)
        running = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * running
        advantages[:, t] = running
    return advantages * mask, (advantages + values) * mask


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum()


def policy_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    cliprange: float = 0.2,
) -> torch.Tensor:  # fmt: skip
    """PPO's clipped surrogate: mean over answer tokens of max(-A * ratio, -A * clip(ratio, 1 +- cliprange)),
    ratio = exp(logprob - old_logprob), the old log-probabilities being the rollout's."""
    ratio = torch.exp((logprobs - old_logprobs) * mask)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    return masked_mean(torch.max(unclipped, clipped), mask)


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
    cliprange_value: float = 0.2,
) -> torch.Tensor:  # fmt: skip
    """The critic's clipped loss: 0.5 * mean over answer tokens of max((V - R)^2, (clip(V, V_old +- cliprange_value)
    - R)^2), V_old being the rollout's values."""
    clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    return 0.5 * masked_mean(torch.max((values.float() - returns) ** 2, (clipped.float() - returns) ** 2), mask)


@torch.no_grad()
def ema_update_(ema: list[torch.Tensor], params: list[torch.Tensor], beta: float = 0.992) -> None:
    """ema = beta * ema + (1 - beta) * param, in place (DeepSpeed-Chat's `moving_average`). Sharded parameters
    (DTensors) update shard by shard: nothing is gathered."""
    for e, p in zip(ema, params, strict=True):
        e.lerp_(p.detach(), 1.0 - beta)


def sequence_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's summed log(pi / pi_ref) over its sampled answer tokens: a one-sample estimate of the KL from the
    reference to the policy (the answers being drawn from the policy), in nats per answer."""
    return ((logprobs - ref_logprobs) * mask).sum(1)


# -- what PPO reads from the models (an engine, or any module taking these arguments) ----------------------------
def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded rows: each row's first real token is position 0, as in generation."""
    return (mask.cumsum(1) - 1).clamp(min=0)


def token_scores(engine, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The scalar head's output at every position ([B, T]): the critic's values. transformers' sequence classifier
    computes the head on every token and returns only the last real one's, so a hook on the head keeps them all."""
    head = next(m for name, m in engine.module.named_modules() if name.rsplit(".", 1)[-1] == "score")
    kept: list[torch.Tensor] = []
    handle = head.register_forward_hook(lambda _module, _args, out: kept.append(out))
    try:
        engine(input_ids=ids, attention_mask=mask, position_ids=positions(mask))
    finally:
        handle.remove()
    return kept[-1][..., 0].float()


def answer_logprobs(engine, seq: torch.Tensor, mask: torch.Tensor, start: int) -> torch.Tensor:
    """log p(answer token | everything before it) for the answer columns seq[:, start:] ([B, T - start])."""
    logits = engine(input_ids=seq, attention_mask=mask, position_ids=positions(mask)).logits
    return token_logprobs(logits[:, start - 1 : -1], seq[:, start:])


__all__ = ["answer_logprobs", "answer_mask", "ema_update_", "gae", "kl_rewards", "masked_mean", "policy_loss",
           "positions", "sequence_kl", "token_logprobs", "token_scores", "value_loss"]  # fmt: skip
