"""One-process checks of the Lightning adapters: one-line errors, the registry, precision mapping, and how the
config's "auto" values and DeepSpeed defaults meet the Trainer's arguments. Nothing here launches ranks.
"""

from __future__ import annotations

import importlib
import logging
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

import ds_plugin
from ds_plugin.checkpoint import CheckpointError, load_engine_checkpoint
from ds_plugin.config import ConfigError
from ds_plugin.strategies import (
    Fp8Precision,
    ZeroFabricStrategy,
    ZeroPrecision,
    ZeroStrategy,
    register_lightning_strategies,
    registry,
)
from ds_plugin.strategies.lightning_precision import to_zero_precision
from ds_plugin.zero.plan import FrameworkSettings, resolve_plan

NAMES = ["zero0", "zero1", "zero2", "zero3", "zero3_offload", "zeropp"]


@pytest.fixture(autouse=True)
def _registered() -> None:
    register_lightning_strategies()  # idempotent; `import ds_plugin` has done it already


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    return message


# -- unknown options -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [ZeroStrategy, ZeroFabricStrategy])
@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (
            {"proces_group_backend": "gloo"},
            "unknown option 'proces_group_backend'; did you mean 'process_group_backend'?",
        ),
        ({"gradient_cliping": 1.0}, "unknown option 'gradient_cliping'; did you mean 'gradient_clipping'?"),
        ({"sync_module_state": False}, "did you mean 'sync_module_states'?"),
        (
            {"stage3_max_live_parameters": 1},
            "unknown option 'stage3_max_live_parameters'; it is a ZeRO setting, pass "
            "zero_optimization={'stage3_max_live_parameters': ...}",
        ),
    ],
)
def test_unknown_option_names_the_closest(cls: type, kwargs: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as exc:
        cls("zero3", **kwargs)
    assert expected in one_line(exc)


@pytest.mark.parametrize("cls", [ZeroStrategy, ZeroFabricStrategy])
def test_lightning_deepspeed_strategy_keywords(cls: type, caplog: pytest.LogCaptureFixture) -> None:
    # Lightning's DeepSpeedStrategy(stage=..., offload_optimizer=..., ...): the class name is all that changes.
    with caplog.at_level(logging.INFO, logger="ds_plugin.strategies._deepspeed_kwargs"):
        s = cls(
            "zero3",
            stage=2,
            offload_optimizer=True,
            pin_memory=False,
            allgather_bucket_size=5e8,
            loss_scale_window=500,
            cpu_checkpointing=True,
            logging_batch_size_per_gpu=4,
        )
    zero = s.config.zero_optimization
    assert (zero.stage, zero.offload_optimizer.device, zero.offload_optimizer.pin_memory) == (2, "cpu", False)
    assert s.config.fp16.loss_scale_window == 500
    # What the config does not act on is reported as such, and Lightning's own keyword is said to have no effect.
    assert {"zero_optimization.allgather_bucket_size", "activation_checkpointing"} <= set(s.config.ignored_keys())
    assert "logging_batch_size_per_gpu has no effect here" in caplog.text
    assert cls("zero2", offload_parameters=True, stage=3).config.zero_optimization.offload_param.device == "cpu"
    assert cls("zero3", zero_optimization=False).config.stage == 0
    with pytest.raises(ConfigError) as exc:  # NVMe is refused where DeepSpeed's key would be
        cls("zero3", offload_optimizer=True, offload_optimizer_device="nvme")
    assert '"nvme" offload is not supported' in one_line(exc)


def test_unknown_preset_and_bad_config_key() -> None:
    with pytest.raises(ConfigError) as exc:
        ZeroStrategy("zeroo3")
    assert "unknown preset 'zeroo3'; did you mean 'zero3'?" in one_line(exc)
    with pytest.raises(ConfigError) as exc:
        ZeroStrategy({"zero_optimization": {"stag": 3}})
    assert "zero_optimization.stag: unknown key; did you mean 'zero_optimization.stage'?" in one_line(exc)


def test_overrides_merge_over_the_config(tmp_path) -> None:
    s = ZeroStrategy("zero3", gradient_clipping=0.5, zero_optimization={"offload_optimizer": {"device": "cpu"}})
    assert s.config.stage == 3 and s.config.gradient_clipping == 0.5
    assert s.config.zero_optimization.offload_optimizer.device == "cpu"
    assert ZeroStrategy("zero2", wandb={"enabled": False}).config.ignored_keys()  # DeepSpeed keys are accepted
    path = tmp_path / "ds_config.json"
    path.write_text('{"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": "auto"}')
    assert ZeroStrategy(str(path)).config.stage == 1
    # A TrainingConfig with overrides: parsed like a dict, ignored keys reported, bad values one line.
    base = ds_plugin.load_config({"zero_optimization": {"stage": 3, "reduce_bucket_size": 1000}})
    s = ZeroStrategy(base, steps_per_print=10, gradient_clipping=0.25)
    assert (s.config.stage, s.config.gradient_clipping) == (3, 0.25)
    assert sorted(s.config.ignored_keys()) == ["steps_per_print", "zero_optimization.reduce_bucket_size"]
    with pytest.raises(ConfigError) as exc:
        ZeroFabricStrategy(base, gradient_clipping="bad")
    assert one_line(exc).startswith("gradient_clipping: expected a number")


def test_engine_before_setup_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="not set up yet"):
        ZeroStrategy().engine  # noqa: B018


