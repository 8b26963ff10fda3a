"""Run an unchanged Accelerate script on the ZeRO engine: `python -m ds_plugin.accelerate [--ds-config C] script.py`.

    accelerate launch --config_file multi_gpu.yaml -m ds_plugin.accelerate --ds-config zeropp.json train.py --lr 1e-4

Accelerate has no plugin registry (its `DistributedType` is a closed enum and its YAML rejects unknown keys), so the
bootstrap works from inside each launched process instead: it reads and checks the config (before any process
group starts), makes `accelerate.Accelerator` ds_plugin's subclass for every module that imports it (the script,
the HF Trainer, trl), and runs the script as `__main__` with `runpy`. The config may also come from the
`DS_PLUGIN_CONFIG` environment variable; `--ds-config` sets it, so processes the script starts see it too.

CPU runs: `accelerate launch` starts two processes for `distributed_type: MULTI_GPU`, but each then finds no GPU
and trains alone unless `ACCELERATE_USE_CPU=true` (and `--cpu` / MULTI_CPU start only one process, accelerate issue
2741); the bootstrap sets the variable in a multi-process launch without a GPU, so the processes form one gloo group.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path

from ds_plugin.accelerate.plugin import CONFIG_ENV, ZeroPlugin
from ds_plugin.config import ConfigError

__all__ = ["install", "main", "switch_on_for_launch", "use_cpu_for_gpu_less_launch"]

logger = logging.getLogger(__name__)


def install() -> None:
    """Make every `accelerate.Accelerator` created from now on a `ds_plugin.accelerate.Accelerator` (idempotent).

    Modules that already imported the name (`from accelerate import Accelerator`) are re-pointed too, and the HF
    Trainer / `TrainingArguments` get their hooks when transformers loads (`ds_plugin.accelerate.hf`).
    """
    import accelerate
    import accelerate.accelerator

    from ds_plugin.accelerate.accelerator import Accelerator
    from ds_plugin.accelerate.hf import install_transformers_hooks

    original = accelerate.accelerator.Accelerator
    if original is not Accelerator:
        for module in list(sys.modules.values()):
            # `__dict__`, not getattr: lazy modules (transformers) would import on attribute access.
            namespace = getattr(module, "__dict__", None)
            if isinstance(namespace, dict) and namespace.get("Accelerator") is original:
                namespace["Accelerator"] = Accelerator
    accelerate.Accelerator = Accelerator
    accelerate.accelerator.Accelerator = Accelerator
    install_transformers_hooks()


def switch_on_for_launch() -> None:
    """What the bootstrap does before the script, done by a `ds-plugin launch` rank whose HF script builds
    `TrainingArguments(deepspeed=...)` (`ds_plugin.deepspeed._rank_entry`): the config is that argument."""
    _configure_logging("info")
    from ds_plugin.accelerate.settings import refuse_other_engines

    refuse_other_engines()
    logger.info("TrainingArguments(deepspeed=...) under ds-plugin launch: the HF Trainer runs on ds_plugin's engine")
    _switch_on()


def _switch_on() -> None:
    # Both ways in (the bootstrap's `main`, a launch rank's first TrainingArguments(deepspeed=...)) end here.
    if use_cpu_for_gpu_less_launch():
        logger.info("no GPU in a %s-process launch: ACCELERATE_USE_CPU=true (gloo)", os.environ.get("WORLD_SIZE"))
    install()


def use_cpu_for_gpu_less_launch() -> bool:
    """Set `ACCELERATE_USE_CPU=true` in a multi-process launch on a machine without a GPU; returns whether it did."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world < 2 or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
        return False
    import torch

    if torch.cuda.is_available():
        return False
    os.environ["ACCELERATE_USE_CPU"] = "true"
    return True


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ds_plugin.accelerate",
        description="Run an Accelerate script (or the HF Trainer / trl in it) on ds_plugin's ZeRO engine.",
    )
    parser.add_argument(
        "--ds-config",
        help=f"DeepSpeed config: a .json/.yaml path or a preset name (zero0..zero3, zero3_offload, zeropp); "
        f"default ${CONFIG_ENV}, or the HF TrainingArguments(deepspeed=...) of the script",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="ds_plugin's log level on the first process (the others log warnings); default info: the plan",
    )
    parser.add_argument("-m", dest="module", action="store_true", help="run the script as a module (python -m)")
    parser.add_argument("script", help="the training script (or module with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return parser


def _check_config(ds_config: str | None) -> None:
    """Resolve `--ds-config` into `DS_PLUGIN_CONFIG` and check it; raises `ConfigError` in one line.

    Without either, the config is checked where it is given: `TrainingArguments(deepspeed=...)`, or `Accelerator()`
    (which then fails naming the variable); both run before the process group starts.
    """
    from ds_plugin.accelerate.settings import refuse_other_engines

    _take_accelerate_deepspeed_config(ds_config)
    refuse_other_engines()
    if ds_config is not None:
        path = Path(ds_config)
        os.environ[CONFIG_ENV] = str(path.resolve()) if path.suffix or path.exists() else ds_config
    if os.environ.get(CONFIG_ENV, "").strip():
        ZeroPlugin.from_env()


def _take_accelerate_deepspeed_config(ds_config: str | None) -> None:
    """A `distributed_type: DEEPSPEED` Accelerate config becomes this run's DeepSpeed config (`deepspeed_yaml.py`);
    Accelerate then sets up plain data parallel processes, and the engine does what DeepSpeed would."""
    from ds_plugin.accelerate.deepspeed_yaml import (
        deepspeed_block_from_env,
        deepspeed_block_from_parent_yaml,
        deepspeed_config_block,
    )

    block = deepspeed_block_from_env()
    if block is not None:
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "false"  # Accelerate would start DeepSpeed itself
    else:
        block = deepspeed_block_from_parent_yaml()
    if block is None:
        return
    if ds_config is not None or os.environ.get(CONFIG_ENV, "").strip():
        logger.info(
            "the DeepSpeed config given to ds_plugin is used instead of the Accelerate config's deepspeed_config"
        )
        return
    config, ignored = deepspeed_config_block(block)
    os.environ[CONFIG_ENV] = str(Path(config).resolve()) if isinstance(config, str) else json.dumps(config)
    logger.info("Accelerate DeepSpeed config: %s", os.environ[CONFIG_ENV])
    for key, reason in ignored.items():
        logger.info("Accelerate config key without effect here: deepspeed_config.%s (%s)", key, reason)


def _configure_logging(level: str) -> None:
    # The CLI's own choice (a library leaves handlers to the application): the first process says what runs.
    first = os.environ.get("RANK", "0") == "0"
    root = logging.getLogger("ds_plugin")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[ds_plugin] %(message)s"))
        root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()) if first else logging.WARNING)


def main(argv: Sequence[str] | None = None) -> None:
    """The `python -m ds_plugin.accelerate` entry point.

    Args:
        argv: the arguments (default `sys.argv[1:]`).
    """
    args = _parser().parse_args(argv)
    _configure_logging(args.log_level)
    try:
        _check_config(args.ds_config)
    except ConfigError as e:
        sys.exit(f"ds_plugin.accelerate: {e}")
    _switch_on()
    try:
        _run(args.script, args.script_args, as_module=args.module)
    except ConfigError as e:
        # The config is the user's to fix: one line, as for a config checked before the script ran.
        sys.exit(f"ds_plugin.accelerate: {e}")


def _run(script: str, script_args: list[str], *, as_module: bool) -> None:
    if as_module:
        sys.argv = [script, *script_args]
        runpy.run_module(script, run_name="__main__", alter_sys=True)
        return
    path = Path(script)
    if not path.is_file():
        sys.exit(f"ds_plugin.accelerate: {path} is not a file; pass the training script (or -m module.name)")
    sys.argv = [str(path), *script_args]
    sys.path[0] = str(path.resolve().parent)  # as `python script.py` would
    runpy.run_path(str(path), run_name="__main__")
