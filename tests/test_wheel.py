"""What `pip install .` installs: ds_plugin without the benchmarks, and a `ds-plugin` that still lists them.

The wheel is built from a copy of the package, pyproject.toml and benchmarks/ (so the exclusion is tested, not
assumed), unpacked, and run with the unpacked folder as the only place ds_plugin can come from: there is no
checkout beside it, as on a user's machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ds_plugin.cli import BENCHMARKS

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("env", "check-config", "estimate", "export", "launch", "bench")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    pytest.importorskip("setuptools", reason="--no-build-isolation builds with this environment's setuptools")
    src = tmp_path_factory.mktemp("src")
    skip = shutil.ignore_patterns("__pycache__", "results", "data")
    for name in ("ds_plugin", "benchmarks"):
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w"]
    subprocess.run([*cmd, str(out), str(src)], check=True, capture_output=True, timeout=300)
    (path,) = out.glob("ds_plugin-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_holds_ds_plugin_and_no_benchmarks(wheel: zipfile.ZipFile) -> None:
    names = wheel.namelist()
    assert {n.split("/")[0] for n in names} == {"ds_plugin", next(n.split("/")[0] for n in names if ".dist-info/" in n)}
    assert [n for n in names if n.startswith(("benchmarks/", "ds_plugin/bench/"))] == []
    assert {"ds_plugin/cli.py", "ds_plugin/env.py", "ds_plugin/kernels/quant_linear_triton.py"} <= set(names)


# Run in the unpacked wheel: each command line's exit code, stdout and stderr, as JSON.
_DRIVER = """
import contextlib, io, json, sys
import ds_plugin
from ds_plugin.cli import main
runs = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    runs.append([code, out.getvalue(), err.getvalue()])
print(json.dumps({"ds_plugin": ds_plugin.__file__, "runs": runs}))
"""


def test_installed_cli_lists_every_command_and_refuses_bench_in_one_line(
    wheel: zipfile.ZipFile, tmp_path: Path
) -> None:
    site = tmp_path / "site"
    wheel.extractall(site)
    argvs = [["--help"], ["bench", "--help"], ["bench", "comm"], ["bench", "kernels", "--json"], ["env", "--json"]]
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER, json.dumps(argvs)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    report = json.loads(done.stdout.splitlines()[-1])
    assert Path(report["ds_plugin"]).is_relative_to(site)
    (help_code, help_out, _), (bench_code, bench_help, _), *refused, (env_code, env_out, env_err) = report["runs"]
    # Every subcommand the README shows, and that `bench` needs the checkout.
    readme = (ROOT / "README.md").read_text()
    assert set(re.findall(r"ds-plugin ([a-z][a-z-]+)", readme)) <= set(COMMANDS)
    listed = dict(re.findall(r"^    (\S+)\s+(.*(?:\n {10,}.*)*)", help_out, flags=re.M))
    assert help_code == 0 and set(listed) == set(COMMANDS), help_out
    assert "repository checkout" in " ".join(listed["bench"].split())
    assert bench_code == 0 and all(name in bench_help for name in BENCHMARKS)
    for code, out, err in refused:
        assert (code, out) == (2, "") and err.count("\n") == 1, err
        assert err.startswith("ds-plugin bench: error: needs the repository checkout") and "pip install -e ." in err
    # The machine check a user runs needs nothing that stayed behind.
    assert env_code == 0 and json.loads(env_out)["packages"]["torch"], (env_out, env_err)
