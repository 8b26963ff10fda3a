"""Named presets: a word for the common ZeRO setups, each a DeepSpeed config dict.

`Trainer(strategy="zeropp")`, `ds-plugin check-config zeropp` and `get_preset("zero3")` all read this table.
"""

from __future__ import annotations

import copy
import difflib
import os
from collections.abc import Mapping
from typing import Any

from ds_plugin.config import ConfigError, TrainingConfig, from_deepspeed

__all__ = ["PRESETS", "get_preset", "load_config", "register_preset"]

PRESETS: dict[str, dict[str, Any]] = {
    "zero0": {"zero_optimization": {"stage": 0}},
    "zero1": {"zero_optimization": {"stage": 1}},
    "zero2": {"zero_optimization": {"stage": 2}},
    "zero3": {"zero_optimization": {"stage": 3}},
    "zero3_offload": {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
        }
    },
    # ZeRO++ as its paper runs it: INT8 weight all-gather (qwZ), a secondary weight partition per node (hpZ,
    # "auto" = the ranks of one node) and INT4 all-to-all gradient reduction (qgZ).
    "zeropp": {
        "zero_optimization": {
            "stage": 3,
            "zero_quantized_weights": True,
            "zero_hpz_partition_size": "auto",
            "zero_quantized_gradients": True,
        }
    },
}


def register_preset(name: str, config: dict[str, Any]) -> None:
    """Add a named preset (validated now, so a bad one fails at registration).

    Args:
        name: the preset's name, e.g. "zero3_bf16".
        config: a DeepSpeed config dict.
    """
    from_deepspeed(config)
    PRESETS[name] = copy.deepcopy(config)


def get_preset(name: str, **overrides: Any) -> TrainingConfig:
    """The `TrainingConfig` of a named preset.

    Args:
        name: one of `PRESETS`.
        overrides: top-level DeepSpeed keys merged over the preset (sections merged one level deep).
    """
    if name not in PRESETS:
        close = difflib.get_close_matches(name, list(PRESETS), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"unknown preset {name!r}; {hint}presets: {', '.join(PRESETS)}")
    config = copy.deepcopy(PRESETS[name])
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return from_deepspeed(config)


def load_config(config: str | os.PathLike | Mapping[str, Any] | TrainingConfig) -> TrainingConfig:
    """A `TrainingConfig` from a preset name ("zero3", "zeropp", ...), a DeepSpeed .json/.yaml path, or a dict.

    Args:
        config: what to load; a `TrainingConfig` is returned unchanged.
    """
    if isinstance(config, str) and config in PRESETS:
        return get_preset(config)
    if isinstance(config, str) and not os.path.splitext(config)[1] and not os.path.exists(config):
        return get_preset(config)  # no suffix and no such file: a preset name, maybe mistyped ("did you mean")
    return from_deepspeed(config)
