"""The training config: DeepSpeed's JSON schema as frozen dataclasses.

`from_deepspeed(dict | path)` reads a DeepSpeed config unchanged (old key spellings included) and
`TrainingConfig.to_deepspeed()` writes it back. Defaults are DeepSpeed 0.19's. Keys DeepSpeed knows but
that mean nothing on FSDP2 are accepted and listed by `ignored_keys()` with the reason. Anything else
wrong fails at parse time with a `ConfigError` that names the dotted key. The top-level keys the user wrote are
recorded (`explicit_keys`), so a framework fills only what the user left out.

This is the schema only: values that depend on the world size or the framework ("auto", batch sizes, the hpZ
group) are resolved by `ds_plugin.zero.plan.resolve_plan`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from ds_plugin._accelerate_yaml import accelerate_type
from ds_plugin._config_file import read_config_file
from ds_plugin._ignored_keys import (
    CONTIGUOUS_GRADIENTS,
    DS_RUNTIME_ONLY,
    FP8_NO_LOSS_SCALE,
    FSDP_BUCKETS,
    SUB_GROUPS,
    TOP_LEVEL_IGNORED,
    ZERO_IGNORED,
)
from ds_plugin._schema import AUTO, ConfigError, emit_section, option, parse_section, written_fields
from ds_plugin.optimizer_config import OptimizerConfig, SchedulerConfig

__all__ = [
    "AUTO",
    "BF16Config",
    "CommsLoggerConfig",
    "ConfigError",
    "DataTypesConfig",
    "FP8Config",
    "FP16Config",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "TrainingConfig",
    "ZeroConfig",
    "from_deepspeed",
    "read_config_file",
]

DType = Literal["fp32", "fp16", "bf16"]
Auto = Literal["auto"]
OffloadDevice = Literal["none", "cpu", "nvme"]


def _no_nvme(device: str) -> None:
    if device == "nvme":
        raise ConfigError('device: "nvme" offload is not supported (no NVMe swapper on FSDP2); use "cpu"')


@dataclasses.dataclass(frozen=True, kw_only=True)
class FP16Config:
    """`fp16`: FP16 mixed precision with DeepSpeed's dynamic loss scaling."""

    AUTO_IS_DEFAULT = True  # DeepSpeed's model of this section drops "auto" values

    enabled: bool | Auto = option(False, doc="train in fp16 with fp32 master weights", auto=True)
    auto_cast: bool = option(
        False,
        doc="cast the model's floating inputs to fp16 in forward",
        # Stages 0/1 cast in a forward pre-hook (zero/stage1.py), stages 2/3 through FSDP2's MixedPrecisionPolicy
        # (cast_forward_inputs): there is no way to turn the cast off, so neither value changes anything.
        ignored="forward's floating inputs are always cast to the compute dtype (fp16/bf16), at every stage",
    )
    loss_scale: float = option(0.0, doc="0 = dynamic loss scaling; > 0 = that static scale", ge=0)
    initial_scale_power: int = option(16, doc="dynamic scaling starts at 2**initial_scale_power", ge=0, le=64)
    loss_scale_window: int = option(1000, doc="clean steps before the scale doubles", ge=1)
    hysteresis: int = option(2, doc="overflows tolerated before the scale halves", ge=1)
    consecutive_hysteresis: bool = option(False, doc="refill the hysteresis on every clean step")
    min_loss_scale: float = option(1.0, doc="the scale never drops below this", gt=0)
    raise_error_at_min_scale: bool = option(
        True, doc="ds_plugin: an overflow at the minimum scale is an error (DeepSpeed's loss-scaler argument)"
    )

    IGNORED_KEYS = {"fp16_master_weights_and_grads": "master weights are always fp32 shards here"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class BF16Config:
    """`bf16` (old name `bfloat16`): BF16 mixed precision with fp32 master weights."""

    AUTO_IS_DEFAULT = True  # DeepSpeed's model of this section drops "auto" values

    enabled: bool | Auto = option(False, doc="train in bf16 with fp32 master weights", auto=True)

    IGNORED_KEYS = {
        "immediate_grad_update": "gradients are reduced by FSDP2 hooks as they are produced",
        "check_grad_overflow": "bf16 has fp32's range; only fp16 checks overflow",
        "bf16_master_weights_and_grads": "master weights are always fp32 shards here",
        "bf16_optimizer_states": "optimizer states follow the fp32 master weights",
    }


@dataclasses.dataclass(frozen=True, kw_only=True)
class FP8Config:
    """`fp8` (ds_plugin's own block): FP8 training of eligible linear layers."""

    enabled: bool = option(False, doc="swap eligible nn.Linear layers for FP8 linears")
    recipe: Literal["tensorwise", "rowwise", "blockwise"] = option(
        "tensorwise", doc="scaling granularity; blockwise = DeepSeek-V3 1x128 activations, 128x128 weights"
    )
    gradient_format: Literal["e4m3", "e5m2"] = option("e4m3", doc="FP8 format of output gradients")
    all_gather: bool = option(False, doc="ZeRO-3: all-gather weights already cast to FP8")
    skip_modules: tuple[str, ...] = option(("lm_head",), doc="module-name substrings kept in high precision")

    # Configs written for Accelerate's FP8 beside DeepSpeed (LLaMA-Factory's) copy the fp16 block's loss-scale keys.
    IGNORED_KEYS = dict.fromkeys(
        ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
         "min_loss_scale"),
        FP8_NO_LOSS_SCALE,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadOptimizerConfig:
    """`zero_optimization.offload_optimizer`."""

    AUTO_IS_DEFAULT = True  # DeepSpeed's model of this section drops "auto" values

    device: OffloadDevice = option("none", doc="where optimizer state and fp32 master weights live")
    pin_memory: bool = option(True, doc="page-locked host memory for faster copies")

    IGNORED_KEYS = {
        "nvme_path": "NVMe offload is not supported",
        "buffer_count": "NVMe offload is not supported",
        "pipeline_read": "NVMe offload is not supported",
        "pipeline_write": "NVMe offload is not supported",
        "fast_init": "NVMe offload is not supported",
        "ratio": "FSDP2 offloads all or nothing",
        "super_offload": DS_RUNTIME_ONLY,
        "cpuadam_cores_perc": "the optimizer step runs torch's own CPU kernels",
    }

    def __post_init__(self) -> None:
        _no_nvme(self.device)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadParamConfig:
    """`zero_optimization.offload_param` (stage 3 only)."""

    AUTO_IS_DEFAULT = True  # DeepSpeed's model of this section drops "auto" values

    device: OffloadDevice = option("none", doc="where sharded parameters live between uses")
    pin_memory: bool = option(True, doc="page-locked host memory for faster copies")

    IGNORED_KEYS = {
        "nvme_path": "NVMe offload is not supported",
        "buffer_count": "NVMe offload is not supported",
        "buffer_size": "NVMe offload is not supported",
        "max_in_cpu": "NVMe offload is not supported",
    }

    def __post_init__(self) -> None:
        _no_nvme(self.device)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """`zero_optimization`: the ZeRO stage, ZeRO++ and offload."""

    AUTO_IS_DEFAULT = True  # DeepSpeed's model of this section drops "auto" values

    stage: int = option(0, doc="0 = data parallel, 1 = + optimizer states sharded, 2 = + gradients, 3 = + weights")
    contiguous_gradients: bool = option(True, doc="copy gradients into one buffer", ignored=CONTIGUOUS_GRADIENTS)
    overlap_comm: bool | None = option(
        None,
        doc="overlap reduction with backward (null: DeepSpeed's default)",
        ignored="not a switch here: gradients are always reduced during backward (stages 0/1: a bucket as soon as "
        "its last gradient is ready; stages 2/3: each FSDP2 block as its backward ends, landing while the next block's "
        "backward runs: on a GPU on FSDP2's own stream, on gloo asynchronously)",
    )
    reduce_bucket_size: int | Auto = option(
        500_000_000,
        doc="elements per reduce bucket",
        gt=0,
        auto=True,
        ignored="stages 0/1 reduce in buckets of 4M elements, small enough to start during backward; stages 2/3 "
        "reduce per FSDP2 block",
    )
    allgather_bucket_size: int = option(500_000_000, doc="elements per all-gather bucket", ge=0, ignored=FSDP_BUCKETS)
    stage3_prefetch_bucket_size: int | Auto = option(
        50_000_000,
        doc="parameter elements gathered ahead of use (stages 2/3: the next FSDP2 blocks that fit; 0 = none)",
        ge=0,
        auto=True,
        aliases=("prefetch_bucket_size",),
    )
    stage3_param_persistence_threshold: int | Auto = option(
        100_000,
        doc="parameters smaller than this stay unpartitioned",
        ge=0,
        auto=True,
        aliases=("param_persistence_threshold",),
        ignored="FSDP2 shards every parameter; small ones ride in their block's all-gather",
    )
    stage3_max_live_parameters: int = option(
        1_000_000_000,
        doc="stage 3: cap on the block parameters kept gathered from forward to backward "
        "(stage3_max_reuse_distance); the prefetch budget caps what is gathered ahead",
        ge=0,
        aliases=("max_live_parameters",),
    )
    stage3_max_reuse_distance: int = option(
        1_000_000_000,
        doc="stage 3: a block stays gathered from its forward to its backward when fewer parameter elements than "
        "this run in between (and it fits stage3_prefetch_bucket_size); 0 frees every block after its forward",
        ge=0,
        aliases=("max_reuse_distance",),
    )
    stage3_gather_16bit_weights_on_model_save: bool | Auto = option(
        False,
        doc="the HF Trainer's save_model and Accelerate's get_state_dict give the weights in the compute dtype "
        "(fp16/bf16, each cast as it is gathered), as DeepSpeed's; false: the fp32 master weights (any stage); "
        '"auto": false, as Accelerate fills it',
        auto=True,
        aliases=("gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"),
    )
    sub_group_size: int = option(1_000_000_000, doc="optimizer step granularity", ge=0, ignored=SUB_GROUPS)
    offload_optimizer: OffloadOptimizerConfig = option(doc="optimizer offload", factory=OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = option(doc="parameter offload", factory=OffloadParamConfig)
    zero_hpz_partition_size: int | Auto = option(
        1,
        doc="hpZ: secondary weight partition inside groups of this many ranks (auto = ranks per node)",
        ge=0,
        auto=True,
    )
    zero_quantized_weights: bool = option(False, doc="qwZ: INT8 blockwise weight all-gather")
    zero_quantized_nontrainable_weights: bool = option(
        False, doc="store frozen (requires_grad=False) Linear weights as INT8 (DeepSpeed's MixZ++; see frozen_format)"
    )
    frozen_format: Literal["none", "int8", "int4", "nf4", "fp6"] = option(
        "none", doc="ds_plugin: storage of frozen Linear weights (LoRA's base): int8, int4, nf4 or fp6; none keeps them"
    )
    frozen_group_size: int | None = option(
        None, doc="ds_plugin: elements per scale of frozen_format (null: 128 int8, 64 int4, 64 nf4, 128 fp6)", ge=2
    )
    zero_quantized_gradients: bool = option(False, doc="qgZ: INT4 all-to-all gradient reduction")
    zero_quantized_weights_block_size: int = option(4096, doc="ds_plugin: elements per qwZ scale", ge=2)
    zero_quantized_gradients_block_size: int = option(
        64, doc="ds_plugin: elements per qgZ scale (INT4 needs small blocks to train like ZeRO-3)", ge=2
    )

    IGNORED_KEYS = ZERO_IGNORED

    @staticmethod
    def _legacy(data: dict[str, Any], path: str) -> dict[str, Any]:
        # DeepSpeed's model defaults these to null, which means the same as leaving them out.
        for key in (
            "offload_optimizer",
            "offload_param",
            "cpu_offload",
            "cpu_offload_param",
            "cpu_offload_use_pin_memory",
        ):
            if key in data and data[key] is None:
                del data[key]
        # DeepSpeed's deprecated boolean offload switches map onto the offload blocks.
        for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
            if old in data:
                flag = data.pop(old)
                if not isinstance(flag, bool):
                    raise ConfigError(f"{path}.{old}: expected true or false, got {flag!r:.40}")
                if flag:
                    if new in data:
                        raise ConfigError(f"{path}.{old}: conflicts with {path}.{new}; keep only {new!r}")
                    data[new] = {"device": "cpu"}
        if "cpu_offload_use_pin_memory" in data:
            pin = data.pop("cpu_offload_use_pin_memory")
            if not isinstance(pin, bool):
                raise ConfigError(f"{path}.cpu_offload_use_pin_memory: expected true or false, got {pin!r:.40}")
            for block in ("offload_optimizer", "offload_param"):
                if isinstance(data.get(block), Mapping):
                    data[block] = {**data[block], "pin_memory": pin}
        return data

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ConfigError(f"stage: {self.stage} is not a ZeRO stage; use 0, 1, 2 or 3")
        needs_stage3 = {
            "zero_quantized_weights": self.zero_quantized_weights,
            "zero_quantized_gradients": self.zero_quantized_gradients,
            "zero_hpz_partition_size": self.zero_hpz_partition_size not in (0, 1),
            "offload_param": self.offload_param.device != "none",
        }
        if self.zero_quantized_gradients_block_size % 2:
            raise ConfigError(
                f"zero_quantized_gradients_block_size: {self.zero_quantized_gradients_block_size} is odd; INT4 packs "
                "two values per byte, use an even block size such as 64"
            )
        if self.zero_quantized_nontrainable_weights and self.frozen_format not in ("none", "int8"):
            raise ConfigError(
                f"zero_quantized_nontrainable_weights: asks for INT8 but frozen_format is {self.frozen_format!r}; "
                "keep only frozen_format"
            )
        for key, on in needs_stage3.items():
            if on and self.stage != 3:
                raise ConfigError(f"{key}: needs stage 3 (it acts on sharded weights); set stage to 3 or turn it off")

    @property
    def frozen_storage(self) -> str | None:
        """The storage format of frozen Linear weights ("int8", "int4", "nf4", "fp6"), or None to keep them as is."""
        if self.frozen_format != "none":
            return self.frozen_format
        return "int8" if self.zero_quantized_nontrainable_weights else None

    @property
    def hpz_partition_size(self) -> int:
        """The hpZ group size as an int (1 = off); "auto" must be resolved first."""
        if self.zero_hpz_partition_size == AUTO:
            raise ConfigError(
                'zero_optimization.zero_hpz_partition_size: "auto" is not resolved; call ds_plugin.zero.resolve_plan'
            )
        return max(1, int(self.zero_hpz_partition_size))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommsLoggerConfig:
    """`comms_logger`: bytes and calls per collective, per process group, per step."""

    enabled: bool = option(False, doc="record every collective")
    verbose: bool = option(False, doc="log each collective as it happens")
    prof_all: bool = option(True, doc="record all collective types")
    prof_ops: tuple[str, ...] = option((), doc="with prof_all false: only these collectives")
    debug: bool = option(False, doc="record the calling module too")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataTypesConfig:
    """`data_types`."""

    grad_accum_dtype: DType | None = option(None, doc="gradient accumulation dtype (null: the compute dtype)")

    IGNORED_KEYS = {
        "param_dtype": "the compute dtype comes from fp16/bf16",
        "buffer_dtype": "buffers keep the model's dtype",
        "keep_in_fp32_modules": "norms and embeddings are left to the model's own dtype rules",
    }


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """A whole DeepSpeed-style training config. Build it with `from_deepspeed` or a preset name."""

    train_batch_size: int | Auto | None = option(
        None, doc="global batch = micro x accumulation x world", ge=1, auto=True
    )
    train_micro_batch_size_per_gpu: int | Auto | None = option(None, doc="batch per rank per step", ge=1, auto=True)
    gradient_accumulation_steps: int | Auto | None = option(None, doc="micro-steps per optimizer step", ge=1, auto=True)
    gradient_clipping: float | Auto = option(
        1.0, doc="clip the global gradient norm to this (0 = off; DeepSpeed 0.19's default is 1.0)", ge=0, auto=True
    )
    fp16: FP16Config = option(doc="fp16 mixed precision", factory=FP16Config)
    bf16: BF16Config = option(doc="bf16 mixed precision", aliases=("bfloat16",), factory=BF16Config)
    fp8: FP8Config = option(doc="fp8 training", factory=FP8Config)
    zero_optimization: ZeroConfig = option(doc="ZeRO", factory=ZeroConfig)
    communication_data_type: DType | None = option(None, doc="gradient reduction dtype (null: the compute dtype)")
    data_types: DataTypesConfig = option(doc="accumulation dtypes", factory=DataTypesConfig)
    comms_logger: CommsLoggerConfig = option(doc="collective logging", factory=CommsLoggerConfig)
    optimizer: OptimizerConfig | None = option(
        None, doc="the optimizer built on the fp32 masters when none is passed in code", omit_none=True
    )
    scheduler: SchedulerConfig | None = option(
        None, doc="the LR schedule stepped after every optimizer step when none is passed in code", omit_none=True
    )
    host_memory_reuse: bool = option(
        True,
        doc="ds_plugin: training on CPU, glibc malloc keeps freed memory for reuse instead of re-faulting it each "
        "step; false: it unmaps freed blocks of 1 MiB and up at once (resident memory is what is live)",
    )
    chunked_loss: bool = option(
        True,
        doc="ds_plugin: a Hugging Face causal LM's cross-entropy runs in row chunks from the logits' own dtype, "
        "so no fp32 copies of the whole logits are made (same loss to float rounding); false keeps transformers' own",
    )
    blocked_logits: bool = option(
        True,
        doc="ds_plugin: on CPU, a Hugging Face model's output layer computes its logits and its weight's gradient in "
        "blocks of vocabulary columns where its first call measures that faster (the same numbers); false: one matmul",
    )
    non_finite_gradients: Literal["error", "skip"] = option(
        "error",
        doc="ds_plugin: an inf/nan gradient without fp16 loss scaling stops training (error) or skips the step",
    )
    ignored: Mapping[str, tuple[Any, str]] = dataclasses.field(
        default_factory=dict, compare=False, metadata={"internal": True, "doc": "keys accepted without effect"}
    )
    explicit_keys: frozenset[str] = dataclasses.field(
        default=None,  # type: ignore[assignment]  # filled in __post_init__
        compare=False,
        metadata={"internal": True, "doc": "top-level keys the user chose"},
    )
    """The top-level fields the user chose: the keys written in the parsed config (`from_deepspeed`), the fields given
    to `replace`, or, for a config built in code, the fields set away from their defaults. A framework fills the
    others (see `ds_plugin.zero.plan.FrameworkSettings`)."""

    IGNORED_KEYS = TOP_LEVEL_IGNORED

    @staticmethod
    def _legacy(data: dict[str, Any], path: str) -> dict[str, Any]:
        kind = accelerate_type(data)
        if kind is not None:
            raise ConfigError(
                f"config: this is an Accelerate config file (distributed_type: {kind}), not a DeepSpeed config; "
                "give its DeepSpeed JSON or a preset, or add `-m ds_plugin.accelerate` to its `accelerate launch` "
                "(`ds-plugin check-config` checks its deepspeed_config block)"
            )
        sequence = data.get("sequence_parallel")
        if isinstance(sequence, Mapping) and sequence.get("enabled", True) not in (False, "false"):
            # LLaMA-Factory's ALST config: training without it would not be the run asked for (nor fit its memory).
            raise ConfigError(
                "sequence_parallel: sequence parallelism (ALST/Ulysses) is not part of ds_plugin; remove the block "
                '(or set "enabled": false) to train without it'
            )
        # Old DeepSpeed accepted `"zero_optimization": true` (stage 1) or a bare stage number.
        zero = data.get("zero_optimization")
        if isinstance(zero, bool):
            data["zero_optimization"] = {"stage": 1 if zero else 0}
        elif isinstance(zero, int):
            data["zero_optimization"] = {"stage": zero}
        return data

    def __post_init__(self) -> None:
        if self.fp16.enabled is True and self.bf16.enabled is True:
            raise ConfigError("fp16.enabled: fp16 and bf16 are both enabled; enable only one")
        tb, mb, ga = self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps
        if AUTO not in (tb, mb, ga) and tb is not None and mb is not None and tb % (mb * (ga or 1)):
            # The part of DeepSpeed's batch rule that holds at any world size; the rest is `resolve_plan`'s.
            raise ConfigError(
                f"train_batch_size: {tb} is not a multiple of train_micro_batch_size_per_gpu x "
                f"gradient_accumulation_steps = {mb * (ga or 1)}"
            )
        if self.explicit_keys is None:
            object.__setattr__(self, "explicit_keys", _non_default_fields(self))

    # ------------------------------------------------------------------ reading the config

    @property
    def stage(self) -> int:
        return self.zero_optimization.stage

    @property
    def compute_dtype(self) -> DType:
        """ "fp16", "bf16" or "fp32": the dtype forward/backward run in."""
        if self.fp16.enabled is True:
            return "fp16"
        if self.bf16.enabled is True:
            return "bf16"
        if AUTO in (self.fp16.enabled, self.bf16.enabled):
            raise ConfigError('fp16.enabled: "auto" is not resolved; call ds_plugin.zero.resolve_plan')
        return "fp32"

    @property
    def reduce_dtype(self) -> DType:
        """Gradient communication dtype: `communication_data_type`, else the compute dtype (as DeepSpeed)."""
        return self.communication_data_type or self.compute_dtype

    @property
    def grad_accum_dtype(self) -> DType:
        """Gradient accumulation dtype: `data_types.grad_accum_dtype`, else the compute dtype (as DeepSpeed)."""
        return self.data_types.grad_accum_dtype or self.compute_dtype

    def ignored_keys(self) -> dict[str, str]:
        """Dotted key -> why it has no effect here, for every key the user set that is ignored."""
        return {k: reason for k, (_, reason) in self.ignored.items()}

    def unresolved(self) -> list[str]:
        """Dotted keys still set to "auto"."""
        out = []
        for key, value in _walk(self.to_deepspeed(include_ignored=False)):
            if value == AUTO and key not in self.ignored:
                out.append(key)
        return out

    # ------------------------------------------------------------------ changing it

    def replace(self, **sections: Any) -> TrainingConfig:
        """A copy with fields replaced (they count as chosen: `explicit_keys`); nested sections may be given as dicts
        of overrides."""
        changes: dict[str, Any] = {"explicit_keys": self.explicit_keys | frozenset(sections)}
        for name, value in sections.items():
            current = getattr(self, name)
            if dataclasses.is_dataclass(current) and isinstance(value, Mapping):
                merged = {**emit_section(current), **value}
                value = parse_section(type(current), merged, name)
            changes[name] = value
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ I/O

    def to_deepspeed(self, include_ignored: bool = True) -> dict[str, Any]:
        """The config as a DeepSpeed JSON dict, with canonical key names.

        Args:
            include_ignored: also write back the keys that were accepted but ignored, so nothing the user
                wrote is lost on a round trip.
        """
        out = emit_section(self)
        if include_ignored:
            for dotted, (value, _) in self.ignored.items():
                *parents, leaf = dotted.split(".")
                node = out
                for p in parents:
                    node = node.setdefault(p, {})
                node[leaf] = value
        return out


def _non_default_fields(config: TrainingConfig) -> frozenset[str]:
    default = TrainingConfig(explicit_keys=frozenset())
    fields = [f.name for f in dataclasses.fields(config) if not f.metadata.get("internal")]
    return frozenset(k for k in fields if getattr(config, k) != getattr(default, k))


def _walk(d: Mapping[str, Any], prefix: str = ""):
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, Mapping):
            yield from _walk(v, key)
        else:
            yield key, v


def from_deepspeed(config: Mapping[str, Any] | str | os.PathLike | TrainingConfig) -> TrainingConfig:
    """Parse a DeepSpeed config: a dict, or the path to a .json / .yaml file.

    Args:
        config: the DeepSpeed config. A `TrainingConfig` is returned as is.

    Raises:
        ConfigError: with the dotted key and the fix, for anything invalid.
    """
    if isinstance(config, TrainingConfig):
        return config
    if isinstance(config, str | os.PathLike):
        config = read_config_file(Path(config))
    ignored: dict[str, tuple[Any, str]] = {}
    cfg = parse_section(TrainingConfig, config, "", ignored)
    if cfg.optimizer is not None:
        for key, reason in cfg.optimizer.ignored_params().items():
            ignored[f"optimizer.params.{key}"] = (cfg.optimizer.params[key], reason)
    return dataclasses.replace(cfg, ignored=ignored, explicit_keys=written_fields(TrainingConfig, config))
