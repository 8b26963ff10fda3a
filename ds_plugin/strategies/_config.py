"""The strategies' DeepSpeed config: read it (preset, path, dict or `TrainingConfig`, plus constructor overrides)
and resolve it against the framework's own arguments, the way the transformers integration fills "auto".

Shared by the Lightning Trainer and Fabric adapters; a mapping, not an algorithm.
"""

from __future__ import annotations

import difflib
import inspect
import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from ds_plugin.config import AUTO, ConfigError, TrainingConfig, from_deepspeed
from ds_plugin.presets import PRESETS, get_preset

__all__ = ["ConfigSource", "batch_size", "load_strategy_config", "resolve_config"]

logger = logging.getLogger(__name__)

ConfigSource = str | os.PathLike | Mapping[str, Any] | TrainingConfig
_ZERO_KEYS = frozenset(TrainingConfig().zero_optimization.__dataclass_fields__)


def _raw_keys(source: Any) -> frozenset[str]:
    """Top-level keys the user wrote, so a DeepSpeed default is not mistaken for a choice."""
    if isinstance(source, TrainingConfig):
        default = TrainingConfig()
        return frozenset(k for k in source.__dataclass_fields__ if getattr(source, k) != getattr(default, k))
    if isinstance(source, Mapping):
        return frozenset(source)
    if isinstance(source, str) and source in PRESETS:
        return frozenset(PRESETS[source])
    try:
        text = Path(source).read_text()
        data = yaml.safe_load(text) if Path(source).suffix.lower() in (".yaml", ".yml") else json.loads(text)
    except (OSError, ValueError, yaml.YAMLError):
        return frozenset()  # from_deepspeed reports the unreadable file
    return frozenset(data) if isinstance(data, Mapping) else frozenset()


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


def load_strategy_config(
    config: ConfigSource, overrides: Mapping[str, Any], *, owner: str, cls: type
) -> tuple[TrainingConfig, frozenset[str]]:
    """The strategy's config and the top-level keys the user set (in the source or as overrides).

    Args:
        config: a preset name, a DeepSpeed .json/.yaml path, a dict, or a `TrainingConfig`.
        overrides: top-level DeepSpeed keys given to the strategy's constructor (sections merge one level deep).
        owner: the strategy's name, for error messages.
        cls: the strategy class; its constructor's keyword names are suggested for near misses.
    """
    params = inspect.signature(cls.__init__).parameters.values()
    options = [p.name for p in params if p.kind == p.KEYWORD_ONLY or p.name == "config"]
    for key, value in overrides.items():
        _check_option(owner, key, value, options)
    explicit = _raw_keys(config) | frozenset(overrides)
    if isinstance(config, str) and config not in PRESETS and not Path(config).suffix and not Path(config).exists():
        base = get_preset(config)  # an unknown name: get_preset names the closest preset
    elif isinstance(config, str) and config in PRESETS:
        base = get_preset(config)
    else:
        base = from_deepspeed(config)
    if not overrides:
        return base, explicit
    data = base.to_deepspeed()
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(data.get(key), Mapping):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return from_deepspeed(data), explicit


def batch_size(loader: Any) -> int | None:
    """A dataloader's batch size (for an "auto" `train_micro_batch_size_per_gpu`), or None.

    Args:
        loader: a `DataLoader` (or anything with `batch_size` / `batch_sampler.batch_size`).
    """
    return getattr(getattr(loader, "batch_sampler", None), "batch_size", None) or getattr(loader, "batch_size", None)


def _framework_value(config: TrainingConfig, explicit: frozenset[str], key: str, value: Any, setting: str) -> Any:
    """The framework's value where the config says "auto" or nothing; a clash with an explicit value is an error."""
    current = getattr(config, key)
    if current == AUTO or (key not in explicit and current is not None) or current is None:
        return value
    if value is not None and value != current:
        raise ConfigError(
            f"{key}: the config says {current!r} but {setting}={value!r}; set it in one place "
            f'(or write "{key}": "auto" in the config)'
        )
    return current


def resolve_config(
    config: TrainingConfig,
    explicit: frozenset[str],
    *,
    plugin: Any,
    world_size: int,
    ranks_per_node: int,
    owner: str,
    micro_batch_size: int | None = None,
    accumulation: int | None = None,
    clip: float | None = None,
) -> TrainingConfig:
    """Fill the config from the framework: precision, world, accumulation, clipping, micro batch size.

    Args:
        config: the strategy's config.
        explicit: the top-level keys the user set (a DeepSpeed default yields to the framework).
        plugin: the `ZeroPrecision` (its compute dtype, and the sections it sets, e.g. FP8's).
        world_size: data-parallel ranks.
        ranks_per_node: ranks on one node (an "auto" hpZ group).
        owner: the strategy's name, for messages.
        micro_batch_size: the dataloader's batch size (used where the config says "auto").
        accumulation: the framework's gradient accumulation (Trainer `accumulate_grad_batches`).
        clip: the framework's gradient clipping norm (Trainer `gradient_clip_val`; None = off).
    """
    config = config.replace(**plugin.config_overrides())
    precision, precision_label = plugin.compute_dtype, plugin.precision
    if AUTO in (config.fp16.enabled, config.bf16.enabled):
        config = config.resolve(precision=precision)
    if precision != "fp32":
        if config.compute_dtype not in ("fp32", precision):
            raise ConfigError(
                f"{owner}: precision={precision_label!r} trains in {precision} but the config enables "
                f"{config.compute_dtype}; set the precision in one place"
            )
        config = config.replace(fp16={"enabled": precision == "fp16"}, bf16={"enabled": precision == "bf16"})
    elif config.compute_dtype != "fp32":
        logger.info("%s: the config's %s block sets the compute dtype", owner, config.compute_dtype)
    setting = "Trainer(accumulate_grad_batches)"
    ga = _framework_value(config, explicit, "gradient_accumulation_steps", accumulation, setting)
    clip_value = _framework_value(config, explicit, "gradient_clipping", clip, "Trainer(gradient_clip_val)")
    mb = config.train_micro_batch_size_per_gpu
    config = config.replace(
        gradient_accumulation_steps=AUTO if ga is not None else None,
        gradient_clipping=float(clip_value or 0.0),
        train_micro_batch_size_per_gpu=AUTO if mb in (AUTO, None) and micro_batch_size else mb,
    )
    return config.resolve(
        world_size=world_size,
        ranks_per_node=min(ranks_per_node, world_size),
        micro_batch_size=micro_batch_size,
        gradient_accumulation_steps=ga,
    )
