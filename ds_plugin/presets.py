"""Named presets, and `load_config`: the one reader of a config source (preset name, path, dict or `TrainingConfig`,
plus overrides) for every entry point and adapter.

`Trainer(strategy="zeropp")`, `ds-plugin check-config zeropp` and `get_preset("zero3")` all read the preset table.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ds_plugin.config import ConfigError, TrainingConfig, from_deepspeed, read_config_file

__all__ = ["PRESETS", "ConfigSource", "get_preset", "load_config", "merge_overrides", "register_preset"]

ConfigSource = str | os.PathLike | Mapping[str, Any] | TrainingConfig
"""What every entry point accepts as a config: a preset name, a DeepSpeed .json/.yaml path, a dict or a config."""

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
_ZERO_KEYS = frozenset(TrainingConfig().zero_optimization.__dataclass_fields__)


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
        raise _unknown_preset(name)
    return from_deepspeed(merge_overrides(PRESETS[name], overrides))


def load_config(
    config: ConfigSource,
    overrides: Mapping[str, Any] | None = None,
    *,
    owner: str | None = None,
    options: Iterable[str] = (),
) -> TrainingConfig:
    """A `TrainingConfig` from a preset name ("zero3", "zeropp", ...), a DeepSpeed .json/.yaml path, or a dict, with
    `overrides` merged over it. Every entry point (the adapters' config arguments included) reads configs here.

    Its `explicit_keys` are the top-level keys the user chose: written in the source (for a `TrainingConfig`, those it
    records) or given as overrides.

    Args:
        config: what to load; a `TrainingConfig` is returned unchanged when there are no overrides.
        overrides: top-level DeepSpeed keys merged over the config (sections one level deep), e.g. an adapter's
            constructor keywords.
        owner: who passes `overrides` ("ZeroStrategy"); an unknown override key is then an error naming the owner,
            the closest DeepSpeed key or one of `options`.
        options: the owner's own keyword names, suggested for near misses.

    Raises:
        ConfigError: one line naming the key and the fix.
    """
    overrides = overrides or {}
    if owner is not None:
        for key, value in overrides.items():
            _check_option(owner, key, value, options)
    raw = _source(config)
    if isinstance(raw, TrainingConfig):
        if not overrides:
            return raw
        # Overrides go through the parser like any other key: merge them into what the config says beyond DeepSpeed's
        # defaults (a default written out would be reported as an ignored key the user never wrote).
        chosen = raw.explicit_keys
        raw = _non_default(raw.to_deepspeed(), TrainingConfig().to_deepspeed())
    elif isinstance(raw, Mapping) or owner is None:
        chosen = frozenset()  # what is not a mapping fails in the parser, naming the root key
    else:
        raise ConfigError(f"{owner}: the config must be a JSON object (a dict), got {type(raw).__name__}")
    cfg = from_deepspeed(merge_overrides(raw, overrides) if isinstance(raw, Mapping) else raw)
    return dataclasses.replace(cfg, explicit_keys=cfg.explicit_keys | chosen) if chosen else cfg


def merge_overrides(config: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`config` with `overrides` merged over it: a section given as a dict is merged one level deep, anything else is
    replaced. Neither argument is changed.

    Args:
        config: a DeepSpeed config dict.
        overrides: top-level DeepSpeed keys.
    """
    merged = copy.deepcopy(dict(config))
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def _unknown_preset(name: str) -> ConfigError:
    close = difflib.get_close_matches(name, list(PRESETS), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return ConfigError(f"unknown preset {name!r}; {hint}presets: {', '.join(PRESETS)}")


def _source(config: ConfigSource) -> Mapping[str, Any] | TrainingConfig | Any:
    """The config as the user wrote it: a preset's dict, a file's contents (read once), a dict, or a config."""
    if isinstance(config, TrainingConfig | Mapping):
        return config
    if isinstance(config, str) and config in PRESETS:
        return PRESETS[config]
    if isinstance(config, str) and not os.path.splitext(config)[1] and not os.path.exists(config):
        raise _unknown_preset(config)  # no suffix and no such file: a preset name, maybe mistyped ("did you mean")
    return read_config_file(Path(config))


def _check_option(owner: str, key: str, value: Any, options: Iterable[str]) -> None:
    try:
        from_deepspeed({key: value})
        return
    except ConfigError as e:
        if not str(e).startswith(f"{key}: unknown key"):
            return  # a DeepSpeed key with a bad value: the full parse names it
    if key in _ZERO_KEYS:
        raise ConfigError(
            f"{owner}: unknown option {key!r}; it is a ZeRO setting, pass zero_optimization={{{key!r}: ...}}"
        )
    valid = sorted({*options, *TrainingConfig().to_deepspeed(include_ignored=False)})
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"valid options: {', '.join(valid)}"
    raise ConfigError(f"{owner}: unknown option {key!r}; {hint}")


def _non_default(data: Mapping[str, Any], default: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        base = default.get(key)
        if isinstance(value, Mapping) and isinstance(base, Mapping):
            value = _non_default(value, base)
            if value:
                out[key] = value
        elif key not in default or value != base:
            out[key] = value
    return out
