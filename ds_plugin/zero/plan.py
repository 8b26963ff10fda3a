"""`resolve_plan`: a DeepSpeed config plus the framework's own arguments, resolved once into a `ZeroPlan`.

Every entry point (`initialize`, the Lightning Trainer and Fabric strategies, any adapter to come) turns its
inputs into one frozen plan of plain values here, and `setup_zero` (`setup.py`) applies it. Every consistency
check runs in this one step, with the config's one-line errors: "auto" values filled from the framework (the
way the transformers integration does), batch sizes against the world size, the hpZ group against the world
size, FP8 all-gather against the stage, offload against the device.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any, Literal

from ds_plugin.config import AUTO, CommsLoggerConfig, ConfigError, FP8Config, FP16Config, TrainingConfig
from ds_plugin.presets import load_config

__all__ = ["FrameworkSettings", "ZeroPlan", "resolve_plan"]

logger = logging.getLogger(__name__)

DType = Literal["fp32", "fp16", "bf16"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FrameworkSettings:
    """What a framework (the Lightning Trainer, Fabric) says about the run, beside the DeepSpeed config.

    A value the config leaves at "auto" (or, for a DeepSpeed default the user did not write, leaves unset) is
    taken from here; an explicit config value that disagrees with the framework's is an error, not a silent pick.
    """

    owner: str
    """The adapter's name, for error messages ("ZeroStrategy")."""
    precision: DType | None = None
    """The framework's compute dtype; None when it has no say (`initialize`)."""
    precision_label: str | None = None
    """How the user spelled it ("bf16-mixed"), for messages."""
    config_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Config sections the framework's precision plugin sets (FP8 adds its `fp8` block)."""
    explicit_keys: frozenset[str] = frozenset()
    """Top-level keys the user wrote, so a DeepSpeed default the user did not choose yields to the framework."""
    micro_batch_size: int | None = None
    """The dataloader's batch size (used where the config says "auto")."""
    accumulation: int | None = None
    """The framework's gradient accumulation steps."""
    accumulation_setting: str = "gradient accumulation"
    """How the framework names its accumulation setting, for messages."""
    clip: float | None = None
    """The framework's gradient clipping norm (None = off)."""
    clip_setting: str = "gradient clipping"
    """How the framework names its clipping setting, for messages."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZeroPlan:
    """Everything setup and the engine need, as plain values resolved once (see `resolve_plan`)."""

    config: TrainingConfig = dataclasses.field(compare=False)
    """The resolved config (no "auto" left in a key that acts), kept for `ignored_keys()` and reports. Not part of
    equality: two plans are equal when they set up the same run, however the config spelled it."""
    world_size: int
    ranks_per_node: int
    device_type: str
    stage: int
    compute_dtype: DType
    reduce_dtype: DType
    grad_accum_dtype: DType
    reshard_after_forward: bool | int
    """FSDP2's setting for the blocks (stages 2/3): False (stage 2), True (stage 3), or hpZ's group size k."""
    offload: bool
    """Sharded state (fp32 masters, optimizer state) lives in host memory (`offload_optimizer`/`offload_param`)."""
    pin_memory: bool
    quantized_weights_block: int | None
    """qwZ: elements per INT8 scale; None = off."""
    quantized_gradients_block: int | None
    """qgZ: elements per INT4 scale; None = off."""
    frozen_format: str | None
    """Storage of frozen Linear weights: "int8", "int4" or "nf4" (see `quantize_frozen_`); None = as loaded."""
    frozen_group_size: int | None
    """Elements per scale of `frozen_format`; None = the format's default."""
    fp8: FP8Config | None
    """FP8 layers to swap in (recipe, skipped modules); None = off."""
    fp8_all_gather: bool
    gradient_accumulation_steps: int
    gradient_clipping: float
    """Clip the global gradient norm to this inside every optimizer step; 0 = off."""
    loss_scaling: FP16Config | None
    """DeepSpeed's dynamic (or static) loss scaling settings; None unless the compute dtype is fp16."""
    comms_logger: CommsLoggerConfig | None
    """The collective logger to switch on at setup; None = off."""
    host_memory_reuse: bool
    non_finite_gradients: str
    """Without a loss scaler (bf16/fp32): "error" stops at a non-finite gradient, "skip" skips that step."""
    """CPU runs: make glibc keep freed memory mapped (see `host_memory.py`)."""


def _framework_value(config: TrainingConfig, fw: FrameworkSettings, key: str, value: Any, setting: str) -> Any:
    """The framework's value where the config says "auto" or nothing it chose; a clash is an error."""
    current = getattr(config, key)
    if current == AUTO or current is None or key not in fw.explicit_keys:
        return value
    if value is not None and value != current:
        raise ConfigError(
            f"{key}: the config says {current!r} but {setting}={value!r}; set it in one place "
            f'(or write "{key}": "auto" in the config)'
        )
    return current