# -- precision -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["64-true", "64"])
def test_trainer_precision_the_strategy_cannot_do(precision: str) -> None:
    with pytest.raises(ValueError) as exc:
        pl.Trainer(strategy="zero3", precision=precision, accelerator="cpu", devices=2, logger=False)
    assert one_line(exc).startswith("ZeroStrategy does not support precision='64-true' (the DoublePrecision plugin)")


def test_fabric_precision_the_strategy_cannot_do() -> None:
    with pytest.raises(ValueError) as exc:
        Fabric(strategy="zero3", precision="64-true", accelerator="cpu", devices=2)
    assert one_line(exc).startswith("ZeroFabricStrategy does not support precision='64-true'")


def test_transformer_engine_is_refused() -> None:
    from lightning.pytorch.plugins.precision import TransformerEnginePrecision

    plugin = TransformerEnginePrecision.__new__(TransformerEnginePrecision)  # no transformer_engine here
    plugin.precision = "transformer-engine"
    with pytest.raises(ValueError) as exc:
        to_zero_precision(plugin, "ZeroStrategy")
    assert "precision='transformer-engine' (the TransformerEnginePrecision plugin)" in one_line(exc)
    # Without transformer_engine installed, Lightning itself refuses first, before any strategy sees it.
    with pytest.raises((ValueError, ModuleNotFoundError)):
        pl.Trainer(strategy="zero3", precision="transformer-engine", accelerator="cpu", devices=2, logger=False)


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("32-true", "fp32"), ("bf16-mixed", "bf16"), ("bf16-true", "bf16"), ("16-true", "fp16"), ("16", "bf16")],
)
def test_trainer_precision_maps_to_zero_precision(precision: str, dtype: str) -> None:
    t = pl.Trainer(strategy="zero2", precision=precision, accelerator="cpu", devices=2, logger=False)
    assert isinstance(t.strategy.precision_plugin, ZeroPrecision)
    assert t.strategy.precision_plugin.compute_dtype == dtype  # "16" is 16-mixed, which Lightning makes bf16 on CPU


def test_fp8_plugin() -> None:
    t = pl.Trainer(strategy="zero3", plugins=Fp8Precision(recipe="rowwise"), accelerator="cpu", devices=2, logger=False)
    plugin = t.strategy.precision_plugin
    assert isinstance(plugin, Fp8Precision) and plugin.compute_dtype == "bf16"
    assert plugin.config_overrides()["fp8"]["recipe"] == "rowwise"
    with pytest.raises(ConfigError) as exc:
        Fp8Precision(recipe="bogus")
    assert "fp8.recipe" in one_line(exc)


