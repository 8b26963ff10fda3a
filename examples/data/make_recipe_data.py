"""Write the small data sets the recipes train on (examples/lora_sft.py, chatglm_ptuning.py, rlhf.py).

    python examples/data/make_recipe_data.py        # rewrites the .jsonl files beside this script

Everything is templated from the tables below with a fixed seed, so the files are reproducible and the recipes
never download anything. Each file holds one JSON object per line with a "split" field; the held-out rows are
new combinations of things the training rows show (a sum under another wording, a product with new attributes,
a question about a known thing asked another way), so a held-out score measures what was learned, not recall.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent

# -- arithmetic.jsonl (LoRA SFT): single-digit sums under five wordings; exact match on held-out wordings --------
SUM_TEMPLATES = ["What is {a} plus {b}? ", "{a} + {b} = ", "Add {a} and {b}: ", "Sum of {a} and {b} is ",
                 "{b} added to {a} makes "]  # fmt: skip

# -- adgen_tiny.jsonl (P-Tuning v2): ChatGLM's ADGEN task in miniature, attributes -> one line of ad copy ------------
KINDS = ["shirt", "dress", "coat", "skirt", "jacket", "sweater"]
COLORS = ["red", "blue", "black", "white", "green", "grey"]
STYLES = ["casual", "elegant", "sporty", "vintage"]
FITS = ["loose", "slim", "relaxed"]
AD_TEMPLATES = ["A {style} {color} {kind} with a {fit} fit.", "This {color} {kind} is {style} and {fit}.",
                "{Style} and {fit}: the {color} {kind}."]  # fmt: skip

# -- rlhf_sft.jsonl / rlhf_pairs.jsonl (RLHF): questions about the colour of things, answers good and bad ----------
THINGS = {"sky": "blue", "grass": "green", "snow": "white", "coal": "black", "lemon": "yellow", "tomato": "red",
          "sea": "blue", "leaf": "green", "milk": "white", "night": "black", "banana": "yellow", "cherry": "red",
          "cloud": "white", "frog": "green", "crow": "black", "sun": "yellow", "ruby": "red",
          "ink": "black"}  # fmt: skip
QUESTIONS = ["What color is the {t}?", "Tell me the color of the {t}.", "Which color has the {t}?",
             "The {t}: what color?"]  # fmt: skip
# The preferred answer is right and polite; each other kind is wrong, rude, or refuses.
ANSWERS = {
    "good": " It is {c}. Glad to help!",
    "wrong": " It is {w}. Glad to help!",
    "rude": " It is {c}. Go away.",
    "refuse": " I do not know. Go away.",
}
# The SFT demonstrations are as mixed as a web crawl: the preferred kind is only one answer in four.
SFT_MIX = {"good": 0.25, "wrong": 0.25, "rude": 0.3, "refuse": 0.2}


def write(name: str, rows: list[dict]) -> None:
    (HERE / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    counts = {s: sum(r["split"] == s for r in rows) for s in sorted({r["split"] for r in rows})}
    print(f"{name}: {len(rows)} rows {counts}")


def arithmetic(rng: random.Random) -> list[dict]:
    rows = [{"prompt": t.format(a=a, b=b), "response": str(a + b)} for t in SUM_TEMPLATES for a in range(10)
            for b in range(10)]  # fmt: skip
    rng.shuffle(rows)
    held = len(rows) // 5  # one row in five held out: its sum is almost always seen under another wording
    return [{**r, "split": "test" if i < held else "train"} for i, r in enumerate(rows)]


def adgen(rng: random.Random) -> list[dict]:
    rows = []
    for kind, color, style in ((k, c, s) for k in KINDS for c in COLORS for s in STYLES):
        fit = rng.choice(FITS)
        content = f"type#{kind}*color#{color}*style#{style}*fit#{fit}"
        words = {"kind": kind, "color": color, "style": style, "fit": fit, "Style": style.capitalize()}
        rows.append({"content": content, "summary": rng.choice(AD_TEMPLATES).format(**words)})
    rng.shuffle(rows)
    held = len(rows) // 6
    return [{**r, "split": "test" if i < held else "train"} for i, r in enumerate(rows)]


def answer(kind: str, thing: str, rng: random.Random) -> str:
    color = THINGS[thing]
    wrong = rng.choice(sorted({c for c in THINGS.values() if c != color}))
    return ANSWERS[kind].format(c=color, w=wrong)


def rlhf(rng: random.Random) -> tuple[list[dict], list[dict]]:
    prompts = [(q.format(t=t), t) for q in QUESTIONS for t in THINGS]
    rng.shuffle(prompts)
    held = set(range(len(prompts) // 4))  # a quarter of the (question, thing) pairs are held out everywhere
    sft, pairs = [], []
    kinds, weights = list(SFT_MIX), list(SFT_MIX.values())
    for i, (question, thing) in enumerate(prompts):
        split = "test" if i in held else "train"
        prompt = f"Human: {question}\nAssistant:"
        for _ in range(3):  # three demonstrations per prompt, drawn from the mix
            sft.append(
                {"prompt": prompt, "response": answer(rng.choices(kinds, weights)[0], thing, rng), "split": split}
            )
        for bad in ("wrong", "rude", "refuse"):  # the preferred answer against each kind of bad one
            pairs.append({"prompt": prompt, "chosen": answer("good", thing, rng), "rejected": answer(bad, thing, rng),
                          "split": split})  # fmt: skip
    return sft, pairs


def main() -> None:
    rng = random.Random(0)
    write("arithmetic.jsonl", arithmetic(rng))
    write("adgen_tiny.jsonl", adgen(rng))
    sft, pairs = rlhf(rng)
    write("rlhf_sft.jsonl", sft)
    write("rlhf_pairs.jsonl", pairs)


if __name__ == "__main__":
    main()
