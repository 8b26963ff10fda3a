"""`resolve_plan`: a DeepSpeed config plus the framework's own arguments, resolved once into a `ZeroPlan`.

Every entry point (`initialize`, `apply_zero`, the Lightning Trainer and Fabric strategies, the Accelerate adapter,
`ds-plugin check-config --world-size`) turns its inputs into one frozen plan of plain values here, and `setup_zero`
(`setup.py`) applies it; below it nothing reads a raw config. This is the only place where values that depend on the
world size or the framework are resolved, with the config's one-line errors: "auto" values filled from the framework
(the way the transformers integration does), batch sizes against the world size, the hpZ group against the world
size, FP8 all-gather against the stage, offload against the device.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from ds_plugin.config import (
    AUTO,
    CommsLoggerConfig,
    ConfigError,
    FP8Config,
    FP16Config,
    OptimizerConfig,
    SchedulerConfig,
    TrainingConfig,
    ZeroConfig,
)
from ds_plugin.optimizer_config import fill_auto
from ds_plugin.presets import ConfigSource, load_config
from ds_plugin.zero.mesh import ZeroSetupError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "FrameworkSettings",
    "ZeroPlan",
    "dataloader_batch_size",
    "plan_for",
    "refuse_framework_auto",
    "resolve_plan",
]

logger = logging.getLogger(__name__)

DType = Literal["fp32", "fp16", "bf16"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FrameworkSettings:
    """What a framework (the Lightning Trainer, Fabric) says about the run, beside the DeepSpeed config.

    A value the config leaves at "auto" (or, for a DeepSpeed default the user did not write, leaves unset) is
    taken from here; an explicit config value (`TrainingConfig.explicit_keys`, recorded when the config was read)
    that disagrees with the framework's is an error, not a silent pick.
    """

    owner: str
    """The adapter's name, for error messages ("ZeroStrategy")."""
    precision: DType | None = None
    """The framework's compute dtype; None when it has no say (`initialize`)."""
    precision_label: str | None = None
    """How the user spelled it ("bf16-mixed"), for messages."""
    config_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Config sections the framework's precision plugin sets (FP8 adds its `fp8` block)."""
    micro_batch_size: int | None = None
    """The dataloader's batch size (used where the config says "auto")."""
    accumulation: int | None = None
    """The framework's gradient accumulation steps."""
    accumulation_setting: str = "gradient accumulation"
    """How the framework names its accumulation setting, for messages."""
    clip: float | None = None
    """The framework's gradient clipping norm (None: it has no setting; `clip_default` applies)."""
    clip_default: float = 0.0
    """The clipping norm when neither the config nor the framework's setting gives one: 0 (off) for frameworks
    whose loop clips (Lightning's `gradient_clip_val`), 1.0 for Accelerate, whose DeepSpeed integration fills that
    into a config's "auto" or absent `gradient_clipping`."""
    clip_setting: str = "gradient clipping"
    """How the framework names its clipping setting, for messages."""
    auto_values: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Values for "auto" params of the `optimizer` / `scheduler` blocks, by dotted key ("optimizer.params.lr"):
    what Accelerate's DummyOptim / DummyScheduler or the HF Trainer's arguments say."""


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
    prefetch_numel: int
    """`stage3_prefetch_bucket_size`: parameter elements whose all-gather may run ahead of use (stages 2/3)."""
    reuse_numel: int
    """`stage3_max_reuse_distance`: stage 3 keeps a block gathered from its forward to its backward when fewer
    parameter elements than this run in between (see `zero/apply.py`)."""
    live_numel: int
    """`stage3_max_live_parameters`: at most this many parameter elements of blocks are kept that way."""
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
    """CPU runs: make glibc keep freed memory mapped (see `host_memory.py`)."""
    chunked_loss: bool
    """Hugging Face causal LMs compute their loss with `kernels.cross_entropy.causal_lm_loss`."""
    blocked_logits: bool
    """Hugging Face models' output layers compute on CPU with `kernels.blocked_logits.blocked_linear`."""
    non_finite_gradients: str
    """Without a loss scaler (bf16/fp32): "error" stops at a non-finite gradient, "skip" skips that step."""
    save_16bit_weights: bool
    """`stage3_gather_16bit_weights_on_model_save`: whole-model saves (HF `save_model`, Accelerate `get_state_dict`)
    give parameters in the compute dtype, not the fp32 masters."""
    optimizer: OptimizerConfig | None = None
    """The config's `optimizer` block ("auto" filled where the framework said): built when no optimizer is passed."""
    scheduler: SchedulerConfig | None = None
    """The config's `scheduler` block ("auto" filled where the framework said): built when no scheduler is passed."""

    def check_world(self, world_size: int) -> None:
        """Refuse a mesh of another size than the plan was resolved for.

        Args:
            world_size: the mesh's size.

        Raises:
            ZeroSetupError: the sizes differ.
        """
        if self.world_size != world_size:
            raise ZeroSetupError(
                f"the plan was resolved for {self.world_size} ranks but the mesh has {world_size}; "
                "resolve it for this mesh"
            )


