"""Accelerate's `distributed_type: DEEPSPEED` config file, read as Accelerate's DeepSpeed plugin reads it (neither
Accelerate nor DeepSpeed imported): its `deepspeed_config` block becomes the DeepSpeed config Accelerate would build.
`ds-plugin check-config` checks such a file this way, and the Accelerate adapter (`ds_plugin.accelerate`) runs it.

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

from collections.abc import Mapping
from typing import Any

from ds_plugin._schema import ConfigError

__all__ = ["IGNORED", "accelerate_type", "deepspeed_config_block", "deepspeed_section"]

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
# Keys of newer Accelerate releases for features ds_plugin does not have: a run without them would not be the one asked.
_REFUSED = {
    "seq_parallel_communication_data_type": "sequence parallelism (ALST/Ulysses) is not part of ds_plugin; remove it "
    "and the config's context-parallel settings (parallelism_config cp_size) to train without it",
}
_MAPPED = ("zero_stage", "offload_optimizer_device", "offload_param_device", "gradient_accumulation_steps",
           "gradient_clipping", "zero3_save_16bit_model")  # fmt: skip


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
        if key in _REFUSED:
            raise ConfigError(f"deepspeed_config.{key}: {_REFUSED[key]}")
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


def accelerate_type(data: Any) -> str | None:
    """The `distributed_type` of an Accelerate config file's contents, or None when they are not one."""
    if not isinstance(data, Mapping) or not ("distributed_type" in data or "compute_environment" in data):
        return None
    return str(data.get("distributed_type", "NO"))


def deepspeed_section(data: Mapping[str, Any], where: str) -> dict[str, Any] | None:
    """The `deepspeed_config` block of an Accelerate config whose type is DEEPSPEED, else None.

    Args:
        data: the Accelerate config file's contents.
        where: the file, for messages.
    """
    if accelerate_type(data) != "DEEPSPEED":
        return None
    block = data.get("deepspeed_config") or {}
    if not isinstance(block, Mapping):
        raise ConfigError(f"{where}: deepspeed_config is not a mapping; fix the Accelerate config")
    return dict(block)
