"""Hostile command lines and input files for every benchmark, `estimate` and `check-config` (`export`, `env` and
the hand-written cases: test_cli_errors.py; shared pieces: _cli_fuzz_common.py).

Whatever the input, a mistake ends in exit code 2 and exactly one line on stderr that says `error` and names the
flag, argument, file or config key at fault; never a traceback. Only inputs that must fail are generated, and
every benchmark's work function is replaced by one that raises: a valid command line that slipped through fails
the test instead of starting minutes of work.
"""

from __future__ import annotations

import pytest
from _cli_fuzz_common import (
    CHAOS,
    FAST,
    _ms_ok,
    _shapes_ok,
    _unknown_flag,
    assert_one_line_error,
    bad_choice,
    bad_float,
    bad_int,
    bad_list,
    bad_output,
    bad_output_dir,
    bad_tc,
    files_fixture,  # noqa: F401  (the `files` fixture: pytest finds it here)
    junk,
    no_runs_fixture,  # noqa: F401  (autouse in this module: no benchmark starts)
)
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_plugin.cli import BENCHMARKS
from ds_plugin.presets import PRESETS

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
    "export": {
        "--layers": (["1"], bad_int()),
        "--hidden": (["64"], bad_int()),
        "--intermediate": (["128"], bad_int()),
        "--vocab": (["256"], bad_int()),
        "--world-size": (["2"], bad_int(1, 1024)),
        "--dtype": (["bf16", "fp32"], bad_choice(("fp32", "bf16", "fp16"))),
        "--workdir": (["new/work"], bad_output_dir),
        "--timeout": (["600"], bad_float(0, WEEK, above=True)),
        "--out": (["new/export.json"], bad_output),
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
BENCH_SWITCHES |= {"generate": ["--json"], "export": ["--json", "--no-baseline"]}
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
