"""`ZeroPlugin` and the refusals, in this process: every error is one line and comes before a process group starts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from _accelerate_launch import REPO, clean_env, run

from ds_plugin.accelerate import CONFIG_ENV, Accelerator, ZeroPlugin
from ds_plugin.accelerate.bootstrap import main as bootstrap_main
from ds_plugin.config import ConfigError


@pytest.fixture(autouse=True)
def no_launch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (CONFIG_ENV, "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.delenv(name, raising=False)


def assert_nothing_started() -> None:
    from accelerate.state import AcceleratorState, PartialState

    assert not dist.is_initialized()
    assert AcceleratorState._shared_state == {} and PartialState._shared_state == {}


def one_line(text: str) -> str:
    assert "\n" not in text.strip(), text
    return text


def test_plugin_merges_overrides_and_keeps_auto() -> None:
    plugin = ZeroPlugin(
        "zero3", zero_stage=2, offload_optimizer_device="cpu", frozen_format="int8", overrides={"gradient_clipping": 1}
    )  # fmt: skip
    cfg = plugin.training_config
    assert (cfg.stage, cfg.zero_optimization.offload_optimizer.device, cfg.zero_optimization.frozen_format) == (
        2, "cpu", "int8")  # fmt: skip
    assert cfg.gradient_clipping == 1
    assert {"zero_optimization", "gradient_clipping"} <= plugin.explicit_keys


def test_plugin_from_env_path_preset_or_inline_json(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    for value, stage in ((str(path), 1), ("zeropp", 3), ('{"zero_optimization": {"stage": 2}}', 2)):
        monkeypatch.setenv(CONFIG_ENV, value)
        assert ZeroPlugin.from_env().training_config.stage == stage


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: ZeroPlugin.from_env(), f"{CONFIG_ENV} is not set"),
        (lambda: ZeroPlugin(), "no DeepSpeed config"),
        (lambda: ZeroPlugin({"zero_optimization": {"stage": 7}}), "stage: 7 is not a ZeRO stage"),
        (lambda: ZeroPlugin("zero4"), "unknown preset 'zero4'"),
        (lambda: ZeroPlugin("zero3", overides={}), None),  # a TypeError from the dataclass, not ours
    ],
)
def test_plugin_errors_are_one_line(make, expected: str | None) -> None:
    if expected is None:
        with pytest.raises(TypeError):
            make()
        return
    with pytest.raises(ConfigError, match=expected) as info:
        make()
    one_line(str(info.value))


def test_accelerator_without_config_fails_before_the_process_group() -> None:
    with pytest.raises(ConfigError, match=CONFIG_ENV) as info:
        Accelerator()
    one_line(str(info.value))
    assert_nothing_started()


def test_accelerate_plugins_are_refused_before_the_process_group() -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin

    with pytest.raises(ConfigError, match="fsdp_plugin") as info:
        Accelerator(zero_plugin=ZeroPlugin("zero3"), fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    one_line(str(info.value))
    with pytest.raises(ConfigError, match="deepspeed_plugin"):
        Accelerator(zero_plugin=ZeroPlugin("zero3"), deepspeed_plugin=object())
    assert_nothing_started()


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["--ds-config", "missing.json"], {}, "missing.json'?: cannot read the config"),
        (["--ds-config", "bad.json"], {}, "zero_optimization.stage: 9 is not a ZeRO stage"),
        # A DEEPSPEED Accelerate config is read (tests/accelerate/test_deepspeed_yaml.py); its JSON is checked first.
        ([], {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "missing.json"}, "cannot read"),
        ([], {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "9"}, "stage: 9 is not a ZeRO"),
        (["--ds-config", "zero3"], {"ACCELERATE_USE_FSDP": "true"}, "distributed_type: FSDP"),
    ],
)
def test_bootstrap_refuses_before_running_the_script(
    argv: list[str], env: dict[str, str], expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "bad.json").write_text(json.dumps({"zero_optimization": {"stage": 9}}))
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script ran')\n")
    monkeypatch.chdir(tmp_path)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as info:
        bootstrap_main([*argv, str(script)])
    message = one_line(str(info.value.code))
    assert message.startswith("ds_plugin.accelerate: ")
    assert pytest.importorskip("re").search(expected, message), message
    assert_nothing_started()


def test_script_building_accelerates_deepspeed_plugin_gets_one_line(tmp_path: Path) -> None:
    """Through the launch path (one process): the script's own DeepSpeedPlugin is refused before the group."""
    script = tmp_path / "own_plugin.py"
    script.write_text(
        "import torch.distributed as dist\n"
        "from accelerate import Accelerator\n"
        "from accelerate.utils import DeepSpeedPlugin\n"
        "try:\n"
        "    Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))\n"
        "finally:\n"
        "    print('process group started:', dist.is_initialized(), flush=True)\n"
    )
    proc = run([sys.executable, "-m", "ds_plugin.accelerate", "--ds-config", "zero3", str(script)], timeout=60,
               env=clean_env(), cwd=REPO)  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert proc.returncode == 1, proc.stdout
    assert "process group started: False" in lines
    assert lines[-1].startswith("ds_plugin.accelerate: Accelerator(deepspeed_plugin=...)"), proc.stdout
    assert "Traceback" not in proc.stdout


def test_accumulation_conflicting_with_the_json_fails_before_the_process_group() -> None:
    plugin = ZeroPlugin({"gradient_accumulation_steps": 4, "zero_optimization": {"stage": 1}})
    with pytest.raises(ConfigError, match=r"config says 4 but Accelerator\(gradient_accumulation_steps=2\)") as info:
        Accelerator(zero_plugin=plugin, gradient_accumulation_steps=2)
    one_line(str(info.value))
    assert_nothing_started()


def test_hf_trainer_default_ddp_timeout_becomes_ds_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from ds_plugin.accelerate.hf import _collective_timeout

    monkeypatch.setenv("DS_PLUGIN_TIMEOUT", "120")
    default, chosen = SimpleNamespace(ddp_timeout=1800), SimpleNamespace(ddp_timeout=900)
    _collective_timeout(default)
    _collective_timeout(chosen)
    assert (default.ddp_timeout, chosen.ddp_timeout) == (120, 900)


def test_ds_config_beats_a_deepspeed_accelerate_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "train.py"
    script.write_text("import os\nraise SystemExit('the script ran with ' + os.environ['ACCELERATE_USE_DEEPSPEED'])\n")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "1")
    # The bootstrap runs the script as `python script.py` would: it sets sys.argv, sys.path[0] and __main__. Put them
    # back after, or every later multiprocessing child in this process starts from that script's directory.
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setitem(sys.modules, "__main__", sys.modules["__main__"])
    with pytest.raises(SystemExit, match="the script ran with false"):
        bootstrap_main(["--ds-config", "zero3", str(script)])
    assert ZeroPlugin.from_env().training_config.stage == 3
