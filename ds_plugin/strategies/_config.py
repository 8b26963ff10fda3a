"""The strategies' DeepSpeed config: read it once (preset, path, dict or `TrainingConfig`, plus constructor overrides)
and say which keys the user chose, so the plan (`ds_plugin.zero.plan`) lets the framework fill the rest.

Shared by the Lightning Trainer and Fabric adapters; a mapping, not an algorithm.
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
from ds_plugin.presets import PRESETS, get_preset

__all__ = ["ConfigSource", "batch_size", "load_strategy_config"]

ConfigSource = str | os.PathLike | Mapping[str, Any] | TrainingConfig
_ZERO_KEYS = frozenset(TrainingConfig().zero_optimization.__dataclass_fields__)


def _check_option(owner: str, key: str, value: Any, options: Iterable[str]) -> None:
    try:
        from_deepspeed({key: value})
        return
    except ConfigError as e:
        if not str(e).startswith(f"{key}: unknown key"):
            return  # a DeepSpeed key with a bad value: the full parse below names it
    if key in _ZERO_KEYS:
        raise ConfigError(
            f"{owner}: unknown option {key!r}; it is a ZeRO setting, pass zero_optimization={{{key!r}: ...}}"
        )
    valid = sorted({*options, *TrainingConfig().to_deepspeed(include_ignored=False)})
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"valid options: {', '.join(valid)}"
    raise ConfigError(f"{owner}: unknown option {key!r}; {hint}")


def _raw(config: ConfigSource) -> Mapping[str, Any] | TrainingConfig:
    """The config as the user wrote it: a preset's dict, a file's contents (read once), a dict, or a config."""
    if isinstance(config, TrainingConfig | Mapping):
        return config
    if isinstance(config, str) and config in PRESETS:
        return copy.deepcopy(PRESETS[config])
    if isinstance(config, str) and not Path(config).suffix and not Path(config).exists():
        get_preset(config)  # an unknown name: raises, naming the closest preset
    return read_config_file(Path(config))


def load_strategy_config(
    config: ConfigSource, overrides: Mapping[str, Any], *, owner: str, options: Iterable[str]
) -> tuple[TrainingConfig, frozenset[str]]:
    """The strategy's config and the top-level keys the user set (in the source or as overrides).

    Args:
        config: a preset name, a DeepSpeed .json/.yaml path, a dict, or a `TrainingConfig`.
        overrides: top-level DeepSpeed keys given to the strategy's constructor (sections merge one level deep).
        owner: the strategy's name, for error messages.
        options: the strategy's own keyword names, suggested for near misses.
    """
    for key, value in overrides.items():
        _check_option(owner, key, value, options)
    raw = _raw(config)
    if isinstance(raw, TrainingConfig):
        if not overrides:
            return raw, _chosen(raw)
        # Overrides go through the parser like any other key: merge them into what the config says beyond DeepSpeed's
        # defaults (a default written out would be reported as an ignored key the user never wrote).
        chosen, raw = _chosen(raw), _non_default(raw.to_deepspeed(), TrainingConfig().to_deepspeed())
    elif isinstance(raw, Mapping):
        chosen = frozenset(raw)
    else:
        raise ConfigError(f"{owner}: the config must be a JSON object (a dict), got {type(raw).__name__}")
    merged = dict(raw)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return from_deepspeed(merged), chosen | frozenset(overrides)


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


def _chosen(config: TrainingConfig) -> frozenset[str]:
    """The top-level keys a `TrainingConfig` sets away from DeepSpeed's defaults (what its author chose)."""
    default = TrainingConfig()
    fields = [f.name for f in dataclasses.fields(config) if not f.metadata.get("internal")]
    return frozenset(k for k in fields if getattr(config, k) != getattr(default, k))


def batch_size(loader: Any) -> int | None:
    """A dataloader's batch size (for an "auto" `train_micro_batch_size_per_gpu`), or None.

    Args:
        loader: a `DataLoader` (or anything with `batch_sampler.batch_size` / `batch_size`).
    """
    return getattr(getattr(loader, "batch_sampler", None), "batch_size", None) or getattr(loader, "batch_size", None)