def _framework_value(config: TrainingConfig, fw: FrameworkSettings, key: str, value: Any, setting: str) -> Any:
    """The framework's value where the config says "auto" or nothing it chose; a clash is an error."""
    current = getattr(config, key)
    if current == AUTO or current is None or key not in config.explicit_keys:
        return value
    if value is not None and value != current:
        raise ConfigError(
            f"{key}: the config says {current!r} but {setting}={value!r}; set it in one place "
            f'(or write "{key}": "auto" in the config)'
        )
    return current


def _fill_precision(config: TrainingConfig, precision: DType | None) -> TrainingConfig:
    """The one fill of an "auto" `fp16.enabled` / `bf16.enabled`: on where it is the framework's precision, else off
    (without a framework, off)."""
    if AUTO not in (config.fp16.enabled, config.bf16.enabled):
        return config
    return config.replace(
        fp16={"enabled": precision == "fp16"} if config.fp16.enabled == AUTO else {},
        bf16={"enabled": precision == "bf16"} if config.bf16.enabled == AUTO else {},
    )


def _apply_framework(config: TrainingConfig, fw: FrameworkSettings) -> tuple[TrainingConfig, Any]:
    """Fill the config from the framework: precision, accumulation, clipping, micro batch size."""
    if fw.config_overrides:
        config = config.replace(**fw.config_overrides)
    precision = fw.precision
    if precision is not None:
        config = _fill_precision(config, precision)
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
        gradient_clipping=float(clip if clip is not None else fw.clip_default),
        train_micro_batch_size_per_gpu=AUTO if mb in (AUTO, None) and fw.micro_batch_size else mb,
    )
    return config, ga


def _prefetch_numel(value: Any) -> int:
    # "auto" (the HF Trainer fills it from the hidden size; nothing did here) takes the key's default.
    if value == AUTO:
        value = ZeroConfig.__dataclass_fields__["stage3_prefetch_bucket_size"].default
    return int(value)


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


def _check_batch(tb: Any, mb: Any, ga: Any, world: int) -> tuple[Any, Any, Any]:
    """DeepSpeed's rule: train_batch_size = micro x accumulation x world; any two (with the world) give the third."""
    if AUTO in (tb, mb, ga):
        return tb, mb, ga
    if world < 1:
        raise ConfigError(f"world size {world} must be at least 1")
    if tb is not None and mb is not None and ga is not None:
        if tb != mb * ga * world:
            raise ConfigError(
                f"train_batch_size: {tb} != train_micro_batch_size_per_gpu {mb} x gradient_accumulation_steps {ga} "
                f"x world size {world} = {mb * ga * world}; fix one of the three or drop train_batch_size"
            )
    elif tb is not None and mb is not None:
        if tb % (mb * world):
            raise ConfigError(
                f"train_batch_size: {tb} is not divisible by train_micro_batch_size_per_gpu {mb} x world size {world}"
            )
        ga = tb // (mb * world)
    elif tb is not None and ga is not None:
        if tb % (ga * world):
            raise ConfigError(
                f"train_batch_size: {tb} is not divisible by gradient_accumulation_steps {ga} x world size {world}"
            )
        mb = tb // (ga * world)
    elif tb is not None:
        ga = 1
        if tb % world:
            raise ConfigError(f"train_batch_size: {tb} is not divisible by the world size {world}")
        mb = tb // world
    elif mb is not None:
        ga = ga or 1
        tb = mb * ga * world
    return tb, mb, ga


def _check_fp8_all_gather(config: TrainingConfig, world_size: int) -> None:
    """Refuse `fp8.all_gather` where it cannot act: without FP8 layers, below stage 3, or with hpZ.

    Not a parse-time check: an adapter's precision plugin adds the `fp8` block (`FrameworkSettings.config_overrides`)
    to a config whose stage it did not choose.
    """
    if not config.fp8.all_gather:
        return
    if not config.fp8.enabled:
        raise ConfigError(
            "fp8.all_gather: needs fp8.enabled (it gathers the weights of the FP8 layers); "
            "set fp8.enabled to true or turn fp8.all_gather off"
        )
    if config.stage != 3:
        raise ConfigError(
            f"fp8.all_gather: needs zero_optimization.stage 3 (stage {config.stage} does not gather sharded "
            "weights for every forward); set stage to 3 or turn fp8.all_gather off"
        )
    hpz = config.zero_optimization.zero_hpz_partition_size
    if hpz != AUTO and int(hpz) > 1 and int(hpz) < world_size:
        raise ConfigError(
            f"fp8.all_gather: cannot combine with zero_optimization.zero_hpz_partition_size {hpz} (FSDP2 has no "
            "FP8 path for hpZ's secondary shard); set zero_hpz_partition_size to 1 or turn fp8.all_gather off"
        )


