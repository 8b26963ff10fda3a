"""DeepSpeed-Chat's three RLHF steps on ds_plugin, on CPU with 2 processes: SFT, a reward model, then PPO (or DPO).

    torchrun --standalone --nproc-per-node 2 examples/rlhf.py [--step all|sft|reward|ppo|dpo] [--model PATH] [--smoke]
        [--step sft|reward|ppo|dpo --data train.jsonl [--eval-data test.jsonl]] [--sft-data A --pref-data B]

1. SFT: LoRA on a tiny Llama (built from a config, nothing is downloaded) whose frozen base is stored INT4 and
   sharded by ZeRO-3, on mixed-quality demonstrations (examples/data/rlhf_sft.jsonl, good one time in four).
2. Reward model: a small Llama with a scalar head, pairwise loss -log sigmoid(r_chosen - r_rejected) on
   examples/data/rlhf_pairs.jsonl; signal: held-out pairwise accuracy.
3. PPO (`--step all` ends with it): the actor is the SFT model with a fresh LoRA on its frozen INT4 base, the
   reference the same engine with the adapter switched off, the critic the reward model with LoRA on its frozen INT8
   base and its head trained as the value head, the reward model frozen and stored INT8. Rollouts are sampled with
   `engine.generate` (the ZeRO-3 shards gathered once per call); DeepSpeed-Chat's per-token KL penalty, GAE and
   clipped policy and value losses (examples/_ppo.py). Signals: the reward model's mean score of answers sampled for
   held-out questions, and their KL to the reference.
   DPO (`--step dpo`, Direct Preference Optimization, in place of PPO): a fresh LoRA on the SFT model against a frozen
   reference copy, each stored INT8 and sharded by its own engine. Signals: held-out preference accuracy and margin,
   and the same reward-model score.
Text is read as bytes; `--model PATH` uses a local causal-LM checkpoint and its tokenizer for every model instead,
streamed (`ds_plugin.load_pretrained`): each rank reads only the rows it keeps.
`--step` runs one step alone, reading earlier steps' output from --out-dir. Your own JSON Lines: `--data` (and
`--eval-data`, else `--eval-fraction` of it held out) feeds the step `--step` names: SFT rows ({"prompt",
"response"}, Alpaca's or chat's) for sft, preference rows ({"prompt", "chosen", "rejected"}) for reward and dpo, and
for ppo (their prompts); `--step all` takes `--sft-data` and `--pref-data`. Each step reloads what it saved onto a
fresh base stored the same way and checks its logits on held-out rows against the engine's (`check_reload`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from functools import partial
from pathlib import Path

import _offline  # noqa: F401  (first: keeps the libraries off the Hugging Face Hub)
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ppo import (
    answer_logprobs,
    answer_mask,
    ema_update_,
    gae,
    kl_rewards,
    policy_loss,
    positions,
    sequence_kl,
    token_scores,
    value_loss,
)
from _recipe_common import (
    check_model,
    load_tokenizer,
    pad,
    recorded_steps,
    reload_check,
    reload_lora,
    save_engine_logits,
    until,
)
from _recipe_data import SFT, DataError, answer_loss_sums, fail, fraction, load_rows, sft_batch
from _rlhf_chart import plot
from peft import LoraConfig, PeftModel, get_peft_model
from torch.optim import AdamW
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig

import ds_plugin
from ds_plugin.peft_adapters import full_state_dict

# peft and transformers disagree on deprecated names (is_gradient_checkpointing, past_key_values): not ours.
warnings.filterwarnings("ignore", category=FutureWarning)
DATA = Path(__file__).parent / "data"
ROWS: dict[str, tuple[list[dict], list[dict]]] = {}  # "sft" and "pref": (training rows, held-out rows), from main()
DEVICE, TOK = torch.device("cpu"), load_tokenizer(None)  # main() picks this rank's GPU, --model's tokenizer
LORA = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")  # every projection; not the head


def rows(kind: str, split: str, share: bool = False) -> list[dict]:
    """The "sft" or "pref" rows of a split ("train" or "test"); with share=True, this rank's share of them."""
    found = ROWS[kind][split == "test"]
    return found[dist.get_rank() :: dist.get_world_size()] if share else found


