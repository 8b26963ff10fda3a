"""Data sets the recipes have never seen, one per format, for `--data` / `--eval-data` runs.

    python tests/examples/unseen_data.py DIR        # writes DIR/<name>.train.jsonl and DIR/<name>.test.jsonl

- `reverse_chat` (chat, SFT recipes): a system turn and two exchanges asking for a made-up word spelled backwards;
  the held-out words never occur in training.
- `people_adgen` (ADGEN, P-Tuning): "name#Ann*age#31*city#Oslo" -> "Ann is 31 and lives in Oslo."; the held-out
  rows are combinations of name, age and city absent from training.
- `fruit_alpaca` (Alpaca, RLHF's SFT step): "Name the colour of this fruit." with the fruit as input.
- `tone_pairs` (preference, reward model and DPO): a calm answer preferred to the same words shouted; held-out
  prompts ask about other things.

Reproducible (fixed seeds); nothing is downloaded.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def reverse_chat(rng: random.Random) -> tuple[list[dict], list[dict]]:
    words = sorted({"".join(rng.choices(LETTERS, k=rng.randint(3, 5))) for _ in range(600)})
    rng.shuffle(words)
    train_words, held_words = words[:400], words[400:440]

    def row(word: str) -> dict:
        other = rng.choice(train_words)  # the first exchange shows the task on a training word
        return {"messages": [{"role": "system", "content": "Answer in one word."},
                             {"role": "user", "content": f"Spell backwards: {other}"},
                             {"role": "assistant", "content": other[::-1]},
                             {"role": "user", "content": f"Spell backwards: {word}"},
                             {"role": "assistant", "content": word[::-1]}]}  # fmt: skip

    return [row(w) for w in train_words], [row(w) for w in held_words]


def people_adgen(rng: random.Random) -> tuple[list[dict], list[dict]]:
    names = ["Ann", "Bob", "Cleo", "Dev", "Eva", "Finn", "Gus", "Hana"]
    cities = ["Oslo", "Lima", "Rome", "Kyiv", "Pune", "Nice"]
    rows = [{"content": f"name#{n}*age#{a}*city#{c}", "summary": f"{n} is {a} and lives in {c}."}
            for n in names for c in cities for a in (rng.randint(18, 80),)]  # fmt: skip
    rng.shuffle(rows)
    return rows[8:], rows[:8]


def fruit_alpaca(rng: random.Random) -> tuple[list[dict], list[dict]]:
    fruits = {"lime": "green", "plum": "purple", "kiwi": "brown", "peach": "orange", "grape": "purple",
              "apple": "red", "pear": "green", "mango": "orange", "fig": "purple", "date": "brown"}  # fmt: skip
    asks = ["Name the colour of this fruit.", "What colour is it?", "Give the fruit's colour."]
    rows = [{"instruction": ask, "input": f"a {f}", "output": f"It is {c}."} for f, c in fruits.items() for ask in asks]
    rng.shuffle(rows)
    return rows[6:], rows[:6]


def tone_pairs(rng: random.Random) -> tuple[list[dict], list[dict]]:
    things = ["a fruit", "a tree", "a bird", "a river", "a city", "a metal", "a planet", "a colour", "a tool",
              "a fish", "a flower", "a stone", "a song", "a game", "a boat", "a star"]  # fmt: skip
    answers = ["here is one for you", "happy to name one", "sure, one comes to mind", "let me think of one"]
    rows = []
    for thing in things:
        for answer in answers:
            calm = f" {answer.capitalize()}."
            rows.append({"prompt": f"Q: Name {thing}.\nA:", "chosen": calm, "rejected": f" {answer.upper()}!!!"})
    held = set(rng.sample(things, 4))  # prompts about these things only in the held-out rows
    return [r for r in rows if r["prompt"][8:-4] not in held], [r for r in rows if r["prompt"][8:-4] in held]


SETS = {"reverse_chat": reverse_chat, "people_adgen": people_adgen, "fruit_alpaca": fruit_alpaca,
        "tone_pairs": tone_pairs}  # fmt: skip


def write(where: Path, name: str) -> tuple[Path, Path]:
    """DIR/<name>.train.jsonl and DIR/<name>.test.jsonl."""
    where.mkdir(parents=True, exist_ok=True)
    paths = where / f"{name}.train.jsonl", where / f"{name}.test.jsonl"
    for path, rows in zip(paths, SETS[name](random.Random(7)), strict=True):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


if __name__ == "__main__":
    for name in SETS:
        print(*write(Path(sys.argv[1]), name))
