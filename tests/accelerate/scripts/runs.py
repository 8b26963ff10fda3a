"""Several runs of unchanged Accelerate scripts in one launch (process start-up dominates on CPU).

    accelerate launch ... -m ds_plugin.accelerate --ds-config C runs.py --out runs.json --runs '<JSON list>'

Each run is {"name", "script", "args", "config"}: the script (examples/with_accelerate/train.py, or a script here with a
`main()` that reads `sys.argv`) is imported once and its `main()` called with `args`. `config` is what the run's
`Accelerator` reads from `DS_PLUGIN_CONFIG` (where the bootstrap puts `--ds-config`); `"plain"` gives the script
Accelerate's own `Accelerator` instead, the class ds_plugin's subclasses (the DDP reference). Between runs
Accelerate's per-process state is reset and the process group is kept (`end_training` would destroy it).

Rank 0 writes `--out`: per run, its own result file's JSON (or the script's `--out` JSON for the HF parts) with
`output`, the ds_plugin log lines of that run, or the run's traceback; the first failing run ends the launch.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


_modules: dict[str, ModuleType] = {}


def _script(path: str) -> ModuleType:
    if path not in _modules:
        spec = importlib.util.spec_from_file_location(f"_run_{len(_modules)}_{Path(path).stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _modules[path] = module
    return _modules[path]


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _run(run: dict[str, Any]) -> None:
    import accelerate

    from ds_plugin.accelerate.accelerator import Accelerator

    module = _script(run["script"])
    if run["config"] == "plain":
        # Accelerate's own class, which ds_plugin's subclasses (the bootstrap re-pointed the public name).
        module.Accelerator = next(c for c in Accelerator.__mro__ if c.__module__ == "accelerate.accelerator")
    else:
        module.Accelerator = accelerate.Accelerator  # ds_plugin's, installed by the bootstrap
        path = Path(run["config"])
        os.environ["DS_PLUGIN_CONFIG"] = str(path.resolve()) if path.suffix or path.exists() else run["config"]
    sys.argv = [run["script"], *run["args"]]
    module.main()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs", required=True, help="a JSON list of runs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # Kept for the next run; destroyed once, at the end.
    import accelerate.state

    accelerate.state.PartialState.destroy_process_group = lambda self, group=None: None
    first = os.environ.get("RANK", "0") == "0"
    result: dict[str, Any] = {}
    for run in json.loads(args.runs):
        lines = _Lines()
        logging.getLogger("ds_plugin").addHandler(lines)
        try:
            _run(run)
            if first:
                result[run["name"]] = json.loads(Path(run["result"]).read_text())
        except BaseException:
            result[run["name"]] = {"error": traceback.format_exc()}
        finally:
            logging.getLogger("ds_plugin").removeHandler(lines)
        if first and "error" not in result.get(run["name"], {}):
            result[run["name"]]["output"] = "\n".join(lines.lines)
        if "error" in result.get(run["name"], {}):
            break  # the other rank may be stuck in a collective: end the launch
        if dist.is_initialized():
            dist.barrier()
        _reset_accelerate()
    if first:
        tmp = Path(args.out + ".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, args.out)
    if any("error" in r for r in result.values()):
        os._exit(1)  # do not wait in a collective for a rank that may have failed differently
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