def llama(auto, hidden: int, layers: int, path: str | None, **streamed) -> torch.nn.Module:
    """An `auto` model (causal LM, or reward model): the same random Llama on every call, or --model's checkpoint,
    streamed: the empty model `initialize` fills, each rank reading only the rows it keeps (`streamed`: the peft
    adapter to add, one to merge as the rows are read, the frozen format, see `ds_plugin.load_pretrained`)."""
    torch.manual_seed(0)
    if path:  # the reward model scores the last token before the padding: it must know the tokenizer's pad id
        kwargs = {"num_labels": 1} if auto is AutoModelForSequenceClassification else {}
        return ds_plugin.load_pretrained(path, model_class=auto, pad_token_id=TOK.pad_token_id, defer=True,
                                         **streamed, **kwargs)  # fmt: skip
    config = LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, num_labels=1,
                         initializer_range=0.05, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    model = auto.from_config(config)  # the same weights as LlamaForCausalLM(config) (or ...ForSequenceClassification)
    if auto is AutoModelForCausalLM:
        # Head and final norm stay frozen; a random head this small caps the best logit's lead near 6 nats, leaving
        # ~20% of every sampled byte to chance however good the adapter. A pretrained head is sharper; so is this.
        model.lm_head.weight.data.mul_(3.0)
    return model


def merged_sft(out_dir: Path) -> torch.nn.Module:
    """The tiny SFT model as one set of weights: the random base with `sft_adapter/` merged into it."""
    base = llama(AutoModelForCausalLM, 128, 4, None)
    return PeftModel.from_pretrained(base, out_dir / "sft_adapter").merge_and_unload()


def text_ids(prompt: str, response: str) -> tuple[list[int], int]:
    """BOS prompt response EOS, and where the response starts."""
    head = TOK.encode(prompt)
    return [*head, *TOK.encode(response, add_special_tokens=False), TOK.eos_token_id], len(head)


def response_logps(model, prompts: list[str], responses: list[str]) -> torch.Tensor:
    """Summed log-probability of each response (and its EOS) given its prompt: the quantity DPO compares."""
    seqs, starts = zip(*(text_ids(p, r) for p, r in zip(prompts, responses, strict=True)), strict=True)
    ids, mask = pad(list(seqs), TOK.pad_token_id, DEVICE)
    logps = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1)
    token = logps.gather(-1, ids[:, 1:, None])[..., 0]
    pos = torch.arange(ids.shape[1] - 1, device=DEVICE)[None]
    keep = (pos >= torch.tensor(starts, device=DEVICE)[:, None] - 1) & (mask[:, 1:] == 1)
    return (token * keep).sum(1)


def rm_scores(rm, prompts: list[str], responses: list[str]) -> torch.Tensor:
    """The reward model's scalar at the last real token (the EOS) of prompt + response."""
    ids, mask = pad([text_ids(p, r)[0] for p, r in zip(prompts, responses, strict=True)], TOK.pad_token_id, DEVICE)
    return rm(input_ids=ids, attention_mask=mask).logits[:, 0].float()


