"""Every config key tells the truth: it acts, or `ignored_keys()` reports it with the reason.

(a) Our own schema: every field (and every alias of it) of every section, and every `IGNORED_KEYS` entry, is
either in `ACTS` below, a reviewed table of keys the library reads, or is reported by `ignored_keys()` when set.
(b) DeepSpeed 0.19.8's own config models, where `deepspeed` is installed: every key it takes, by field name and
by alias, is accepted by `from_deepspeed` with the model's default value. DeepSpeed is probed in a subprocess so
that importing it (and its accelerator detection) cannot touch the process the other tests run in.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import types
import typing
from typing import Any, Literal, get_args, get_origin

import pytest

from ds_plugin._schema import json_key
from ds_plugin.config import ConfigError, TrainingConfig, from_deepspeed
from ds_plugin.zero.plan import resolve_plan

# Keys the library reads, each with where. Reviewed by hand: a key belongs here only if changing its value changes
# what training does (or what the config checks). Everything else must be reported by `ignored_keys()`.
ACTS: dict[str, str] = {
    "train_batch_size": "TrainingConfig.resolve: the batch-size rule",
    "train_micro_batch_size_per_gpu": "TrainingConfig.resolve; strategies pass it to the data loader",
    "gradient_accumulation_steps": "zero/engine.py: the accumulation boundary and loss division",
    "gradient_clipping": "zero/engine.py: clip by the global norm",
    "fp16.enabled": "TrainingConfig.compute_dtype",
    "fp16.loss_scale": "zero/engine.py: static scale for DynamicLossScaler",
    "fp16.initial_scale_power": "zero/engine.py: DynamicLossScaler",
    "fp16.loss_scale_window": "zero/engine.py: DynamicLossScaler",
    "fp16.hysteresis": "zero/engine.py: DynamicLossScaler",
    "fp16.consecutive_hysteresis": "zero/engine.py: DynamicLossScaler",
    "fp16.min_loss_scale": "zero/engine.py: DynamicLossScaler",
    "fp16.raise_error_at_min_scale": "zero/engine.py: DynamicLossScaler",
    "bf16.enabled": "TrainingConfig.compute_dtype",
    "fp8.enabled": "precision/fp8.py: swaps in FP8 linears",
    "fp8.recipe": "precision/fp8_linear.py: scaling granularity",
    "fp8.gradient_format": "precision/fp8_linear.py: output-gradient format",
    "fp8.all_gather": "zero/apply.py: FP8 weight all-gather",
    "fp8.skip_modules": "precision/fp8_linear.py: modules kept in high precision",
    "zero_optimization.stage": "zero/apply.py: the whole layout",
    "zero_optimization.offload_optimizer.device": "zero/apply.py: masters and optimizer state on the host",
    "zero_optimization.offload_optimizer.pin_memory": "zero/apply.py: CPUOffloadPolicy(pin_memory)",
    "zero_optimization.offload_param.device": "zero/apply.py: CPUOffloadPolicy",
    "zero_optimization.offload_param.pin_memory": "zero/apply.py: CPUOffloadPolicy(pin_memory)",
    "zero_optimization.zero_hpz_partition_size": "zero/mesh.py: hpZ groups",
    "zero_optimization.stage3_prefetch_bucket_size": "zero/apply.py: _set_prefetch, the blocks gathered ahead",
    "zero_optimization.stage3_max_reuse_distance": "zero/apply.py: _kept_blocks, blocks kept gathered into backward",
    "zero_optimization.stage3_max_live_parameters": "zero/apply.py: _kept_blocks, the cap on the blocks kept",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "peft_adapters.py: saved_weights_dtype, whole-model "
    "saves (HF save_model, Accelerate get_state_dict) in the compute dtype",
    "zero_optimization.zero_quantized_weights": "zero/zeropp.py: qwZ",
    "zero_optimization.zero_quantized_gradients": "zero/zeropp.py: qgZ",
    "zero_optimization.zero_quantized_weights_block_size": "zero/zeropp.py: qwZ scale blocks",
    "zero_optimization.zero_quantized_gradients_block_size": "zero/zeropp.py: qgZ scale blocks",
    "zero_optimization.zero_quantized_nontrainable_weights": "zero/apply.py: quantize_frozen_(model, 'int8')",
    "zero_optimization.frozen_format": "zero/apply.py: quantize_frozen_(model, fmt)",
    "zero_optimization.frozen_group_size": "zero/apply.py: quantize_frozen_(group_size=)",
    "communication_data_type": "TrainingConfig.reduce_dtype",
    "data_types.grad_accum_dtype": "TrainingConfig.grad_accum_dtype",
    "comms_logger.enabled": "runtime/comms_logger.py",
    "comms_logger.verbose": "runtime/comms_logger.py",
    "comms_logger.prof_all": "runtime/comms_logger.py",
    "comms_logger.prof_ops": "runtime/comms_logger.py",
    "comms_logger.debug": "runtime/comms_logger.py",
    "host_memory_reuse": "zero/apply.py: reuse_freed_host_memory (true) / release_freed_host_memory (false) on CPU",
    "chunked_loss": "zero/apply.py: use_chunked_loss swaps a transformers causal LM's loss for the chunked one",
    "blocked_logits": "zero/apply.py: use_blocked_logits gives a transformers model's output layer blocked_linear",
    "non_finite_gradients": "zero/engine.py: stop or skip at an inf/nan gradient without loss scaling",
    "optimizer.type": "optimizer_config.py: the optimizer initialize builds on the fp32 masters",
    "optimizer.params": "optimizer_config.py: that optimizer's arguments",
    "scheduler.type": "lr_schedules.py: the LR schedule the engine steps",
    "scheduler.params": "lr_schedules.py: that schedule's arguments",
}


@dataclasses.dataclass(frozen=True)
class Key:
    path: str  # dotted path of the section ("" at the top level)
    spelling: str  # the JSON key as written: the field's key, one of its aliases, or an IGNORED_KEYS entry
    canonical: str  # the field's canonical key ("" for an IGNORED_KEYS entry)
    field: dataclasses.Field | None
    tp: Any

    @property
    def dotted(self) -> str:
        return f"{self.path}.{self.spelling}" if self.path else self.spelling

    @property
    def canonical_dotted(self) -> str:
        return f"{self.path}.{self.canonical}" if self.path else self.canonical


def _section_type(tp: Any) -> type | None:
    if dataclasses.is_dataclass(tp):
        return tp
    return next((a for a in get_args(tp) if dataclasses.is_dataclass(a)), None)


def _walk(cls: type = TrainingConfig, path: str = "") -> list[Key]:
    """Every key of `cls` and its nested sections; nested sections are walked under their canonical key."""
    keys: list[Key] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        sub = _section_type(hints[f.name])
        if sub is not None:
            keys.extend(_walk(sub, f"{path}.{json_key(f)}" if path else json_key(f)))
            continue
        for spelling in (json_key(f), *f.metadata.get("aliases", ())):
            keys.append(Key(path, spelling, json_key(f), f, hints[f.name]))
    for spelling in getattr(cls, "IGNORED_KEYS", {}):
        keys.append(Key(path, spelling, "", None, None))
    return keys


SCHEMA = _walk()


def _nest(dotted: str, value: Any) -> dict[str, Any]:
    *parents, leaf = dotted.split(".")
    out: dict[str, Any] = {leaf: value}
    for p in reversed(parents):
        out = {p: out}
    return out


def _non_default(default: Any, tp: Any, meta: typing.Mapping[str, Any]) -> Any:
    """A valid value of type `tp` that differs from `default`, within the field's bounds."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        for arg in get_args(tp):
            if arg is not type(None) and get_origin(arg) is not Literal:
                return _non_default(default if isinstance(default, arg) else None, arg, meta)
        raise AssertionError(f"no non-default value for {tp}")
    if get_origin(tp) is Literal:
        return next(a for a in get_args(tp) if a != default)
    if tp is bool:
        return not default if isinstance(default, bool) else True
    if tp in (int, float):
        value = tp(default + 2 if isinstance(default, int | float) else 2)
        if meta.get("le") is not None and value > meta["le"]:
            value = tp(default - 2)
        return value
    if tp is str:
        return "not-the-default"
    if get_origin(tp) is tuple:
        return ("not-the-default",)
    raise AssertionError(f"no non-default value for {tp}")


