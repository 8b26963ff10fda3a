"""Run `accelerate launch ...` (or `python -m ds_plugin.accelerate ...`) in a subprocess with a timeout.

The launcher, torchrun's agent and every rank are killed at the timeout and again when the command ends, so no rank
outlives a test; each launch rendezvouses on a free port of its own. A script writes its JSON result from rank 0
after its last collective; success is judged by that file (see `_result`).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

__all__ = ["EXAMPLES", "REPO", "SCRIPTS", "accelerate_launch", "clean_env", "free_port", "launch_cmd", "run"]

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "with_accelerate"
SCRIPTS = Path(__file__).resolve().parent / "scripts"
CPU_YAML = EXAMPLES / "cpu_2proc.yaml"
_LAUNCH_VARS = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "ACCELERATE_USE_CPU", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP",
                "ACCELERATE_MIXED_PRECISION", "DS_PLUGIN_CONFIG")  # fmt: skip


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for a launch: no launcher or config variables left over, one thread per rank, offline."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


def free_port() -> int:
    """A TCP port nobody listens on now (each launch gets its own rendezvous port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_all(procs: dict[int, psutil.Process]) -> None:
    for p in procs.values():
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs([p for p in procs.values() if p.is_running()], timeout=10)


def run(
    cmd: list[str],
    *,
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    done_file: Path | None = None,
    grace: float = 30.0,
) -> Any:
    """Run `cmd`; returns the CompletedProcess (stdout and stderr merged into `stdout`).

    Every descendant is tracked while the command runs (torchrun starts its ranks in sessions of their own, so a
    process-group kill would miss them), and whatever is left of them is killed at the timeout or at the end.
    Output goes to a file, so a rank that outlives its launcher cannot block the read.

    Args:
        cmd: the command.
        timeout: seconds before everything is killed (the test then fails with the output's tail).
        env: the environment (default `clean_env()`).
        cwd: the working directory.
        done_file: the result file; once it exists the command gets `grace` more seconds to exit, then it is ended
            (a gloo rank that hangs at interpreter exit after a complete run must not cost the whole timeout).
        grace: seconds, see `done_file`.
    """
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            cmd, cwd=cwd or REPO, env=env or clean_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        family: dict[int, psutil.Process] = {proc.pid: psutil.Process(proc.pid)}
        deadline = time.monotonic() + timeout
        timed_out = finished = False
        try:
            while proc.poll() is None:
                if not finished and done_file is not None and done_file.is_file():
                    finished = True
                    deadline = min(deadline, time.monotonic() + grace)
                if time.monotonic() > deadline:
                    timed_out = not finished
                    break
                with contextlib.suppress(psutil.Error):
                    family.update({c.pid: c for c in family[proc.pid].children(recursive=True)})
                time.sleep(0.2)
        finally:
            _kill_all(family)
            proc.wait()
        log.seek(0)
        output = log.read().decode(errors="replace")
    if timed_out:
        raise AssertionError(f"{cmd[:6]} timed out after {timeout}s:\n{_tail(output)}")
    return subprocess.CompletedProcess(cmd, proc.returncode, output, "")


def launch_cmd(script: Path, ds_config: str | None) -> list[str]:
    """The `accelerate launch` command line for `script` (through the bootstrap when `ds_config` is given).

    Args:
        script: the training script.
        ds_config: the DeepSpeed config for `--ds-config`; None for plain Accelerate.
    """
    launcher = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(CPU_YAML),
                "--main_process_port", str(free_port())]  # fmt: skip
    if ds_config is None:
        return [*launcher, str(script)]
    return [*launcher, "-m", "ds_plugin.accelerate", "--ds-config", ds_config, str(script)]


def accelerate_launch(
    script: Path, *args: str, out: Path, ds_config: str | None = None, timeout: float = 150.0, **env: str
) -> dict[str, Any]:
    """`accelerate launch --config_file cpu_2proc.yaml [-m ds_plugin.accelerate --ds-config C] script args`.

    Args:
        script: the training script.
        args: its arguments (besides `--out`).
        out: where the script writes its JSON result.
        ds_config: the DeepSpeed config; None for plain Accelerate (DDP; then ACCELERATE_USE_CPU=true is set, as
            a plain Accelerate user must on CPU).
        timeout: seconds for the whole launch.
        env: more environment variables.
    """
    if ds_config is None:
        env = {"ACCELERATE_USE_CPU": "true", **env}
    cmd = [*launch_cmd(script, ds_config), *args, "--out", str(out)]
    proc = run(cmd, timeout=timeout, env=clean_env(**env), done_file=out)
    return _result(proc, out)


def _result(proc: Any, out: Path) -> dict[str, Any]:
    # Judged by the result file, written by rank 0 after the run's last collective: gloo ranks sometimes abort at
    # interpreter exit ("terminate called without an active exception", see ds_plugin/launch.py) after a complete
    # run, and torchrun then reports a failure although every result is in.
    if not out.is_file():
        raise AssertionError(f"launch failed (exit code {proc.returncode}, no result):\n{_tail(proc.stdout)}")
    result = json.loads(out.read_text())
    result["output"] = proc.stdout
    result["returncode"] = proc.returncode
    return result
