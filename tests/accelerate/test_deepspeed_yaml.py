"""Accelerate's `distributed_type: DEEPSPEED` configs, unchanged, on the engine (DeepSpeed never imported).

trl's `examples/accelerate_configs/deepspeed_zero{1,2,3}.yaml` (tests/configs/trl/: byte for byte as trl ships them,
each a version from trl's history: ZeRO-1 bf16, ZeRO-2 fp32, ZeRO-3 fp16, gradient_accumulation_steps 1) and an
`accelerate config` answer naming a `deepspeed_config_file` (an HF-style "auto" JSON) each run the plain Accelerate
script examples/with_accelerate/train.py on 2 CPU processes:

    accelerate launch --config_file <yaml> --multi_gpu --num_processes 2 --mixed_precision no \
        -m ds_plugin.accelerate train.py

(launch flags only: 2 processes instead of the YAML's 8, fp32 so losses can be compared, `--multi_gpu` because
Accelerate's DeepSpeed launcher needs DeepSpeed and a GPU). The fp32 losses must equal plain Accelerate DDP's within
1e-5. ZeRO-1 and ZeRO-2 end to end are in the `long` tier (each launch costs ~40 s on two cores); how each YAML maps
to a DeepSpeed config, and the variables Accelerate's DeepSpeed launcher exports, are checked in this process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _accelerate_launch import EXAMPLES, REPO, accelerate_launch, clean_env, free_port, run

from ds_plugin.accelerate.deepspeed_yaml import deepspeed_block_from_env, deepspeed_config_block
from ds_plugin.config import ConfigError

TRL = REPO / "tests" / "configs" / "trl"
TRAIN = EXAMPLES / "train.py"
ARGS = ("--steps", "4")
FP32_REL = 1e-5


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    out = tmp_path_factory.mktemp("ddp") / "ddp.json"
    return accelerate_launch(TRAIN, *ARGS, out=out)["losses"]


def _launch_yaml(yaml: Path, out: Path) -> dict:
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(yaml),
           "--multi_gpu", "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(free_port()),
           "-m", "ds_plugin.accelerate", str(TRAIN), *ARGS, "--out", str(out)]  # fmt: skip
    proc = run(cmd, timeout=240, env=clean_env(), done_file=out)
    assert out.is_file(), proc.stdout[-4000:]
    return {**json.loads(out.read_text()), "output": proc.stdout}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "stage"),
    [
        pytest.param("deepspeed_zero1.yaml", 1, marks=pytest.mark.long),
        pytest.param("deepspeed_zero2.yaml", 2, marks=pytest.mark.long),
        ("deepspeed_zero3.yaml", 3),
        ("deepspeed_config_file.yaml", 3),
    ],
)
def test_deepspeed_yaml_unchanged_trains_like_ddp(ddp, tmp_path: Path, name: str, stage: int) -> None:
    result = _launch_yaml(TRL / name, tmp_path / "out.json")
    assert result["accelerator"] == "ds_plugin.accelerate.accelerator" and result["num_processes"] == 2
    assert f"ZeRO stage {stage} on 2 ranks: compute fp32" in result["output"]
    assert "deepspeed_config.zero3_init_flag" in result["output"]  # reported with its reason
    assert len(result["losses"]) == len(ddp) and ddp[-1] < ddp[0]
    for got, want in zip(result["losses"], ddp, strict=True):
        assert abs(got - want) <= FP32_REL * abs(want), (result["losses"], ddp)


# ---------------------------------------------------------------------------------------------------- one process


def test_trl_yamls_map_to_deepspeed_configs() -> None:
    import yaml

    for stage in (1, 2, 3):
        block = yaml.safe_load((TRL / f"deepspeed_zero{stage}.yaml").read_text())["deepspeed_config"]
        config, ignored = deepspeed_config_block(block)
        assert config["zero_optimization"]["stage"] == stage
        assert config["train_micro_batch_size_per_gpu"] == "auto" and config["gradient_clipping"] == "auto"
        assert config["gradient_accumulation_steps"] == 1  # each of trl's three says 1
        launcher = {"deepspeed_multinode_launcher"} & set(block)  # ZeRO-2's version has no launcher key
        assert set(ignored) == {"zero3_init_flag"} | launcher
        assert all(len(reason) > 20 for reason in ignored.values())
    assert config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


def test_accelerates_deepspeed_launcher_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_CONFIG_DS_FIELDS": "zero_stage,offload_optimizer_device,gradient_accumulation_steps,"
        "gradient_clipping",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none",  # exported as a default, not in the YAML's fields
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4",
        "ACCELERATE_GRADIENT_CLIPPING": "1.0",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    config, ignored = deepspeed_config_block(deepspeed_block_from_env())
    assert config["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert (config["gradient_accumulation_steps"], config["gradient_clipping"], ignored) == (4, 1.0, {})
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    assert deepspeed_block_from_env() is None


@pytest.mark.parametrize(
    ("block", "words"),
    [
        ({"deepspeed_config_file": "ds.json", "zero_stage": 2}, "zero_stage must be set in that JSON"),
        ({"zero_stag": 2}, "deepspeed_config.zero_stag: not an Accelerate DeepSpeed key"),
        ({"zero_stage": 2, "gradient_accumulation_steps": "four"}, "is not a number"),
    ],
)
def test_bad_deepspeed_blocks_are_one_line(block: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words) as err:
        deepspeed_config_block(block)
    assert "\n" not in str(err.value)