def _apply_framework(config: TrainingConfig, fw: FrameworkSettings, world_size: int) -> tuple[TrainingConfig, Any]:
    """Fill the config from the framework: precision, accumulation, clipping, micro batch size."""
    if fw.config_overrides:
        config = config.replace(**fw.config_overrides)
    precision = fw.precision
    if precision is not None:
        if AUTO in (config.fp16.enabled, config.bf16.enabled):
            # Only the precision: `resolve` would also turn an "auto" gradient_clipping into 1.0 here, before the
            # framework's clipping value is applied below.
            config = config.replace(
                fp16={"enabled": precision == "fp16"} if config.fp16.enabled == AUTO else {},
                bf16={"enabled": precision == "bf16"} if config.bf16.enabled == AUTO else {},
            )
        if precision != "fp32":
            if config.compute_dtype not in ("fp32", precision):
                raise ConfigError(
                    f"{fw.owner}: precision={fw.precision_label or precision!r} trains in {precision} but the config "
                    f"enables {config.compute_dtype}; set the precision in one place"
                )
            config = config.replace(fp16={"enabled": precision == "fp16"}, bf16={"enabled": precision == "bf16"})
        elif config.compute_dtype != "fp32":
            logger.info("%s: the config's %s block sets the compute dtype", fw.owner, config.compute_dtype)
    ga = _framework_value(config, fw, "gradient_accumulation_steps", fw.accumulation, fw.accumulation_setting)
    clip = _framework_value(config, fw, "gradient_clipping", fw.clip, fw.clip_setting)
    mb = config.train_micro_batch_size_per_gpu
    config = config.replace(
        gradient_accumulation_steps=AUTO if ga is not None else None,
        gradient_clipping=float(clip or 0.0),
        train_micro_batch_size_per_gpu=AUTO if mb in (AUTO, None) and fw.micro_batch_size else mb,
    )
    return config, ga


def _reshard_after_forward(stage: int, hpz: int, world_size: int) -> bool | int:
    if stage < 3:
        return False  # stage 2 keeps the gathered weights to backward; stages 0/1 do not shard weights at all
    if hpz <= 1:
        return True
    if hpz == world_size:
        # A secondary group spanning the whole world is the primary one; FSDP2 rejects the int form here.
        logger.info("hpZ partition size %d equals the world size: plain stage 3", hpz)
        return True
    return hpz


def _offload(config: TrainingConfig, device_type: str) -> tuple[bool, bool]:
    zero = config.zero_optimization
    wanted = "cpu" in (zero.offload_optimizer.device, zero.offload_param.device)
    if wanted and device_type == "cpu":
        logger.info("offload to cpu requested on a CPU-only run: everything already lives in host memory")
        return False, False
    pin = zero.offload_param.pin_memory if zero.offload_param.device == "cpu" else zero.offload_optimizer.pin_memory
    return wanted, pin


def resolve_plan(
    config: TrainingConfig | Mapping[str, Any] | str | os.PathLike,
    *,
    world_size: int,
    ranks_per_node: int | None = None,
    device_type: str = "cpu",
    framework: FrameworkSettings | None = None,
) -> ZeroPlan:
    """Resolve a config against the run into a `ZeroPlan`; every check runs here, once.

    Args:
        config: a preset name, a DeepSpeed .json/.yaml path, a dict or a `TrainingConfig`.
        world_size: data-parallel ranks.
        ranks_per_node: ranks on one node (an "auto" hpZ group, qgZ's two hops); default torchrun's
            `LOCAL_WORLD_SIZE`, else all ranks.
        device_type: the mesh's device type ("cpu", "cuda", ...): offload and host memory reuse depend on it.
        framework: the framework's own arguments; None for `initialize`, where the config must say everything
            ("auto" values are an error there, except the hpZ group).

    Raises:
        ConfigError: one line naming the dotted key and the fix.
    """
    config = load_config(config)
    if ranks_per_node is None:
        ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    ranks_per_node = max(1, min(ranks_per_node, world_size))
    ga = None
    if framework is not None:
        config, ga = _apply_framework(config, framework, world_size)
    else:
        for key in ("gradient_accumulation_steps", "gradient_clipping"):
            if getattr(config, key) == AUTO:
                raise ConfigError(
                    f'{key}: "auto" is not resolved; without a framework to take it from, write the value'
                )
    config = config.resolve(
        world_size=world_size,
        ranks_per_node=ranks_per_node,
        micro_batch_size=framework.micro_batch_size if framework else None,
        gradient_accumulation_steps=ga,
    )
    zero = config.zero_optimization
    offload, pin = _offload(config, device_type)
    return ZeroPlan(
        config=config,
        world_size=world_size,
        ranks_per_node=ranks_per_node,
        device_type=device_type,
        stage=config.stage,
        compute_dtype=config.compute_dtype,
        reduce_dtype=config.reduce_dtype,
        grad_accum_dtype=config.grad_accum_dtype,
        reshard_after_forward=_reshard_after_forward(config.stage, zero.hpz_partition_size, world_size),
        offload=offload,
        pin_memory=pin,
        quantized_weights_block=zero.zero_quantized_weights_block_size if zero.zero_quantized_weights else None,
        quantized_gradients_block=zero.zero_quantized_gradients_block_size if zero.zero_quantized_gradients else None,
        frozen_format=zero.frozen_storage,
        frozen_group_size=zero.frozen_group_size,
        fp8=config.fp8 if config.fp8.enabled else None,
        fp8_all_gather=config.fp8.enabled and config.fp8.all_gather,
        gradient_accumulation_steps=int(config.gradient_accumulation_steps or 1),
        gradient_clipping=float(config.gradient_clipping),
        loss_scaling=config.fp16 if config.compute_dtype == "fp16" else None,
        comms_logger=config.comms_logger if config.comms_logger.enabled else None,
        host_memory_reuse=config.host_memory_reuse and device_type == "cpu",
        non_finite_gradients=config.non_finite_gradients,
    )