@torch.no_grad()
def sample(model, prompts: list[str], gen: torch.Generator, new_tokens: int = 32) -> list[str]:
    """Sampled answers (temperature 1), left-padded; as many steps on every rank (ZeRO-3 forwards are collectives)."""
    ids, mask = pad([TOK.encode(p) for p in prompts], TOK.pad_token_id, DEVICE, left=True)
    width = ids.shape[1]
    for _ in range(new_tokens):
        position_ids = (mask.cumsum(1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[:, -1].float()
        token = torch.multinomial(torch.softmax(logits, -1).cpu(), 1, generator=gen).to(DEVICE)
        ids, mask = torch.cat([ids, token], 1), torch.cat([mask, torch.ones_like(token)], 1)
    return [TOK.decode(until(row, TOK.eos_token_id), skip_special_tokens=True) for row in ids[:, width:].tolist()]


def mean_over_ranks(*values: float) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    return t.tolist()


def train(engine, loss_fn, data: list, size: int, steps: int, desc: str) -> list[float]:
    """The training loop of every step; every rank draws the same global batch and keeps its slice."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen, history = torch.Generator().manual_seed(0), []
    for _ in tqdm(range(steps), desc=desc, disable=rank != 0):
        picks = torch.randint(len(data), (size * world,), generator=gen)[rank::world].tolist()
        loss = loss_fn([data[i] for i in picks])
        engine.backward(loss)
        engine.step()
        history.append(mean_over_ranks(loss.item())[0])
    return history


def check_reload(engine, folder: Path, reload, kind: str) -> float:
    """What `folder` holds, reloaded onto a fresh base stored the same way (`reload()`, on rank 0), must give the
    engine's own logits (the reward model's scores) on held-out rows: fp32 on a CPU, the engine's operations on the
    same values, so within 1e-5 (bit for bit here; the margin lets another thread count repeat the check); on GPUs
    (bf16 compute) within 0.25."""
    held = rows(kind, "test")[:4]
    if kind == "pref":
        ids, mask = pad([text_ids(r["prompt"], r["chosen"])[0] for r in held], TOK.pad_token_id, DEVICE)
    else:
        ids, mask, _ = sft_batch(TOK, held, DEVICE)
    with torch.no_grad():
        logits = engine.eval()(input_ids=ids, attention_mask=mask).logits
    if dist.get_rank() == 0:
        exact = DEVICE.type == "cpu"
        why = "fp32, the same operations" if exact else "bf16 compute"
        save_engine_logits(folder, ids, mask, logits, 1e-5 if exact else 0.25, why)
    return reload_check(reload, folder)


def zero(stage: int, frozen_format: str = "none") -> dict:
    # bf16 on GPUs; fp32 on CPUs, where bf16 matmuls without AVX512-BF16/AMX run several times slower.
    return {"zero_optimization": {"stage": stage, "frozen_format": frozen_format}, "gradient_clipping": 1.0,
            "bf16": {"enabled": DEVICE.type == "cuda"}}  # fmt: skip


zero3 = partial(zero, 3)


def step_sft(args) -> dict:
    """LoRA on the INT4 actor base, loss on the response tokens only."""
    train_rows, mine = rows("sft", "train"), rows("sft", "test", share=True)
    if args.model:
        actor = llama(AutoModelForCausalLM, 128, 4, args.model, peft_config=LORA, frozen_format="int4")
    else:
        actor = get_peft_model(llama(AutoModelForCausalLM, 128, 4, None), LORA)
    engine = ds_plugin.initialize(actor, zero3("int4"), optimizer=partial(AdamW, lr=2e-3))

    def loss_on(batch: list[dict]) -> torch.Tensor:
        """Each row's mean loss on its answer tokens (every assistant turn of a chat row), averaged over rows."""
        ids, mask, labels = sft_batch(TOK, batch, DEVICE)
        per_row = [answer_loss_sums(logits[None], row[None]) for logits, row in
                   zip(engine(input_ids=ids, attention_mask=mask).logits, labels, strict=True)]  # fmt: skip
        return torch.stack([total / count for total, count in per_row]).mean()

    with torch.no_grad():
        before = mean_over_ranks(loss_on(mine).item())[0]
    history = train(engine, loss_on, train_rows, 16, args.sft_steps, "1/3 SFT")
    with torch.no_grad():
        after = mean_over_ranks(loss_on(mine).item())[0]
    folder = ds_plugin.save_adapter(engine, args.out_dir / "sft_adapter")
    base = partial(llama, AutoModelForCausalLM, 128, 4, None)
    diff = check_reload(engine, folder, lambda: reload_lora(folder, args.model, "int4", base), "sft")
    return {"metric": "heldout_response_loss", "before": before, "after": after, "curve": history,
            "reload_max_diff": diff}  # fmt: skip


def step_reward(args) -> dict:
    """A fully trained small reward model: pairwise loss, held-out pairwise accuracy."""
    train_rows, mine = rows("pref", "train"), rows("pref", "test", share=True)
    rm = llama(AutoModelForSequenceClassification, 64, 2, args.model)
    engine = ds_plugin.initialize(rm, zero3(), optimizer=partial(AdamW, lr=5e-4))

    def margins(batch: list[dict]) -> torch.Tensor:
        prompts = [r["prompt"] for r in batch] * 2
        scores = rm_scores(engine, prompts, [r["chosen"] for r in batch] + [r["rejected"] for r in batch])
        return scores[: len(batch)] - scores[len(batch) :]

    def accuracy() -> float:
        with torch.no_grad():
            return mean_over_ranks((margins(mine) > 0).float().mean().item())[0]

    before = accuracy()
    history = train(engine, lambda b: -F.logsigmoid(margins(b)).mean(), train_rows, 16, args.rm_steps, "2/3 reward")
    after = accuracy()
    state = full_state_dict(engine)  # whole fp32 weights on rank 0; a collective
    folder = args.out_dir / "reward_model"
    engine.module.save_pretrained(folder, state_dict=state, is_main_process=dist.get_rank() == 0)
    del state  # the reload check's copy is then the only whole one
    dist.barrier()

    def reload() -> torch.nn.Module:
        if args.model:  # read as saved, fp32 (the reward model is trained whole, in fp32)
            return ds_plugin.load_pretrained(folder, model_class=AutoModelForSequenceClassification, frozen=True)
        return AutoModelForSequenceClassification.from_pretrained(folder).eval()

    diff = check_reload(engine, folder, reload, "pref")
    return {"metric": "heldout_pairwise_accuracy", "before": before, "after": after, "curve": history,
            "reload_max_diff": diff}  # fmt: skip


def step_dpo(args) -> dict:
    """DPO of the SFT actor against an INT8 reference; scored by the reward model on held-out questions."""
    train_rows, mine = rows("pref", "train"), rows("pref", "test", share=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    questions = sorted({r["prompt"] for r in rows("pref", "test")})[rank::world] * args.samples

    # The SFT model merged into one set of weights twice over: the actor's frozen base (a fresh LoRA trains on it)
    # and the reference, both stored INT8 and sharded, the reference with no optimizer. At step 0 they are equal.
    # --model streams each of them: the SFT adapter is merged into the rows as they are read, never a whole copy.
    sft_model = partial(merged_sft, args.out_dir)
    sft = {"merge_adapter": args.out_dir / "sft_adapter", "frozen_format": "int8"}
    if args.model:
        actor = llama(AutoModelForCausalLM, 128, 4, args.model, peft_config=LORA, **sft)
        frozen_sft = llama(AutoModelForCausalLM, 128, 4, args.model, frozen=True, **sft)
        scorer = ds_plugin.load_pretrained(
            args.out_dir / "reward_model", model_class=AutoModelForSequenceClassification, frozen=True, defer=True
        )
    else:
        actor = get_peft_model(sft_model(), LORA)
        frozen_sft = sft_model().requires_grad_(False)
        scorer = AutoModelForSequenceClassification.from_pretrained(args.out_dir / "reward_model")
        scorer.requires_grad_(False)
    policy = ds_plugin.initialize(actor, zero3("int8"), optimizer=partial(AdamW, lr=args.dpo_lr))
    reference = ds_plugin.initialize(frozen_sft, zero3("int8"))
    reward_model = ds_plugin.initialize(scorer, zero3())

    def log_ratios(batch: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        prompts, answers = [r["prompt"] for r in batch] * 2, [r[k] for k in ("chosen", "rejected") for r in batch]
        with torch.no_grad():
            ref_logps = response_logps(reference, prompts, answers)
        ratio = response_logps(policy, prompts, answers) - ref_logps
        return ratio[: len(batch)], ratio[len(batch) :]

    def evaluate(seed: int) -> tuple[float, float, float]:
        """Held-out accuracy and margin of the implicit reward beta*log(pi/pi_ref); reward-model score of samples."""
        with torch.no_grad():
            chosen, rejected = log_ratios(mine)
            margin = args.beta * (chosen - rejected)
            answers = sample(policy, questions, torch.Generator().manual_seed(seed + rank))
            score = rm_scores(reward_model, questions, answers).mean().item()
        right = (margin > 0).float() + 0.5 * (margin == 0).float()  # a tie (step 0: policy == reference) is a coin
        return mean_over_ranks(right.mean().item(), margin.mean().item(), score)

    first = sample(policy, questions[:3], torch.Generator().manual_seed(5))

    def dpo_loss(batch: list[dict]) -> torch.Tensor:
        chosen, rejected = log_ratios(batch)
        return -F.logsigmoid(args.beta * (chosen - rejected)).mean()

    evals = [(0, *evaluate(seed=3))]
    history = train(policy, dpo_loss, train_rows, 8, args.dpo_steps, "3/3 DPO")
    evals.append((args.dpo_steps, *evaluate(seed=3)))
    folder = ds_plugin.save_adapter(policy, args.out_dir / "dpo_adapter")
    examples = sample(policy, questions[:3], torch.Generator().manual_seed(5))
    reload = partial(reload_lora, folder, args.model, "int8", sft_model, merge_adapter=sft["merge_adapter"])
    diff = check_reload(policy, folder, reload, "pref")
    return {"metric": "reward_model_score", "before": evals[0][3], "after": evals[-1][3], "curve": history,
            "evals": evals, "examples": list(zip(questions[:3], first, examples, strict=True)),
            "reload_max_diff": diff}  # fmt: skip


# -- step 3 as DeepSpeed-Chat does it: PPO with an actor, a critic, a reference and a reward model ------------------
def rollout(actor, reward_model, critic, prompts: list[str], args, seed: int) -> dict:
    """Answers generated by the actor (gathered once for the whole `generate`, HF's KV cache), then, with no
    gradient, what PPO needs of them (DeepSpeed-Chat's `generate_experience`): the actor's and the reference's
    log-probabilities (the reference is the actor with its adapter switched off), the reward model's score of each
    whole answer, the critic's values (`critic` None: not needed); then per-token rewards, advantages, returns."""
    ids, prompt_mask = pad([TOK.encode(p) for p in prompts], TOK.pad_token_id, DEVICE, left=True)
    start = ids.shape[1]
    actor.eval()
    torch.manual_seed(seed)  # generate samples from torch's global generator; each rank seeds its own
    # Sampled from the policy itself (no top-k, top-p or temperature): PPO's ratios are of its probabilities.
    sampling = {"do_sample": True, "top_k": 0, "top_p": 1.0, "temperature": 1.0}
    if args.greedy:
        sampling = {"do_sample": False}
    seq = actor.generate(input_ids=ids, attention_mask=prompt_mask, max_new_tokens=args.answer_tokens,
                         pad_token_id=TOK.pad_token_id, eos_token_id=TOK.eos_token_id, **sampling)  # fmt: skip
    answer = answer_mask(seq[:, start:], TOK.eos_token_id)
    mask = torch.cat([prompt_mask, answer.long()], 1)
    seq = seq.masked_fill(mask == 0, TOK.pad_token_id)  # the reward model reads the last token before the padding
    out = {"seq": seq, "mask": mask, "start": start, "answer": answer}
    with torch.no_grad():
        out["logprobs"] = answer_logprobs(actor, seq, mask, start)
        with actor.module.disable_adapter():
            out["ref_logprobs"] = answer_logprobs(actor, seq, mask, start)
        out["scores"] = reward_model(input_ids=seq, attention_mask=mask, position_ids=positions(mask)).logits[:, 0]
        if critic is not None:
            critic.eval()
            out["values"] = token_scores(critic, seq, mask)[:, start - 1 : -1]
            rewards = kl_rewards(out["logprobs"], out["ref_logprobs"], out["scores"], answer, args.kl_ctl,
                                 args.clip_reward_value)  # fmt: skip
            out["advantages"], out["returns"] = gae(out["values"], rewards, answer, args.gamma, args.lam)
    return out


def ppo_update(actor, critic, r: dict, args) -> tuple[float, float]:
    """One pass over a rollout (DeepSpeed-Chat's `train_rlhf`): the actor's clipped policy loss, a step, then the
    critic's clipped value loss, a step. Returns both losses, averaged over ranks."""
    actor.train()
    logprobs = answer_logprobs(actor, r["seq"], r["mask"], r["start"])
    actor_loss = policy_loss(logprobs, r["logprobs"], r["advantages"], r["answer"], args.cliprange)
    actor.backward(actor_loss)
    actor.step()
    critic.train()
    values = token_scores(critic, r["seq"], r["mask"])[:, r["start"] - 1 : -1]
    critic_loss = value_loss(values, r["values"], r["returns"], r["answer"], args.cliprange_value)
    critic.backward(critic_loss)
    critic.step()
    return mean_over_ranks(actor_loss.item(), critic_loss.item())


def ppo_models(args, stage: int = 3) -> tuple:
    """The four models as three engines. Actor: the SFT model merged into a frozen base stored INT4, with a fresh
    LoRA (the reference is the same engine with the adapter disabled: no second copy). Critic: the reward model
    with LoRA on its frozen INT8 base and its scalar head trained as the value head. Reward model: frozen, INT8."""
    rm_folder, adapter = args.out_dir / "reward_model", args.out_dir / "sft_adapter"
    critic_lora = LoraConfig(r=LORA.r, lora_alpha=LORA.lora_alpha, target_modules="all-linear",
                             modules_to_save=["score"])  # fmt: skip
    if args.model:
        actor = llama(AutoModelForCausalLM, 128, 4, args.model, peft_config=LORA, merge_adapter=adapter,
                      frozen_format="int4")  # fmt: skip
        seq_cls = partial(ds_plugin.load_pretrained, rm_folder, model_class=AutoModelForSequenceClassification,
                          frozen_format="int8", defer=True)  # fmt: skip
        critic, scorer = seq_cls(peft_config=critic_lora), seq_cls(frozen=True)
    else:
        actor = get_peft_model(merged_sft(args.out_dir), LORA)
        critic = get_peft_model(AutoModelForSequenceClassification.from_pretrained(rm_folder), critic_lora)
        scorer = AutoModelForSequenceClassification.from_pretrained(rm_folder).requires_grad_(False)
    return (ds_plugin.initialize(actor, zero(stage, "int4"), optimizer=partial(AdamW, lr=args.actor_lr)),
            ds_plugin.initialize(critic, zero(stage, "int8"), optimizer=partial(AdamW, lr=args.critic_lr)),
            ds_plugin.initialize(scorer, zero(stage, "int8")))  # fmt: skip


def step_ppo(args) -> dict:
    """PPO of the SFT actor against the reward model, with a critic; scored on held-out questions."""
    rank, world = dist.get_rank(), dist.get_world_size()
    prompts = sorted({r["prompt"] for r in rows("pref", "train")})
    questions = sorted({r["prompt"] for r in rows("pref", "test")})[rank::world] * args.samples
    actor, critic, reward_model = ppo_models(args, args.zero_stage)
    ema = [p.detach().clone() for p in actor.trainable_parameters()] if args.enable_ema else None

    def evaluate(seed: int) -> tuple[float, float, list[str]]:
        """The reward model's mean score of answers sampled for held-out questions, and their mean KL to the
        reference (summed log(pi/pi_ref) over each answer's tokens: nats per answer); the first answers."""
        r = rollout(actor, reward_model, None, questions, args, seed + 1000 * rank)
        kl = sequence_kl(r["logprobs"], r["ref_logprobs"], r["answer"])
        texts = [TOK.decode(row, skip_special_tokens=True) for row in (r["seq"][:3, r["start"] :]).tolist()]
        return *mean_over_ranks(r["scores"].mean().item(), kl.mean().item()), texts

    before = evaluate(seed=3)
    gen, history, log = torch.Generator().manual_seed(args.seed), [], []
    for step in tqdm(range(args.ppo_steps), desc="3/3 PPO", disable=rank != 0):
        picks = torch.randint(len(prompts), (args.ppo_batch * world,), generator=gen)[rank::world].tolist()
        seed = (args.seed * args.ppo_steps + step) * world + rank
        r = rollout(actor, reward_model, critic, [prompts[i] for i in picks], args, seed)
        for _ in range(args.ppo_epochs):
            losses = ppo_update(actor, critic, r, args)
            if ema is not None:
                ema_update_(ema, actor.trainable_parameters(), args.ema_beta)
        kl = sequence_kl(r["logprobs"], r["ref_logprobs"], r["answer"]).mean().item()
        score, kl = mean_over_ranks(r["scores"].mean().item(), kl)
        history.append(losses[0])
        log.append({"step": step, "score": score, "kl": kl, "actor_loss": losses[0], "critic_loss": losses[1]})
    after = evaluate(seed=3)
    folder = ds_plugin.save_adapter(actor, args.out_dir / "ppo_adapter")
    reload = partial(reload_lora, folder, args.model, "int4", partial(merged_sft, args.out_dir),
                     merge_adapter=args.out_dir / "sft_adapter")  # fmt: skip
    result = {"metric": "reward_model_score", "before": before[0], "after": after[0], "curve": history,
              "kl": [before[1], after[1]], "iterations": log,
              "examples": list(zip(questions[:3], before[2], after[2], strict=True))}  # fmt: skip
    if ema is not None:  # the EMA actor (DeepSpeed-Chat's actor_ema): its weights swapped in, scored, saved
        trained = [p.detach().clone() for p in actor.trainable_parameters()]
        with torch.no_grad():
            for p, e in zip(actor.trainable_parameters(), ema, strict=True):
                p.copy_(e)
            result["ema_score_kl"] = list(evaluate(seed=3)[:2])
            ds_plugin.save_adapter(actor, args.out_dir / "ppo_adapter_ema")
            for p, t in zip(actor.trainable_parameters(), trained, strict=True):
                p.copy_(t)
    result["reload_max_diff"] = check_reload(actor, folder, reload, "pref")
    return result


# The steps each step trains from: a step run again makes what was recorded for these out of date.
TRAINED_FROM = {"sft": (), "reward": (), "ppo": ("sft", "reward"), "dpo": ("sft", "reward")}


def check_args(args) -> None:
    """A value out of range, or a step that needs an earlier one's output missing from --out-dir: one line on
    stderr and exit code 2 (argparse's), before any model is built or process group started."""
    rules = [("--ppo-steps", args.ppo_steps >= 0, "at least 0"), ("--ppo-batch", args.ppo_batch >= 1, "at least 1"),
             ("--ppo-epochs", args.ppo_epochs >= 1, "at least 1"), ("--samples", args.samples >= 1, "at least 1"),
             ("--answer-tokens", args.answer_tokens >= 1, "at least 1"), ("--actor-lr", args.actor_lr > 0, "above 0"),
             ("--critic-lr", args.critic_lr > 0, "above 0"), ("--kl-ctl", args.kl_ctl >= 0, "at least 0"),
             ("--clip-reward-value", args.clip_reward_value > 0, "above 0"),
             ("--cliprange", 0 < args.cliprange < 1, "between 0 and 1"),
             ("--cliprange-value", args.cliprange_value > 0, "above 0"),
             ("--gamma", 0 <= args.gamma <= 1, "between 0 and 1"), ("--lam", 0 <= args.lam <= 1, "between 0 and 1"),
             ("--ema-beta", 0 < args.ema_beta < 1, "between 0 and 1"),
             ("--zero-stage", args.zero_stage in (2, 3), "2 or 3")]  # fmt: skip
    for flag, ok, need in rules:
        if not ok:  # a NaN fails every comparison, so it lands here too
            fail(flag, DataError(f"{getattr(args, flag[2:].replace('-', '_'))}: must be {need}"))
    if args.step in ("ppo", "dpo"):
        if missing := [f"{n}/" for n in ("sft_adapter", "reward_model") if not (args.out_dir / n).is_dir()]:
            why = f"--step {args.step} starts from them: run --step sft and --step reward first (or --step all)"
            fail("--out-dir", DataError(f"{args.out_dir}: no {' or '.join(missing)} in it; {why}"))


def load_data(args) -> None:
    """ROWS from --data/--eval-data (the step --step names) or --sft-data/--pref-data, else the shipped files."""
    step = args.step
    if args.data and step == "all":
        fail("--data", DataError("feeds the step --step names; with --step all pass --sft-data and --pref-data"))
    reads = {"sft": ["sft"], "reward": ["pref"], "dpo": ["pref"], "ppo": ["pref"], "all": ["sft", "pref"]}[step]
    for kind in reads:
        formats, default = (SFT, "rlhf_sft.jsonl") if kind == "sft" else (("preference",), "rlhf_pairs.jsonl")
        own = getattr(args, f"{kind}_data")
        data, flag = (args.data, "--data") if args.data else (own, f"--{kind}-data")
        eval_data = args.eval_data if step != "all" else None
        ROWS[kind] = load_rows(data, eval_data, args.eval_fraction, formats, DATA / default,
                               ascii_only=not args.model, flags=(flag, "--eval-data"))  # fmt: skip


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (`check_args`, `check_model`) and its data read (`load_data`): every problem is
    one line and exit code 2 here, before any process group starts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", default="all", choices=["all", "sft", "reward", "ppo", "dpo"],
                        help="all: sft, reward, ppo (DeepSpeed-Chat's three steps); dpo in place of ppo")  # fmt: skip
    parser.add_argument("--sft-steps", type=int, default=120)
    parser.add_argument("--rm-steps", type=int, default=150)
    parser.add_argument("--dpo-steps", type=int, default=60)
    parser.add_argument("--dpo-lr", type=float, default=5e-5, help="higher overfits: samples degrade")
    parser.add_argument("--beta", type=float, default=0.3, help="DPO's KL strength")
    parser.add_argument("--samples", type=int, default=4, help="sampled answers per held-out question")
    ppo = parser.add_argument_group("PPO (DeepSpeed-Chat's step 3; its defaults where it has one)")
    ppo.add_argument("--ppo-steps", type=int, default=40, help="iterations: a rollout, then --ppo-epochs updates")
    ppo.add_argument("--ppo-batch", type=int, default=8, help="prompts per rank per rollout")
    ppo.add_argument("--ppo-epochs", type=int, default=1, help="passes of the actor and critic over each rollout")
    ppo.add_argument("--actor-lr", type=float, default=2e-4)
    ppo.add_argument("--critic-lr", type=float, default=5e-4)
    ppo.add_argument("--kl-ctl", type=float, default=0.1, help="per-token KL penalty against the reference")
    ppo.add_argument("--clip-reward-value", type=float, default=5.0, help="reward-model scores clipped to +-this")
    ppo.add_argument("--cliprange", type=float, default=0.2, help="policy ratio clipped to 1 +- this")
    ppo.add_argument("--cliprange-value", type=float, default=0.2, help="values clipped to the rollout's +- this")
    ppo.add_argument("--gamma", type=float, default=1.0, help="GAE's discount")
    ppo.add_argument("--lam", type=float, default=0.95, help="GAE's lambda")
    ppo.add_argument("--answer-tokens", type=int, default=32, help="most new tokens per sampled answer")
    ppo.add_argument("--greedy", action="store_true", help="greedy rollouts (deterministic; no exploration)")
    ppo.add_argument("--enable-ema", action="store_true", help="also keep (and save, score) an EMA of the actor")
    ppo.add_argument("--ema-beta", type=float, default=0.992)
    ppo.add_argument("--seed", type=int, default=0, help="of the prompts drawn and the answers sampled in training")
    ppo.add_argument("--zero-stage", type=int, default=3, help="ZeRO stage of the PPO engines: 2 or 3")
    parser.add_argument("--model", help="a local causal-LM checkpoint and its tokenizer (default: tiny random Llamas)")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/rlhf"))
    parser.add_argument("--smoke", action="store_true", help="a short run: 40 SFT, 30 reward, 8 PPO, 20 DPO steps")
    parser.add_argument("--data", help="training rows of the step --step names (JSON Lines; default: shipped data)")
    parser.add_argument("--eval-data", help="held-out rows of that step (default: --eval-fraction of --data)")
    parser.add_argument("--eval-fraction", type=fraction, default=0.1, help="held out when --eval-data is absent")
    parser.add_argument("--sft-data", help="SFT rows (--step all or sft): {prompt, response}, Alpaca's or chat's")
    parser.add_argument("--pref-data", help="preference rows (all, reward, ppo, dpo): {prompt, chosen, rejected}")
    args = parser.parse_args(argv)
    check_args(args)  # a bad value, or a step whose inputs are not in --out-dir: one line, before anything loads
    check_model(args.model, reward_model=True)  # a wrong --model: one line, before anything loads
    load_data(args)  # a bad data file: one line, before any process group starts
    if args.smoke:
        args.sft_steps, args.rm_steps, args.dpo_steps, args.ppo_steps, args.samples = 40, 30, 20, 8, 2
    return args


def main() -> None:
    args = arguments()
    start = time.perf_counter()
    # Two processes share two cores: one thread each avoids oversubscription.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    global DEVICE, TOK
    TOK = load_tokenizer(args.model)
    if torch.cuda.is_available():
        DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(DEVICE)
    dist.init_process_group("nccl" if DEVICE.type == "cuda" else "gloo")
    args.out_dir.mkdir(parents=True, exist_ok=True)

    steps = {"sft": step_sft, "reward": step_reward, "ppo": step_ppo, "dpo": step_dpo}
    chosen = ["sft", "reward", "ppo"] if args.step == "all" else [args.step]
    results = {name: steps[name](args) for name in chosen}
    if dist.get_rank() == 0:
        recorded = recorded_steps(args.out_dir / "summary.json", results, TRAINED_FROM)
        plot(recorded, args.out_dir / "rlhf.png")
        (args.out_dir / "summary.json").write_text(json.dumps(recorded))
        for name, r in results.items():
            print(f"{name:>6}: {r['metric']} {r['before']:.3f} -> {r['after']:.3f}")
        if "dpo" in results:
            (_, acc0, margin0, _), *_, (_, acc1, margin1, _) = results["dpo"]["evals"]
            print(f"{'':8}held-out preference accuracy {acc0:.2f} -> {acc1:.2f}, margin {margin0:.2f} -> {margin1:.2f}")
        if "ppo" in results:
            kl0, kl1 = results["ppo"]["kl"]
            print(f"{'':8}KL to the reference {kl0:.3f} -> {kl1:.3f} nats per sampled held-out answer")
        for name in ("ppo", "dpo"):
            for question, sft, tuned in results.get(name, {}).get("examples", []):
                print(f"        {question!r}\n          SFT: {sft!r}\n          {name.upper()}: {tuned!r}")
        print(f"adapters and reward model in {args.out_dir}; base: {args.model or 'tiny random Llamas'}")
        last = results[chosen[-1]]
        line = {"recipe": "rlhf", "metric": last["metric"], "before": last["before"], "after": last["after"]}
        for name, r in results.items():  # every step's held-out signal, before and after
            line[f"{name}_{r['metric']}"] = [r["before"], r["after"]]
        if "dpo" in results:
            line["dpo_heldout_preference_accuracy"] = [acc0, acc1]
        if "ppo" in results:
            line["ppo_kl_to_reference"] = results["ppo"]["kl"]
            if "ema_score_kl" in results["ppo"]:
                line["ppo_ema_score_kl"] = results["ppo"]["ema_score_kl"]
        print(json.dumps({**line, "seconds": round(time.perf_counter() - start, 1)}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
