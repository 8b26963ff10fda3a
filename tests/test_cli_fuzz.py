"""Hostile command lines and input files for every `ds-plugin` subcommand and benchmark.

Whatever the input, a mistake ends in exit code 2 and exactly one line on stderr that says `error` and names the
flag, argument, file or config key at fault; never a traceback. Only inputs that must fail are generated, and
every benchmark's work function is replaced by one that raises: a valid command line that slipped through fails
the test instead of starting minutes of work.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_plugin.cli import BENCHMARKS, load_benchmark, main
from ds_plugin.presets import PRESETS

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


@pytest.fixture(scope="module", autouse=True)
def no_benchmark_runs() -> Iterator[None]:
    # The harnesses come from the checkout's benchmarks/ package, as `ds-plugin bench` imports them.
    with pytest.MonkeyPatch.context() as mp:
        for name, func in WORK.items():
            mp.setattr(load_benchmark(name), func, _would_have_run)
        yield


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
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
    with contextlib.chdir(root):  # random relative names then name nothing that exists
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


# -- every flag of every command: (valid base values, invalid values) ------------------------------------------
Spec = dict[str, tuple[list[str], st.SearchStrategy[str]]]
WEEK = 7 * 24 * 3600.0
RECIPES = ("tensorwise", "rowwise", "blockwise")

BENCH_FLAGS: dict[str, Spec] = {
    "big-model": {
        "--format": (["int4", "nf4"], bad_choice(("int4", "nf4"))),
        "--layers": (["1"], bad_int()),
        "--hidden": (["256"], bad_int()),
        "--intermediate": (["688"], bad_int()),
        "--vocab": (["1000"], bad_int()),
        "--heads": (["4"], bad_int()),
        "--world-size": (["2"], bad_int(1, 1024)),
        "--device": (["cpu", "cuda"], bad_choice(("cpu", "cuda"))),
        "--seq": (["64"], bad_int()),
        "--steps": (["2"], bad_int(2)),
        "--adapter-dir": (["new_adapters"], bad_output_dir),
        "--out": (["new/big.json"], bad_output),
        "--timeout": (["600"], bad_float(0, WEEK, above=True)),
    },
    "generate": {
        "--world-size": (["2"], bad_int(1, 1024)),
        "--hidden": (["64"], bad_int()),
        "--layers": (["2"], bad_int()),
        "--vocab": (["256"], bad_int()),
        "--batch": (["1"], bad_int()),
        "--prompt": (["4"], bad_int()),
        "--new-tokens": (["4"], bad_int()),
        "--repeats": (["1"], bad_int()),
        "--out": (["new/generate.json"], bad_output),
    },
    "comm": {
        "--steps": (["1", "2"], bad_int()),
        "--n-layer": (["2"], bad_int()),
        "--n-embd": (["128", "256"], st.one_of(bad_int(), st.sampled_from(["6", "130"]))),
        "--seq": (["64"], bad_int()),
        "--out": (["new/report.json"], bad_output),
    },
    "fp8": {
        "--hidden": (["256"], bad_int()),
        "--layers": (["2"], bad_int()),
        "--steps": (["6"], bad_int()),
        "--batch-tokens": (["512"], bad_int()),
        "--recipes": (["rowwise", "tensorwise,blockwise"], bad_list(RECIPES)),
    },
    "kernels": {
        "--m": (
            ["1,16"],
            st.one_of(st.sampled_from(["", ",", "0", "-1", "1,a", "1.5"]), junk).filter(lambda s: not _ms_ok(s)),
        ),
        "--shapes": (
            ["8192x8192", "256x128,128x256"],
            st.one_of(
                st.sampled_from(["8192x100", "8192", "1x2x128", "0x128", "x128", "", "8192xx8192", "1x" + "1" * 5000]),
                junk,
            ).filter(lambda s: not _shapes_ok(s)),
        ),
        "--formats": (["int4", "fp6,int8"], bad_list(("fp6", "int4", "int8"))),
        "--out-dir": (["new_results"], bad_output_dir),
    },
    "kernel-resources": {"--arch": (["90", "80"], bad_int(70, 200)), "--out": (["new/res.json"], bad_output)},
    "lora-memory": {
        "--world-size": (["2"], bad_int(1, 1024)),
        "--size": (["tiny", "100m"], bad_choice(("100m", "tiny"))),
        "--hidden": (["128", "64"], st.one_of(bad_int(), st.sampled_from(["1", "3", "130"]))),
        "--layers": (["2"], bad_int()),
        "--seq": (["16"], bad_int()),
        "--batch": (["1"], bad_int()),
        "--steps": (["2", "3"], bad_int(2)),
        "--runs": (["bf16", "int4,nf4"], bad_list(("bf16", "int8", "int4", "nf4", "bnb_qlora"))),
        "--out": (["new/lora.json"], bad_output),
        "--png": (["new/lora.png"], bad_output),
    },
    "peers": {
        "--names": (["ddp"], bad_choice(("ddp", "fsdp2", "ds_plugin_zero1", "ds_plugin_zero3"))),
        "--dtypes": (["bf16"], bad_choice(("bf16", "fp32"))),
        "--sizes": (["16m", "350m"], bad_choice(("16m", "124m", "350m"))),
        "--world-sizes": (["1", "4"], bad_int(1, 1024)),
        "--warmup": (["0", "3"], bad_int(0)),
        "--steps": (["12"], bad_int()),
        "--repeats": (["1"], bad_int()),
        "--timeout": (["900", "0.5"], bad_float(0, WEEK, above=True)),
        "--out": (["new/peers.json"], bad_output),
        "--png": (["new/peers.png"], bad_output),
        "--host-memory-reuse": (["on", "off"], bad_choice(("on", "off"))),
    },
    "quantize": {
        "--rows": (["8", "1"], bad_int()),
        "--repeats": (["1"], bad_int()),
        "--threads": (["1", "2"], bad_int()),
        "--device": (["cpu"], bad_choice(("cpu", "cuda"))),
    },
    "slow-link": {
        "--hidden": (["64"], bad_int()),
        "--layers": (["1"], bad_int()),
        "--batch": (["8"], bad_int()),
        "--steps": (["5"], bad_int()),
        "--warmup": (["0"], bad_int(0)),
        "--rate": (["1gbit", "100mbit"], bad_tc),
        "--burst": (["256kb"], bad_tc),
        "--latency": (["100ms"], bad_tc),
        "--delay-ms": (["0", "0.5"], bad_float(0, 60_000)),
        "--timeout": (["600"], bad_float(0, WEEK, above=True)),
        "--configs": (
            ["zero3", "zeropp, hpz"],
            bad_list(("zero3", "zeropp", "hpz", "deepspeed_zero3", "deepspeed_hpz", "deepspeed_zeropp")),
        ),
        "--host-memory-reuse": (["on"], bad_choice(("on", "off"))),
    },
    "zero-memory": {
        "--world-size": (["4"], bad_int(1, 1024)),
        "--n-layer": (["2"], bad_int()),
        "--n-embd": (["128"], st.one_of(bad_int(), st.sampled_from(["4", "100"]))),
        "--vocab": (["1024"], bad_int()),
        "--seq": (["32"], bad_int()),
        "--batch": (["1"], bad_int()),
        "--steps": (["2"], bad_int(2)),
        "--out": (["new/zero.json"], bad_output),
        "--png": (["new/zero.png"], bad_output),
    },
}
BENCH_SWITCHES = {
    "big-model": ["--json", "--no-qlora"],
    "comm": ["--json"],
    "fp8": ["--json"],
    "kernels": ["--json", "--no-gemlite", "--allow-fallback"],
}
BENCH_SWITCHES |= {"lora-memory": ["--json", "--no-isolate"], "peers": ["--json"], "slow-link": ["--json"]}
BENCH_SWITCHES |= {"zero-memory": ["--json", "--no-lora"], "kernel-resources": ["--json"], "quantize": ["--json"]}
BENCH_SWITCHES |= {"generate": ["--json"]}
assert set(BENCH_FLAGS) == set(BENCHMARKS) == set(BENCH_SWITCHES)

ESTIMATE_FLAGS: Spec = {
    "--params": (["7.5e9", "1000"], bad_float(1, 1e18)),
    "--world-size": (["8", "64"], bad_int()),
    "--nodes": (["1", "2"], bad_int()),
    "--frozen-format": (["bf16", "int4"], bad_choice(("fp32", "bf16", "fp16", "int8", "int4", "nf4", "fp6"))),
    "--frozen-group-size": (["64"], bad_int()),
    "--lora-rank": (["8"], bad_int()),
    "--hidden-size": (["4096"], bad_int()),
    "--num-layers": (["32"], bad_int()),
    "--model-config": (
        ["hf.json"],
        st.one_of(st.sampled_from(["missing.json", "", "plain_file/x", "dir", "list.json"]), junk).filter(
            lambda s: s != "hf.json"
        ),
    ),
}
CHECK_CONFIG_FLAGS: Spec = {"--world-size": (["8"], bad_int()), "--ranks-per-node": (["8"], bad_int())}


def _unknown_flag(known: list[str]) -> st.SearchStrategy[str]:
    # Not a prefix of a real flag: argparse takes unambiguous abbreviations (`--st` for `--steps`).
    names = st.from_regex(r"--[a-z][a-z0-9-]{0,10}", fullmatch=True)
    return names.filter(lambda f: not _is_help(f) and not any(k.startswith(f) for k in known))


@st.composite
def faulty(
    draw: st.DrawFn, flags: Spec, switches: list[str], base: list[str], other_flags: tuple[str, ...] = ()
) -> tuple[list[str], str]:
    """`base`, valid flags in random order and exactly one fault; returns (argv, the name the error must quote).

    `other_flags`: the parser's flags that are in neither `flags` nor `switches`.
    """
    pairs = [[flag, draw(st.sampled_from(values))] for flag, (values, _) in flags.items() if draw(st.booleans())]
    pairs += [[s] for s in switches if draw(st.booleans())]
    kind = draw(st.sampled_from(["value", "unknown", "dangling", "switch-value"]))
    if kind == "value":
        flag = draw(st.sampled_from(sorted(flags)))
        fault, name = [flag, draw(flags[flag][1])], flag
        # argparse keeps the last of repeated flags: a valid one after the fault would hide checks made after parsing
        pairs = [p for p in pairs if p[0] != flag]
    elif kind == "unknown":
        name = draw(_unknown_flag([*flags, *switches, *other_flags]))
        fault = [name, *draw(st.lists(st.sampled_from(["1", "x"]), max_size=1))]
    elif kind == "dangling":  # a flag that takes a value, given none: it must go last
        name = draw(st.sampled_from(sorted(flags)))
        return [*base, *(t for p in draw(st.permutations(pairs)) for t in p), name], name
    else:
        name = draw(st.sampled_from(switches)) if switches else draw(_unknown_flag([*flags, *other_flags]))
        fault = [f"{name}=yes"]
    pairs.append(fault)  # placed by the permutation below
    return [*base, *(t for p in draw(st.permutations(pairs)) for t in p)], name


# -- the fuzz tests --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bench", sorted(BENCHMARKS))
@FAST
@given(data=st.data())
def test_bench_faults_name_the_flag(bench: str, data: st.DataObject, files: dict[str, str]) -> None:
    argv, name = data.draw(faulty(BENCH_FLAGS[bench], BENCH_SWITCHES[bench], ["bench", bench]))
    assert_one_line_error(argv, name)


def _chaos(known: list[str], values: st.SearchStrategy[str]) -> st.SearchStrategy[list[str]]:
    # Real flags and junk in any order, then an unknown flag: a flag left wanting a value reports that, and a
    # value nothing takes is an unrecognized argument, so some error is certain and nothing can run.
    token = st.one_of(st.sampled_from(known), values, junk)
    return st.lists(token, max_size=8).map(lambda tokens: [*tokens, "--zz-not-a-flag"])


@pytest.mark.parametrize("bench", sorted(BENCHMARKS))
@CHAOS
@given(data=st.data())
def test_bench_chaos_is_one_line(bench: str, data: st.DataObject, files: dict[str, str]) -> None:
    flags = BENCH_FLAGS[bench]
    values = st.one_of(*(st.one_of(st.sampled_from(ok), bad) for ok, bad in flags.values()))
    assert_one_line_error(["bench", bench, *data.draw(_chaos([*flags, *BENCH_SWITCHES[bench]], values))])


@settings(max_examples=60, deadline=None)
@given(first=junk.filter(lambda t: t not in (*BENCHMARKS, "", "--")), rest=st.lists(junk, max_size=3))
def test_bench_unknown_name(first: str, rest: list[str]) -> None:
    assert_one_line_error(["bench", first, *rest])


@settings(max_examples=60, deadline=None)
@given(argv=st.lists(junk, max_size=4))
def test_no_command(argv: list[str]) -> None:
    # A command anywhere (`-- env`) could make a valid line: an unknown flag in front keeps it an error.
    if {"env", "check-config", "estimate", "export", "bench"} & set(argv):
        argv = ["--zz-not-a-flag", *argv]
    assert_one_line_error(argv)


@FAST
@given(data=st.data())
def test_estimate_faults_name_the_flag(data: st.DataObject, files: dict[str, str]) -> None:
    given = ("--params", "--model-config", "--world-size")
    flags = {k: v for k, v in ESTIMATE_FLAGS.items() if k not in given}
    size = data.draw(st.sampled_from([["--params", "7.5e9"], ["--model-config", "hf.json"]]))
    base = ["estimate", "--world-size", "8", *size]
    argv, name = data.draw(faulty(flags, ["--json"], base, (*given, "--lora-targets")))
    assert_one_line_error(argv, name)


@FAST
@given(data=st.data())
def test_estimate_bad_sizes_name_the_flag(data: st.DataObject, files: dict[str, str]) -> None:
    flag = data.draw(st.sampled_from(["--params", "--model-config", "--world-size"]))
    parts = {"--world-size": "8"} if flag == "--model-config" else {"--world-size": "8", "--params": "1e9"}
    parts[flag] = data.draw(ESTIMATE_FLAGS[flag][1])
    assert_one_line_error(["estimate", *(t for pair in parts.items() for t in pair)], flag)


@CHAOS
@given(data=st.data())
def test_estimate_chaos_is_one_line(data: st.DataObject, files: dict[str, str]) -> None:
    values = st.one_of(*(st.one_of(st.sampled_from(ok), bad) for ok, bad in ESTIMATE_FLAGS.values()))
    assert_one_line_error(["estimate", *data.draw(_chaos([*ESTIMATE_FLAGS, "--json", "--lora-targets"], values))])


@FAST
@given(data=st.data())
def test_check_config_faults_name_the_flag(data: st.DataObject, files: dict[str, str]) -> None:
    argv, name = data.draw(faulty(CHECK_CONFIG_FLAGS, [], ["check-config", "ok.json"]))
    assert_one_line_error(argv, name)


BAD_CONFIGS = ["missing.json", "dir", "text.json", "binary.json", "list.json", "deep.json", "bad.yaml", "plain_file"]


@FAST
@given(
    source=st.one_of(st.sampled_from(BAD_CONFIGS), junk.filter(lambda s: s not in (*PRESETS, "ok.json"))),
    extra=st.sampled_from([[], ["--world-size", "8"]]),
)
def test_check_config_bad_files_are_one_line(source: str, extra: list[str], files: dict[str, str]) -> None:
    if source.startswith("-"):
        source = f"./{source}"  # a path, not a flag
    line = assert_one_line_error(["check-config", source, *extra])
    if source in BAD_CONFIGS and source != "list.json":  # that one names the root key: `config: expected ...`
        assert source in line


@FAST
@given(data=st.data())
def test_export_faults_are_one_line(data: st.DataObject, files: dict[str, str]) -> None:
    ckpt = data.draw(st.one_of(st.sampled_from(["missing", "dir", "empty_ckpt", "bad_ckpt", "plain_file"]), junk))
    out = data.draw(st.sampled_from(["out", "new/out"]))
    choice = data.draw(st.sampled_from(["ckpt", "out_dir", "dtype", "missing", "extra", "unknown"]))
    if ckpt.startswith("-"):
        ckpt = f"./{ckpt}"
    if choice == "ckpt":  # the checkpoint itself is the fault
        assert_one_line_error(["export", ckpt, out, *data.draw(st.sampled_from([[], ["--dtype", "bf16"]]))])
    elif choice == "out_dir":
        assert_one_line_error(["export", "empty_ckpt", data.draw(bad_output_dir)], "out_dir")
    elif choice == "dtype":
        dtype = data.draw(bad_choice(("fp32", "bf16", "fp16")))
        assert_one_line_error(["export", ckpt, out, "--dtype", dtype], "--dtype")
    elif choice == "missing":
        assert_one_line_error(["export", *data.draw(st.sampled_from([[], [ckpt]]))], "out_dir")
    elif choice == "extra":
        assert_one_line_error(["export", ckpt, out, "surplus"], "surplus")
    else:
        flag = data.draw(_unknown_flag(["--dtype"]))
        assert_one_line_error(["export", ckpt, out, flag], flag)


@settings(max_examples=30, deadline=None)
@given(argv=st.one_of(_unknown_flag(["--json"]).map(lambda f: [f]), st.lists(junk, min_size=1, max_size=3)))
def test_env_faults_are_one_line(argv: list[str]) -> None:
    if all(t == "--" or (len(t) > 2 and "--json".startswith(t)) for t in argv):  # `env --js` would be valid
        argv = [*argv, "--zz-not-a-flag"]
    assert_one_line_error(["env", *argv])


# -- explicit cases: the message names the flag or the dotted key ----------------------------------------------
EXPLICIT = [
    (["estimate", "--world-size", "-3", "--params", "1e9"], ["--world-size"]),
    (["estimate", "--params", "nan", "--world-size", "8"], ["--params", "finite"]),
    (["estimate", "--params", "1e308", "--world-size", "8"], ["--params"]),
    (["estimate", "--params", "1e9"], ["--world-size"]),
    (["estimate", "--params", "1e9", "--world-size", "8", "--nodes", "3"], ["--nodes"]),
    (["estimate", "--params", "1e9", "--world-size", "8", "--frozen-format", "int3"], ["--frozen-format"]),
    (["estimate", "--model-config", "missing.json", "--world-size", "8"], ["--model-config"]),
    (["estimate", "--model-config", "hf_empty.json", "--world-size", "8"], ["--model-config", "hidden_size"]),
    (["estimate", "--model-config", "hf_str.json", "--world-size", "8"], ["hidden_size"]),
    (["estimate", "--model-config", "hf_zero_heads.json", "--world-size", "8"], ["num_attention_heads"]),
    (["estimate", "--model-config", "hf_huge.json", "--world-size", "8"], ["hidden_size"]),
    (["estimate", "--model-config", "list.json", "--world-size", "8"], ["--model-config", "list"]),
    (["estimate", "--model-config", "binary.json", "--world-size", "8"], ["--model-config"]),
    (["estimate", "--model-config", "deep.json", "--world-size", "8"], ["--model-config"]),
    (["estimate", "--params", "1e9", "--model-config", "hf.json", "--world-size", "8"], ["--params", "--model-config"]),
    (["estimate", "--world-size", "2", "--bogus"], ["estimate", "--bogus"]),
    (["check-config", "stage7.json"], ["zero_optimization.stage"]),
    (["check-config", "typo.json"], ["zero_optimization.stagee"]),
    (["check-config", "deep.json"], ["deep.json"]),
    (["check-config", "binary.json"], ["binary.json"]),
    (["check-config", "bad.yaml"], ["bad.yaml"]),
    (["check-config", "ok.json", "--world-size", "0"], ["--world-size"]),
    (["check-config"], ["file"]),
    (["export", "plain_file", "out"], ["plain_file", "not a directory"]),
    (["export", "empty_ckpt", "out"], ["empty_ckpt", "not a ds_plugin checkpoint"]),
    (["export", "bad_ckpt", "out"], ["bad_ckpt"]),
    (["export", "empty_ckpt", "plain_file"], ["out_dir"]),
    (["export", "empty_ckpt", "out", "--dtype", "int3"], ["--dtype"]),
    (["env", "--json=1"], ["--json"]),
    (["bench"], ["name"]),
    (["bench", "nope"], ["nope"]),
    (["--bogus"], ["--bogus"]),
    ([], ["COMMAND"]),
    (["bench", "comm", "--steps", "0"], ["bench comm", "--steps"]),
    (["bench", "comm", "--n-embd", "6"], ["--n-embd"]),
    (["bench", "fp8", "--recipes", "nope"], ["--recipes", "nope"]),
    (["bench", "kernels", "--shapes", "8192x100"], ["--shapes"]),
    (["bench", "kernels", "--m", "0"], ["--m"]),
    (["bench", "kernels", "--out-dir", "plain_file"], ["--out-dir"]),
    (["bench", "lora-memory", "--steps", "1"], ["--steps"]),
    (["bench", "lora-memory", "--hidden", "130"], ["--hidden"]),
    (["bench", "lora-memory", "--world-size", "100000"], ["--world-size"]),
    (["bench", "peers", "--timeout", "nan"], ["--timeout"]),
    (["bench", "peers", "--out", "plain_file/x.json"], ["--out", "plain_file"]),
    (["bench", "slow-link", "--timeout", "inf"], ["--timeout"]),
    (["bench", "slow-link", "--rate", "1..2gbit"], ["--rate"]),
    (["bench", "slow-link", "--delay-ms", "-1"], ["--delay-ms"]),
    (["bench", "zero-memory", "--steps", "1"], ["--steps"]),
    (["bench", "zero-memory", "--png", "dir"], ["--png"]),
    (["bench", "zero-memory", "--world-size", "0"], ["--world-size"]),
    # A newline in a value is echoed escaped, keeping the message on one line.
    (
        ["estimate", "--model-config", "hf.json", "--world-size", "8", "--lora-rank", "4", "--lora-targets", "a\nb"],
        ["a\\nb"],
    ),
]


@pytest.mark.parametrize(("argv", "names"), EXPLICIT, ids=[" ".join(a)[:60] for a, _ in EXPLICIT])
def test_explicit_errors_name_the_culprit(argv: list[str], names: list[str], files: dict[str, str]) -> None:
    assert_one_line_error(argv, *names)


@pytest.mark.parametrize("argv", [["--help"], ["estimate", "--help"], ["bench", "comm", "--help"], ["bench", "-h"]])
def test_help_still_exits_0(argv: list[str]) -> None:
    code, out, err = run_cli(argv)
    assert code == 0 and out.startswith("usage: ds-plugin") and err == ""


def test_export_writes_and_reports_a_full_disk_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    import safetensors.torch

    from ds_plugin.checkpoint import save_checkpoint

    ckpt = str(save_checkpoint(tmp_path / "ck", model_state={"w": torch.ones(4)}))
    code, out, err = run_cli(["export", ckpt, str(tmp_path / "new" / "out")])
    assert (code, err) == (0, "") and out.startswith("exported 1 tensors (4 parameters)")

    def full_disk(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device", str(tmp_path / "full" / "model.safetensors"))

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    line = assert_one_line_error(["export", ckpt, str(tmp_path / "full")], "No space left on device")
    assert line.startswith("ds-plugin export: error: ") and "model.safetensors" in line


def test_export_marker_with_a_files_list(tmp_path: Path) -> None:
    (tmp_path / "ds_plugin_checkpoint.json").write_text('{"format": "ds_plugin.dcp", "version": 1, "files": [1]}')
    assert_one_line_error(["export", str(tmp_path), str(tmp_path / "out")], str(tmp_path))


def _console() -> list[str]:
    script = Path(sys.executable).parent / "ds-plugin"  # the installed console script, else the module
    return [str(script)] if script.is_file() else [sys.executable, "-m", "ds_plugin.cli"]


@pytest.mark.parametrize("command", [_console(), [sys.executable, "-m", "ds_plugin.cli"]], ids=["script", "module"])
def test_real_process_exit_code_and_stderr(command: list[str]) -> None:
    done = subprocess.run(
        [*command, "estimate", "--world-size", "-3"], capture_output=True, text=True, timeout=120, env=dict(os.environ)
    )
    assert done.returncode == 2, done
    assert done.stdout == "" and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("ds-plugin estimate: error: ")
    assert "--world-size" in done.stderr