# -- the registry ----------------------------------------------------------------------------------------------
def test_register_is_idempotent_and_covers_trainer_and_fabric() -> None:
    assert register_lightning_strategies() == NAMES
    importlib.reload(registry)  # a second import of the module
    assert register_lightning_strategies() == NAMES
    for name in NAMES:
        assert StrategyRegistry[name]["init_params"] == {"config": name}
        assert STRATEGY_REGISTRY[name]["init_params"] == {"config": name}
    zeropp = StrategyRegistry.get("zeropp")
    assert isinstance(zeropp, ZeroStrategy)
    assert zeropp.config.zero_optimization.zero_quantized_weights
    assert isinstance(STRATEGY_REGISTRY.get("zero1"), ZeroFabricStrategy)


def test_a_name_registered_by_someone_else_is_left_alone() -> None:
    from lightning.fabric.strategies.registry import _StrategyRegistry

    fresh = _StrategyRegistry()
    fresh.register("zero1", dict, description="someone else's")
    registry._register_names(fresh, registry.trainer_strategy)
    assert fresh["zero1"]["strategy"] is dict and fresh["zeropp"]["strategy"] is registry.trainer_strategy
    assert isinstance(fresh.get("zeropp"), ZeroStrategy)


def test_lightnings_deepspeed_names_build_zero_where_deepspeed_is_absent(monkeypatch, tmp_path) -> None:
    from lightning.fabric.strategies import DeepSpeedStrategy as FabricDeepSpeed
    from lightning.fabric.strategies.registry import _StrategyRegistry
    from lightning.pytorch.strategies import DeepSpeedStrategy

    trainers, fabrics = _StrategyRegistry(), _StrategyRegistry()
    DeepSpeedStrategy.register_strategies(trainers)
    FabricDeepSpeed.register_strategies(fabrics)
    trainers.register("deepspeed_mine", dict, description="someone else's")
    lightnings = sorted(k for k in trainers if k != "deepspeed_mine")
    monkeypatch.setattr(registry, "_deepspeed_installed", lambda: True)  # installed: Lightning's names stay its own
    assert registry.deepspeed_names(trainers, registry.trainer_deepspeed_name) == []
    assert trainers["deepspeed_stage_3"]["strategy"] is DeepSpeedStrategy
    monkeypatch.setattr(registry, "_deepspeed_installed", lambda: False)
    for _ in range(2):  # idempotent
        assert sorted(registry.deepspeed_names(trainers, registry.trainer_deepspeed_name)) == lightnings
        assert trainers["deepspeed_stage_2_offload"]["init_params"] == {
            "lightning_name": "deepspeed_stage_2_offload", "stage": 2, "offload_optimizer": True
        }  # fmt: skip
    assert trainers["deepspeed_mine"]["strategy"] is dict
    assert "deepspeed_stage_1_offload" in registry.deepspeed_names(fabrics, registry.fabric_deepspeed_name)

    def zero(strategy, cls):
        assert isinstance(strategy, cls), type(strategy)
        z = strategy.config.zero_optimization
        return z.stage, z.offload_optimizer.device, z.offload_optimizer.pin_memory, z.offload_param.device

    assert zero(trainers.get("deepspeed"), ZeroStrategy) == (2, "none", True, "none")  # Lightning's default stage
    assert zero(trainers.get("deepspeed_stage_1"), ZeroStrategy)[0] == 1
    assert zero(trainers.get("deepspeed_stage_3"), ZeroStrategy) == (3, "none", True, "none")
    # Lightning's offload blocks: its pin_memory default (False) rides along, as it writes it.
    assert zero(trainers.get("deepspeed_stage_3_offload"), ZeroStrategy) == (3, "cpu", False, "cpu")
    assert zero(fabrics.get("deepspeed_stage_1_offload"), ZeroFabricStrategy) == (1, "cpu", False, "none")
    with pytest.raises(ConfigError) as exc:
        trainers.get("deepspeed_stage_3_offload_nvme")
    assert '"nvme" offload is not supported' in one_line(exc)
    # Lightning's config variable: the file decides and the name's keywords are not used, as in Lightning.
    config = tmp_path / "ds.json"
    config.write_text('{"zero_optimization": {"stage": 1}, "gradient_clipping": 0.5}')
    monkeypatch.setenv(registry.LIGHTNING_CONFIG_ENV, str(config))
    from_env = trainers.get("deepspeed_stage_3_offload")
    assert zero(from_env, ZeroStrategy) == (1, "none", True, "none") and from_env.config.gradient_clipping == 0.5
    monkeypatch.setenv(registry.LIGHTNING_CONFIG_ENV, str(tmp_path / "missing.json"))  # as Lightning: must be a file
    with pytest.raises(ConfigError) as exc:
        trainers.get("deepspeed_stage_3")
    assert "PL_DEEPSPEED_CONFIG_PATH=" in one_line(exc) and "is not a file" in str(exc.value)
    monkeypatch.delenv(registry.LIGHTNING_CONFIG_ENV)
    # The Trainer and Fabric themselves, through Lightning's own registries, as `import ds_plugin` registers them.
    saved = [(reg, {name: dict.get(reg, name) for name in reg if name.startswith("deepspeed")})
             for reg in (StrategyRegistry, STRATEGY_REGISTRY)]  # fmt: skip
    try:
        register_lightning_strategies()
        trainer = pl.Trainer(strategy="deepspeed_stage_2", accelerator="cpu", devices=2, logger=False)
        assert zero(trainer.strategy, ZeroStrategy)[0] == 2
        fabric = Fabric(strategy="deepspeed_stage_3", accelerator="cpu", devices=2)
        assert zero(fabric.strategy, ZeroFabricStrategy)[0] == 3
    finally:
        for reg, entries in saved:
            dict.update(reg, entries)


