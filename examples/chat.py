"""Chat with what a recipe trained: its base model plus the saved adapter (or prefix), on one CPU process.

    python examples/chat.py --path runs/lora_sft --prompt "What is 3 plus 4? "
    python examples/chat.py --path runs/rlhf --prompt "What color is the sky?" --temperature 0.7
    python examples/chat.py --path runs/chatglm_ptuning --model /path/to/glm          # prompts from stdin

`--path` is a recipe's --out-dir (or one of the folders in it): lora_sft.py's and accelerate_lora_sft.py's
adapter/, chatglm_ptuning.py's prefix/, rlhf.py's ppo_adapter/ (the final actor; then dpo_adapter/, then
sft_adapter/). The base is the one the recipe trained on: its tiny model, built from the same config and seed (nothing
is downloaded; chatglm_ptuning.py's reads text with the word vocabulary it saved beside the prefix), or `--model
PATH`, the checkpoint you trained with, read row by row and stored as in training (the frozen Linear weights
quantized as they are read). Each prompt is laid out as the recipe's data was: in the
tokenizer's chat template when it has one; otherwise as the recipe's shipped rows were written (RLHF's
"Human: ...\\nAssistant:", ADGEN's "...\\nAd: "), or verbatim with `--raw`. Answers are greedy, or sampled with
`--temperature` (and `--top-p`), up to `--max-new-tokens` or the end-of-sequence token.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from functools import partial
from pathlib import Path

import _offline  # noqa: F401  (first: keeps the libraries off the Hugging Face Hub)
import torch
from _recipe_common import WordTokenizer, load_tokenizer, reload_lora

warnings.filterwarnings("ignore", category=FutureWarning)  # peft and transformers disagree on deprecated names

# The folders the recipes write, in the order --path looks for them, with the layout of their shipped prompts.
SAVED = {
    "ppo_adapter": "Human: {}\nAssistant:",  # rlhf.py
    "dpo_adapter": "Human: {}\nAssistant:",
    "sft_adapter": "Human: {}\nAssistant:",
    "prefix": "{}\nAd: ",  # chatglm_ptuning.py
    "adapter": "{}",  # lora_sft.py, accelerate_lora_sft.py
}


def find(path: Path) -> Path:
    """The saved folder: `path` itself when it is one, else the first of SAVED inside it."""
    if (path / "adapter_config.json").is_file():
        return path
    for name in SAVED:
        if (path / name / "adapter_config.json").is_file():
            return path / name
    names = ", ".join(f"{n}/" for n in SAVED)
    sys.stderr.write(f"chat.py: error: --path {path}: no saved adapter or prefix in it (looked for {names}); "
                     "pass a recipe's --out-dir\n")  # fmt: skip
    raise SystemExit(2)


def load(folder: Path, model_path: str | None, frozen_format: str | None) -> torch.nn.Module:
    """The saved adapter or prefix on the recipe's base, stored as in training."""
    if folder.name == "prefix":
        from chatglm_ptuning import reload_prefix

        return reload_prefix(folder, model_path, "fp32", frozen_format or "none")
    if folder.name in ("sft_adapter", "ppo_adapter", "dpo_adapter"):
        import rlhf
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = partial(rlhf.llama, AutoModelForCausalLM, 128, 4, None)
        if folder.name == "sft_adapter":
            return reload_lora(folder, model_path, frozen_format or "int4", base)
        # PPO and DPO trained a fresh LoRA on the SFT model, merged, stored INT4 (PPO) or INT8 (DPO).
        sft = folder.parent / "sft_adapter"

        def merged() -> torch.nn.Module:
            return PeftModel.from_pretrained(base(), sft).merge_and_unload()

        stored = frozen_format or ("int4" if folder.name == "ppo_adapter" else "int8")
        return reload_lora(folder, model_path, stored, merged, merge_adapter=sft)
    return reload_lora(folder, model_path, frozen_format or "int4")


def prompt_ids(tok, prompt: str, layout: str) -> list[int]:
    """The prompt as one user turn of the chat template, when the tokenizer has one; else in `layout`."""
    if getattr(tok, "chat_template", None):
        turn = [{"role": "user", "content": prompt}]
        return tok.encode(tok.apply_chat_template(turn, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)  # fmt: skip
    return tok.encode(layout.format(prompt))


@torch.no_grad()
def answer(model, tok, ids: list[int], args, gen: torch.Generator) -> str:
    """Greedy (temperature 0) or sampled tokens until EOS or max_new_tokens; no KV cache, so a prefix is attached
    to every step as in training."""
    ids, new = torch.tensor([ids]), []
    for _ in range(args.max_new_tokens):
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1].float()
        if args.temperature > 0:
            probs = torch.softmax(logits / args.temperature, -1)
            if args.top_p < 1:  # nucleus: the smallest set of tokens whose probability reaches top_p
                sorted_probs, order = probs.sort(descending=True)
                outside = sorted_probs.cumsum(0) - sorted_probs > args.top_p
                probs[order[outside]] = 0
            token = int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
        else:
            token = int(logits.argmax())
        if token == tok.eos_token_id:
            break
        new.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], 1)
    return tok.decode(new, skip_special_tokens=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", type=Path, required=True, help="a recipe's --out-dir, or the adapter folder in it")
    parser.add_argument("--model", help="the checkpoint the recipe trained on (default: the recipe's tiny model)")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); default: one per line of stdin")
    parser.add_argument("--raw", action="store_true", help="the prompt verbatim, not in the recipe's layout")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: sampled")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--frozen-format", help="storage of the frozen base (default: the recipe's)")
    args = parser.parse_args()
    folder = find(args.path)
    # chatglm_ptuning.py's tiny GLM reads the words of its training rows: the vocabulary it saved beside the prefix.
    tok = (None if args.model else WordTokenizer.saved(folder)) or load_tokenizer(args.model)
    torch.manual_seed(args.seed)
    model = load(folder, args.model, args.frozen_format).eval()
    gen = torch.Generator().manual_seed(args.seed)
    layout = "{}" if args.raw else SAVED.get(folder.name, "{}")
    prompts = args.prompt or (line.rstrip("\n") for line in sys.stdin)
    for prompt in prompts:
        print(answer(model, tok, prompt_ids(tok, prompt, layout), args, gen), flush=True)


if __name__ == "__main__":
    main()
