"""Tiny models, data and training loops shared by the ZeRO engine tests (built from configs; nothing downloaded)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

VOCAB, SEQ, BATCH = 128, 32, 2


def quiet() -> None:
    """Silence the per-rank chatter of transformers (config warnings) in worker processes."""
    warnings.simplefilter("ignore")
    import transformers

    transformers.logging.set_verbosity_error()


def gpt2(seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)


def llama(seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


MODELS = {"gpt2": gpt2, "llama": llama}


def batch(step: int, rank: int, world: int, per_rank: int = BATCH) -> torch.Tensor:
    """This rank's slice of step `step`'s global batch: every rank sees different tokens."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (world * per_rank, SEQ), generator=g)
    return tokens[rank * per_rank : (rank + 1) * per_rank]


def zero_config(stage: int, *, dtype: str = "fp32", clip: float = 0.0, gas: int = 1, **zero: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "zero_optimization": {"stage": stage, **zero},
        "gradient_clipping": clip,
        "gradient_accumulation_steps": gas,
    }
    if dtype != "fp32":
        cfg["bf16" if dtype == "bf16" else "fp16"] = {"enabled": True}
    return cfg


def train_ddp(
    model: nn.Module, rank: int, world: int, steps: int, *, lr: float = 1e-3, clip: float = 0.0, optim: str = "adamw"
) -> dict[str, list[float]]:
    """Plain DistributedDataParallel: the reference every stage is compared with."""
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = make_optimizer(optim, lr)(ddp.parameters())
    losses, norms = [], []
    for step in range(steps):
        x = batch(step, rank, world)
        loss = ddp(input_ids=x, labels=x).loss
        loss.backward()
        if clip:
            norms.append(float(nn.utils.clip_grad_norm_(ddp.parameters(), clip)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"loss": losses, "norm": norms}


def make_optimizer(name: str, lr: float = 1e-3):
    if name == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    return lambda params: torch.optim.SGD(params, lr=lr * 100, momentum=0.9)


def train_engine(
    engine: Any, rank: int, world: int, steps: int, *, per_rank: int = BATCH, clip_first: float | None = None
) -> dict[str, list[float]]:
    """`steps` optimizer steps; each global batch is split into `gradient_accumulation_steps` micro-batches.
    `clip_first`: the script clips with `engine.clip_grad_norm_` to this before each optimizer step."""
    gas = engine.gradient_accumulation_steps
    losses, norms = [], []
    for step in range(steps):
        x = batch(step, rank, world, per_rank)
        micro = []
        for chunk in x.chunk(gas):
            loss = engine(input_ids=chunk, labels=chunk).loss
            engine.backward(loss)
            if clip_first is not None and engine.is_gradient_accumulation_boundary():
                engine.clip_grad_norm_(clip_first)
            engine.step()
            micro.append(loss.item())
        losses.append(sum(micro) / len(micro))
        if engine.last_grad_norm is not None:
            norms.append(float(engine.last_grad_norm))
    return {"loss": losses, "norm": norms}


def full_params(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full CPU tensor (DTensors gathered)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in module.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = t.detach().float().cpu().clone()
    return out


def max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))
