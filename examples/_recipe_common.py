"""What the recipes share: the check of `--model PATH`, the byte tokenizer they default to, padding, plotting.

The recipes next to this file import it as `_recipe_common` (`python examples/x.py`, torchrun, Lightning's relaunch
and `-m ds_plugin.accelerate` put the script's directory first on sys.path). A wrong `--model` gets one line on
stderr and exit code 2, as argparse reports a bad argument.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections import Counter
from pathlib import Path
from typing import NoReturn

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

from ds_plugin.checkpoint.hf_stream import CheckpointLoadError, load_pretrained

EXPECTED = "expected a local transformers checkpoint: a directory with config.json, the weights and the tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


class ByteTokenizer:
    """Bytes as token ids, with three ids the text never uses; the default, in place of a checkpoint's tokenizer."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([self.bos_token_id] if add_special_tokens else []) + list(text.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return bytes(i for i in ids if i > 2 or not skip_special_tokens).decode(errors="replace")


class WordTokenizer(ByteTokenizer):
    """Whole words as tokens, from a vocabulary built from the training text; anything else as bytes.

    The text is cut into pieces: a run of letters, one digit, one other symbol (each with the space before it, as
    GPT-2's tokenizer cuts), or one whitespace character; the pieces joined give the text back. Ids 0-2 are pad, BOS
    and EOS, 3-127 the ASCII bytes (a piece outside the vocabulary: its bytes, '?' for a non-ASCII one), 128 on the
    vocabulary's words, so every word the training text holds is one token and decoding never misspells it. Digits
    stay single tokens, so a number training never shows is still made of known tokens."""

    PIECES = re.compile(r" ?(?:[^\W\d_]+|\d|[^\w\s]|_)|\s")
    FILE = "word_vocab.json"  # saved beside the prefix, so a reload (and examples/chat.py) reads text the same way

    def __init__(self, words: list[str]) -> None:
        self.words = list(words)
        self.ids = {w: 128 + i for i, w in enumerate(self.words)}

    @property
    def vocab_size(self) -> int:
        return 128 + len(self.words)

    @classmethod
    def build(cls, texts, max_words: int = 4096) -> WordTokenizer:
        """The pieces of `texts` longer than one byte, most frequent first (ties alphabetical), `max_words` at most."""
        counts = Counter(p for text in texts for p in cls.PIECES.findall(text) if len(p) > 1)
        return cls(sorted(counts, key=lambda p: (-counts[p], p))[:max_words])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.bos_token_id] if add_special_tokens else []
        for piece in self.PIECES.findall(text):
            ids += [self.ids[piece]] if piece in self.ids else list(piece.encode("ascii", errors="replace"))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        out = bytearray()
        for i in ids:
            if i >= 128:
                out += self.words[i - 128].encode() if i < self.vocab_size else b"?"
            elif i > 2 or not skip_special_tokens:
                out.append(i)
        return out.decode(errors="replace")

    def save(self, folder: Path) -> None:
        (Path(folder) / self.FILE).write_text(json.dumps({"words": self.words}, indent=0) + "\n")

    @classmethod
    def saved(cls, folder: Path) -> WordTokenizer | None:
        """The vocabulary saved in `folder`, or None when there is none (a run with bytes or `--model`)."""
        path = Path(folder) / cls.FILE
        return cls(json.loads(path.read_text())["words"]) if path.is_file() else None


def fail(path: str, problem: str) -> NoReturn:
    """One line on stderr naming the path and the problem; exit code 2 (argparse's, for a bad argument)."""
    sys.stderr.write(f"{Path(sys.argv[0]).name}: error: --model {path}: {problem}\n")
    raise SystemExit(2)


def first_line(error: Exception) -> str:
    return next(iter(str(error).splitlines()), type(error).__name__)


def describe(architectures: list[str], config: dict) -> str:
    if architectures:
        return f"{', '.join(architectures)} (model_type {config.get('model_type')!r})"
    return f"of model_type {config.get('model_type')!r} (config.json names no architecture)"