def _ids(keys: list[Key]) -> list[str]:
    return [k.dotted for k in keys]


FIELDS = [k for k in SCHEMA if k.field is not None]
TABLE = [k for k in SCHEMA if k.field is None]


def test_schema_walk_finds_every_section():
    paths = {k.path for k in SCHEMA}
    assert {"", "fp16", "bf16", "fp8", "zero_optimization", "data_types", "comms_logger"} <= paths
    assert {"zero_optimization.offload_optimizer", "zero_optimization.offload_param"} <= paths


@pytest.mark.parametrize("key", FIELDS, ids=_ids(FIELDS))
def test_every_field_acts_or_is_reported(key: Key):
    meta = key.field.metadata
    if key.canonical_dotted in ACTS:
        assert not meta.get("ignored"), f"{key.dotted} is in ACTS but the schema says it is ignored"
        return
    assert meta.get("ignored"), f"{key.dotted} neither acts (ACTS) nor has an ignored= reason"
    only = meta.get("ignored_values")
    value = only[0] if only else _non_default(key.field.default, key.tp, meta)
    cfg = from_deepspeed(_nest(key.dotted, value))
    # Reported under the canonical key, whichever spelling was written (as the config writes it back).
    assert cfg.ignored_keys().get(key.canonical_dotted) == meta["ignored"], key.dotted
    assert from_deepspeed(cfg.to_deepspeed()) == cfg, "the written-back config must read the same"


