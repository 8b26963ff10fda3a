"""Accelerate's `distributed_type: DEEPSPEED` YAML reaching the processes `accelerate launch` starts, so the launch
command users already have runs on the engine with `-m ds_plugin.accelerate` added.

    accelerate launch --config_file deepspeed_zero3.yaml -m ds_plugin.accelerate train.py

The YAML's `deepspeed_config` block reaches the processes one of two ways: `accelerate launch`'s DeepSpeed path
(a GPU machine with DeepSpeed installed) exports it as `ACCELERATE_DEEPSPEED_*` variables with
`ACCELERATE_USE_DEEPSPEED=true`; with `--multi_gpu` on the command line (or `--cpu` runs, where Accelerate ignores the
DeepSpeed type) nothing is exported, so the YAML named by the launching `accelerate launch --config_file` (the parent
process) is read here. Either way `deepspeed_config_block` (`ds_plugin._accelerate_yaml`, which also says how each
key maps) turns it into the DeepSpeed config Accelerate would build.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ds_plugin._accelerate_yaml import IGNORED, deepspeed_config_block, deepspeed_section

__all__ = ["IGNORED", "deepspeed_block_from_env", "deepspeed_block_from_parent_yaml", "deepspeed_config_block"]

_ENV = {
    "zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING",
    "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT",
    "zero3_save_16bit_model": "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
    "deepspeed_config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE",
}


def deepspeed_block_from_env() -> dict[str, Any] | None:
    """The `deepspeed_config` block `accelerate launch`'s DeepSpeed path exported, or None when it did not run."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() != "true":
        return None
    fields = os.environ.get("ACCELERATE_CONFIG_DS_FIELDS", "")
    block = {key: os.environ[var] for key, var in _ENV.items() if var in os.environ}
    if fields:  # only what the YAML set: Accelerate exports its defaults too
        chosen = set(fields.split(","))
        block = {k: v for k, v in block.items() if k in chosen}
    return block


def _parent_config_file() -> Path | None:
    """The `--config_file` of the `accelerate launch` that started this process (its torchrun agent is the parent)."""
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    if not any(a.endswith("accelerate") or "accelerate.commands" in a for a in argv) or "launch" not in argv:
        return None
    for i, arg in enumerate(argv):
        for flag in ("--config_file", "--config-file"):
            if arg == flag and i + 1 < len(argv):
                return Path(argv[i + 1])
            if arg.startswith(flag + "="):
                return Path(arg.split("=", 1)[1])
    try:
        from accelerate.commands.config import default_config_file
    except ImportError:
        return None
    return Path(default_config_file) if Path(default_config_file).is_file() else None


def deepspeed_block_from_parent_yaml() -> dict[str, Any] | None:
    """The `deepspeed_config` block of the launching Accelerate YAML when its type is DEEPSPEED, else None."""
    path = _parent_config_file()
    if path is None or not path.is_file():
        return None
    import yaml

    text = path.read_text()
    return deepspeed_section(json.loads(text) if path.suffix == ".json" else yaml.safe_load(text), str(path))
