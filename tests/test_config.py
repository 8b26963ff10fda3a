"""DeepSpeed configs written from its documented keys parse, keep their values, and round-trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_plugin.config import AUTO, ConfigError, TrainingConfig, from_deepspeed
from ds_plugin.presets import PRESETS, get_preset, load_config
from ds_plugin.zero.plan import FrameworkSettings, resolve_plan

CONFIGS = Path(__file__).parent / "configs"
GOOD = sorted(CONFIGS.glob("*.json")) + sorted(CONFIGS.glob("*.yaml"))

# Old spellings DeepSpeed still reads (a section or a key) -> the spelling `to_deepspeed` writes.
ALIASES = {
    "bfloat16": "bf16",
    "zero_optimization.gather_16bit_weights_on_model_save": "zero_optimization.stage3_gather_16bit_weights_on_model"
    "_save",
}


def _written_as(dotted: str) -> str:
    return next(
        (new + dotted[len(old) :] for old, new in ALIASES.items() if f"{dotted}.".startswith(f"{old}.")), dotted
    )


def _load(path: Path) -> dict:
    if path.suffix == ".yaml":
        from ds_plugin.config import read_config_file  # YAML 1.2 floats such as 2.0e8, which PyYAML reads as strings

        return read_config_file(path)
    return json.loads(path.read_text())


def _leaves(d: dict, prefix: str = ""):
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict) and v:
            yield from _leaves(v, key)
        else:
            yield key, v


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d[part]
    return d


def test_corpus_is_not_empty():
    assert len(GOOD) >= 6


@pytest.mark.parametrize("path", GOOD, ids=lambda p: p.name)
def test_documented_configs_parse_and_round_trip(path):
    raw = _load(path)
    cfg = from_deepspeed(path)
    out = cfg.to_deepspeed()
    for key, value in _leaves(raw):
        got = _get(out, _written_as(key))
        if isinstance(value, list):
            assert list(got) == value, key
        else:
            assert got == value, key
    # Parsing what we wrote gives the same config again.
    assert from_deepspeed(out) == cfg


def test_defaults_are_deepspeeds():
    cfg = from_deepspeed({})
    assert cfg.stage == 0
    fp16 = cfg.fp16
    assert (fp16.enabled, fp16.loss_scale, fp16.initial_scale_power, fp16.loss_scale_window) == (False, 0, 16, 1000)
    assert (fp16.hysteresis, fp16.consecutive_hysteresis, fp16.min_loss_scale, fp16.auto_cast) == (2, False, 1, False)
    z = cfg.zero_optimization
    assert z.reduce_bucket_size == 5e8 and z.allgather_bucket_size == 5e8
    assert z.stage3_prefetch_bucket_size == 5e7 and z.stage3_param_persistence_threshold == 1e5
    assert z.stage3_max_live_parameters == 1e9 and z.stage3_max_reuse_distance == 1e9 and z.sub_group_size == 1e9
    assert z.zero_hpz_partition_size == 1 and not z.zero_quantized_weights and not z.zero_quantized_gradients
    assert not z.zero_quantized_nontrainable_weights
    assert z.offload_optimizer.device == "none" and z.offload_param.device == "none"
    assert z.contiguous_gradients is True
    # DeepSpeed 0.19.8: GRADIENT_CLIPPING_DEFAULT = 1.0 (runtime/constants.py).
    assert cfg.gradient_clipping == 1.0
    assert cfg.compute_dtype == cfg.reduce_dtype == cfg.grad_accum_dtype == "fp32"


def test_communication_and_accumulation_dtypes_default_to_compute_dtype():
    cfg = from_deepspeed({"bf16": {"enabled": True}})
    assert (cfg.compute_dtype, cfg.reduce_dtype, cfg.grad_accum_dtype) == ("bf16", "bf16", "bf16")
    cfg = from_deepspeed({"fp16": {"enabled": True}, "communication_data_type": "fp32"})
    assert (cfg.compute_dtype, cfg.reduce_dtype, cfg.grad_accum_dtype) == ("fp16", "fp32", "fp16")
    cfg = from_deepspeed({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}})
    assert cfg.grad_accum_dtype == "fp32"


def test_old_aliases():
    cfg = from_deepspeed({"bfloat16": {"enabled": True}, "zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert cfg.bf16.enabled is True
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    cfg = from_deepspeed(
        {"zero_optimization": {"stage": 3, "cpu_offload_param": True, "cpu_offload_use_pin_memory": False}}
    )
    assert cfg.zero_optimization.offload_param.device == "cpu"
    assert cfg.zero_optimization.offload_param.pin_memory is False
    assert from_deepspeed({"zero_optimization": True}).stage == 1
    assert from_deepspeed({"zero_optimization": 2}).stage == 2
    short = from_deepspeed({"zero_optimization": {"stage": 3, "prefetch_bucket_size": 123}})
    assert short.zero_optimization.stage3_prefetch_bucket_size == 123
    assert short.to_deepspeed()["zero_optimization"]["stage3_prefetch_bucket_size"] == 123


def test_nulls_deepspeed_defaults_to_mean_leaving_the_key_out():
    # DeepSpeed's ZeRO model defaults the offload blocks and the old offload switches to null.
    nulls = ("offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory")
    cfg = from_deepspeed({"zero_optimization": {"stage": 3, **dict.fromkeys(nulls)}})
    assert cfg.zero_optimization == from_deepspeed({"zero_optimization": {"stage": 3}}).zero_optimization
    assert cfg.ignored_keys() == {}


def test_ignored_keys_are_reported_with_reasons():
    cfg = from_deepspeed(CONFIGS / "deepspeed_chat_step1_zero3_offload.json")
    ignored = cfg.ignored_keys()
    for key in (
        "steps_per_print",
        "hybrid_engine",
        "tensorboard",
        "zero_optimization.memory_efficient_linear",
        "prescale_gradients",
    ):
        assert ignored.get(key), key
    # Acted on: how far ahead stages 2/3 gather (DeepSpeed-Chat's step 1 writes 3e7).
    assert "zero_optimization.stage" not in ignored and "zero_optimization.stage3_prefetch_bucket_size" not in ignored
    assert resolve_plan(cfg, world_size=2).prefetch_numel == 30_000_000
    docs = from_deepspeed(CONFIGS / "deepspeed_docs_zero3_sparse_attention.json").ignored_keys()
    for key in (
        "fp16.auto_cast",
        "zero_optimization.overlap_comm",
        "zero_optimization.module_granularity_threshold",
        "zero_optimization.use_all_reduce_for_fetch_params",
        "zero_optimization.allgather_sequential",
        "sparse_attention",
    ):
        assert docs.get(key), key
    # It acts now (INT8 frozen-weight storage): nothing to report as ignored.
    assert "zero_optimization.zero_quantized_nontrainable_weights" not in docs


def test_auto_values_are_kept_then_resolved():
    cfg = from_deepspeed(CONFIGS / "hf_trainer_zero3_auto.json")
    assert cfg.train_micro_batch_size_per_gpu == AUTO and cfg.gradient_clipping == AUTO
    assert "fp16.enabled" in cfg.unresolved()
    # The optimizer and scheduler blocks' "auto" params come from the framework (the HF Trainer's arguments).
    hf = {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    auto = {f"optimizer.params.{k}": v for k, v in hf.items()}
    auto |= {"scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_max_lr": 3e-4}
    auto["scheduler.params.warmup_num_steps"] = 5
    fw = FrameworkSettings(owner="T", precision="bf16", micro_batch_size=2, accumulation=3, clip=0.5, auto_values=auto)
    plan = resolve_plan(cfg, world_size=4, framework=fw)
    r = plan.config
    assert plan.optimizer.params == hf and plan.scheduler.params["warmup_num_steps"] == 5
    assert (r.train_micro_batch_size_per_gpu, r.gradient_accumulation_steps, r.train_batch_size) == (2, 3, 24)
    assert r.gradient_clipping == 0.5 and r.compute_dtype == "bf16" and r.fp16.enabled is False
    # The prefetch budget, which acts, takes its default in the plan. Keys without effect here are reported ignored
    # whatever their value, "auto" included, and are not "auto" values waiting for a framework.
    assert plan.prefetch_numel == 50_000_000
    assert r.unresolved() == ["zero_optimization.stage3_prefetch_bucket_size"]
    for key in ("reduce_bucket_size", "stage3_param_persistence_threshold"):
        assert r.ignored[f"zero_optimization.{key}"][0] == AUTO


@pytest.mark.parametrize(
    ("tb", "mb", "ga", "world", "expect"),
    [
        (32, 4, None, 4, (32, 4, 2)),
        (32, None, 2, 4, (32, 4, 2)),
        (None, 4, 2, 4, (32, 4, 2)),
        (32, None, None, 4, (32, 8, 1)),
        (32, 4, 2, 4, (32, 4, 2)),
    ],
)
def test_batch_size_any_two_determine_the_third(tb, mb, ga, world, expect):
    raw = {
        k: v
        for k, v in (
            ("train_batch_size", tb),
            ("train_micro_batch_size_per_gpu", mb),
            ("gradient_accumulation_steps", ga),
        )
        if v is not None
    }
    r = resolve_plan(from_deepspeed(raw), world_size=world).config
    assert (r.train_batch_size, r.train_micro_batch_size_per_gpu, r.gradient_accumulation_steps) == expect


def test_inconsistent_batch_sizes_fail_once_world_size_is_known():
    cfg = from_deepspeed(
        {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    )
    with pytest.raises(ConfigError, match="train_batch_size"):
        resolve_plan(cfg, world_size=2)


def test_hpz_must_divide_world_size():
    cfg = from_deepspeed({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}})
    assert resolve_plan(cfg, world_size=8).config.zero_optimization.hpz_partition_size == 4
    with pytest.raises(ConfigError, match="zero_hpz_partition_size"):
        resolve_plan(cfg, world_size=6)
    auto = resolve_plan("zeropp", world_size=8, ranks_per_node=4).config
    assert auto.zero_optimization.hpz_partition_size == 4


def test_presets():
    assert set(PRESETS) >= {"zero0", "zero1", "zero2", "zero3", "zero3_offload", "zeropp"}
    for name in ("zero0", "zero1", "zero2", "zero3"):
        assert get_preset(name).stage == int(name[-1])
    pp = get_preset("zeropp").zero_optimization
    assert pp.stage == 3 and pp.zero_quantized_weights and pp.zero_quantized_gradients
    assert pp.zero_hpz_partition_size == AUTO
    off = get_preset("zero3_offload").zero_optimization
    assert off.offload_optimizer.device == off.offload_param.device == "cpu"
    assert get_preset("zero2", bf16={"enabled": True}).compute_dtype == "bf16"
    with pytest.raises(ConfigError, match="did you mean 'zero3'"):
        get_preset("zero33")


def test_config_is_frozen_and_replace_validates():
    cfg = get_preset("zero3")
    with pytest.raises(AttributeError):
        cfg.gradient_clipping = 2.0  # type: ignore[misc]
    assert cfg.replace(zero_optimization={"stage": 2}).stage == 2
    with pytest.raises(ConfigError, match=r"zero_optimization\.stage"):
        cfg.replace(zero_optimization={"stage": 7})
    assert isinstance(cfg.replace(gradient_clipping=0.0), TrainingConfig)


def test_the_keys_the_user_chose_are_recorded_when_the_config_is_read(tmp_path):
    # Canonical names, aliases mapped; a key written at its default value still counts (the user chose it).
    written = from_deepspeed({"bfloat16": {"enabled": True}, "gradient_clipping": 1.0, "steps_per_print": 10})
    assert written.explicit_keys == {"bf16", "gradient_clipping"}
    assert from_deepspeed({}).explicit_keys == frozenset()
    # A config built in code: the fields set away from DeepSpeed's defaults; `replace` adds what it sets.
    assert TrainingConfig(gradient_accumulation_steps=4).explicit_keys == {"gradient_accumulation_steps"}
    assert written.replace(gradient_accumulation_steps=2).explicit_keys == {"bf16", "gradient_clipping",
                                                                            "gradient_accumulation_steps"}  # fmt: skip
    # Every reader of a config source records the same: presets, files, dicts, overrides, and a config plus overrides.
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2}}))
    assert load_config(str(path)).explicit_keys == {"gradient_accumulation_steps", "zero_optimization"}
    assert load_config("zero3").explicit_keys == {"zero_optimization"}
    merged = load_config("zero3", {"zero_optimization": {"offload_param": {"device": "cpu"}}, "gradient_clipping": 1})
    assert merged.stage == 3 and merged.zero_optimization.offload_param.device == "cpu"  # merged one level deep
    assert merged.explicit_keys == {"zero_optimization", "gradient_clipping"}
    assert load_config(written, {"zero_optimization": {"stage": 1}}).explicit_keys == {
        "bf16", "gradient_clipping", "zero_optimization"}  # fmt: skip
    # The record is not part of the value: a round trip through DeepSpeed JSON (every key written) is equal.
    assert from_deepspeed(written.to_deepspeed()) == written


def test_an_unknown_override_names_its_owner_and_the_closest_key():
    with pytest.raises(ConfigError, match=r"^Owner: unknown option 'gradient_clip'; did you mean 'gradient_clipping'"):
        load_config("zero3", {"gradient_clip": 1.0}, owner="Owner")
    with pytest.raises(ConfigError, match=r"it is a ZeRO setting, pass zero_optimization=\{'stage': \.\.\.\}"):
        load_config("zero3", {"stage": 2}, owner="Owner")
    with pytest.raises(ConfigError, match="did you mean 'zero3'"):
        load_config("zero33", owner="Owner")


def test_check_config_reads_an_accelerate_deepspeed_yaml(tmp_path, capsys):
    from ds_plugin.cli import main

    # trl's YAML, as users launch it: its deepspeed_config block is checked as Accelerate turns it into DeepSpeed's.
    yaml_path = CONFIGS / "trl" / "deepspeed_zero3.yaml"
    assert main(["check-config", str(yaml_path)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out.split("\n\n")[0])["zero_optimization"]["stage"] == 3
    assert "deepspeed_config.zero3_init_flag: " in captured.out
    assert "valid Accelerate DeepSpeed config (ZeRO stage 3)" in captured.err
    assert f"accelerate launch --config_file {yaml_path} -m ds_plugin.accelerate" in captured.err
    # Another type has no DeepSpeed block; a key of a feature ds_plugin lacks is refused with the reason.
    other = tmp_path / "ddp.yaml"
    other.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processes: 2\n")
    assert main(["check-config", str(other)]) == 2
    assert "distributed_type MULTI_GPU, not DEEPSPEED" in capsys.readouterr().err
    sequence = tmp_path / "alst.yaml"
    sequence.write_text(
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  seq_parallel_communication_data_type: bf16\n"
    )
    assert main(["check-config", str(sequence)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sequence parallelism (ALST/Ulysses) is not part of ds_plugin" in err


def test_check_config_world_size_resolves_through_the_plan(tmp_path, capsys):
    from ds_plugin.cli import main

    # The launch's resolution: hpZ "auto" from --ranks-per-node, its divisibility and the batch rule checked.
    assert main(["check-config", "zeropp", "--world-size", "16", "--ranks-per-node", "8"]) == 0
    out = json.loads(capsys.readouterr().out.split("\n\n")[0])
    assert out["zero_optimization"]["zero_hpz_partition_size"] == 8
    assert main(["check-config", "zeropp", "--world-size", "6", "--ranks-per-node", "4"]) == 2
    assert "zero_hpz_partition_size: 4 does not divide the world size 6" in capsys.readouterr().err
    # "auto" values a framework would fill are not an error here (a launch fills them): DeepSpeed's defaults.
    path = CONFIGS / "hf_trainer_zero3_auto.json"
    assert main(["check-config", str(path), "--world-size", "4"]) == 0
    out = json.loads(capsys.readouterr().out.split("\n\n")[0])
    assert (out["gradient_clipping"], out["fp16"]["enabled"], out["bf16"]["enabled"]) == (1.0, False, False)
