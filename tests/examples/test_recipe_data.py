"""The recipes' `--data` path (examples/_recipe_data.py): every format each recipe reads, tokenized with the loss
where it belongs, and every bad file a one-line error (file, line, field) with exit code 2 before any process group
starts. All in this process: each recipe's `__main__` runs with `runpy` and stops at its data check."""

from __future__ import annotations

import importlib
import itertools
import json
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from test_examples import EXAMPLES, fails_with_one_line, tiny_checkpoint

ROWS = {  # one good row of each format
    "sft": {"prompt": "What is 2 plus 3? ", "response": "5"},
    "alpaca": {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
    "chat": {"messages": [{"role": "user", "content": "2 plus 3?"}, {"role": "assistant", "content": "5"}]},
    "adgen": {"content": "type#shirt*color#red", "summary": "A red shirt."},
    "preference": {"prompt": "Colour of snow?", "chosen": " White.", "rejected": " Go away."},
}
# Each recipe, the formats it reads, and the arguments that make it read --data.
READS = {
    "lora_sft.py": (["sft", "alpaca", "chat"], []),
    "accelerate_lora_sft.py": (["sft", "alpaca", "chat"], []),
    "chatglm_ptuning.py": (["adgen", "sft", "alpaca", "chat"], []),
    "rlhf.py": (["preference"], ["--step", "reward"]),
}
CASES = [(script, fmt) for script, (formats, _) in READS.items() for fmt in formats] + [("rlhf.py", "sft")]


@pytest.fixture
def data_module(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return importlib.import_module("_recipe_data")


def write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def run_fails(script: str, args: list[str], tmp_path, monkeypatch, capsys) -> str:
    out = tmp_path / "out"
    err = fails_with_one_line(script, [*args, "--smoke", "--out-dir", str(out)], monkeypatch, capsys)
    assert not dist.is_initialized() and not out.exists()  # before any process group, nothing written
    return err


@pytest.mark.parametrize(("script", "fmt"), CASES)
def test_a_row_missing_a_field(script, fmt, tmp_path, monkeypatch, capsys):
    extra = ["--step", "sft"] if (script, fmt) == ("rlhf.py", "sft") else READS[script][1]
    good = ROWS[fmt]
    field = next(iter(good))  # drop the format's first field from row 3
    data = write(tmp_path / "train.jsonl", [good, good, {k: v for k, v in good.items() if k != field}])
    err = run_fails(script, ["--data", str(data), *extra], tmp_path, monkeypatch, capsys)
    assert err.startswith(f"{script}: error: --data {data}:3: missing field {field!r}"), err
    # The held-out file is checked the same way, and named as such: here a field of the wrong type.
    ok = write(tmp_path / "ok.jsonl", [good, good])
    bad_eval = write(tmp_path / "eval.jsonl", [good, {**good, field: 7} if field != "messages" else {"messages": []}])
    err = run_fails(script, ["--data", str(ok), "--eval-data", str(bad_eval), *extra], tmp_path, monkeypatch, capsys)
    assert err.startswith(f"{script}: error: --eval-data {bad_eval}:2: field {field!r}"), err


@pytest.mark.parametrize("script", list(READS))
def test_not_json_lines(script, tmp_path, monkeypatch, capsys):
    extra = READS[script][1]
    good = ROWS[READS[script][0][0]]
    pretty = tmp_path / "data.json"  # a JSON document spread over lines, not one object per line
    pretty.write_text(json.dumps([good], indent=2))
    err = run_fails(script, ["--data", str(pretty), *extra], tmp_path, monkeypatch, capsys)
    assert f"--data {pretty}:1: " in err and "one JSON object per line" in err, err
    other = write(tmp_path / "other.jsonl", [{"question": "?", "answer": "!"}])  # JSON Lines, but no known format
    err = run_fails(script, ["--data", str(other), *extra], tmp_path, monkeypatch, capsys)
    assert f"--data {other}:1: fields {{question, answer}}; this recipe reads rows of " in err, err
    err = run_fails(script, ["--data", str(tmp_path / "missing.jsonl"), *extra], tmp_path, monkeypatch, capsys)
    assert err.endswith("missing.jsonl: no such file (expected JSON Lines: one JSON object per line)"), err


def test_rlhf_data_flags(tmp_path, monkeypatch, capsys):
    sft = write(tmp_path / "sft.jsonl", [ROWS["sft"]] * 2)
    err = run_fails("rlhf.py", ["--data", str(sft)], tmp_path, monkeypatch, capsys)  # --step all
    assert err == "rlhf.py: error: --data feeds the step --step names; with --step all pass --sft-data and --pref-data"
    # --step all: SFT rows where preference rows belong is named by its flag.
    err = run_fails("rlhf.py", ["--sft-data", str(sft), "--pref-data", str(sft)], tmp_path, monkeypatch, capsys)
    assert err.startswith(f"rlhf.py: error: --pref-data {sft}:1: fields {{prompt, response}}; this recipe reads rows "
                          "of {prompt, chosen, rejected}"), err  # fmt: skip


def test_non_ascii_needs_a_tokenizer(tmp_path, monkeypatch, capsys):
    data = write(tmp_path / "adgen.jsonl", [ROWS["adgen"], {"content": "类型#上衣", "summary": "红色上衣"}])
    err = run_fails("chatglm_ptuning.py", ["--data", str(data)], tmp_path, monkeypatch, capsys)
    assert f"--data {data}:2: field 'content' is not ASCII" in err and "pass --model PATH" in err, err


def test_formats_and_splits(data_module, tmp_path):
    d = data_module
    for fmt, row in ROWS.items():
        assert d.read_rows(write(tmp_path / f"{fmt}.jsonl", [row]), tuple(ROWS)) == (fmt, [row])
    rows = [{"prompt": str(i), "response": str(i)} for i in range(50)]
    train, held = d.load_rows(str(write(tmp_path / "many.jsonl", rows)), None, 0.2, d.SFT, Path("unused"))
    assert len(held) == 10 and len(train) == 40 and not {r["prompt"] for r in held} & {r["prompt"] for r in train}
    assert d.load_rows(str(tmp_path / "many.jsonl"), None, 0.2, d.SFT, Path("unused"))[1] == held  # a fixed shuffle
    # Without --data: the shipped file, split by its "split" field.
    train, held = d.load_rows(None, None, 0.1, d.SFT, d.DATA / "arithmetic.jsonl")
    assert (len(train), len(held)) == (2000, 160) and held[0] == {"prompt": "How much is 7 plus 9? ", "response": "16"}
    alpaca = d.normalize(ROWS["alpaca"])
    assert alpaca == {"prompt": "### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 3\n\n### Response:\n",
                      "response": "5"}  # fmt: skip


def arithmetic_questions() -> dict[str, tuple[tuple[int, int], str]]:
    """Every question examples/data/make_recipe_data.py can write -> its operands (a, b) and its wording: the
    operands in the order the sum is asked ("{b} added to {a}" writes b first), which the text alone does not tell."""
    spec = importlib.util.spec_from_file_location("make_recipe_data", EXAMPLES / "data/make_recipe_data.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    wordings = [o + op + c for o in gen.OPENINGS for op in gen.OPERATIONS for c in gen.CLOSINGS] + gen.NEW_WORDINGS
    questions = {}
    for w in wordings:
        for a, b in itertools.product(range(10), repeat=2):
            text = w.format(a=a, b=b)
            assert questions.setdefault(text, ((a, b), w)) == ((a, b), w), text  # no text asks two things
    return questions


def test_shipped_held_out_rows_are_unseen(data_module):
    # The held-out rows ask for what training never shows, so their scores measure generalisation, not recall.
    d = data_module
    train, held = d.load_rows(None, None, 0.1, d.SFT, d.DATA / "arithmetic.jsonl")
    questions = arithmetic_questions()
    assert all(sum(questions[r["prompt"]][0]) == int(r["response"]) for r in train + held)
    seen_pairs, seen_wordings = map(set, zip(*(questions[r["prompt"]] for r in train), strict=True))
    held_pairs, held_wordings = map(set, zip(*(questions[r["prompt"]] for r in held), strict=True))
    assert len(held_pairs) == 20 and not held_pairs & seen_pairs, held_pairs & seen_pairs  # never asked in training
    assert {pair[::-1] for pair in held_pairs} <= seen_pairs  # their commuted twins are (as the README says)
    assert len(held_wordings) == 8 and not held_wordings & seen_wordings, held_wordings & seen_wordings
    assert len(held) == len(held_pairs) * len(held_wordings)  # every held-out pair in every held-out wording

    # ADGEN: each held-out product pairs a kind with a colour training never shows with that kind (one colour per
    # kind, each colour held out with one kind); the kind, the colour and every other attribute value are each seen
    # in training, with other values.
    train, held = d.load_rows(None, None, 0.1, ("adgen",), d.DATA / "adgen_tiny.jsonl")

    def attributes(row: dict) -> dict[str, str]:
        content = row["prompt"].removesuffix("\nAd: ")
        return dict(item.split("#") for item in content.split("*"))

    seen = [attributes(r) for r in train]
    unseen = [attributes(r) for r in held]
    seen_products = {(a["type"], a["color"]) for a in seen}
    held_products = {(a["type"], a["color"]) for a in unseen}
    assert len(held_products) == 12 and not held_products & seen_products, held_products & seen_products
    assert len({k for k, _ in held_products}) == len({c for _, c in held_products}) == 12, held_products
    for field in ("type", "color", "style", "fit"):
        assert {a[field] for a in unseen} <= {a[field] for a in seen}, field
    # The ad copy reuses every attribute value of its row.
    assert all(a[f] in r["response"].lower() for r, a in zip(held, unseen, strict=True) for f in a), held[:2]


def test_encode_puts_the_loss_on_answers_only(data_module, tmp_path, monkeypatch):
    d = data_module
    common = importlib.import_module("_recipe_common")
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"},
                         {"role": "assistant", "content": "4"}]}  # fmt: skip
    byte = common.ByteTokenizer()
    ids, labels, start = d.encode(byte, d.normalize(chat))  # no chat template: "Role: text" lines
    assert byte.decode(ids[:start]) == "\x01System: Be brief.\nUser: Hi\nAssistant: Hello\x02\nUser: 2+2?\nAssistant: "
    assert [i for i, label in zip(ids, labels, strict=True) if label != -100] == [*b"Hello", 2, *b"4", 2]
    ids, labels, start = d.encode(byte, ROWS["sft"])
    assert labels == [-100] * start + [*b"5", 2] and ids[:start] == byte.encode("What is 2 plus 3? ")

    # A tokenizer with a chat template: the template's text, the loss on each answer and the end of its turn.
    tiny_checkpoint(tmp_path / "model")
    tok = common.load_tokenizer(str(tmp_path / "model"))
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% if m['role'] == 'assistant' %}</s>"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    ids, labels, start = d.encode(tok, d.normalize(chat))
    assert tok.decode(ids) == "<|system|>Be brief.<|user|>Hi<|assistant|>Hello</s><|user|>2+2?<|assistant|>4</s>"
    trained = [tok.decode([i]) for i, label in zip(ids, labels, strict=True) if label != -100]
    assert "".join(trained) == "Hello</s>4</s>", trained
    assert tok.decode(ids[:start]).endswith("<|user|>2+2?<|assistant|>")


