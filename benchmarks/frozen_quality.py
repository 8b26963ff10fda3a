"""Held-out perplexity of a small byte-level Llama whose frozen Linear weights are stored in each weight format.

Trains a tiny ``LlamaForCausalLM`` (config built here, nothing downloaded) on the train split of a public-domain
text shipped in ``benchmarks/data/``, then, for each format, replaces every ``nn.Linear`` weight except the output
head by ``dequantize_weight(quantize_weight(W))`` and measures perplexity on the held-out split, and the mean
per-byte KL divergence from the bf16 model's predictions. Prints the JSON report and writes it to
``benchmarks/results/frozen_quality_cpu.json``.

Why the KL column: at this scale a format's perplexity change is a sum of a first-order term (the held-out
gradient against the weight error, of random sign) and a second-order one (the real damage). The first can be as
large as the second, so perplexity can rank formats by chance; the KL divergence is second-order only and tracks the
damage itself.

The baseline row is the trained model with its weights rounded to bf16; every format quantizes those bf16 weights
and dequantizes back to bf16. The forward pass computes in fp32 by default (``--compute-dtype bfloat16`` runs it in
bf16): the rows then differ only by their weight values, not by bf16 activation rounding, and on CPUs without bf16
matrix units the fp32 pass is ~5x faster.

    python -m benchmarks.frozen_quality [--steps 600] [--threads 2] [--compute-dtype float32] [--out PATH]
"""

from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning. On a shared CPU (CI, a busy laptop) spinning threads fight the other
# processes for the cores: measured, 2 threads ran the INT4 search 7-50x slower than 1 until this was set.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import copy
import datetime
import json
import math
import random
import time
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from ds_plugin.quant.frozen.codecs import DEFAULT_GROUP_SIZE, dequantize_weight, quantize_weight

ROOT = Path(__file__).resolve().parent
TEXT = ROOT / "data" / "devils_dictionary.txt"
OUT = ROOT / "results" / "frozen_quality_cpu.json"
SEQ = 256
CHUNK = 4096  # held-out text is every HELDOUT_EVERY-th chunk of this many bytes, spread over the whole book
HELDOUT_EVERY = 10
# (row label, format, method): "bf16" leaves the weights alone; "bnb-nf4" is bitsandbytes' own NF4 with its
# double quantization (compress_statistics=True), for comparison with ours.
ROWS = [
    ("bf16", "bf16", None),
    ("int8", "int8", "default"),
    ("int4 absmax", "int4", "absmax"),
    ("int4 searched", "int4", "search"),
    ("nf4 (ours, double quant)", "nf4", "double_quant"),
    ("nf4 (ours, no double quant)", "nf4", "no_double_quant"),
    ("nf4 (bitsandbytes, compress_statistics)", "bnb-nf4", None),
    ("fp6 e3m2", "fp6", "default"),
]


def seed_everything(seed: int) -> None:
    """Seed Python's and torch's generators.

    Args:
        seed: the seed.
    """
    random.seed(seed)
    torch.manual_seed(seed)


def load_splits(path: Path = TEXT) -> tuple[torch.Tensor, torch.Tensor]:
    """The text as bytes (token ids 0..255), split into train and held-out parts by interleaved chunks.

    The book is alphabetical, so a held-out tail would be the letters W-Z only; every tenth 4 KB chunk instead
    samples the whole of it.

    Args:
        path: the text file.
    """
    data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()
    chunks = list(data.split(CHUNK))
    heldout = torch.cat(chunks[HELDOUT_EVERY - 1 :: HELDOUT_EVERY])
    train = torch.cat([c for i, c in enumerate(chunks) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1])
    return train, heldout


