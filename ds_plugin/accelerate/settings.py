"""Accelerate's own arguments mapped onto the core's `FrameworkSettings`, and what ds_plugin refuses to run with.

DeepSpeed's "auto" values are the framework's to fill (as transformers' DeepSpeed integration does): here Accelerate's
`mixed_precision` (fp8 meaning the config's `fp8` block on bf16 compute), its `gradient_accumulation_steps`, the first
prepared dataloader's batch size, and the loop's max grad norm when it has one (`ZeroPlugin.gradient_clipping`; the HF
Trainer's `max_grad_norm`). The resolution itself, and every clash check, is `ds_plugin.zero.plan.resolve_plan`'s.
"""

from __future__ import annotations

import os
from typing import Any

from ds_plugin.accelerate.plugin import ZeroPlugin
from ds_plugin.config import ConfigError
from ds_plugin.zero.plan import FrameworkSettings, ZeroPlan

__all__ = ["describe_plan", "framework_settings", "refuse_other_engines"]

PRECISION = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}
"""Accelerate's `mixed_precision` -> the config's compute dtype (DeepSpeed's mixed precision: no autocast)."""


def framework_settings(
    plugin: ZeroPlugin, *, mixed_precision: str, accumulation: int, micro_batch_size: int | None
) -> FrameworkSettings:
    """What Accelerate (and the loop inside it) says about the run.

    Args:
        plugin: the run's `ZeroPlugin` (the loop's accumulation / clipping, if it set them).
        mixed_precision: Accelerate's setting: "no", "fp16", "bf16" or "fp8".
        accumulation: `Accelerator(gradient_accumulation_steps=...)`.
        micro_batch_size: the first prepared dataloader's batch size per process, if any.

    Raises:
        ConfigError: the plugin's accumulation disagrees with Accelerate's.
    """
    ga = plugin.gradient_accumulation_steps
    if ga is not None and accumulation > 1 and int(ga) != accumulation:
        raise ConfigError(
            f"{plugin.accumulation_setting}={ga} disagrees with Accelerator(gradient_accumulation_steps="
            f"{accumulation}); set it in one place"
        )
    fp8 = mixed_precision == "fp8"
    return FrameworkSettings(
        owner="ds_plugin.accelerate.Accelerator",
        precision=PRECISION["bf16" if fp8 else mixed_precision],
        precision_label=f"mixed_precision={mixed_precision}",
        config_overrides={"fp8": {"enabled": True}} if fp8 else {},
        micro_batch_size=micro_batch_size,
        accumulation=int(ga) if ga is not None else accumulation,
        accumulation_setting=plugin.accumulation_setting
        if ga is not None
        else "Accelerator(gradient_accumulation_steps)",
        clip=plugin.gradient_clipping,
        clip_setting=plugin.clip_setting,
        # Accelerate's `_prepare_deepspeed` fills an "auto" (or absent) gradient_clipping with 1.0: DeepSpeed then clips
        # every step whether or not the script calls clip_grad_norm_.
        clip_default=1.0,
    )


def describe_plan(plan: ZeroPlan) -> str:
    """One line saying what the engine will run (logged by the main process at setup).

    Args:
        plan: the resolved plan.
    """
    extras = []
    if plan.quantized_weights_block:
        extras.append("qwZ")
    if isinstance(plan.reshard_after_forward, int) and not isinstance(plan.reshard_after_forward, bool):
        extras.append(f"hpZ {plan.reshard_after_forward}")
    if plan.quantized_gradients_block:
        extras.append("qgZ")
    if plan.offload:
        extras.append("offload")
    if plan.fp8 is not None:
        extras.append(f"fp8 {plan.fp8.recipe}")
    if plan.frozen_format:
        extras.append(f"frozen {plan.frozen_format}")
    plus = f" + {', '.join(extras)}" if extras else ""
    micro = plan.config.train_micro_batch_size_per_gpu
    return (
        f"ZeRO stage {plan.stage}{plus} on {plan.world_size} ranks: compute {plan.compute_dtype}, reduce "
        f"{plan.reduce_dtype}, gradient accumulation {plan.gradient_accumulation_steps}, clipping "
        f"{plan.gradient_clipping:g}, micro batch {micro if micro is not None else 'unknown'}"
    )


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


def refuse_other_engines(kwargs: dict[str, Any] | None = None) -> None:
    """Refuse Accelerate's DeepSpeed / FSDP plugins (arguments or the launch config's environment), in one line.

    Args:
        kwargs: `Accelerator` keyword arguments to check (None: only the environment).

    Raises:
        ConfigError: a DeepSpeed or FSDP plugin of Accelerate's is in use.
    """
    kwargs = kwargs or {}
    if kwargs.get("deepspeed_plugin") is not None or kwargs.get("deepspeed_plugins") is not None:
        raise ConfigError(
            "Accelerator(deepspeed_plugin=...): ds_plugin replaces Accelerate's DeepSpeed plugin; drop the plugin "
            "and give its config as ZeroPlugin(config=...) or --ds-config"
        )
    if kwargs.get("fsdp_plugin") is not None:
        raise ConfigError(
            "Accelerator(fsdp_plugin=...): ds_plugin already shards the model with FSDP2; drop the FSDP plugin"
        )
    if _truthy("ACCELERATE_USE_DEEPSPEED"):
        # Only reached without the bootstrap, which turns a DEEPSPEED launch config into ds_plugin's config.
        raise ConfigError(
            "the accelerate launch config selects distributed_type: DEEPSPEED; add `-m ds_plugin.accelerate` before "
            "the script in the accelerate launch command, which reads that config"
        )
    if _truthy("ACCELERATE_USE_FSDP"):
        raise ConfigError(
            "the accelerate launch config selects distributed_type: FSDP; ds_plugin needs MULTI_GPU (also on CPU) "
            "with the DeepSpeed config in --ds-config"
        )
