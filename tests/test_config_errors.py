"""Bad configs: each gives exit 2 from `ds-plugin check-config` and a one-line message naming the key.

The parser is also fuzzed with random nested JSON: nothing but `ConfigError` may ever escape it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds_plugin.cli import main
from ds_plugin.config import ConfigError, from_deepspeed
from ds_plugin.zero.plan import FrameworkSettings, resolve_plan

# (config, text the error must contain)
BAD = [
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stage": -1}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stage": "3"}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stag": 3}}, "zero_optimization.stag"),
    ({"zero_optimisation": {"stage": 3}}, "zero_optimisation"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled"),
    ({"fp16": {"loss_scale_window": -5}}, "fp16.loss_scale_window"),
    ({"fp16": {"loss_scale_window": 0}}, "fp16.loss_scale_window"),
    ({"fp16": {"hysteresis": 0}}, "fp16.hysteresis"),
    ({"fp16": {"min_loss_scale": 0}}, "fp16.min_loss_scale"),
    ({"fp16": {"loss_scale": -1}}, "fp16.loss_scale"),
    ({"fp16": {"initial_scale_power": 1.5}}, "fp16.initial_scale_power"),
    ({"fp16": {"enabled": "yes"}}, "fp16.enabled"),
    ({"fp16": {"enable": True}}, "fp16.enable"),
    ({"fp16": True}, "fp16"),
    ({"bf16": {"enabled": 1}}, "bf16.enabled"),
    ({"gradient_clipping": -1.0}, "gradient_clipping"),
    ({"gradient_clipping": "big"}, "gradient_clipping"),
    ({"train_batch_size": 0}, "train_batch_size"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3}, "train_batch_size"),
    ({"train_micro_batch_size_per_gpu": 2.5}, "train_micro_batch_size_per_gpu"),
    ({"gradient_accumulation_steps": -2}, "gradient_accumulation_steps"),
    ({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}}, "zero_hpz_partition_size"),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": -1}}, "zero_hpz_partition_size"),
    ({"zero_optimization": {"stage": 1, "zero_quantized_weights": True}}, "zero_quantized_weights"),
    ({"zero_optimization": {"stage": 2, "zero_quantized_gradients": True}}, "zero_quantized_gradients"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "offload_param"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}}, "zero_optimization.offload_param.device"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}, "offload_optimizer.device"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"devise": "cpu"}}}, "offload_optimizer.devise"),
    ({"zero_optimization": {"stage": 3, "cpu_offload": "yes"}}, "zero_optimization.cpu_offload"),
    ({"zero_optimization": {"reduce_bucket_size": 0}}, "zero_optimization.reduce_bucket_size"),
    ({"zero_optimization": {"reduce_bucket_size": "5e8"}}, "zero_optimization.reduce_bucket_size"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_weight": True}}, "zero_quantized_weight"),
    ({"zero_optimization": ["stage", 3]}, "zero_optimization"),
    ({"communication_data_type": "fp8"}, "communication_data_type"),
    ({"data_types": {"grad_accum_dtype": "float64"}}, "data_types.grad_accum_dtype"),
    ({"data_types": {"accum_dtype": "fp32"}}, "data_types.accum_dtype"),
    ({"comms_logger": {"enabled": "true"}}, "comms_logger.enabled"),
    ({"comms_logger": {"prof_ops": "all_reduce"}}, "comms_logger.prof_ops"),
    ({"fp8": {"recipe": "blockwize"}}, "fp8.recipe"),
    ({"fp8": {"gradient_format": "e3m4"}}, "fp8.gradient_format"),
    ({"fp8": {"enabled": True, "skip_modules": "lm_head"}}, "fp8.skip_modules"),
    ({"gradient_clippin": 1.0}, "gradient_clippin"),
    ({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": -1}}, "stage3_max_live_parameters"),
    ([1, 2, 3], "config"),
    (
        {"zero_optimization": {"stage": 3, "zero_quantized_gradients_block_size": 63}},
        "zero_quantized_gradients_block_size",
    ),
]


def test_corpus_size():
    assert len(BAD) >= 30


@pytest.mark.parametrize(("config", "key"), BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_config_is_one_line_error_naming_the_key(config, key, tmp_path, capsys):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    assert main(["check-config", str(path)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1, err
    assert key in err, err
    assert "Traceback" not in captured.err + captured.out


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ConfigError, match=r"did you mean 'zero_optimization\.stage'"):
        from_deepspeed({"zero_optimization": {"stag": 3}})
    with pytest.raises(ConfigError, match=r"did you mean 'zero_optimization'"):
        from_deepspeed({"zero_optimisation": {}})


@pytest.mark.parametrize("text", ["{", '{"fp16": }', ""])
def test_unreadable_files(text, tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text(text)
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "c.json" in err and "not valid JSON" in err, err


def test_json_that_is_not_an_object(tmp_path, capsys):
    # Valid JSON, so not an unreadable file: a bad config whose offending key is the whole config (as `[1, 2, 3]`
    # in BAD).
    path = tmp_path / "c.json"
    path.write_text("null")
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "config" in err and "expected an object" in err, err


def test_missing_file(tmp_path, capsys):
    assert main(["check-config", str(tmp_path / "nope.json")]) == 2
    assert "nope.json" in capsys.readouterr().err
    # A long path is shortened in its middle: the file's name stays in the one line.
    deep = tmp_path / ("d" * 150) / "nope.json"
    assert main(["check-config", str(deep)]) == 2
    err = capsys.readouterr().err
    assert "nope.json': cannot read the config" in err and len(err.strip().splitlines()) == 1


def test_cli_process_prints_no_traceback(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 9}}))
    proc = subprocess.run(
        [sys.executable, "-m", "ds_plugin.cli", "check-config", str(path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "zero_optimization.stage" in proc.stderr
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------- fuzzing

json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
# Real key names make the fuzzer reach deep into the sections instead of failing at the first unknown key.
KEYS = [
    "fp16",
    "bf16",
    "bfloat16",
    "fp8",
    "zero_optimization",
    "stage",
    "enabled",
    "loss_scale",
    "hysteresis",
    "offload_param",
    "offload_optimizer",
    "device",
    "pin_memory",
    "cpu_offload",
    "cpu_offload_param",
    "cpu_offload_use_pin_memory",
    "zero_hpz_partition_size",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "comms_logger",
    "prof_ops",
    "data_types",
    "grad_accum_dtype",
    "communication_data_type",
    "recipe",
    "skip_modules",
    "optimizer",
    "reduce_bucket_size",
]
keyed = st.recursive(
    json_scalars | st.sampled_from(["auto", "cpu", "none", "fp32", "bf16", "blockwise"]),
    lambda inner: st.dictionaries(st.sampled_from(KEYS), inner, max_size=5) | st.lists(inner, max_size=3),
    max_leaves=25,
)


def _only_config_errors(value):
    try:
        cfg = from_deepspeed(value)
    except ConfigError:
        return
    # Whatever parses must also write back and parse again.
    assert from_deepspeed(cfg.to_deepspeed()) == cfg
    try:
        fw = FrameworkSettings(owner="fuzz", precision="bf16", micro_batch_size=2, accumulation=1)
        resolve_plan(cfg, world_size=4, framework=fw)
    except ConfigError:
        pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(json_values)
def test_fuzz_random_json(value):
    _only_config_errors(value)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(KEYS), keyed, max_size=6))
def test_fuzz_config_shaped_json(value):
    _only_config_errors(value)
