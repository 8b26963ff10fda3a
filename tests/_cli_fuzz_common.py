"""Shared pieces of the CLI fuzz tests: the fixtures (input files; benchmarks that must never start), the runner
that captures one command's exit code and stderr, and hypothesis strategies for values that must be refused."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st

from ds_plugin.cli import load_benchmark, main

MAX = 2**31 - 1
FAST = settings(max_examples=40, deadline=None)
CHAOS = settings(max_examples=25, deadline=None)

# The function each benchmark's `main` calls to do the work.
WORK = {
    "big-model": "run",
    "comm": "run",
    "fp8": "benchmark",
    "generate": "run",
    "kernels": "benchmark",
    "kernel-resources": "report",
    "lora-memory": "run",
    "peers": "run",
    "quantize": "benchmark",
    "slow-link": "benchmark",
    "zero-memory": "run",
}


def _would_have_run(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("would have run the benchmark: the generated command line was valid")


@pytest.fixture(scope="module", autouse=True, name="no_benchmark_runs")
def no_runs_fixture() -> Iterator[None]:
    # The harnesses come from the checkout's benchmarks/ package, as `ds-plugin bench` imports them.
    with pytest.MonkeyPatch.context() as mp:
        for name, func in WORK.items():
            mp.setattr(load_benchmark(name), func, _would_have_run)
        yield


@pytest.fixture(scope="module", name="files")
def files_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Short paths (so messages quote them whole) to hostile inputs; the tests run inside their folder."""
    root = tmp_path_factory.mktemp("fuzz")
    (root / "dir").mkdir()
    (root / "empty_ckpt").mkdir()
    (root / "bad_ckpt").mkdir()
    (root / "bad_ckpt" / "ds_plugin_checkpoint.json").write_text('{"format": "other"}')
    contents: dict[str, str | bytes] = {
        "ok.json": '{"zero_optimization": {"stage": 2}}',
        "hf.json": json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 10}),
        "text.json": "this is not JSON",
        "binary.json": b"\xff\xfe\x00garbage",
        "list.json": "[1, 2]",
        "deep.json": "[" * 50_000 + "]" * 50_000,
        "bad.yaml": "zero_optimization:\n  stage: [1\n",
        "stage7.json": '{"zero_optimization": {"stage": 7}}',
        "typo.json": '{"zero_optimization": {"stagee": 2}}',
        "hf_empty.json": "{}",
        "hf_str.json": '{"hidden_size": "64", "num_hidden_layers": 2, "vocab_size": 10}',
        "hf_zero_heads.json": '{"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 10, "num_attention_heads": 0}',
        "hf_huge.json": '{"hidden_size": 1' + "0" * 400 + ', "num_hidden_layers": 2, "vocab_size": 10}',
        "plain_file": "x",
    }
    for name, data in contents.items():
        path = root / name
        path.write_bytes(data) if isinstance(data, bytes) else path.write_text(data)
    # Random relative names then name nothing that exists. (MonkeyPatch.chdir, not contextlib.chdir: Python 3.10.)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        yield {name: name for name in [*contents, "dir", "empty_ckpt", "bad_ckpt"]}