def test_word_tokenizer(data_module, tmp_path, monkeypatch, capsys):
    # The P-Tuning recipe's default tokens: the words of the training rows, whole; everything else as bytes.
    d, common = data_module, importlib.import_module("_recipe_common")
    train, held = d.load_rows(None, None, 0.1, ("adgen",), d.DATA / "adgen_tiny.jsonl")
    tok = common.WordTokenizer.build(text for row in train for text in d.row_texts(row))
    pieces = {p for row in train for text in d.row_texts(row) for p in tok.PIECES.findall(text)}
    assert set(tok.words) == {p for p in pieces if len(p) > 1} and tok.vocab_size == 128 + len(tok.words)
    for row in train[:20] + held:  # every held-out word is a training word: one token each, spelled back exactly
        ids, _, start = d.encode(tok, row)
        assert tok.decode(ids, skip_special_tokens=True) == row["prompt"] + row["response"], row
        assert len(ids[start:]) == len(row["response"].split()) + row["response"].count(":") + 2, ids  # "." and EOS
    assert tok.encode(" red coat", add_special_tokens=False) == [tok.ids[" red"], tok.ids[" coat"]]
    # Unknown words and numbers as bytes (digits one by one), non-ASCII as "?", and back.
    assert tok.encode("Zed 42", add_special_tokens=False) == [*b"Zed 42"]
    assert tok.decode(tok.encode("Hello wörld"), skip_special_tokens=True) == "Hello w?rld"
    tok.save(tmp_path)
    assert common.WordTokenizer.saved(tmp_path).words == tok.words
    assert common.WordTokenizer.saved(tmp_path / "elsewhere") is None
    # The flag chooses the tiny GLM's tokens; with --model (its own tokenizer) it is a one-line error.
    err = fails_with_one_line("chatglm_ptuning.py", ["--model", str(tmp_path), "--tokenizer", "bytes"], monkeypatch,
                              capsys)  # fmt: skip
    assert (
        err == "chatglm_ptuning.py: error: --tokenizer bytes: --model uses its own tokenizer; --tokenizer "
        "chooses the tiny GLM's"
    ), err


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