def check_model(
    path: str | None,
    architectures: tuple[str, ...] = (),
    lora_targets: tuple[str, ...] = (),
    reward_model: bool = False,
) -> int:
    """Check `--model PATH` before anything is loaded: a directory with config.json naming a causal LM
    (`...ForCausalLM`; with `architectures`, one of those), weights and tokenizer files; transformers builds it (on
    the meta device: no memory, no weights read), it has every module LoRA targets, and (`reward_model`)
    transformers has a sequence-classification class for it. Returns the parameter count (0 without `--model`);
    one line on stderr and exit 2 on the first problem."""
    if not path:
        return 0
    where = Path(path)
    if not where.exists():
        fail(path, f"no such directory ({EXPECTED})")
    if not where.is_dir():
        fail(path, f"not a directory ({EXPECTED})")
    if not (where / "config.json").is_file():
        fail(path, f"no config.json in it ({EXPECTED})")
    try:
        config = json.loads((where / "config.json").read_text())
        found = list(config.get("architectures") or [])
    except (OSError, ValueError, AttributeError) as e:
        fail(path, f"config.json is not a transformers config ({type(e).__name__}: {e})")
    supported = any(a in architectures if architectures else a.endswith("ForCausalLM") for a in found)
    if not supported:
        needs = " or ".join(architectures) or "a causal LM (a ...ForCausalLM class in config.json's architectures)"
        fail(path, f"unsupported architecture {describe(found, config)}; this recipe supports {needs}")
    if not any(where.glob("*.safetensors")) and not any(where.glob("*.bin")):
        fail(path, f"no weights (*.safetensors or *.bin) next to config.json ({EXPECTED})")
    if not any((where / name).is_file() for name in TOKENIZER_FILES):
        fail(path, f"no tokenizer ({', '.join(TOKENIZER_FILES)}) next to config.json ({EXPECTED})")
    found = describe(found, config)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path, local_files_only=True))
    except Exception as e:  # an unknown model_type, a class this transformers lacks, remote code (never run)
        fail(path, f"unsupported architecture {found}: transformers cannot build it ({first_line(e)})")
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    if missing := [t for t in lora_targets if t not in names]:
        targets = ", ".join(lora_targets)  # Llama's projections; Mistral, Qwen2 and Gemma have them too
        fail(
            path,
            f"unsupported architecture {found}: no {', '.join(missing)} modules; this recipe puts LoRA on {targets}",
        )
    if reward_model and config.get("model_type") not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
        fail(path, f"unsupported architecture {found}: the reward model needs a sequence-classification class for it")
    try:  # every tensor there, whole, of the shape and dtype config.json gives: headers only, nothing is read
        load_pretrained(path, frozen=True, defer=True)
    except CheckpointLoadError as e:
        fail(path, str(e))
    return sum(p.numel() for p in model.parameters())


def load_tokenizer(path: str | None):
    """The byte tokenizer, or `--model`'s own (offline), padding with EOS where it has no pad token."""
    if not path:
        return ByteTokenizer()
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tok.eos_token_id is None:
        fail(path, "its tokenizer has no EOS token, which ends every answer the recipe trains on")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # the recipes build attention masks from lengths, so padding may reuse EOS
    return tok


def pad(rows: list[list[int]], pad_id: int, device=None, left: bool = False) -> tuple:
    """Token rows padded to one width (`left`: on the left, so that every row's last token is its own), and the
    attention mask, built from the lengths: a tokenizer may pad with EOS, which is also a real token."""
    fill = [max(map(len, rows)) - len(r) for r in rows]
    ids = [[pad_id] * n + r if left else r + [pad_id] * n for r, n in zip(rows, fill, strict=True)]
    mask = [[0] * n + [1] * len(r) if left else [1] * len(r) + [0] * n for r, n in zip(rows, fill, strict=True)]
    return torch.tensor(ids, device=device), torch.tensor(mask, device=device)


def until(ids: list[int], *stops: int) -> list[int]:
    """The ids before the first of `stops` (all of them if none occurs)."""
    return ids[: min((ids.index(s) for s in stops if s in ids), default=len(ids))]


