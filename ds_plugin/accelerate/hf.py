"""The HF `Trainer` (and trl's trainers, its subclasses) on the ZeRO engine, under `python -m ds_plugin.accelerate`.

The Trainer builds its own `Accelerator` (the bootstrap makes it ds_plugin's) and treats the run as plain DDP, so
four of its steps are mapped here, each only when the Trainer's accelerator is a ds_plugin one:

* `TrainingArguments(deepspeed=...)`: the user's DeepSpeed JSON (path or dict) becomes this Trainer's ds_plugin
  config (as in Accelerate, an argument in code beats the launch's `--ds-config`), checked when the arguments are
  built, before they start the process group; `deepspeed` is then cleared so transformers does not start DeepSpeed
  itself. Without it, `DS_PLUGIN_CONFIG` must be set (also checked there). `fsdp=...` is refused there too.
* the Accelerator's arguments: a `ZeroPlugin` whose "auto" values come from `TrainingArguments`
  (`gradient_accumulation_steps`, `max_grad_norm`; precision and batch size reach the Accelerator anyway), as
  transformers' own DeepSpeed integration fills them.
* the collective timeout: transformers' default `ddp_timeout` (1800 s, set as a default) becomes ds_plugin's
  (`DS_PLUGIN_TIMEOUT`, default 10 minutes), so a dead rank ends the run as soon as outside the Trainer; any other
  `ddp_timeout` is kept.
* the DeepSpeed JSON's `optimizer` / `scheduler` blocks, as transformers' DeepSpeed integration uses them: with an
  `optimizer` block and no optimizer passed to the Trainer, `create_optimizer` hands Accelerate a `DummyOptim`
  (the block built on the engine's masters); with a `scheduler` block, `create_scheduler` gives the engine's schedule
  (stepped by the engine, logged by the Trainer). Their "auto" params come from the arguments as transformers fills
  them: lr, betas (adam_beta1/2), eps (adam_epsilon), weight_decay; warmup_min_lr 0, warmup_max_lr the learning
  rate, warmup_num_steps `get_warmup_steps`, total_num_steps the run's optimizer steps.
* `save_model`: every rank gathers the full weights (a peft model: its trainable ones), rank 0 writes them with
  `save_pretrained`, so `from_pretrained` / `PeftModel.from_pretrained` read the result.
* checkpoints (`save_steps`, `resume_from_checkpoint`): the optimizer state is the engine's sharded DCP directory
  instead of rank 0's `optimizer.pt` (which would hold only rank 0's shards); the scheduler stays the Trainer's.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from ds_plugin._after_import import after_import
from ds_plugin.accelerate.checkpoint import has_engine_state, load_engine_state, save_engine_state
from ds_plugin.accelerate.plugin import CONFIG_ENV, ZeroPlugin
from ds_plugin.config import ConfigError
from ds_plugin.runtime.faults import default_timeout

__all__ = ["install_transformers_hooks"]

logger = logging.getLogger(__name__)

_MARK = "_ds_plugin_hook"


def install_transformers_hooks() -> None:
    """Hook `TrainingArguments` and `Trainer` now, or when transformers loads them (idempotent)."""
    if importlib.util.find_spec("transformers") is None:
        return
    after_import("transformers.training_args", _hook_training_args)
    after_import("transformers.trainer", _hook_trainer)


def _wrap(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(cls, name)
    if getattr(original, _MARK, False):
        return
    wrapped = functools.wraps(original)(make(original))
    setattr(wrapped, _MARK, True)
    setattr(cls, name, wrapped)


# ---------------------------------------------------------------------- TrainingArguments


def _take_deepspeed_config(args: Any) -> None:
    if getattr(args, "fsdp", None):
        raise ConfigError(
            "TrainingArguments(fsdp=...): ds_plugin shards the model itself; drop fsdp and give a DeepSpeed config"
        )
    source = getattr(args, "deepspeed", None)
    if source:
        if isinstance(source, str) and source.lstrip().startswith("{"):
            try:  # `--deepspeed '{...}'`: JSON written out, as transformers reads it
                source = json.loads(source)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"TrainingArguments(deepspeed=...) is not valid JSON: {exc}") from None
        if isinstance(source, str):
            path = Path(source)
            given = str(path.resolve()) if path.suffix or path.exists() else source  # a path, or a preset name
        else:
            given = json.dumps(source)
        # As in Accelerate, an argument in code beats the launch's setting: this Trainer uses its own JSON.
        if os.environ.get(CONFIG_ENV, "").strip() not in ("", given):
            logger.info("TrainingArguments(deepspeed=...) is used instead of %s for this Trainer", CONFIG_ENV)
        elif not os.environ.get(CONFIG_ENV, "").strip():
            # The run's config from now on: arguments built again from these without it (trl's SFTTrainer turns
            # plain TrainingArguments into its SFTConfig) and processes the script starts find it there.
            os.environ[CONFIG_ENV] = given
        ZeroPlugin(config=source)  # checked now, before the arguments start the process group
        args.deepspeed = None  # transformers would start DeepSpeed itself
        args._ds_plugin_config = source
    elif not os.environ.get(CONFIG_ENV, "").strip():
        ZeroPlugin.from_env()  # raises, naming the variable


_HF_DEFAULT_TIMEOUT = 1800  # TrainingArguments.ddp_timeout's default


def _collective_timeout(args: Any) -> None:
    """ds_plugin's collective timeout where `ddp_timeout` is transformers' default; read before the group starts."""
    if getattr(args, "ddp_timeout", None) == _HF_DEFAULT_TIMEOUT:
        args.ddp_timeout = max(1, int(default_timeout().total_seconds()))


def _hook_training_args(module: ModuleType) -> None:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def __post_init__(self: Any) -> None:
            _take_deepspeed_config(self)
            _collective_timeout(self)
            original(self)

        return __post_init__

    def keep_config(original: Callable[..., Any]) -> Callable[..., Any]:
        # Arguments built again from these (trl's SFTTrainer: `SFTConfig(**args.to_dict())`) keep this Trainer's
        # DeepSpeed config, as they would under DeepSpeed: `deepspeed` reads as given.
        def to_dict(self: Any) -> dict[str, Any]:
            out = original(self)
            source = getattr(self, "_ds_plugin_config", None)
            if source is not None and "deepspeed" in out:
                out["deepspeed"] = source
            return out

        return to_dict

    _wrap(module.TrainingArguments, "__post_init__", make)
    _wrap(module.TrainingArguments, "to_dict", keep_config)


# ---------------------------------------------------------------------- Trainer


def _engine(trainer: Any) -> Any:
    from ds_plugin.accelerate.accelerator import Accelerator

    accelerator = getattr(trainer, "accelerator", None)
    return accelerator.engine if isinstance(accelerator, Accelerator) else None


def trainer_plugin(args: Any) -> ZeroPlugin:
    """The `ZeroPlugin` for a Trainer's arguments: its DeepSpeed JSON (or `DS_PLUGIN_CONFIG`), with "auto" values
    from `gradient_accumulation_steps` and `max_grad_norm`.

    Args:
        args: the Trainer's `TrainingArguments`.
    """
    loop = {
        "gradient_accumulation_steps": int(args.gradient_accumulation_steps),
        "gradient_clipping": float(args.max_grad_norm or 0.0),
        "accumulation_setting": "TrainingArguments(gradient_accumulation_steps)",
        "clip_setting": "TrainingArguments(max_grad_norm)",
    }
    source = getattr(args, "_ds_plugin_config", None)
    return ZeroPlugin(config=source, **loop) if source is not None else ZeroPlugin.from_env(**loop)


def _is_peft(model: Any) -> bool:
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def _hook_trainer(module: ModuleType) -> None:
    from ds_plugin.accelerate.accelerator import Accelerator
    from ds_plugin.peft_adapters import full_state_dict, saved_weights_dtype

    if "Accelerator" in module.__dict__:
        module.Accelerator = Accelerator  # bound before the bootstrap ran
    trainer = module.Trainer
    scheduler_name = getattr(module, "SCHEDULER_NAME", "scheduler.pt")

    def build_args(original: Callable[..., Any]) -> Callable[..., Any]:
        def _build_accelerator_args(self: Any, **kwargs: Any) -> dict[str, Any]:
            built = original(self, **kwargs)
            built["zero_plugin"] = trainer_plugin(self.args)
            return built

        return _build_accelerator_args

    def save_model(original: Callable[..., Any]) -> Callable[..., Any]:
        def save(self: Any, output_dir: str | None = None, _internal_call: bool = False) -> None:
            engine = _engine(self)
            if engine is None:
                return original(self, output_dir, _internal_call)
            output_dir = output_dir or self.args.output_dir
            # Every rank gathers (a collective); only the saving rank writes. transformers < 5.24's `_save` assumes it
            # runs there alone: called on another rank it wrote that rank's empty dict over the same files.
            state = full_state_dict(engine, trainable_only=_is_peft(self.model), dtype=saved_weights_dtype(engine))
            if self.args.should_save:
                self._save(output_dir, state_dict=state)
            if self.args.push_to_hub and not _internal_call:
                self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
            return None

        return save

    def save_optimizer(original: Callable[..., Any]) -> Callable[..., Any]:
        def save(self: Any, output_dir: str) -> None:
            engine = _engine(self)
            if engine is None:
                return original(self, output_dir)
            # A peft model's checkpoint holds the adapter and its optimizer state, not the frozen base: what the
            # Trainer asks of DeepSpeed (`exclude_frozen_parameters=True`); resuming keeps the base it was built with.
            save_engine_state(output_dir, engine, exclude_frozen=_is_peft(self.model))
            if self.args.should_save and self.lr_scheduler is not None:
                import torch

                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, scheduler_name))
            return None

        return save

    def load_optimizer(original: Callable[..., Any]) -> Callable[..., Any]:
        def load(self: Any, checkpoint: str | None) -> None:
            engine = _engine(self)
            if engine is None or checkpoint is None or not has_engine_state(checkpoint):
                return original(self, checkpoint)
            load_engine_state(checkpoint, engine)
            path = os.path.join(checkpoint, scheduler_name)
            if self.lr_scheduler is not None and os.path.isfile(path):
                import torch

                self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))
            return None

        return load

    def create_optimizer(original: Callable[..., Any]) -> Callable[..., Any]:
        def create(self: Any, *args: Any, **kwargs: Any) -> Any:
            accelerator = getattr(self, "accelerator", None)
            if self.optimizer is not None or not isinstance(accelerator, Accelerator):
                return original(self, *args, **kwargs)
            if accelerator.zero_plugin.training_config.optimizer is None:
                return original(self, *args, **kwargs)
            from ds_plugin.accelerate.dummy import DummyOptim

            a = self.args
            accelerator.fill_config_auto(
                {
                    "optimizer.params.lr": a.learning_rate,
                    "optimizer.params.betas": [a.adam_beta1, a.adam_beta2],
                    "optimizer.params.eps": a.adam_epsilon,
                    "optimizer.params.weight_decay": a.weight_decay,
                }
            )
            model = args[0] if args else kwargs.get("model") or self.model
            self.optimizer = DummyOptim(list(model.parameters()), lr=a.learning_rate, weight_decay=a.weight_decay)
            return self.optimizer

        return create

    def create_scheduler(original: Callable[..., Any]) -> Callable[..., Any]:
        def create(self: Any, num_training_steps: int, *args: Any, **kwargs: Any) -> Any:
            accelerator = getattr(self, "accelerator", None)
            engine = _engine(self)
            config = accelerator.zero_plugin.training_config if engine is not None else None
            if self.lr_scheduler is not None or config is None or config.scheduler is None:
                return original(self, num_training_steps, *args, **kwargs)
            from ds_plugin.accelerate.dummy import DummyScheduler

            a = self.args
            warmup = a.get_warmup_steps(num_training_steps)
            accelerator.fill_config_auto(
                {
                    "scheduler.params.warmup_min_lr": 0,
                    "scheduler.params.warmup_max_lr": a.learning_rate,
                    "scheduler.params.warmup_num_steps": max(1, warmup),
                    "scheduler.params.total_num_steps": num_training_steps,
                }
            )
            self.lr_scheduler = accelerator.prepare_scheduler(DummyScheduler(self.optimizer, warmup_num_steps=warmup))
            self._created_lr_scheduler = True
            return self.lr_scheduler

        return create

    _wrap(trainer, "_build_accelerator_args", build_args)
    _wrap(trainer, "create_optimizer", create_optimizer)
    _wrap(trainer, "create_scheduler", create_scheduler)
    _wrap(trainer, "save_model", save_model)
    _wrap(trainer, "_save_optimizer_and_scheduler", save_optimizer)
    _wrap(trainer, "_load_optimizer_and_scheduler", load_optimizer)
    logger.debug("transformers Trainer hooked for ds_plugin")