@pytest.mark.parametrize("key", TABLE, ids=_ids(TABLE))
def test_every_ignored_table_entry_is_reported(key: Key):
    assert key.spelling not in {k.spelling for k in FIELDS if k.path == key.path}, "a field and a table entry"
    reason = from_deepspeed(_nest(key.dotted, True)).ignored_keys().get(key.dotted)
    assert isinstance(reason, str) and len(reason) > 10, key.dotted


def test_acts_table_has_no_stale_entry():
    canonical = {k.canonical_dotted for k in FIELDS}
    assert set(ACTS) <= canonical, sorted(set(ACTS) - canonical)


def test_the_once_silent_keys_now_say_what_happens():
    cfg = from_deepspeed(
        {
            "fp16": {"enabled": True, "auto_cast": False},
            "zero_optimization": {"stage": 3, "overlap_comm": True, "zero_quantized_nontrainable_weights": True},
        }
    )
    ignored = cfg.ignored_keys()
    assert "compute dtype" in ignored["fp16.auto_cast"]
    assert "during backward" in ignored["zero_optimization.overlap_comm"]
    # DeepSpeed's MixZ++ switch acts now: INT8 storage of the frozen weights, not an ignored key.
    assert "zero_optimization.zero_quantized_nontrainable_weights" not in ignored
    assert cfg.zero_optimization.frozen_storage == "int8"
    off = from_deepspeed({"zero_optimization": {"zero_quantized_nontrainable_weights": False}})
    assert off.ignored_keys() == {}
    assert off.zero_optimization.frozen_storage is None
    assert off.to_deepspeed()["zero_optimization"]["zero_quantized_nontrainable_weights"] is False


def test_plain_spellings_of_stage3_keys_are_accepted():
    # DeepSpeed's ZeRO model takes the field name as well as its `stage3_*` alias.
    for plain in ("use_all_reduce_for_fetch_params", "allgather_sequential", "module_granularity_threshold"):
        for spelling in (plain, f"stage3_{plain}"):
            cfg = from_deepspeed({"zero_optimization": {"stage": 3, spelling: 1 if "threshold" in plain else True}})
            assert f"zero_optimization.{spelling}" in cfg.ignored_keys()
            assert from_deepspeed(cfg.to_deepspeed()) == cfg