def run_cli(argv: list[str]) -> tuple[Any, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def assert_one_line_error(argv: list[str], *names: str) -> str:
    """Run `argv`; it must fail with exit code 2 and one `error` line on stderr naming each of `names`."""
    code, out, err = run_cli(argv)
    assert code == 2, (argv, code, out, err)
    assert "Traceback" not in err and out == "", (argv, out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n") and lines[0].strip(), (argv, err)
    assert lines[0].startswith("ds-plugin") and ": error: " in lines[0], (argv, err)
    for name in names:
        assert name in lines[0], (argv, name, err)
    return lines[0]


# -- what is invalid, decided without the code under test ------------------------------------------------------
def _int_ok(text: str, lo: int, hi: int) -> bool:
    try:
        return lo <= int(text) <= hi
    except ValueError:
        return False


def _float_ok(text: str, lo: float, hi: float, above: bool) -> bool:
    try:
        value = float(text)
    except ValueError:
        return False
    return math.isfinite(value) and (value > lo if above else value >= lo) and value <= hi


def _list_ok(text: str, choices: tuple[str, ...]) -> bool:
    names = [n.strip() for n in text.split(",") if n.strip()]
    return bool(names) and all(n in choices for n in names)


def _shapes_ok(text: str) -> bool:
    items = [s.strip().lower() for s in text.split(",") if s.strip()]
    for item in items:
        m = re.fullmatch(r"\s*([0-9]+)\s*x\s*([0-9]+)\s*", item)
        if not m or not (_int_ok(m[1], 1, MAX) and _int_ok(m[2], 128, MAX) and int(m[2]) % 128 == 0):
            return False
    return bool(items)


def _ms_ok(text: str) -> bool:
    items = [s for s in text.split(",") if s.strip()]
    return bool(items) and all(_int_ok(s, 1, MAX) for s in items)


def _is_help(token: str) -> bool:
    return token.startswith("-h") or token.startswith("--h")


# Any text but NUL (a real command line cannot carry it) and help requests (which exit 0 by design).
junk = st.text(st.characters(blacklist_characters="\x00"), max_size=12).filter(lambda t: not _is_help(t))
JUNK_NUMBERS = ["", " ", "1.5", "1e3", "nan", "NaN", "inf", "-inf", "1e999", "0x10", "ten", "1,000", "9" * 5000]


def bad_int(lo: int = 1, hi: int = MAX) -> st.SearchStrategy[str]:
    return st.one_of(
        st.integers(max_value=lo - 1).map(str),
        st.integers(min_value=hi + 1, max_value=10**60).map(str),
        st.sampled_from(JUNK_NUMBERS),
        st.floats().map(repr),
        junk,
    ).filter(lambda s: not _int_ok(s, lo, hi))


def bad_float(lo: float, hi: float, above: bool = False) -> st.SearchStrategy[str]:
    return st.one_of(
        st.floats(max_value=lo).map(repr),
        st.floats(min_value=hi).map(repr),
        st.sampled_from(JUNK_NUMBERS),
        junk,
    ).filter(lambda s: not _float_ok(s, lo, hi, above))


def bad_choice(choices: tuple[str, ...]) -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from([c.upper() for c in choices] + ["", " "]), junk).filter(lambda s: s not in choices)


def bad_list(choices: tuple[str, ...]) -> st.SearchStrategy[str]:
    spoiled = st.lists(st.sampled_from(choices), max_size=3).flatmap(
        lambda names: junk.map(lambda j: ",".join([*names, j]))
    )
    return st.one_of(spoiled, st.sampled_from([",", " , ", ""]), junk).filter(lambda s: not _list_ok(s, choices))


BAD_OUTPUTS = ["", "dir", "plain_file/report.json", "plain_file/sub/report.json"]
bad_output = st.sampled_from(BAD_OUTPUTS)
bad_output_dir = st.sampled_from(["", "plain_file", "plain_file/sub"])
bad_tc = st.one_of(
    st.sampled_from(["", "0bit", "0", "1..2gbit", "-5mbit", "fast", "1 gigabit", "nan", "1e3ms", "10 parsecs"]),
    junk.filter(lambda s: not re.fullmatch(r"[0-9.]*[a-z]*", s.strip().lower())),
)


def _unknown_flag(known: list[str]) -> st.SearchStrategy[str]:
    # Not a prefix of a real flag: argparse takes unambiguous abbreviations (`--st` for `--steps`).
    names = st.from_regex(r"--[a-z][a-z0-9-]{0,10}", fullmatch=True)
    return names.filter(lambda f: not _is_help(f) and not any(k.startswith(f) for k in known))
