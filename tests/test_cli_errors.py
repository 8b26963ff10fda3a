"""One-line errors of the `ds-plugin` commands outside the benchmarks' flag fuzzing: `export` and `env` fuzzed,
hand-written bad command lines naming their culprit, `--help` still exiting 0, a full disk during export, and the
real console script's exit code and stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _cli_fuzz_common import (
    FAST,
    _unknown_flag,
    assert_one_line_error,
    bad_choice,
    bad_output_dir,
    files_fixture,  # noqa: F401  (the `files` fixture: pytest finds it here)
    junk,
    no_runs_fixture,  # noqa: F401  (autouse in this module: no benchmark starts)
    run_cli,
)
from hypothesis import given, settings
from hypothesis import strategies as st


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
    from safetensors.torch import load_file

    import ds_plugin.export as export
    from ds_plugin.checkpoint import save_checkpoint

    ckpt = str(save_checkpoint(tmp_path / "ck", model_state={"w": torch.ones(4)}))
    out = tmp_path / "new" / "out"
    code, text, err = run_cli(["export", ckpt, str(out)])
    assert (code, err) == (0, "") and text.startswith("exported 1 tensors (4 parameters)")
    assert torch.equal(load_file(out / "model.safetensors")["w"], torch.ones(4))
    other = str(save_checkpoint(tmp_path / "ck2", model_state={"w": torch.zeros(4)}))

    # The disk fills while the new export is written over the first one: one line naming the file, and the first
    # export stays whole, with no partial file beside it.
    def full_disk(f: Any, t: Any) -> None:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(export, "write_tensor_data", full_disk)
        line = assert_one_line_error(["export", other, str(out)], "No space left on device")
    assert line.startswith("ds-plugin export: error: ") and "model.safetensors" in line
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert torch.equal(load_file(out / "model.safetensors")["w"], torch.ones(4))

    # A disk too small for the export is refused before anything is written, in one line giving both sizes.
    class Usage:
        free = 15  # bytes: the 16 bytes of 4 fp32 weights do not fit

    with monkeypatch.context() as m:
        m.setattr(export.shutil, "disk_usage", lambda path: Usage)
        line = assert_one_line_error(["export", other, str(out)], "needs 16 B", "15 B are free", str(out))
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert torch.equal(load_file(out / "model.safetensors")["w"], torch.ones(4))
    code, text, err = run_cli(["export", other, str(out)])  # with room, the second export replaces the first
    assert (code, err) == (0, "") and torch.equal(load_file(out / "model.safetensors")["w"], torch.zeros(4))


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