def test_configs_as_published_are_read():
    # Shaped after LLaMA-Factory's ds_z3_config.json: a key DeepSpeed skips, and "auto" on keys without effect here.
    z3 = {
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "sub_group_size": 1e9,
            "contiguous_gradients": True,
        },
        "comms_config": {"verbose": False},
    }
    cfg = from_deepspeed(z3)
    ignored = cfg.ignored_keys()
    assert "comms_logger" in ignored["comms_config"]
    assert "optimizer step" in ignored["zero_optimization.sub_group_size"]
    assert "flat buffer" in ignored["zero_optimization.contiguous_gradients"]
    assert {"zero_optimization.reduce_bucket_size", "zero_optimization.stage3_param_persistence_threshold"} <= set(
        ignored
    )
    # Only the "auto" values that act wait for a framework.
    assert cfg.unresolved() == [
        "train_batch_size",
        "gradient_clipping",
        "zero_optimization.stage3_prefetch_bucket_size",
    ]
    assert from_deepspeed(cfg.to_deepspeed()) == cfg
    # LLaMA-Factory's FP8 config copies the fp16 block's loss-scale keys into its fp8 block.
    fp8 = from_deepspeed({"fp8": {"enabled": True, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}})
    assert fp8.fp8.enabled and "no dynamic loss scale" in fp8.ignored_keys()["fp8.hysteresis"]
    # Accelerate's templates write "auto" 16-bit saves; Accelerate fills false unless told to save 16-bit weights.
    saves = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": "auto"}}
    assert resolve_plan(saves, world_size=2, check_only=True).save_16bit_weights is False
    saves["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    assert resolve_plan(saves, world_size=2, check_only=True).save_16bit_weights is True
    # DeepSpeed's Adam kernel switches are reported, not silently taken.
    params = {"lr": 1e-3, "torch_adam": True, "fp32_optimizer_states": True, "adam_w_mode": False}
    adam = from_deepspeed({"optimizer": {"type": "Adam", "params": params}})
    assert set(adam.ignored_keys()) == {"optimizer.params.torch_adam", "optimizer.params.fp32_optimizer_states"}
    # OpenRLHF writes "auto" on any ZeRO key; DeepSpeed's section models drop such values, so the key takes its default.
    openrlhf = from_deepspeed(
        {"zero_optimization": {"stage": 3, "sub_group_size": "auto", "stage3_max_live_parameters": "auto"}}
    )
    assert openrlhf.zero_optimization.stage3_max_live_parameters == 1_000_000_000
    assert openrlhf.ignored["zero_optimization.sub_group_size"][0] == "auto"
    assert from_deepspeed(openrlhf.to_deepspeed()) == openrlhf
    with pytest.raises(ConfigError, match=r"^communication_data_type"):  # the top level is read as written
        from_deepspeed({"communication_data_type": "auto"})
    # LLaMA-Factory's ALST config: sequence parallelism on is refused in one line; switched off, it is reported.
    with pytest.raises(ConfigError, match=r"^sequence_parallel: sequence parallelism \(ALST/Ulysses\) is not part"):
        from_deepspeed({"sequence_parallel": {"enabled": True, "size": 4, "mode": "ulysses"}})
    assert "sequence_parallel" in from_deepspeed({"sequence_parallel": {"enabled": False}}).ignored_keys()
    # An Accelerate config file where a DeepSpeed config belongs: one line saying what to do instead.
    with pytest.raises(ConfigError, match=r"an Accelerate config file \(distributed_type: MULTI_GPU\)"):
        from_deepspeed({"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU"})


def test_sparse_attention_parses_and_is_reported():
    block = {"mode": "fixed", "block": 16, "different_layout_per_head": True, "num_local_blocks": 4}
    cfg = from_deepspeed({"sparse_attention": block, "zero_optimization": {"stage": 2}})
    assert "Sparse Attention" in cfg.ignored_keys()["sparse_attention"]
    assert cfg.to_deepspeed()["sparse_attention"] == block


# ---------------------------------------------------------------------------------------------------------- (b)

DEEPSPEED_VERSION = "0.19.8"

# Run in a subprocess: prints one line "KEYS <json>" with DeepSpeed's keys per section.
_PROBE = r"""
import json, os
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed
from deepspeed.comm.config import CommsLoggerConfig
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig

def fields(model):
    defaults = model().model_dump(mode="json")
    return [[name, f.alias, defaults[name]] for name, f in model.model_fields.items()]

# The top level and `data_types` are plain dicts that DeepSpeedConfig reads key by key: record what it reads.
read = set()
class Recorder(dict):
    def __init__(self, prefix, *args):
        super().__init__(*args)
        self.prefix = prefix
    def _saw(self, key):
        read.add(self.prefix + str(key))
    def get(self, key, *default):
        self._saw(key)
        return super().get(key, *default)
    def __getitem__(self, key):
        self._saw(key)
        return super().__getitem__(key)
    def __contains__(self, key):
        self._saw(key)
        return super().__contains__(key)
    def keys(self):
        outer = self
        class Keys:
            def __contains__(self, key):
                outer._saw(key)
                return dict.__contains__(outer, key)
            def __iter__(self):
                return iter(dict.keys(outer))
        return Keys()

DeepSpeedConfig(Recorder("", {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1,
                              "data_types": Recorder("data_types.")}))
print("KEYS " + json.dumps({
    "version": deepspeed.__version__,
    "models": {
        "zero_optimization": fields(DeepSpeedZeroConfig),
        "zero_optimization.offload_param": fields(DeepSpeedZeroOffloadParamConfig),
        "zero_optimization.offload_optimizer": fields(DeepSpeedZeroOffloadOptimizerConfig),
        "fp16": fields(DeepSpeedFP16Config),
        "bf16": fields(DeepSpeedBF16Config),
        "comms_logger": fields(CommsLoggerConfig),
    },
    "read": sorted(read),
}))
"""


@pytest.fixture(scope="module")
def deepspeed_keys() -> dict[str, Any]:
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip(f"deepspeed is not installed (pip install deepspeed=={DEEPSPEED_VERSION})")
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    run = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(ln for ln in run.stdout.splitlines() if ln.startswith("KEYS "))
    probe = json.loads(line[len("KEYS ") :])
    if probe["version"] != DEEPSPEED_VERSION:
        pytest.skip(f"deepspeed {probe['version']} is installed; the defaults here are {DEEPSPEED_VERSION}'s")
    return probe


# Old spellings `_legacy` rewrites into current keys before parsing: they act through those.
LEGACY = {
    "bfloat16": "the old name of bf16",
    "zero_optimization.cpu_offload": "offload_optimizer.device = cpu",
    "zero_optimization.cpu_offload_param": "offload_param.device = cpu",
    "zero_optimization.cpu_offload_use_pin_memory": "pin_memory of both offload blocks",
}
SECTIONS = {".".join(k.path.split(".")[: i + 1]) for k in SCHEMA if k.path for i in range(k.path.count(".") + 1)}


def _known(dotted: str) -> bool:
    """Whether `dotted` is a key of our schema: a field spelling, an IGNORED_KEYS entry, a section or a legacy key."""
    return dotted in {k.dotted for k in SCHEMA} or dotted in SECTIONS or dotted in LEGACY


def test_every_deepspeed_model_key_is_accepted(deepspeed_keys):
    refused = []
    for section, fields in deepspeed_keys["models"].items():
        assert fields, section
        for name, alias, default in fields:
            for spelling in filter(None, (name, alias)):
                dotted = f"{section}.{spelling}"
                raw = _nest(dotted, default)
                if section.startswith("zero_optimization"):
                    raw["zero_optimization"].setdefault("stage", 3)  # stage-3-only keys are valid at their defaults
                try:
                    cfg = from_deepspeed(raw)
                except Exception as exc:
                    refused.append(f"{dotted}={default!r}: {exc}")
                    continue
                # Accepted, and either a key of ours (which test (a) holds to the truth) or reported.
                if dotted not in cfg.ignored_keys() and not _known(dotted):
                    refused.append(f"{dotted}: accepted but neither a known key nor reported")
                try:
                    again = from_deepspeed(cfg.to_deepspeed())
                except Exception as exc:
                    refused.append(f"{dotted}: written back, does not read again: {exc}")
                    continue
                if again != cfg:
                    refused.append(f"{dotted}: written back, reads differently")
    assert not refused, "\n".join(refused)


def test_every_key_deepspeedconfig_reads_is_accepted(deepspeed_keys):
    read = deepspeed_keys["read"]
    assert "zero_optimization" in read and "data_types.grad_accum_dtype" in read, read
    # Blocks DeepSpeed hands to the pydantic models above, and keys DeepSpeed reads from them, are covered there.
    unknown = [k for k in read if not _known(k)]
    assert not unknown, unknown