@torch.no_grad()
def greedy(model: torch.nn.Module, tok, prompts: list[list[int]], device, new_tokens: int = 3) -> list[str]:
    """Greedy answers to prompts (token ids), left-padded so every row's last token is its own: the LoRA SFT
    recipes' held-out answers, one function so that both recipes score the same way. A fixed number of steps on
    every rank (each ZeRO-3 forward is a collective); an answer is the text up to the first EOS (or PAD), as
    generated."""
    ids, mask = pad(prompts, tok.pad_token_id, device, left=True)
    width = ids.shape[1]
    for _ in range(new_tokens):
        position_ids = (mask.cumsum(1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    stops = (tok.eos_token_id, tok.pad_token_id)
    return [tok.decode(until(row, *stops), skip_special_tokens=False) for row in ids[:, width:].tolist()]


def pyplot():
    """matplotlib.pyplot, or None (with a note) when matplotlib is not installed."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return print("no matplotlib (pip install matplotlib, or the bench extra): no loss-curve PNG")
    return plt


def save_figure(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"loss curve: {path}")


# The LoRA SFT recipes' model (examples/lora_sft.py and its Accelerate twin), kept in one place so the two train
# the same network.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_lora_sft_args(parser) -> None:
    """The training flags both LoRA SFT recipes share (Lightning's and Accelerate's train alike)."""
    parser.add_argument(
        "--steps",
        type=int,
        default=600,
        help="600: about a minute on 2 CPU cores; 500 reached 0.86 held-out exact match at --seed 1, 450 "
        "0.82-0.83 (lr 2e-3)",
    )
    parser.add_argument("--evals", type=int, default=4, help="held-out evals in training (+1 before; 0: none)")
    parser.add_argument(
        "--lr",
        type=float,
        default=2e-3,
        help="2e-3: held-out exact match 0.89, 0.91, 0.90 at --seed 0, 1, 2 (0.92, 0.93 at 3, 4); 3e-3: 0.73 at "
        "seed 0, 1.5e-3: 0.86 at seed 3, 1e-3: 0.81-0.86 (600 steps, measured on a CPU)",
    )
    parser.add_argument("--micro-batch", type=int, default=16, help="rows per process per step")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0, help="of the training order (the base is always the same)")
    parser.add_argument("--frozen-format", default="int4", choices=["int8", "int4", "nf4"])


def recorded_steps(path: Path, results: dict, trained_from: dict[str, tuple[str, ...]]) -> dict:
    """This run's per-step results with what earlier runs into the same --out-dir recorded in `path` (steps run one
    at a time, DeepSpeed-Chat's way, add up), less the records of steps trained from a step this run redid; in
    `trained_from`'s order (step -> the steps it trains from)."""
    earlier = json.loads(path.read_text()) if path.is_file() else {}
    kept = {k: v for k, v in earlier.items() if k not in results and not set(results) & set(trained_from.get(k, ()))}
    return {k: results.get(k, kept.get(k)) for k in trained_from if k in kept or k in results}


def lora_config(lora_rank: int) -> LoraConfig:
    """LoRA on every projection, alpha = 2 x rank."""
    return LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=LORA_TARGETS)


def lora_sft_model(lora_rank: int, model_path: str | None = None, frozen_format: str | None = None):
    """The same random tiny Llama on every call (fixed seed), with LoRA on every projection (none for lora_rank=0).

    With --model's checkpoint: the empty model, streamed (`ds_plugin.load_pretrained(..., defer=True)`): ZeRO setup
    (the Lightning strategy, Accelerate's prepare) allocates each rank's shards and reads only their rows into them,
    the frozen Linear weights stored as `frozen_format` as they are read. No rank ever holds the whole model."""
    torch.manual_seed(0)
    if model_path:
        peft_config = lora_config(lora_rank) if lora_rank else None
        return load_pretrained(model_path, peft_config=peft_config, frozen=lora_rank == 0,
                               frozen_format=frozen_format, defer=True)  # fmt: skip
    else:
        # initializer_range 0.05, not 0.02: the head and final norm stay frozen, and a random head that small caps
        # every logit near 2.5, so the loss could not fall below ~2.5 nats however right the answers are.
        config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             initializer_range=0.05, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
        base = LlamaForCausalLM(config)
    if lora_rank == 0:
        return base
    return get_peft_model(base, lora_config(lora_rank))


def warmup_cosine(steps: int, per_step: int = 1):
    """The LoRA SFT recipes' learning-rate factor, for a LambdaLR: a short linear warm-up (a fifteenth of the steps),
    then a cosine to zero, so the last evaluation sees a settled adapter. `per_step`: how many times the scheduler
    is stepped per optimizer step (Accelerate steps a prepared one once per process), so both recipes give every
    optimizer step the same rate."""
    warm = max(1, steps // 15)

    def factor(calls: int) -> float:
        s = calls // per_step
        return min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))

    return factor


# -- the LoRA SFT recipes' curves ----------------------------------------------------------------------------------
def plot_sft(losses: list[float], history: list[tuple[int, float]], path: Path, loss_label: str, title: str) -> None:
    """The answer-loss curve and held-out exact match over the steps, side by side."""
    if (plt := pyplot()) is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.plot(losses, lw=0.8)
    left.set(xlabel="step", ylabel=loss_label, yscale="log", title=title)
    right.plot(*zip(*history, strict=True), marker="o")
    right.set(xlabel="step", ylabel="held-out exact match", ylim=(-0.02, 1.02), title="held-out pairs and wordings")
    save_figure(fig, path)


# -- reload checks: what a recipe saved, on a fresh base, against the trained engine's own logits -------------------
CHECK_FILE = "reload_check.pt"  # beside the saved weights: held-out input, the engine's logits on it, the tolerance


