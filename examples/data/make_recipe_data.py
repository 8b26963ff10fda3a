"""Write the small data sets the recipes train on (examples/lora_sft.py, chatglm_ptuning.py, rlhf.py).

    python examples/data/make_recipe_data.py        # rewrites the .jsonl files beside this script

Everything is templated from the tables below with fixed seeds, so the files are reproducible and the recipes
never download anything. Each file holds one JSON object per line with a "split" field. The held-out ("test") rows
ask for something the training rows never show, so a held-out score measures what was learned, not recall:

- arithmetic.jsonl: sums of two digits. The held-out rows are twenty ordered operand pairs training never shows
  (their commuted twins it does: "3 + 4" held out, "4 + 3" trained), each asked in eight wordings training never
  shows either: three new combinations of an opening, the operation and a closing, five with words no training row
  has.
- adgen_tiny.jsonl: attributes -> one line of ad copy that reuses them, phrased by the kind of garment. The held-out
  rows are the products of one colour per kind never seen with that kind in training (each colour and each kind
  is seen with others), so the copy must be put together from the attributes, not recalled.
- rlhf_sft.jsonl, rlhf_pairs.jsonl: a quarter of the (question, thing) pairs are held out.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

HERE = Path(__file__).parent

# -- arithmetic.jsonl (LoRA SFT): sums of two digits, each asked as an opening + the operation + a closing ---------
OPENINGS = ["What is ", "Compute ", "Calculate ", "Tell me ", "Work out ", "Find ", "Q: what is ", "Quick: ", "",
            "Hi! What is ", "Now find ", "Please compute ", "I need ", "Solve ", "Hey, what's ", "Give me ",
            "Can you tell me ", "Next: "]  # fmt: skip
OPERATIONS = ["{a} plus {b}", "{a} + {b}", "{a}+{b}", "the sum of {a} and {b}", "{b} added to {a}",
              "{a} and {b} added together", "{a} increased by {b}", "{a} plus {b} in total",
              "the total of {a} and {b}"]  # fmt: skip
CLOSINGS = ["? ", " = ", ": ", "? Answer: ", ". Result: ", " is ", "?\nA: ", ", please: ", " equals ", "? It is "]
# Held-out wordings with words no training row has ("How much", "add up", "makes", "you get", "with ... gives").
NEW_WORDINGS = ["How much is {a} plus {b}? ", "Please add up {a} and {b}: ", "Find {a} + {b}, it makes ",
                "Add {a} to {b} and you get ", "{a} with {b} added gives "]  # fmt: skip
HELD_PAIRS, WORDINGS_PER_PAIR = 20, 25  # operand pairs held out; wordings drawn for each training pair

# -- adgen_tiny.jsonl (P-Tuning v2): ChatGLM's ADGEN task in miniature, attributes -> one line of ad copy ------------
# Twelve kinds and twelve colours: with six of each, every error on a held-out product put the held-out kind or
# colour back to one training showed with the other (the one pair training never shows is the one a model learns
# never to write); with more of each, copying the attribute pays more than recalling which pairs go together.
KINDS = ["coat", "dress", "hat", "jacket", "shirt", "tunic", "skirt", "scarf", "sweater", "vest", "blouse", "cap"]
COLORS = ["red", "blue", "green", "white", "yellow", "pink", "black", "grey", "brown", "orange", "purple", "beige"]
STYLES = ["casual", "elegant", "sporty", "vintage"]
FITS = ["loose", "slim", "relaxed"]
# The phrasing is fixed by the kind (four kinds each), so the copy is one sentence a model can learn, not a coin toss.
PHRASINGS = ["{A} {style} {color} {kind} with a {fit} fit.", "This {color} {kind} is {style} and {fit}.",
             "{Style} and {fit}: the {color} {kind}."]  # fmt: skip
AD_TEMPLATES = {kind: PHRASINGS[i % len(PHRASINGS)] for i, kind in enumerate(KINDS)}  # fmt: skip

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
    # Held out in one order only: with both orders held out the tiny model learnt a table, not addition (measured:
    # held-out exact match 0.09 after 600 steps), so the held-out question is one whose commuted twin was trained.
    pairs = [(a, b) for a in range(10) for b in range(a + 1, 10)]
    held = {(a, b) if rng.random() < 0.5 else (b, a) for a, b in rng.sample(pairs, HELD_PAIRS)}
    wordings = [o + op + c for o in OPENINGS for op in OPERATIONS for c in CLOSINGS]
    rng.shuffle(wordings)
    held_wordings, train_wordings = wordings[:3] + NEW_WORDINGS, wordings[3:]
    rows = []
    for a, b in ((a, b) for a in range(10) for b in range(10) if (a, b) not in held):
        rows += [{"prompt": w.format(a=a, b=b), "response": str(a + b), "split": "train"}
                 for w in rng.sample(train_wordings, WORDINGS_PER_PAIR)]  # fmt: skip
    test = [{"prompt": w.format(a=a, b=b), "response": str(a + b), "split": "test"} for w in held_wordings
            for a, b in sorted(held)]  # fmt: skip
    rng.shuffle(rows)
    rng.shuffle(test)
    return test + rows


def adgen(rng: random.Random) -> list[dict]:
    held = dict(zip(KINDS, rng.sample(COLORS, len(KINDS)), strict=True))  # each kind's colour held out, a different one
    rows = []
    for kind, color, style, fit in itertools.product(KINDS, COLORS, STYLES, FITS):
        content = f"type#{kind}*color#{color}*style#{style}*fit#{fit}"
        words = {"kind": kind, "color": color, "style": style, "fit": fit, "Style": style.capitalize(),
                 "A": "An" if style[0] in "aeiou" else "A"}  # fmt: skip
        split = "test" if held[kind] == color else "train"
        rows.append({"content": content, "summary": AD_TEMPLATES[kind].format(**words), "split": split})
    rng.shuffle(rows)
    return sorted(rows, key=lambda r: r["split"] == "train")  # held-out rows first, as in the other files


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


def rlhf_rng() -> random.Random:
    """The generator `rlhf` has drawn from since these files were first written: seed 0, after the draws an earlier
    arithmetic (a shuffle of 500 rows) and ADGEN table (two choices of three for each of 144 rows, a shuffle) took
    from it, replayed so that rlhf_sft.jsonl and rlhf_pairs.jsonl stay byte for byte as they were."""
    rng = random.Random(0)
    rng.shuffle([None] * 500)
    for _ in range(144):
        rng.choice(range(3)), rng.choice(range(3))
    rng.shuffle([None] * 144)
    return rng


def main() -> None:
    write("arithmetic.jsonl", arithmetic(random.Random(1)))
    write("adgen_tiny.jsonl", adgen(random.Random(2)))
    sft, pairs = rlhf(rlhf_rng())
    write("rlhf_sft.jsonl", sft)
    write("rlhf_pairs.jsonl", pairs)


if __name__ == "__main__":
    main()
