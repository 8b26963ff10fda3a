"""What the recipes train on: JSON Lines in the formats the ecosystem uses, read, checked and tokenized in one place.

A data file holds one JSON object per line; its format is told from the first row's fields and every row must have
the same ones (other fields are ignored):

    SFT         {"prompt": ..., "response": ...}
    Alpaca      {"instruction": ..., "input": ..., "output": ...}           ("input" may be absent or "")
    chat        {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]}
    ADGEN       {"content": ..., "summary": ...}                             (ChatGLM's P-Tuning data)
    preference  {"prompt": ..., "chosen": ..., "rejected": ...}              (trl's reward/DPO format)

`--data PATH` names the training rows, `--eval-data PATH` the held-out ones; without it, `--eval-fraction` of the
training file (a fixed shuffle) is held out. Without `--data` a recipe reads its shipped file, whose "split" field
says which rows are held out. A file that is not JSON Lines, a row without a field of its format, or a field of the
wrong type is one line on stderr naming the file, the line and the field, and exit code 2, before any model is
built or process group started.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import NoReturn

import torch
from _recipe_common import pad

DATA = Path(__file__).resolve().parent / "data"

# Format name -> the fields every row of it must have (strings, but `messages`); tried in this order on row 1.
FORMATS = {
    "chat": ("messages",),
    "alpaca": ("instruction", "output"),
    "preference": ("prompt", "chosen", "rejected"),
    "adgen": ("content", "summary"),
    "sft": ("prompt", "response"),
}
SFT = ("sft", "alpaca", "chat")  # what the SFT recipes (and RLHF's SFT step) read
ROLES = ("system", "user", "assistant")


class DataError(ValueError):
    """A data file the recipe cannot read; the message is one line: where, what, and the fix."""


def describe(fmt: str) -> str:
    return "{instruction, input, output}" if fmt == "alpaca" else "{" + ", ".join(FORMATS[fmt]) + "}"


def _check_row(row: dict, fmt: str, where: str, ascii_only: bool) -> None:
    missing = [f for f in FORMATS[fmt] if f not in row]
    if missing:
        raise DataError(f"{where}: missing field {missing[0]!r}: every row needs the fields of line 1's format "
                        f"{describe(fmt)}")  # fmt: skip
    strings = [f for f in FORMATS[fmt] if f != "messages"] + (["input"] if fmt == "alpaca" and "input" in row else [])
    for field in strings:
        if not isinstance(row[field], str):
            raise DataError(f"{where}: field {field!r} is a {type(row[field]).__name__}, not a string")
    if fmt == "chat":
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: field 'messages' must be a non-empty list of {{role, content}} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
                raise DataError(f"{where}: field 'messages'[{i}] must be {{\"role\": one of {', '.join(ROLES)}, "
                                f"\"content\": a string}}")  # fmt: skip
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: field 'messages' has no assistant turn: nothing to learn from")
    if ascii_only:
        texts = [(f, row[f]) for f in FORMATS[fmt] if f != "messages"] + [("input", row.get("input") or "")]
        texts += [("messages", m["content"]) for m in row.get("messages", []) if fmt == "chat"]
        if bad := next((f for f, text in texts if not text.isascii()), None):
            raise DataError(f"{where}: field {bad!r} is not ASCII; the default tiny model reads bytes 0-127 only: "
                            "pass --model PATH (a checkpoint with its tokenizer) for such text")  # fmt: skip


def read_rows(path: str | Path, formats: tuple[str, ...], ascii_only: bool = False) -> tuple[str, list[dict]]:
    """The rows of a JSON Lines file and their format (one of `formats`, told from line 1); `ascii_only`: text
    the default byte-level tiny model (128 ids) can read.

    Raises:
        DataError: no such file, a line that is not a JSON object, a format not in `formats`, a row without one of
            the format's fields or with a field of the wrong type; the message names the file and the line.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file (expected JSON Lines: one JSON object per line)")
    rows, fmt = [], None
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except ValueError as e:
                raise DataError(f"{where}: not JSON Lines ({e}); write one JSON object per line") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: a JSON {type(row).__name__}, not an object; write one object per line")
            if fmt is None:
                fmt = next((name for name in FORMATS if all(f in row for f in FORMATS[name])), None)
                if fmt not in formats:
                    wanted = " or ".join(describe(f) for f in formats)
                    found = "{" + ", ".join(row) + "}"
                    raise DataError(f"{where}: fields {found}; this recipe reads rows of {wanted}")
            _check_row(row, fmt, where, ascii_only)
            rows.append(row)
    if not rows:
        raise DataError(f"{path}: no rows (expected JSON Lines: one JSON object per line)")
    return fmt, rows