def save_engine_logits(folder: Path, ids: torch.Tensor, mask: torch.Tensor, logits: torch.Tensor, tolerance: float,
                       why: str) -> None:  # fmt: skip
    """Keep the engine's logits on held-out input (its real tokens only) next to what it saved; rank 0 calls it."""
    picked = logits[mask.bool()] if logits.dim() == 3 else logits  # a reward model gives one score per row
    check = {"input_ids": ids.cpu(), "attention_mask": mask.cpu(), "logits": picked.float().cpu(),
             "tolerance": tolerance, "why": why}  # fmt: skip
    torch.save(check, Path(folder) / CHECK_FILE)


@torch.no_grad()
def reload_mismatch(model: torch.nn.Module, folder: Path) -> tuple[float, str | None]:
    """The largest difference between `model`'s logits (what `folder` holds, reloaded onto a fresh base) and the
    engine's, on the held-out input kept in `folder`; and the one-line complaint when it exceeds the tolerance
    (a NaN does too), else None."""
    check = torch.load(Path(folder) / CHECK_FILE, weights_only=True)
    ids, mask = check["input_ids"], check["attention_mask"]
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    picked = logits[mask.bool()] if logits.dim() == 3 else logits
    diff = (picked - check["logits"]).abs().max().item()
    if diff <= check["tolerance"]:
        return diff, None
    return diff, (f"reload check failed: {folder} reloaded onto a fresh base gives logits up to {diff:.3g} away from "
                  f"the trained engine's on held-out input (tolerance {check['tolerance']:g}: {check['why']}); "
                  "the saved files do not hold what was trained")  # fmt: skip


def reload_check(reload, folder: Path) -> float:
    """Every rank calls it and rebuilds the model (`reload()`: reading `--model` is a collective, each rank quantizing
    a share of the rows); rank 0 compares (`reload_mismatch`). A mismatch ends every rank with exit code 1 and one
    line on stderr. Returns the largest difference (rank 0's)."""
    import torch.distributed as dist

    model = reload()
    result = [reload_mismatch(model, folder) if not dist.is_initialized() or dist.get_rank() == 0 else None]
    del model
    if dist.is_initialized():
        dist.broadcast_object_list(result)
    diff, problem = result[0]
    if problem:
        if not dist.is_initialized() or dist.get_rank() == 0:
            sys.stderr.write(f"{Path(sys.argv[0]).name}: {problem}\n")
        if dist.is_initialized():
            dist.destroy_process_group()
        raise SystemExit(1)
    return diff


def lora_tolerance(low_precision: bool, gpu: bool) -> tuple[float, str]:
    """The LoRA recipes' reload-check tolerance (max |logit difference|) and why.

    The engine's logits for the check are computed with qwZ off (`engine.exact_weight_gathers()`): qwZ rounds every
    gathered weight not stored quantized (embedding, norms, LoRA) to INT8 blocks, which moved logits by up to 0.73
    (logits up to 6.6, the default run) against a reload that, like the saved file, holds the weights unrounded.
    With the weights exact, fp32 on a CPU is the engine's operations on the same values: 0.0 in the recipe, 1e-5
    lets a process with another thread count (a test) repeat the check. bf16 compute: 1.0; fp32 on a GPU
    (reloaded on the CPU: other kernels): 1e-3 (neither measured here)."""
    if low_precision:
        return 1.0, "bf16 compute"
    if gpu:
        return 1e-3, "fp32 on a GPU, then a CPU"
    return 1e-5, "fp32, the same operations"


def reload_lora(adapter: Path, model_path: str | None, frozen_format: str, base=None, **streamed) -> torch.nn.Module:
    """The saved LoRA adapter on a fresh copy of the base (`base()`, default the LoRA SFT recipes' tiny Llama; or
    `model_path`, streamed: its frozen weights quantized as they are read, never a whole full-precision copy, with
    `streamed` passed on to `load_pretrained`), stored as in training; one process."""
    import ds_plugin

    if model_path:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        model = ds_plugin.load_pretrained(model_path, peft_config=LoraConfig.from_pretrained(adapter),
                                          frozen_format=frozen_format, **streamed)  # fmt: skip
        result = set_peft_model_state_dict(model, load_file(Path(adapter) / "adapter_model.safetensors"))
        if result.unexpected_keys:
            raise ValueError(f"{adapter}: tensors the model has no place for: {result.unexpected_keys[:3]}")
        return model.eval()
    from peft import PeftModel

    model = PeftModel.from_pretrained(base() if base else lora_sft_model(0), adapter).eval()
    ds_plugin.quantize_frozen_(model, frozen_format)
    return model
