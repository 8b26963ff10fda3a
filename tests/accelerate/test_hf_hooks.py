"""The HF Trainer hooks of `ds_plugin.accelerate.hf`, on a stand-in Trainer class (no process group needed)."""

from __future__ import annotations

import os
import types
from typing import Any

import pytest

import ds_plugin.peft_adapters
from ds_plugin.accelerate import hf
from ds_plugin.config import ConfigError


class _Trainer:
    """The methods `_hook_trainer` wraps, recording what the wrappers call."""

    def __init__(self, should_save: bool) -> None:
        self.args = types.SimpleNamespace(should_save=should_save, output_dir="out", push_to_hub=False)
        self.model = object()
        self.saved: list[tuple[Any, Any]] = []

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        return {}

    def create_optimizer(self) -> Any: ...

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any: ...

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        raise AssertionError("the engine's save must not fall back to the Trainer's own")

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None: ...

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None: ...

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        self.saved.append((output_dir, state_dict))


@pytest.mark.parametrize("rank", [0, 1])
def test_save_model_gathers_on_every_rank_and_writes_on_the_saving_rank_only(rank, monkeypatch):
    # transformers < 5.24's Trainer._save writes whatever it is given, on any rank: a second rank's call wrote its
    # empty dict over rank 0's adapter (seen with transformers 5.17 and trl's DPOTrainer, 3 runs in 10).
    gathered = []
    full = {"lora_A.weight": "rank 0's tensor"} if rank == 0 else {}
    monkeypatch.setattr(
        ds_plugin.peft_adapters, "full_state_dict", lambda engine, **kw: gathered.append(engine) or full
    )
    monkeypatch.setattr(ds_plugin.peft_adapters, "saved_weights_dtype", lambda engine: None)
    module = types.ModuleType("stand_in_trainer")
    module.Trainer = type("Trainer", (_Trainer,), {})
    hf._hook_trainer(module)
    monkeypatch.setattr(hf, "_engine", lambda trainer: "engine")
    trainer = module.Trainer(should_save=rank == 0)
    trainer.save_model("adapter")
    assert gathered == ["engine"]  # the gather is a collective: every rank joins it
    assert trainer.saved == ([("adapter", full)] if rank == 0 else [])


def test_save_state_hands_exclude_frozen_parameters_to_the_engine_checkpoint(monkeypatch, tmp_path):
    # Accelerate passes save_state's extra keywords on to DeepSpeed's save_checkpoint; this one is the engine's.
    from ds_plugin.accelerate import checkpoint

    saved = []
    monkeypatch.setattr(checkpoint, "save_engine_state", lambda out, engine, **kw: saved.append((out, engine, kw)))

    class AccelerateStandIn:
        def __init__(self) -> None:
            self.hooks, self.kwargs = [], None

        def register_save_state_pre_hook(self, hook):
            self.hooks.append(hook)
            return types.SimpleNamespace(remove=lambda: self.hooks.remove(hook))

        def save_state(self, output_dir=None, safe_serialization=True, **kwargs):
            self.kwargs = kwargs
            for hook in list(self.hooks):
                hook([], [], output_dir)
            return output_dir

    class Accelerator(checkpoint.EngineCheckpointing, AccelerateStandIn):
        def __init__(self) -> None:
            super().__init__()
            self._engine, self._models, self._optimizers = types.SimpleNamespace(module=object()), [], []

    accelerator = Accelerator()
    accelerator.save_state(str(tmp_path), exclude_frozen_parameters=True, other=1)
    assert saved == [(str(tmp_path), accelerator._engine, {"exclude_frozen": True})]
    assert accelerator.kwargs == {"other": 1} and not accelerator.hooks
    accelerator.save_state(str(tmp_path))
    assert saved[-1][2] == {"exclude_frozen": False}


def test_a_launch_rank_switches_on_at_the_first_deepspeed_arguments(monkeypatch, tmp_path):
    # `ds-plugin launch` of an HF script: arguments without `deepspeed` stay transformers' own and load nothing; the
    # first with it switches the rank to the adapter's hooks (here on a stand-in of transformers.training_args), and
    # arguments built again without it (trl's SFTTrainer rebuilds plain TrainingArguments as its SFTConfig) keep the
    # run's config.
    import dataclasses
    import json

    from ds_plugin.accelerate import bootstrap
    from ds_plugin.accelerate.plugin import CONFIG_ENV
    from ds_plugin.deepspeed import _rank_entry

    @dataclasses.dataclass
    class TrainingArguments:
        deepspeed: Any = None
        fsdp: Any = None
        ddp_timeout: int = 1800
        gradient_accumulation_steps: int = 1
        max_grad_norm: float = 1.0

        def __post_init__(self) -> None:
            self.built = True

        def to_dict(self) -> dict:
            return dataclasses.asdict(self)

    module = types.ModuleType("stand_in_training_args")
    module.TrainingArguments = TrainingArguments
    switched = []
    monkeypatch.setattr(bootstrap, "switch_on_for_launch", lambda: switched.append(hf._hook_training_args(module)))
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    _rank_entry._hf_trainer_on_the_engine(module)

    plain = TrainingArguments()
    assert plain.built and not switched and CONFIG_ENV not in os.environ and plain.ddp_timeout == 1800
    config = tmp_path / "ds.json"
    config.write_text('{"zero_optimization": {"stage": 2}}')
    first = TrainingArguments(deepspeed=str(config))
    assert len(switched) == 1 and first.built and first.deepspeed is None and first._ds_plugin_config == str(config)
    assert os.environ[CONFIG_ENV] == str(config.resolve()) and first.ddp_timeout != 1800  # ds_plugin's timeout
    again = TrainingArguments(**first.to_dict())
    assert again.built and hf.trainer_plugin(again).training_config.zero_optimization.stage == 2
    plain_again = TrainingArguments(**{**first.to_dict(), "deepspeed": None})  # from the run's config
    assert hf.trainer_plugin(plain_again).training_config.zero_optimization.stage == 2
    monkeypatch.setenv(CONFIG_ENV, "zero1")  # the launch's own: an argument in code beats it, rebuilt or not
    coded = TrainingArguments(deepspeed='{"zero_optimization": {"stage": 3}}')
    assert hf.trainer_plugin(TrainingArguments(**coded.to_dict())).training_config.zero_optimization.stage == 3
    monkeypatch.delenv(CONFIG_ENV)
    inline = TrainingArguments(deepspeed='{"zero_optimization": {"stage": 1}}')  # `--deepspeed '{...}'`
    assert json.dumps(inline._ds_plugin_config) == '{"zero_optimization": {"stage": 1}}' and len(switched) == 1
    for bad in (str(tmp_path / "missing.json"), '{"zero_optimization": '):  # checked as it is built, in one line
        with pytest.raises(ConfigError) as exc:
            TrainingArguments(deepspeed=bad)
        assert "\n" not in str(exc.value)
