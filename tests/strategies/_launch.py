"""Run a standalone Lightning script (tests/strategies/scripts/) in a subprocess and read back its result file.

Lightning's launcher re-runs the script itself for `devices=2`, so a multi-process Trainer test is a script,
not a pytest body. Each script writes one JSON result file from rank 0 (renamed into place, so it is never
half-written) *before* its final barrier and `destroy_process_group()`. Success is judged by that file: a
process that aborts at interpreter exit after writing it (a spurious SIGABRT seen with Lightning's launcher) does
not fail the test, while a missing file fails it with the tail of the output. The whole process group
is killed at the timeout, so nothing hangs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["SCRIPTS", "clean_env", "run_script"]

SCRIPTS = Path(__file__).parent / "scripts"
# Launcher variables a parent Lightning run (or a torchrun) may have left: with LOCAL_RANK set, Lightning would
# assume the processes were created externally and never launch the second rank.
_LAUNCH_VARS = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR",
                "MASTER_PORT", "PL_GLOBAL_SEED", "PL_SEED_WORKERS", "TORCHELASTIC_RUN_ID")  # fmt: skip


def clean_env() -> dict[str, str]:
    """The environment for a script: no launcher variables, one thread per rank, no network."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


def run_script(
    name: str, *args: str, workdir: Path | None = None, timeout: float = 240.0, expect_result: bool = True
) -> dict[str, Any]:
    """Run `scripts/<name>` with `--out <file> --workdir <dir> *args`; return its JSON result.

    A run that failed to bind its rendezvous port (another job took the free port Lightning picked) is
    retried once.

    Args:
        name: the script's file name.
        args: more command-line arguments.
        workdir: a directory the script may write to (by default a fresh temporary one, removed afterwards).
        timeout: seconds before the script and its children are killed.
        expect_result: False for a run that is meant to die (the result is then `{"returncode": ...}`).
    """
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="ds_plugin_lightning_") as tmp:
            return run_script(name, *args, workdir=Path(tmp), timeout=timeout, expect_result=expect_result)
    try:
        return _run_once(name, args, workdir, timeout, expect_result)
    except _PortTaken:
        return _run_once(name, args, workdir, timeout, expect_result)


class _PortTaken(Exception):
    pass


def _run_once(name: str, args: tuple[str, ...], workdir: Path, timeout: float, expect_result: bool) -> dict[str, Any]:
    out = workdir / f"{Path(name).stem}-{time.monotonic_ns()}.json"
    cmd = [sys.executable, str(SCRIPTS / name), "--out", str(out), "--workdir", str(workdir), *args]
    proc = subprocess.Popen(
        cmd, cwd=workdir, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"{name} timed out after {timeout}s:\n{_tail(output.decode(errors='replace'))}") from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stray ranks, if any
        except ProcessLookupError:
            pass
    text = output.decode(errors="replace")
    if not expect_result:
        return {"returncode": proc.returncode, "output": text}
    if not out.is_file() and "address already in use" in text.lower():
        raise _PortTaken(text)
    if not out.is_file():
        raise AssertionError(f"{name} wrote no result (exit code {proc.returncode}):\n{_tail(text)}")
    result = json.loads(out.read_text())
    result["returncode"] = proc.returncode
    result["output"] = text
    if result.get("error"):
        raise AssertionError(f"{name} failed on rank 0:\n{result['error']}\n--- output ---\n{_tail(text)}")
    return result
