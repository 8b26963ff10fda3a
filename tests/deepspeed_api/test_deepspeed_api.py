"""`import ds_plugin.deepspeed as deepspeed`: DeepSpeed's API on 2 gloo ranks (one spawn, many assertions).

ZeRO-3 with the model built inside `zero.Init()`: the engine's DeepSpeed methods, `GatheredParameters` reading and
(with `modifier_rank=0`) editing a sharded parameter, which every rank then holds; an edit with no modifier rank is
dropped. Stage 1: an edit reaches the fp32 master, so it survives the next optimizer step's copy back. `comm`,
checkpoints, `save_16bit_model`. In this process: the one-line refusals before any process group, and the launcher's
command line for hostfiles, `--include` and `--node_rank`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ds_plugin.deepspeed as deepspeed
from ds_plugin.cli import main as cli_main
from ds_plugin.config import ConfigError
from ds_plugin.launch import run_ranks

CONFIG3 = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "zero_optimization": {"stage": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_num_steps": 4, "warmup_max_lr": 0.01, "warmup_type": "linear"},
    },
}


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def _api(rank: int, world: int, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    with deepspeed.zero.Init():
        net = _net()
    net.forward_value = lambda: "forward_value"
    out["meta_before_initialize"] = net[0].weight.is_meta
    try:  # nothing to gather before initialize: loading weights there would be lost, so it is refused
        with deepspeed.zero.GatheredParameters(net[0].weight, modifier_rank=0):
            pass
    except ValueError as exc:
        out["gather_on_meta"] = str(exc)
    args = argparse.Namespace(local_rank=rank, deepspeed_config=None)
    data = torch.utils.data.TensorDataset(torch.randn(32, 6), torch.randn(32, 2))
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=net, model_parameters=net.parameters(), training_data=data, config=CONFIG3
    )
    out["types"] = [type(optimizer).__name__, type(scheduler).__name__, type(loader).__name__]
    out["methods"] = [
        engine.gradient_accumulation_steps(),
        engine.zero_optimization_stage(),
        engine.local_rank,
        engine.global_rank,
        str(engine.device),
        engine.train_micro_batch_size_per_gpu(),
        len(loader),
    ]
    boundaries, lrs = [], []
    for x, y in loader:
        boundaries.append(engine.is_gradient_accumulation_boundary())
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        lrs.append(engine.get_lr()[0])
    out["boundaries"], out["lrs"], out["global_steps"] = boundaries, lrs, engine.global_steps
    timer = engine.tput_timer  # DeepSpeed-Chat calls update_epoch_count() at each epoch's end
    counts = (timer.micro_step_count, timer.global_step_count)
    timer.update_epoch_count()
    out["tput"] = (*counts, timer.epoch_count, timer.micro_step_count, engine.global_samples, engine.monitor.enabled)
    consolidated = engine._consolidated_16bit_state_dict()
    out["consolidated"] = sorted(consolidated), sorted({str(t.dtype) for t in consolidated.values()})
    out["module_is_engines"] = engine.module is engine.engine.module and engine.optimizer is optimizer
    # What real scripts read off DeepSpeed's engine (an nn.Module holding the model as `module`, passing the model's
    # own attributes through): DeepSpeed-Chat's `model.model`, HelloDeepSpeed's parameter count, cifar's dtype checks.
    out["passthrough"] = [
        engine.forward_value(),  # the model's own method (a reward model's, in DeepSpeed-Chat)
        sum(p.numel() for p in engine.parameters()),
        [n for n, _ in engine.named_parameters()][:2],
        [n for n, _ in engine.named_modules()][:3],
        sorted(engine.state_dict())[:2],
        engine.bfloat16_enabled(),
        engine.fp16_enabled(),
        engine.gradient_clipping(),
        engine.loss_scale(),
        engine.get_mom(),
        optimizer.overflow,
    ]
    try:
        getattr(engine, "no_such_attribute")  # noqa: B009  (the lookup itself is what is tested)
    except AttributeError as exc:
        out["missing"] = str(exc)
    engine.eval()
    out["eval"] = not engine.module.training
    engine.train()

    # GatheredParameters: full inside; rank 0's edit everywhere afterwards; read-only edits dropped.
    weight = engine.module[0].weight
    before = weight.full_tensor().clone()
    with deepspeed.zero.GatheredParameters(weight):
        out["full_shape_inside"] = list(weight.data.shape)
        out["read_matches"] = torch.equal(weight.data, before)
        weight.data.add_(100.0)  # no modifier rank: dropped
    out["read_only_dropped"] = torch.equal(weight.full_tensor(), before)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=0):
        engine.module[0].weight.data.fill_(float(rank + 1))  # rank 1's value must lose
    out["edited"] = engine.module[0].weight.full_tensor().unique().tolist()
    out["local_shard_rows"] = engine.module[0].weight.to_local().shape[0]

    # comm
    t = torch.tensor([float(rank + 1)])
    deepspeed.comm.all_reduce(t)
    deepspeed.comm.barrier()
    out["comm"] = [deepspeed.comm.get_rank(), deepspeed.comm.get_world_size(), float(t)]

    # checkpoints (a step number as the tag, as scripts pass it) and the 16-bit model
    engine.save_checkpoint(tmp, tag=7)
    out["int_tag"] = (Path(tmp) / "7").is_dir()
    engine.save_checkpoint(tmp, tag="t")
    edited = engine.module[0].weight.full_tensor().clone()
    with deepspeed.zero.GatheredParameters(engine.module[0].weight, modifier_rank=0):
        engine.module[0].weight.data.zero_()
    path, client = engine.load_checkpoint(tmp)
    out["loaded"] = [Path(path).name, client, torch.equal(engine.module[0].weight.full_tensor(), edited)]
    out["lr_after_load"] = engine.get_lr()[0]
    out["nothing_to_load"] = list(engine.load_checkpoint(str(Path(tmp) / "empty")))
    engine.save_16bit_model(tmp)
    if rank == 0:
        saved = torch.load(Path(tmp) / "pytorch_model.bin")
        out["saved16"] = sorted(saved), bool(torch.equal(saved["0.weight"], edited))
    # Under bf16 the file holds bf16 weights: the fp32 masters rounded once, cast as each is gathered.
    engine_bf16, *_ = deepspeed.initialize(model=_net(), config={**CONFIG3, "bf16": {"enabled": True}})
    masters = {k: v.full_tensor() for k, v in engine_bf16.module.state_dict().items()}
    engine_bf16.save_16bit_model(Path(tmp) / "bf16")
    if rank == 0:
        saved = torch.load(Path(tmp) / "bf16" / "pytorch_model.bin")
        out["saved_bf16"] = (
            sorted({str(t.dtype) for t in saved.values()}),
            all(torch.equal(saved[k], masters[k].to(torch.bfloat16)) for k in masters),
        )

    # Stage 1: the edit reaches the fp32 master and survives a step with zero learning rate.
    net1 = _net()
    cfg1 = {
        "train_batch_size": 8,
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
    }
    from ds_plugin.deepspeed.ops.adam import FusedAdam

    engine1, *_ = deepspeed.initialize(model=net1, config=cfg1)
    net_fused = _net()
    fused_engine, fused_optimizer, *_ = deepspeed.initialize(
        model=net_fused,
        optimizer=FusedAdam(net_fused.parameters(), lr=1e-2),
        config={k: v for k, v in cfg1.items() if k != "optimizer"},
    )
    before = [p.detach().clone() for p in fused_engine.module.parameters()]
    fused_engine.backward(fused_engine(torch.ones(4, 6)).sum())
    fused_engine.step()
    moved = [(p.detach() - b).abs().max().item() for p, b in zip(fused_engine.module.parameters(), before, strict=True)]
    out["fused_adam"] = (type(fused_optimizer).__name__, fused_optimizer.param_groups[0]["lr"], min(moved))
    with deepspeed.zero.GatheredParameters(engine1.module[2].bias, modifier_rank=0):
        engine1.module[2].bias.data.fill_(7.0 + rank)
    engine1.backward(engine1(torch.ones(4, 6)).sum())
    engine1.step()
    out["stage1_bias"] = engine1.module[2].bias.detach().tolist()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_api, 2, timeout=300, tmp=str(tmp_path_factory.mktemp("ds_api")))


def test_initialize_returns_deepspeeds_four_and_the_engine_api(ranks):
    for rank, r in enumerate(ranks):
        assert r["meta_before_initialize"] is True
        assert r["types"] == ["AdamW", "WarmupLR", "DataLoader"]
        assert r["methods"] == [2, 3, rank, rank, "cpu", 4, 4]
        assert r["boundaries"] == [False, True, False, True]
        assert r["global_steps"] == 2 and r["module_is_engines"] and r["eval"]
        # DeepSpeed's linear warmup over 4 steps: step k (from 0) has 0.01 * k / 4; a boundary step advances it.
        assert r["lrs"] == pytest.approx([0.0, 0.0, 0.0, 0.0025])
        assert r["comm"] == [rank, 2, 3.0]
        assert "still on the meta device" in r["gather_on_meta"] and "\n" not in r["gather_on_meta"]
        assert r["passthrough"] == [
            "forward_value",
            6 * 8 + 8 + 8 * 2 + 2,  # the whole model's numel, though each rank holds half of it
            ["module.0.weight", "module.0.bias"],
            ["", "module", "module.0"],
            ["module.0.bias", "module.0.weight"],
            False,
            False,
            1.0,  # DeepSpeed's default clipping
            1.0,  # no fp16: no loss scale
            [(0.9, 0.999)],
            False,  # no overflow without fp16
        ]
        assert "'DeepSpeedEngine' object has no attribute 'no_such_attribute'" in r["missing"]
        assert r["int_tag"]
        assert r["tput"] == (4, 2, 1, 0, 2 * 16, False)  # 4 micro-steps; 2 optimizer steps of 4 x 2 x 2 ranks samples
        keys = ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert r["consolidated"] == ((keys, ["torch.float32"]) if rank == 0 else ([], []))


def test_gathered_parameters_reads_full_and_edits_from_the_modifier_rank(ranks):
    for r in ranks:
        assert r["full_shape_inside"] == [8, 6] and r["read_matches"] and r["read_only_dropped"]
        assert r["edited"] == [1.0], "rank 0's edit, on every rank"
        assert r["local_shard_rows"] == 4, "the parameter is sharded again afterwards"
        assert r["stage1_bias"] == [7.0, 7.0]
        name, lr, moved = r["fused_adam"]  # Adam's first step moves every weight by about lr
        assert (name, lr) == ("AdamW", 1e-2) and moved > 1e-3


def test_checkpoint_round_trip_and_16bit_model(ranks):
    for r in ranks:
        assert r["loaded"] == ["t", {}, True]
        assert r["lr_after_load"] == pytest.approx(0.0025)
        assert r["nothing_to_load"] == [None, None]
    assert ranks[0]["saved16"] == (["0.bias", "0.weight", "2.bias", "2.weight"], True)
    assert ranks[0]["saved_bf16"] == (["torch.bfloat16"], True)


# ---------------------------------------------------------------------------------------------------- one process


def test_refusals_are_one_line_before_any_process_group(tmp_path: Path):
    net = _net()
    cases = [
        (lambda: deepspeed.initialize(model=net), "no DeepSpeed config"),
        (
            lambda: deepspeed.initialize(args=argparse.Namespace(deepspeed_config="x.json"), model=net, config={}),
            "keep one of them",
        ),
        (lambda: deepspeed.initialize(model=net, config={"optimizer": {"type": "OneBitAdam"}}), 'use "Adam"'),
        (lambda: deepspeed.initialize(model=net, config={"zero_optimization": {"stag": 3}}), "did you mean"),
        (
            lambda: deepspeed.initialize(model=net, config={"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}),
            'optimizer.params.lr: "auto" is not resolved',
        ),
        (
            lambda: deepspeed.initialize(
                model=net, optimizer=torch.optim.SGD, config={"gradient_accumulation_steps": "auto"}
            ),
            'gradient_accumulation_steps: "auto" is not resolved',
        ),
        (
            lambda: deepspeed.initialize(model=net, config=str(tmp_path / "accelerate.yaml")),
            "an Accelerate config file (distributed_type: DEEPSPEED)",
        ),
    ]
    (tmp_path / "accelerate.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n")
    for call, words in cases:
        with pytest.raises(ConfigError) as err:
            call()
        assert "\n" not in str(err.value) and words in str(err.value)
        assert not dist.is_initialized()


def test_accelerator_and_adam_as_scripts_import_them():
    # DeepSpeedExamples and DeepSpeed-Chat: `from deepspeed.accelerator import get_accelerator`,
    # `from deepspeed.ops.adam import FusedAdam, DeepSpeedCPUAdam`, with `ds_plugin.deepspeed` in place of `deepspeed`.
    from ds_plugin.deepspeed.accelerator import get_accelerator
    from ds_plugin.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    acc = get_accelerator()
    assert acc is deepspeed.accelerator.get_accelerator()
    gpu = torch.cuda.is_available()
    assert acc.device_name() == ("cuda" if gpu else "cpu")
    assert acc.device_name(0) == ("cuda:0" if gpu else "cpu") and acc.device(0) == torch.device(acc.device_name(0))
    assert acc.communication_backend_name() == ("nccl" if gpu else "gloo")
    assert acc.current_device_name() == (f"cuda:{torch.cuda.current_device()}" if gpu else "cpu")
    assert acc.memory_allocated() > 0 and acc.total_memory() >= acc.available_memory() > 0
    acc.manual_seed(3)
    a = torch.rand(2) if not gpu else torch.rand(2, device="cuda")
    acc.manual_seed(3)
    assert torch.equal(a, torch.rand(2) if not gpu else torch.rand(2, device="cuda"))
    acc.empty_cache(), acc.synchronize()
    params = [nn.Parameter(torch.ones(3))]
    fused = FusedAdam(params, lr=2e-3, betas=(0.9, 0.95))  # DeepSpeed's defaults: weight decay 0
    assert type(fused) is torch.optim.AdamW and fused.defaults["weight_decay"] == 0.0
    assert fused.defaults["betas"] == (0.9, 0.95) and fused.defaults["lr"] == 2e-3
    assert type(FusedAdam(params, adam_w_mode=False, weight_decay=0.1)) is torch.optim.Adam
    assert type(DeepSpeedCPUAdam(params, adamw_mode=False)) is torch.optim.Adam
    assert type(DeepSpeedCPUAdam(params, lr=1e-4, fp32_optimizer_states=True)) is torch.optim.AdamW
    with pytest.raises(ValueError, match="bias_correction=False"):
        FusedAdam(params, bias_correction=False)


def _launch_plan(*argv: str) -> tuple[list[str], dict[str, str]]:
    from ds_plugin.deepspeed.launcher import add_launch_arguments, launch_plan

    parser = argparse.ArgumentParser()
    add_launch_arguments(parser)
    return launch_plan(parser.parse_args(list(argv)))


def test_launcher_command_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    script = tmp_path / "train.py"
    script.write_text("")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    # CPU ranks start with glibc's per-thread malloc cache off (it fragments their heap); GPU ranks as they were.
    cpu = {} if torch.cuda.device_count() else {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}
    cmd, env = _launch_plan("--num_gpus", "2", str(script), "--deepspeed", "--deepspeed_config", "c.json")
    assert cmd[cmd.index("ds_plugin.deepspeed._agent") + 1 :] == [  # torchrun, a failed rank in one line
        "--nnodes=1", "--nproc-per-node=2", "--node-rank=0", "--master-addr=127.0.0.1", "--master-port=29500",
        "-m", "ds_plugin.deepspeed._rank_entry", str(script), "--deepspeed", "--deepspeed_config", "c.json",
    ]  # fmt: skip
    assert env == cpu
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.tcache_count=3")  # the user's own setting stands
    assert _launch_plan(str(script))[1] == ({} if cpu == {} else {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=3"})
    monkeypatch.delenv("GLIBC_TUNABLES")
    hosts = tmp_path / "hostfile"
    hosts.write_text("# two nodes\nworker-1 slots=4\nworker-2 slots=4\n")
    cmd, env = _launch_plan("--hostfile", str(hosts), "--node_rank", "1", "--include", "worker-1:0,1@worker-2:2,3",
                            str(script))  # fmt: skip
    assert {"--nnodes=2", "--nproc-per-node=2", "--node-rank=1", "--master-addr=worker-1"} <= set(cmd)
    assert env == {"CUDA_VISIBLE_DEVICES": "2,3", **cpu}
    cmd, _ = _launch_plan("--hostfile", str(hosts), "--num_nodes", "1", "--master_port", "1234", "--no_local_rank",
                          str(script))  # fmt: skip
    assert {"--nnodes=1", "--nproc-per-node=4", "--master-port=1234", "--no-local-rank"} <= set(cmd)
    # DeepSpeed's CPU flags act: cores shared out to the ranks, each rank's output in its own files.
    logs = tmp_path / "rank_logs"
    cmd, env = _launch_plan("--num_gpus", "2", "--bind_core_list", "0-2,5", "--enable_each_rank_log", str(logs),
                            str(script))  # fmt: skip
    assert env["DS_PLUGIN_BIND_CORES"] == "0,1,2,5" and logs.is_dir()
    assert cmd.index(f"--log-dir={logs}") < cmd.index("ds_plugin.deepspeed._rank_entry") and "--redirects=3" in cmd
    from ds_plugin.deepspeed.launcher import add_launch_arguments, without_effect

    parser = argparse.ArgumentParser()
    add_launch_arguments(parser)
    said = without_effect(parser.parse_args(["--force_multi", "--ssh_port", "22", "-q", str(script)]))
    assert [line.split(" has no effect")[0] for line in said] == [
        "ds-plugin launch: --force_multi", "ds-plugin launch: --ssh_port", "ds-plugin launch: --quiet"
    ]  # fmt: skip
    assert without_effect(parser.parse_args([str(script)])) == []


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--num_gpus", "0", "{script}"], "--num_gpus 0: must be at least 1"),
        (["missing.py"], "no such script"),
        (["--hostfile", "{tmp}/nope", "{script}"], "no such file"),
        (["--hostfile", "{bad}", "{script}"], "is not 'host slots=N'"),
        (["--include", "localhost:0", "--exclude", "localhost:1", "{script}"], "mutually exclusive"),
        (["--hostfile", "{hosts}", "{script}"], "pass --node_rank"),
        (["--hostfile", "{hosts}", "--include", "other:0", "{script}"], "host 'other' is not in the host list"),
        (["--num_nodes", "2", "{script}"], "needs --hostfile"),
        (["--autotuning", "tune", "{script}"], "autotuner is not part of ds_plugin"),
        (["--no_python", "{script}"], "--no_python: ranks run Python scripts"),
        (["--num_gpus", "2", "--bind_core_list", "3", "{script}"], "2 ranks need at least as many cores, got 1"),
        (["--bind_core_list", "2-x", "{script}"], "--bind_core_list '2-x': write cores as numbers and ranges"),
    ],
)
def test_launcher_refusals_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv, words):
    script = tmp_path / "train.py"
    script.write_text("")
    (tmp_path / "bad").write_text("worker-1 4\n")
    (tmp_path / "hosts").write_text("worker-1 slots=2\nworker-2 slots=2\n")
    names = {
        "script": str(script),
        "tmp": str(tmp_path),
        "bad": str(tmp_path / "bad"),
        "hosts": str(tmp_path / "hosts"),
    }
    assert cli_main(["launch", *(a.format(**names) for a in argv)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("ds-plugin launch: error:") and words in err, err
    json.dumps(err)


def test_the_import_deepspeed_alias_is_on_only_where_deepspeed_is_absent(monkeypatch: pytest.MonkeyPatch):
    import importlib.util

    from ds_plugin.deepspeed import _alias

    real = importlib.util.find_spec
    monkeypatch.delenv(_alias.ENV, raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    assert _alias.wanted()  # not installed: `import deepspeed` is ds_plugin's under `ds-plugin launch`
    monkeypatch.setenv(_alias.ENV, "0")
    assert not _alias.wanted()
    monkeypatch.setattr(importlib.util, "find_spec", real)
    monkeypatch.delenv(_alias.ENV)
    assert _alias.wanted() is (real("deepspeed") is None)  # installed: its own stays
    monkeypatch.setenv(_alias.ENV, "1")
    assert _alias.wanted()