def build_model() -> LlamaForCausalLM:
    """A 4-layer byte-level Llama: every Linear's in-features (128 or 384) divide all the default group sizes.

    Small enough to train well within the time budget: a better-trained small model shows a format's damage more
    clearly than an under-trained wider one (measured: 256 wide after 300 steps moved perplexity < 0.1% at 4 bits).
    """
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def train(model: nn.Module, data: torch.Tensor, steps: int, batch: int, lr: float) -> float:
    """Train on random windows of ``data`` with AdamW, linear warm-up then cosine decay; returns the last loss.

    Args:
        model: the causal LM.
        data: train token ids.
        steps: optimizer steps.
        batch: sequences per step.
        lr: peak learning rate.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    gen = torch.Generator().manual_seed(0)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - SEQ, (batch,), generator=gen)
        tokens = torch.stack([data[s : s + SEQ] for s in starts.tolist()])
        # The model shifts the labels itself, so the inputs double as labels.
        loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    return loss.item()


@torch.no_grad()
def log_probs(model: nn.Module, data: torch.Tensor, batch: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-byte log-probabilities (fp32) over non-overlapping ``SEQ``-byte windows of ``data``, and the targets.

    Args:
        model: the causal LM.
        data: held-out token ids (a partial last window is dropped).
        batch: windows per forward pass.
    """
    model.eval()
    windows = data[: data.numel() // SEQ * SEQ].view(-1, SEQ)
    out = [
        model(input_ids=windows[i : i + batch], use_cache=False).logits[:, :-1].float().log_softmax(-1)
        for i in range(0, windows.shape[0], batch)
    ]
    return torch.cat(out), windows[:, 1:]


def perplexity_and_kl(lp: torch.Tensor, targets: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """exp(mean NLL of ``targets``), and the mean KL(reference || lp) per byte in nats.

    Args:
        lp: log-probabilities from :func:`log_probs`.
        targets: the bytes predicted.
        reference: the baseline model's log-probabilities on the same windows.
    """
    nll = -lp.gather(-1, targets[..., None]).mean().item()
    kl = (reference.exp() * (reference - lp)).sum(-1).mean().item()
    return math.exp(nll), kl


def frozen_linears(model: LlamaForCausalLM) -> list[nn.Linear]:
    """Every ``nn.Linear`` except the output head (which LoRA/QLoRA keep in high precision).

    Args:
        model: the causal LM.
    """
    return [m for m in model.modules() if isinstance(m, nn.Linear) and m is not model.lm_head]


@torch.no_grad()
def apply_format(model: LlamaForCausalLM, fmt: str, group_size: int | None, method: str | None) -> int:
    """Store each frozen Linear weight in ``fmt`` and put the dequantized weight back; returns the stored bytes.

    The one place a format touches the model, so it can later become the package's ``quantize_frozen_`` verb.

    Args:
        model: the causal LM, in the dtype the weights should come back in.
        fmt: a :mod:`ds_plugin.quant.frozen.codecs` format, ``"bf16"`` (no change) or ``"bnb-nf4"``.
        group_size: elements per group (``None``: the format's default).
        method: the format's method.
    """
    stored = 0
    for linear in frozen_linears(model):
        weight = linear.weight
        if fmt == "bf16":
            stored += weight.numel() * 2
        elif fmt == "bnb-nf4":
            import bitsandbytes.functional as bnb_functional

            packed, state = bnb_functional.quantize_4bit(
                weight, blocksize=group_size, quant_type="nf4", compress_statistics=True
            )
            weight.copy_(bnb_functional.dequantize_4bit(packed, state))
            # Codes, uint8 absmax codes, the nested fp32 absmax per 256 of them, and the fp32 offset (bitsandbytes'
            # 256-entry code table, shared, is not counted).
            stored += packed.numel() + state.absmax.numel() + 4 * state.state2.absmax.numel() + 4
        else:
            parts = quantize_weight(weight, fmt, group_size, method=method)
            stored += sum(t.numel() * t.element_size() for t in parts.values())
            weight.copy_(dequantize_weight(parts, fmt, group_size or DEFAULT_GROUP_SIZE[fmt], weight.dtype))
    return stored


def main() -> None:
    """Train, evaluate every format, print and write the JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    train_data, heldout = load_splits()
    model = build_model()
    start, cpu_start = time.perf_counter(), time.process_time()
    final_loss = train(model, train_data, args.steps, args.batch, args.lr)
    # CPU seconds too: on a shared machine the wall time says more about the neighbours than about the run.
    train_seconds, train_cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    baseline = model.to(torch.bfloat16)
    compute_dtype = getattr(torch, args.compute_dtype)
    rows, reference = [], None
    for label, fmt, method in ROWS:
        if fmt == "bnb-nf4" and not _bnb_imports():
            continue
        group_size = None if fmt == "bf16" else (64 if fmt == "bnb-nf4" else DEFAULT_GROUP_SIZE[fmt])
        candidate = copy.deepcopy(baseline)
        start = time.perf_counter()
        stored = apply_format(candidate, fmt, group_size, method)
        seconds = time.perf_counter() - start
        # bf16 -> fp32 is exact, so an fp32 pass sees exactly the stored bf16 weight values.
        candidate.to(compute_dtype)
        lp, targets = log_probs(candidate, heldout)
        reference = lp if reference is None else reference
        ppl, kl = perplexity_and_kl(lp, targets, reference)
        rows.append(
            {
                "format": label,
                "group_size": group_size,
                "perplexity": ppl,
                "kl_vs_bf16_nats_per_byte": kl,
                "bytes_vs_bf16": stored / sum(2 * m.weight.numel() for m in frozen_linears(candidate)),
                "quantize_seconds": seconds,
            }
        )
    for row in rows:
        row["increase_vs_bf16_pct"] = 100 * (row["perplexity"] / rows[0]["perplexity"] - 1)
    config = model.config
    report = {
        "model": {
            "arch": "LlamaForCausalLM, byte-level (vocab 256)",
            "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size,
            "num_hidden_layers": config.num_hidden_layers,
            "num_attention_heads": config.num_attention_heads,
            "seq_len": SEQ,
            "params": sum(p.numel() for p in model.parameters()),
            "quantized_params": sum(m.weight.numel() for m in frozen_linears(model)),
        },
        "data": {
            "file": str(TEXT.relative_to(ROOT.parent)),
            "train_bytes": train_data.numel(),
            "heldout_bytes": heldout.numel(),
        },
        "steps": args.steps,
        "batch": args.batch,
        "final_train_loss": final_loss,
        "train_seconds": train_seconds,
        "train_cpu_seconds": train_cpu_seconds,
        "weights_dtype": "bfloat16",
        "compute_dtype": args.compute_dtype,
        "threads": args.threads,
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "rows": rows,
    }
    text = json.dumps(report, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


def _bnb_imports() -> bool:
    try:
        import bitsandbytes.functional  # noqa: F401
    except Exception:  # a broken native library raises more than ImportError
        return False
    return True


if __name__ == "__main__":
    main()