def test_without_registration_lightning_rejects_the_name() -> None:
    # dict methods: the registry's own `get` (which monkeypatch would call) instantiates the strategy.
    saved = {name: dict.pop(StrategyRegistry, name) for name in NAMES}
    try:
        with pytest.raises(ValueError) as exc:
            pl.Trainer(strategy="zeropp", accelerator="cpu", devices=2, logger=False)
    finally:
        dict.update(StrategyRegistry, saved)
    assert str(exc.value).startswith("You selected an invalid strategy name: `strategy='zeropp'`.")


def test_the_strategies_package_itself_imports_nothing_heavy() -> None:
    # Only ds_plugin/strategies/__init__.py runs (its parent is stubbed): the adapters load on first use.
    code = (
        "import importlib.util, sys, types; pkg = types.ModuleType('ds_plugin'); "
        "pkg.__path__ = list(importlib.util.find_spec('ds_plugin').submodule_search_locations); "
        "sys.modules['ds_plugin'] = pkg; import ds_plugin.strategies as s; "
        "print(sorted(s.__all__)[0], 'lightning' in sys.modules, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["Fp8Precision", "False", "False"]


# -- config resolution against the Trainer ---------------------------------------------------------------------
def resolve(config="zero3", precision="32-true", world_size=2, ranks_per_node=2, **framework):
    cfg = ds_plugin.load_config(config, {}, owner="ZeroStrategy")
    plugin = ZeroPrecision(precision)
    settings = FrameworkSettings(
        owner="ZeroStrategy",
        precision=plugin.compute_dtype,
        precision_label=plugin.precision,
        accumulation_setting="Trainer(accumulate_grad_batches)",
        clip_setting="Trainer(gradient_clip_val)",
        **framework,
    )
    return resolve_plan(cfg, world_size=world_size, ranks_per_node=ranks_per_node, framework=settings).config


def test_precision_fills_the_config_and_a_clash_is_one_line() -> None:
    assert resolve(precision="bf16-mixed").compute_dtype == "bf16"
    auto = {"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}}
    assert resolve(auto, precision="16-mixed").compute_dtype == "fp16"
    assert resolve({"bf16": {"enabled": True}}).compute_dtype == "bf16"  # "32-true" is Lightning's default
    with pytest.raises(ConfigError) as exc:
        resolve({"bf16": {"enabled": True}}, precision="16-mixed")
    assert "precision='16-mixed' trains in fp16 but the config enables bf16" in one_line(exc)


def test_accumulation_and_clipping_come_from_the_trainer() -> None:
    cfg = resolve(accumulation=4, clip=None)
    assert cfg.gradient_accumulation_steps == 4 and cfg.gradient_clipping == 0.0  # no DeepSpeed default 1.0 here
    assert resolve({"gradient_clipping": 1.0}, clip=None).gradient_clipping == 1.0
    assert resolve({"gradient_clipping": "auto", "gradient_accumulation_steps": "auto"}, accumulation=2, clip=0.3)
    with pytest.raises(ConfigError) as exc:
        resolve({"gradient_accumulation_steps": 4}, accumulation=1)
    assert "gradient_accumulation_steps: the config says 4 but Trainer(accumulate_grad_batches)=1" in one_line(exc)
    with pytest.raises(ConfigError) as exc:
        resolve({"gradient_clipping": 1.0}, clip=0.5)
    assert "gradient_clipping: the config says 1.0 but Trainer(gradient_clip_val)=0.5" in one_line(exc)


def test_batch_sizes_and_hpz() -> None:
    cfg = resolve({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 3}}, micro_batch_size=8)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.train_batch_size) == (8, 16)
    with pytest.raises(ConfigError) as exc:
        resolve({"train_batch_size": 32, "train_micro_batch_size_per_gpu": "auto"}, micro_batch_size=8, accumulation=1)
    assert "train_batch_size: 32 != train_micro_batch_size_per_gpu 8" in one_line(exc)
    assert resolve("zeropp", ranks_per_node=2, world_size=4).zero_optimization.zero_hpz_partition_size == 2