def _resolve_world(
    config: TrainingConfig,
    *,
    world_size: int,
    ranks_per_node: int,
    micro_batch_size: int | None,
    gradient_accumulation_steps: int | None,
) -> TrainingConfig:
    """The config with every value that needs the world size resolved: batch sizes, the hpZ group, the "auto" left
    over once the framework had its say (precision off, DeepSpeed's clipping of 1.0)."""
    config = _fill_precision(config, None)
    mb = config.train_micro_batch_size_per_gpu
    mb = micro_batch_size if mb == AUTO else mb
    ga = config.gradient_accumulation_steps
    ga = gradient_accumulation_steps if ga == AUTO else ga
    tb = None if config.train_batch_size == AUTO else config.train_batch_size
    clip = 1.0 if config.gradient_clipping == AUTO else config.gradient_clipping
    tb, mb, ga = _check_batch(tb, mb, ga, world_size)
    zero = config.zero_optimization
    hpz = ranks_per_node if zero.zero_hpz_partition_size == AUTO else zero.zero_hpz_partition_size
    if int(hpz) > 1 and (world_size % int(hpz) or int(hpz) > world_size):
        raise ConfigError(
            f"zero_optimization.zero_hpz_partition_size: {hpz} does not divide the world size {world_size}; "
            "use a divisor of the world size (usually the ranks per node)"
        )
    config = dataclasses.replace(
        config,
        train_batch_size=tb,
        train_micro_batch_size_per_gpu=mb,
        gradient_accumulation_steps=ga,
        gradient_clipping=clip,
        zero_optimization=dataclasses.replace(zero, zero_hpz_partition_size=hpz),
    )
    _check_fp8_all_gather(config, world_size)
    return config


def refuse_framework_auto(config: TrainingConfig) -> None:
    """Refuse the "auto" values only a framework can fill, for a run without one (`initialize`).

    Raises:
        ConfigError: one line naming the key.
    """
    for key in ("gradient_accumulation_steps", "gradient_clipping"):
        if getattr(config, key) == AUTO:
            raise ConfigError(f'{key}: "auto" is not resolved; without a framework to take it from, write the value')


def resolve_plan(
    config: ConfigSource,
    *,
    world_size: int,
    ranks_per_node: int | None = None,
    device_type: str = "cpu",
    framework: FrameworkSettings | None = None,
    check_only: bool = False,
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
        check_only: no framework and no run (`ds-plugin check-config --world-size`): an "auto" that a framework
            would fill is not an error; it takes what a framework without a say gives (DeepSpeed's defaults).

    Raises:
        ConfigError: one line naming the dotted key and the fix.
    """
    config = load_config(config)
    if ranks_per_node is None:
        ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    ranks_per_node = max(1, min(ranks_per_node, world_size))
    ga = None
    if framework is not None:
        config, ga = _apply_framework(config, framework)
    elif not check_only:
        refuse_framework_auto(config)
    config = _resolve_world(
        config,
        world_size=world_size,
        ranks_per_node=ranks_per_node,
        micro_batch_size=framework.micro_batch_size if framework else None,
        gradient_accumulation_steps=ga,
    )
    optimizer, scheduler = fill_auto(config.optimizer, config.scheduler, framework.auto_values if framework else {})
    config = dataclasses.replace(config, optimizer=optimizer, scheduler=scheduler)
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
        prefetch_numel=_prefetch_numel(zero.stage3_prefetch_bucket_size),
        reuse_numel=int(zero.stage3_max_reuse_distance),
        live_numel=int(zero.stage3_max_live_parameters),
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
        chunked_loss=config.chunked_loss,
        blocked_logits=config.blocked_logits,
        non_finite_gradients=config.non_finite_gradients,
        # "auto": false, the value Accelerate's DeepSpeed integration fills unless told to save 16-bit weights.
        save_16bit_weights=config.zero_optimization.stage3_gather_16bit_weights_on_model_save is True,
        optimizer=optimizer,
        scheduler=scheduler,
    )


def plan_for(config: ZeroPlan | ConfigSource, mesh: DeviceMesh) -> ZeroPlan:
    """The plan for a config on a mesh, for the entry points that take either (`initialize`, `apply_zero`,
    `init_sharded`); a plan is returned as is, its world size checked against the mesh's.

    Args:
        config: a `ZeroPlan`, or anything `resolve_plan` reads.
        mesh: the data-parallel mesh.
    """
    if isinstance(config, ZeroPlan):
        config.check_world(mesh.size())
        return config
    return resolve_plan(config, world_size=mesh.size(), device_type=mesh.device_type)


def dataloader_batch_size(loader: Any) -> int | None:
    """A dataloader's batch size (for `FrameworkSettings.micro_batch_size`), or None.

    Args:
        loader: a `DataLoader` (or anything with `batch_sampler.batch_size` / `batch_size`).
    """
    return getattr(getattr(loader, "batch_sampler", None), "batch_size", None) or getattr(loader, "batch_size", None)
