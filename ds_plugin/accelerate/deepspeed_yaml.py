"""Accelerate's `distributed_type: DEEPSPEED` YAML, read as Accelerate's DeepSpeed plugin reads it (DeepSpeed never
imported), so the launch command users already have runs on the engine with `-m ds_plugin.accelerate` added.

    accelerate launch --config_file deepspeed_zero3.yaml -m ds_plugin.accelerate train.py

The YAML's `deepspeed_config` block reaches the processes one of two ways: `accelerate launch`'s DeepSpeed path
(a GPU machine with DeepSpeed installed) exports it as `ACCELERATE_DEEPSPEED_*` variables with
`ACCELERATE_USE_DEEPSPEED=true`; with `--multi_gpu` on the command line (or `--cpu` runs, where Accelerate ignores the
DeepSpeed type) nothing is exported, so the YAML named by the launching `accelerate launch --config_file` (the parent
process) is read here. Either way `deepspeed_config_block` turns it into the DeepSpeed config Accelerate would build:

| Accelerate key | DeepSpeed config |
| --- | --- |
| `deepspeed_config_file` | that JSON, as it is (then the YAML's own copies below must be absent) |
| `zero_stage` | `zero_optimization.stage` |
| `offload_optimizer_device`, `offload_param_device` | `zero_optimization.offload_optimizer/offload_param.device` |
| `gradient_accumulation_steps`, `gradient_clipping` | the same keys ("auto" when absent) |
| `zero3_save_16bit_model` | `zero_optimization.stage3_gather_16bit_weights_on_model_save` (16-bit saves) |

plus `train_batch_size` / `train_micro_batch_size_per_gpu` "auto" as Accelerate writes them. Keys with no meaning
here (`zero3_init_flag`, `deepspeed_multinode_launcher`, the hostfile and its filters) are reported with the reason.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ds_plugin.config import ConfigError

__all__ = ["IGNORED", "deepspeed_block_from_env", "deepspeed_block_from_parent_yaml", "deepspeed_config_block"]

LAUNCHER_ONLY = "ranks are started by `accelerate launch` (torchrun), not DeepSpeed's launcher"
IGNORED = {
    "zero3_init_flag": "the script builds the model as it does; ds_plugin shards it at prepare (for sharded "
    "initialisation build it on the meta device or use ds_plugin.load_pretrained)",
    "deepspeed_multinode_launcher": LAUNCHER_ONLY,
    "deepspeed_hostfile": LAUNCHER_ONLY,
    "deepspeed_exclusion_filter": LAUNCHER_ONLY,
    "deepspeed_inclusion_filter": LAUNCHER_ONLY,
    "deepspeed_moe_layer_cls_names": "expert parallelism is not part of ds_plugin",
}
_MAPPED = ("zero_stage", "offload_optimizer_device", "offload_param_device", "gradient_accumulation_steps",
           "gradient_clipping", "zero3_save_16bit_model")  # fmt: skip
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


def _number(value: Any, key: str, kind: type) -> Any:
    if value in (None, "auto", "none", "None"):
        return "auto"
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"deepspeed_config.{key}: {value!r} is not a number; fix the Accelerate config") from None


def deepspeed_config_block(block: Mapping[str, Any]) -> tuple[dict[str, Any] | str, dict[str, str]]:
    """The DeepSpeed config (a dict, or the path of `deepspeed_config_file`) and the keys reported as ignored.

    Args:
        block: the YAML's `deepspeed_config` mapping (or the same read from Accelerate's variables).

    Raises:
        ConfigError: an unknown key, or `deepspeed_config_file` beside the settings it replaces (one line).
    """
    known = set(_MAPPED) | set(IGNORED) | {"deepspeed_config_file"}
    for key in block:
        if key not in known:
            raise ConfigError(f"deepspeed_config.{key}: not an Accelerate DeepSpeed key ({', '.join(sorted(known))})")
    ignored = {k: IGNORED[k] for k in block if k in IGNORED}
    config_file = block.get("deepspeed_config_file")
    if config_file not in (None, "", "none", "None"):
        both = [k for k in _MAPPED if block.get(k) not in (None, "none", "None")]
        both = [k for k in both if not (k.startswith("offload_") and block[k] == "none")]
        if both:
            raise ConfigError(
                f"deepspeed_config: deepspeed_config_file is given, so {', '.join(both)} must be set in that JSON, "
                "not in the Accelerate config; remove them from the YAML"
            )
        return str(config_file), ignored
    zero: dict[str, Any] = {"stage": int(_number(block.get("zero_stage", 2), "zero_stage", int))}
    for side in ("optimizer", "param"):
        device = block.get(f"offload_{side}_device")
        if device not in (None, "none", "None"):
            zero[f"offload_{side}"] = {"device": str(device)}
    if str(block.get("zero3_save_16bit_model", "false")).lower() == "true":
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": _number(
            block.get("gradient_accumulation_steps"), "gradient_accumulation_steps", int
        ),
        "gradient_clipping": _number(block.get("gradient_clipping"), "gradient_clipping", float),
        "zero_optimization": zero,
    }
    return config, ignored


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
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if not isinstance(data, Mapping) or data.get("distributed_type") != "DEEPSPEED":
        return None
    block = data.get("deepspeed_config") or {}
    if not isinstance(block, Mapping):
        raise ConfigError(f"{path}: deepspeed_config is not a mapping; fix the Accelerate config")
    return dict(block)