def test_an_hf_trainer_auto_config_resolves_from_the_trainer() -> None:
    config = Path(__file__).parents[1] / "configs" / "hf_trainer_zero3_auto.json"
    cfg = resolve(str(config), precision="bf16-mixed", micro_batch_size=4, accumulation=2, clip=1.0)
    assert (cfg.compute_dtype, cfg.stage, cfg.gradient_clipping) == ("bf16", 3, 1.0)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, cfg.train_batch_size) == (4, 2, 16)
    # Bucket sizes (ignored keys), and the optimizer/scheduler blocks' params: configure_optimizers builds both here.
    prefixes = ("zero_optimization.", "optimizer.params.", "scheduler.params.")
    assert all(key.startswith(prefixes) for key in cfg.unresolved())


def test_loading_something_that_is_not_a_checkpoint(tmp_path) -> None:
    ckpt = tmp_path / "model.ckpt"
    ckpt.write_bytes(b"not a DCP directory")
    with pytest.raises(CheckpointError) as exc:
        load_engine_checkpoint(ckpt, engine=None, optimizer=True)
    assert "is not a directory" in one_line(exc)


IMPORT_ORDERS = {
    "ds_plugin_first": "import ds_plugin; assert 'lightning' not in sys.modules, 'ds_plugin imported lightning'; "
    "from lightning.pytorch.strategies import StrategyRegistry as T; "
    "from lightning.fabric.strategies import STRATEGY_REGISTRY as F; "
    f"missing = [n for n in {NAMES!r} if n not in T or n not in F]; assert not missing, missing",
    "lightning_first": "import lightning.pytorch; import ds_plugin",
    # The adapter module itself is what loads Lightning here.
    "adapter_first": "import ds_plugin; ds_plugin.strategies.ZeroFabricStrategy",
}


def test_names_registered_in_any_import_order() -> None:
    # `import ds_plugin` alone must not import Lightning (3 s per CLI call), yet every name must be in both registries
    # and `Trainer(strategy="zeropp")` and `Fabric(strategy="zero2")` must find theirs whichever package is imported
    # first. Each order needs a fresh interpreter; the three run side by side.
    procs = {}
    for name, order in IMPORT_ORDERS.items():
        code = (
            f"import sys; {order}; "
            "from lightning.pytorch import Trainer; from lightning.fabric import Fabric; "
            "from ds_plugin.strategies import ZeroFabricStrategy, ZeroStrategy; "
            "t = Trainer(strategy='zeropp', accelerator='cpu', devices=1, logger=False); "
            "assert isinstance(t.strategy, ZeroStrategy), type(t.strategy); "
            "f = Fabric(strategy='zero2', accelerator='cpu', devices=1); "
            "assert isinstance(f.strategy, ZeroFabricStrategy), type(f.strategy); print('ok')"
        )
        procs[name] = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    failed = {}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=180)
            if proc.returncode != 0 or not out.strip().endswith("ok"):
                failed[name] = err[-2000:]
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
    assert not failed, failed