def split_rows(rows: list[dict], fraction: float, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """A fixed shuffle; the first `fraction` (at least one row, never all) is held out."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    held = min(len(rows) - 1, max(1, round(fraction * len(rows))))
    return [rows[i] for i in order[held:]], [rows[i] for i in order[:held]]


def fail(flag: str, error: DataError) -> NoReturn:
    """One line on stderr, exit code 2 (argparse's, for a bad argument)."""
    sys.stderr.write(f"{Path(sys.argv[0]).name}: error: {flag} {error}\n")
    raise SystemExit(2)


def add_data_args(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--data", help=f"training rows, JSON Lines ({what}; default: the shipped data)")
    parser.add_argument("--eval-data", help="held-out rows, same formats (default: --eval-fraction of --data)")
    parser.add_argument("--eval-fraction", type=fraction, default=0.1, help="held out when --eval-data is absent")


def fraction(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not between 0 and 1 (exclusive)")
    return value


def load_rows(
    data: str | None,
    eval_data: str | None,
    eval_fraction: float,
    formats: tuple[str, ...],
    default: Path,
    ascii_only: bool = False,
    flags: tuple[str, str] = ("--data", "--eval-data"),
) -> tuple[list[dict], list[dict]]:
    """Training and held-out rows, normalized (see `normalize`): `data` and `eval_data` (or an `eval_fraction`
    split of `data`), else the shipped `default` file split by its "split" field; `ascii_only` as `read_rows`.
    A bad file: `fail`."""
    try:
        _, rows = read_rows(data or default, formats, ascii_only)
    except DataError as e:
        fail(flags[0], e)
    if not data:
        train, held_out = [r for r in rows if r.get("split") != "test"], [r for r in rows if r.get("split") == "test"]
    if eval_data:
        try:
            _, held_out = read_rows(eval_data, formats, ascii_only)
        except DataError as e:
            fail(flags[1], e)
        train = rows if data else train
    elif data:
        if len(rows) < 2:
            fail(flags[0], DataError(f"{data}: one row: nothing left to train on after holding some out; "
                                     "add rows or pass --eval-data"))  # fmt: skip
        train, held_out = split_rows(rows, eval_fraction)
    return [normalize(r) for r in train], [normalize(r) for r in held_out]


def prompt_text(row: dict) -> str:
    """What a normalized row asks: its prompt, or a chat row's last user turn (for printing)."""
    return row["prompt"] if "prompt" in row else [m for m in row["messages"] if m["role"] != "assistant"][-1]["content"]


def alpaca_prompt(instruction: str, context: str) -> str:
    # Alpaca's own template, without its preamble sentence (a tiny byte-level model pays for every byte).
    body = f"### Instruction:\n{instruction}\n\n" + (f"### Input:\n{context}\n\n" if context else "")
    return body + "### Response:\n"


def normalize(row: dict) -> dict:
    """Every SFT-like row as {"prompt", "response"} (chat rows keep "messages"; "response" is the last answer),
    preference rows as they are. ADGEN rows get ChatGLM-ADGEN's layout: the attributes, then "Ad: "."""
    if "messages" in row:
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        return {"messages": row["messages"], "response": answers[-1]}
    if "instruction" in row:
        return {"prompt": alpaca_prompt(row["instruction"], row.get("input") or ""), "response": row["output"]}
    if "content" in row and "summary" in row:
        return {"prompt": f"{row['content']}\nAd: ", "response": row["summary"]}
    if "chosen" in row:
        return {k: row[k] for k in ("prompt", "chosen", "rejected")}
    return {"prompt": row["prompt"], "response": row["response"]}


# -- tokenizing -----------------------------------------------------------------------------------------------------
def _chat_segments(tok, messages: list[dict]) -> list[tuple[str, bool]]:
    """The conversation as text pieces, each flagged if it is trained on (an assistant turn and what ends it).

    With a chat template: the template's text, cut where each assistant turn starts (the text of the turns before
    it with the generation prompt) and ends (the text up to and including it). Without one: "User: ...",
    "Assistant: " then the answer, EOS after each answer (added by `encode`)."""
    template = getattr(tok, "chat_template", None)
    if not template:
        pieces = []
        for m in messages:
            if m["role"] == "assistant":
                pieces += [("Assistant: ", False), (m["content"], True), ("\n", False)]  # EOS, then the newline
            else:
                pieces.append((f"{m['role'].capitalize()}: {m['content']}\n", False))
        return pieces

    def render(upto: int, generation: bool) -> str:
        return tok.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=generation)

    full, pieces, done = render(len(messages), False), [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, end = render(i, True), render(i + 1, False)
        if not (full.startswith(start) and full.startswith(end) and len(start) >= done):
            raise DataError("the tokenizer's chat template does not render a conversation as the text of its turns, "
                            "one after the other; use {prompt, response} rows with it")  # fmt: skip
        pieces += [(full[done : len(start)], False), (full[len(start) : len(end)], True)]
        done = len(end)
    return [*pieces, (full[done:], False)]


def row_texts(row: dict) -> list[str]:
    """The pieces of text `encode` tokenizes one by one (without a chat template): what a vocabulary built from the
    training rows (`_recipe_common.WordTokenizer`) is built from."""
    if "messages" not in row:
        return [row["prompt"], row["response"]]
    return [text for text, _ in _chat_segments(None, row["messages"])]


def encode(tok, row: dict) -> tuple[list[int], list[int], int]:
    """Token ids, labels (-100 where no loss is taken) and where the last answer starts: `ids[:start]` is the
    prompt a model answers at evaluation. Plain rows: BOS, prompt, response, EOS, the loss on response and EOS.
    Chat rows: the loss on every assistant turn only."""
    if "messages" not in row:
        prompt = tok.encode(row["prompt"])
        answer = [*tok.encode(row["response"], add_special_tokens=False), tok.eos_token_id]
        return prompt + answer, [-100] * len(prompt) + answer, len(prompt)
    templated = bool(getattr(tok, "chat_template", None))
    ids = [] if templated or tok.bos_token_id is None else [tok.bos_token_id]  # a template writes its own BOS
    labels, start = [-100] * len(ids), 0
    for text, trained in _chat_segments(tok, row["messages"]):
        piece = tok.encode(text, add_special_tokens=False) if text else []
        if trained:
            start = len(ids)
            if not templated:
                piece = [*piece, tok.eos_token_id]
        ids += piece
        labels += piece if trained else [-100] * len(piece)
    return ids, labels, start


def answer_tokens(tok, rows: list[dict], cap: int = 64) -> int:
    """New tokens enough for the longest answer and its EOS (at most `cap`): greedy decoding runs that many
    steps on every rank (each ZeRO-3 forward is a collective)."""
    return min(cap, max(len(tok.encode(r["response"], add_special_tokens=False)) for r in rows) + 1)


def sft_batch(tok, rows: list[dict], device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask and labels of `rows` (`encode`)."""
    encoded = [encode(tok, r) for r in rows]
    ids, mask = pad([e[0] for e in encoded], tok.pad_token_id, device)
    return ids, mask, pad([e[1] for e in encoded], -100, device)[0]


def answer_loss_sums(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[summed cross-entropy, token count] over the labelled tokens: summed over rows and ranks, then divided."""
    logits, target = logits[:, :-1].float(), labels[:, 1:]
    keep = target != -100
    loss = torch.nn.functional.cross_entropy(logits[keep], target[keep], reduction="sum")
    return torch.stack([loss, keep.sum().to(loss.dtype)])


def same_answer(generated: str, reference: str) -> bool:
    """Exact match, but for surrounding whitespace."""
    return generated.strip() == reference.strip()


class SftExamples:
    """Training rows drawn with replacement, `length` in all; loss only on the answers (`encode`). A map-style
    dataset: a DataLoader (and the samplers Lightning and Accelerate add) index it."""

    def __init__(self, rows: list[dict], length: int, tok, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.rows, self.tok = [rows[i] for i in torch.randint(len(rows), (length,), generator=gen).tolist()], tok

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[list[int], list[int]]:
        ids, labels, _ = encode(self.tok, self.rows[i])
        return ids, labels
