"""`ZeroPlugin`: the DeepSpeed config an Accelerate run trains with, in the style of Accelerate's own plugins.

Accelerate's plugins (`DeepSpeedPlugin`, `FullyShardedDataParallelPlugin`) are dataclasses handed to `Accelerator`;
this one is handed to `ds_plugin.accelerate.Accelerator(zero_plugin=...)`. The config is read and checked when the
plugin is built, so a missing or invalid config fails before any process group starts.

Two kinds of fields, as in `DeepSpeedPlugin`:

* overrides (`zero_stage`, `offload_*_device`, `frozen_format`, `overrides`): merged over the config, as if the
  config said them;
* the training loop's own values (`gradient_accumulation_steps`, `gradient_clipping`): they fill the config's
  "auto" values (and the DeepSpeed defaults the user did not write); an explicit config value that disagrees is an
  error, not a silent pick (see `ds_plugin.zero.plan.FrameworkSettings`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from ds_plugin.config import ConfigError, TrainingConfig
from ds_plugin.presets import ConfigSource, load_config

__all__ = ["CONFIG_ENV", "ZeroPlugin"]

CONFIG_ENV = "DS_PLUGIN_CONFIG"
"""The environment variable `ZeroPlugin.from_env()` reads: a DeepSpeed .json/.yaml path, a preset name, or inline
JSON (`{"zero_optimization": {"stage": 3}}`)."""


def _config_from_env_value(value: str) -> ConfigSource:
    text = value.strip()
    if text.startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{CONFIG_ENV}: not valid inline JSON ({e.msg} at column {e.colno})") from None
    return text


@dataclasses.dataclass
class ZeroPlugin:
    """DeepSpeed ZeRO 0-3 / ZeRO++ / mixed precision for `ds_plugin.accelerate.Accelerator`.

    Args:
        config: a DeepSpeed .json/.yaml path, a dict, a preset name ("zero2", "zero3", "zeropp", ...) or a
            `ds_plugin.TrainingConfig`.
        zero_stage: override `zero_optimization.stage`.
        offload_optimizer_device: override `zero_optimization.offload_optimizer.device` ("none" or "cpu").
        offload_param_device: override `zero_optimization.offload_param.device` ("none" or "cpu").
        frozen_format: override `zero_optimization.frozen_format` (storage of frozen Linear weights: "int8",
            "int4", "nf4" or "none").
        overrides: more top-level DeepSpeed keys merged over the config (sections one level deep).
        gradient_accumulation_steps: the training loop's accumulation steps, where it is not Accelerate's
            (the HF Trainer accumulates itself); default `Accelerator(gradient_accumulation_steps=...)`.
        gradient_clipping: the training loop's max gradient norm (the HF Trainer's `max_grad_norm`); default none:
            the config's `gradient_clipping`, and where that is "auto" or absent 1.0, as Accelerate's DeepSpeed
            integration fills it (the step clips to it; a script's own `clip_grad_norm_` comes on top).
        block_types: module classes or names to shard as separate units; default the transformers models'
            `_no_split_modules`, else the repeated children of `nn.ModuleList`s.
        sync_module_states: start every rank from rank 0's weights, as DDP does.
    """

    config: ConfigSource | None = None
    zero_stage: int | None = None
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    frozen_format: str | None = None
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float | None = None
    block_types: Any = None
    sync_module_states: bool = True
    # How the loop names the two values above, for clash messages (the HF Trainer: its TrainingArguments).
    accumulation_setting: str = dataclasses.field(default="ZeroPlugin(gradient_accumulation_steps)", repr=False)
    clip_setting: str = dataclasses.field(default="ZeroPlugin(gradient_clipping)", repr=False)

    def __post_init__(self) -> None:
        if self.config is None:
            raise ConfigError(
                f"ZeroPlugin: no DeepSpeed config; pass ZeroPlugin(config='ds_config.json' or a preset name) or set "
                f"{CONFIG_ENV}"
            )
        if self.gradient_accumulation_steps is not None and int(self.gradient_accumulation_steps) < 1:
            raise ConfigError(
                f"ZeroPlugin: gradient_accumulation_steps={self.gradient_accumulation_steps}; it must be 1 or more"
            )
        options = [f.name for f in dataclasses.fields(self) if f.repr]
        self._training_config = load_config(self.config, self._merged_overrides(), owner="ZeroPlugin", options=options)

    def _merged_overrides(self) -> dict[str, Any]:
        """The override fields as DeepSpeed keys, merged over `overrides`."""
        merged: dict[str, Any] = {k: dict(v) if isinstance(v, Mapping) else v for k, v in self.overrides.items()}
        zero: dict[str, Any] = {}
        if self.zero_stage is not None:
            zero["stage"] = int(self.zero_stage)
        if self.offload_optimizer_device is not None:
            zero["offload_optimizer"] = {"device": self.offload_optimizer_device}
        if self.offload_param_device is not None:
            zero["offload_param"] = {"device": self.offload_param_device}
        if self.frozen_format is not None:
            zero["frozen_format"] = self.frozen_format
        if zero:
            merged["zero_optimization"] = {**merged.get("zero_optimization", {}), **zero}
        return merged

    @classmethod
    def from_env(cls, **kwargs: Any) -> ZeroPlugin:
        """The plugin for the config named by `DS_PLUGIN_CONFIG` (a path, a preset name or inline JSON).

        Args:
            kwargs: the other `ZeroPlugin` fields.

        Raises:
            ConfigError: the variable is unset or empty, or the config is invalid (one line).
        """
        value = os.environ.get(CONFIG_ENV, "")
        if not value.strip():
            raise ConfigError(
                f"{CONFIG_ENV} is not set; set it to a DeepSpeed config path or preset name (zero2, zero3, zeropp), "
                "or pass --ds-config to python -m ds_plugin.accelerate"
            )
        return cls(config=_config_from_env_value(value), **kwargs)

    @property
    def training_config(self) -> TrainingConfig:
        """The parsed config with the overrides merged in ("auto" values still unresolved)."""
        return self._training_config

    @property
    def explicit_keys(self) -> frozenset[str]:
        """Top-level keys the user wrote (in the config or as overrides): the framework does not override them."""
        return self._training_config.explicit_keys
