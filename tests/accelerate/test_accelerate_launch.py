"""Unchanged Accelerate scripts on 2 CPU processes through `accelerate launch -m ds_plugin.accelerate`.

The runs: plain Accelerate DDP (the reference), ZeRO-2, ZeRO-3 (saving its state at step 3 and the model at the
end), ZeRO-3 resumed from that state in a new launch, ZeRO++ in bf16, FP8 in one process, the HF Trainer + trl
DPOTrainer, and the FSDP2-style order in fp16. Process start-up dominates, so the runs share three launches
(scripts/runs.py calls each script's `main()` in turn, resetting Accelerate's state between them): the 2-process
trainings, the resumed run with the HF/trl parts, and the 1-process runs. The training script is
examples/with_accelerate/train.py, which never imports ds_plugin.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from _accelerate_launch import EXAMPLES, REPO, SCRIPTS, clean_env, launch_cmd, run

pytestmark = pytest.mark.slow

TRAIN = EXAMPLES / "train.py"
ARGS = ("--steps", "6", "--grad-accum", "2")
FP32_REL = 1e-5


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("accelerate")


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


def launch(workdir: Path, name: str, runs: list[dict[str, Any]], *, processes: int, timeout: float) -> dict:
    """One launch of scripts/runs.py for `runs` ({"name", "script", "args", "config"}); returns {run name: result}.

    Each run writes its own result file (`--out`, added here); runs.py gathers them, with each run's log lines.
    """
    for r in runs:
        r["result"] = str(workdir / f"{r['name']}.json")
        r["args"] = [*map(str, r["args"]), "--out", r["result"]]
    out = workdir / f"{name}.json"
    script = [str(SCRIPTS / "runs.py"), "--out", str(out), "--runs", json.dumps(runs)]
    ds_config = next(r["config"] for r in runs if r["config"] != "plain")  # the bootstrap checks it first
    if processes == 1:
        cmd = [sys.executable, "-m", "ds_plugin.accelerate", "--ds-config", ds_config, *script]
    else:
        cmd = [*launch_cmd(Path(script[0]), ds_config), *script[1:]]
    proc = run(cmd, timeout=timeout, env=clean_env(), done_file=out)
    if not out.is_file():
        partial = {r["name"]: json.loads(Path(r["result"]).read_text()) for r in runs if Path(r["result"]).is_file()}
        raise AssertionError(
            f"launch {name} failed (exit code {proc.returncode}, no result; results so far {sorted(partial)}):\n"
            f"{json.dumps(partial)[-3000:]}\n{_tail(proc.stdout)}"
        )
    return json.loads(out.read_text())


def result_of(runs: dict[str, Any], name: str) -> dict[str, Any]:
    if name not in runs:
        pytest.fail(f"run {name} did not run: an earlier run of its launch failed", pytrace=False)
    if "error" in runs[name]:
        pytest.fail(f"run {name} failed:\n{runs[name]['error']}", pytrace=False)
    return runs[name]


def _train(name: str, config: str, *args: str) -> dict[str, Any]:
    return {"name": name, "script": str(TRAIN), "config": config, "args": [*ARGS, *args]}


@pytest.fixture(scope="module")
def two_processes(workdir: Path) -> dict[str, Any]:
    runs = [
        _train("ddp", "plain"),
        _train("zero2", str(EXAMPLES / "zero2.json")),
        _train("zero3", str(EXAMPLES / "zero3.json"), "--save-state-at", "3", "--output-dir", str(workdir / "zero3")),
        _train("zeropp", str(EXAMPLES / "zeropp.json"), "--output-dir", str(workdir / "zeropp")),
    ]
    return launch(workdir, "two_processes", runs, processes=2, timeout=420)


@pytest.fixture(scope="module")
def resumed_and_hf(workdir: Path, two_processes: dict[str, Any]) -> dict[str, Any]:
    result_of(two_processes, "zero3")  # the state it resumes from
    resumed = _train("resumed", str(EXAMPLES / "zero3.json"), "--resume-from", str(workdir / "zero3" / "state"),
                     "--resume-step", "3")  # fmt: skip
    parts = "trainer,dpo" if importlib.util.find_spec("trl") else "trainer"  # trl: the dev extra
    # The Trainer part brings its own JSON; DPO runs on the run's (LoRA's frozen base stored as INT8).
    hf = {"name": "hf", "script": str(SCRIPTS / "hf_trainers.py"), "config": str(EXAMPLES / "zero3_lora_int8.json"),
          "args": ["--workdir", str(workdir), "--parts", parts,
                   "--hf-config", str(REPO / "tests" / "configs" / "hf_trainer_zero3_auto.json")]}  # fmt: skip
    return launch(workdir, "resumed_and_hf", [resumed, hf], processes=2, timeout=400)


@pytest.fixture(scope="module")
def one_process(workdir: Path) -> dict[str, Any]:
    fp8 = _train("fp8", "zero3", "--model", "llama", "--mixed-precision", "fp8")
    delayed = {"name": "delayed", "script": str(SCRIPTS / "delayed_optimizer.py"), "config": "zero1", "args": []}
    return launch(workdir, "one_process", [fp8, delayed], processes=1, timeout=200)


@pytest.fixture(scope="module")
def ddp(two_processes: dict[str, Any]) -> dict[str, Any]:
    return result_of(two_processes, "ddp")


@pytest.fixture(scope="module")
def zero2(two_processes: dict[str, Any]) -> dict[str, Any]:
    return result_of(two_processes, "zero2")


@pytest.fixture(scope="module")
def zero3(two_processes: dict[str, Any]) -> dict[str, Any]:
    return result_of(two_processes, "zero3")


@pytest.fixture(scope="module")
def resumed(resumed_and_hf: dict[str, Any]) -> dict[str, Any]:
    return result_of(resumed_and_hf, "resumed")


@pytest.fixture(scope="module")
def zeropp(two_processes: dict[str, Any]) -> dict[str, Any]:
    return result_of(two_processes, "zeropp")


def assert_close(losses: list[float], reference: list[float], rel: float) -> None:
    assert len(losses) == len(reference) > 0
    for step, (a, b) in enumerate(zip(losses, reference, strict=True)):
        assert a == pytest.approx(b, rel=rel), f"micro-step {step}: {a} vs {b} ({losses} vs {reference})"


def test_reference_is_plain_accelerate_ddp(ddp: dict[str, Any]) -> None:
    assert ddp["accelerator"] == "accelerate.accelerator"
    assert (ddp["distributed_type"], ddp["num_processes"]) == ("DistributedType.MULTI_CPU", 2)
    assert ddp["losses"][-1] < ddp["losses"][0] - 0.3  # it trains, so a no-op step elsewhere cannot match it


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_fp32_losses_match_ddp(request: pytest.FixtureRequest, ddp: dict[str, Any], name: str) -> None:
    run_ = request.getfixturevalue(name)
    assert run_["accelerator"] == "ds_plugin.accelerate.accelerator"
    assert run_["num_processes"] == 2
    stage = name[-1]
    # "auto" filled as Accelerate fills it: accumulation 2, clipping 1.0 in the step (as its DeepSpeed integration
    # does; the script's own clip_grad_norm_ at 1.0 came first, so the step does not clip again), micro batch 4.
    assert (
        f"ZeRO stage {stage} on 2 ranks: compute fp32, reduce fp32, gradient accumulation 2, clipping 1, micro batch 4"
        in run_["output"]
    )
    assert_close(run_["losses"], ddp["losses"], FP32_REL)
    assert_close(run_["grad_norms"], ddp["grad_norms"], 1e-4)  # clip_grad_norm_ returns the global norm
    assert run_["eval_count"] == ddp["eval_count"] == 10  # gather_for_metrics drops the padding
    assert run_["eval_loss"] == pytest.approx(ddp["eval_loss"], rel=FP32_REL)


def test_resume_in_a_new_process_gives_the_same_next_losses(zero3: dict[str, Any], resumed: dict[str, Any]) -> None:
    assert "loaded the engine state" in resumed["output"]
    assert resumed["losses"] == zero3["losses"][6:]  # steps 4-6 (two micro-steps each), bit for bit
    assert resumed["eval_loss"] == zero3["eval_loss"]


def _example_module() -> Any:
    spec = importlib.util.spec_from_file_location("accelerate_example_train", TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_get_state_dict_loads_with_from_pretrained(workdir: Path, zero3: dict[str, Any]) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(workdir / "zero3" / "model").eval()
    example = _example_module()
    data = torch.frombuffer(bytearray(example.DATA.read_bytes()), dtype=torch.uint8).long()
    windows = example.ByteWindows(data, 32, 10, seed=2)
    ids = torch.stack([windows[i]["input_ids"] for i in range(len(windows))])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert loss.item() == pytest.approx(zero3["eval_loss"], rel=1e-5)  # the trained weights, whole
    saved = load_file(workdir / "zero3" / "save_model" / "model.safetensors")  # accelerator.save_model
    full = model.state_dict()
    assert set(saved) <= set(full) and len(saved) >= len(full) - 1  # lm_head may be tied to wte
    for key, value in saved.items():
        torch.testing.assert_close(value, full[key], rtol=0, atol=0)


def test_zeropp_bf16_trains_close_to_ddp(workdir: Path, zeropp: dict[str, Any], ddp: dict[str, Any]) -> None:
    import torch
    from safetensors.torch import load_file

    assert "ZeRO stage 3 + qwZ, qgZ on 2 ranks: compute bf16" in zeropp["output"]
    losses = zeropp["losses"]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.3
    assert losses != ddp["losses"]  # quantized collectives and bf16: close, not equal
    assert losses[-1] == pytest.approx(ddp["losses"][-1], rel=0.05)
    # The JSON sets stage3_gather_16bit_weights_on_model_save: `get_state_dict` (into save_pretrained) and
    # `save_model` both write the weights in bf16, the same weights.
    pretrained = load_file(workdir / "zeropp" / "model" / "model.safetensors")
    saved = load_file(workdir / "zeropp" / "save_model" / "model.safetensors")
    assert pretrained.keys() == saved.keys() and len(saved) > 10
    assert {t.dtype for t in [*saved.values(), *pretrained.values()]} == {torch.bfloat16}
    assert all(torch.equal(saved[k], pretrained[k]) for k in saved)


def test_fp8_from_accelerate_mixed_precision_in_one_process(one_process: dict[str, Any]) -> None:
    result = result_of(one_process, "fp8")
    assert "ZeRO stage 3 + fp8 tensorwise on 1 ranks: compute bf16" in result["output"]
    assert "fp8 tensorwise: converted" in result["output"]
    assert result["distributed_type"] == "DistributedType.NO"
    assert result["losses"][-1] < result["losses"][0] - 0.3


@pytest.fixture(scope="module")
def hf(resumed_and_hf: dict[str, Any]) -> dict[str, Any]:
    result = dict(result_of(resumed_and_hf, "hf"))
    for name, part in result.items():
        if isinstance(part, dict) and "error" in part:
            pytest.fail(f"part {name} failed:\n{part['error']}", pytrace=False)
    return result


def _falls(losses: dict[str, float]) -> list[float]:
    values = [losses[k] for k in sorted(losses, key=int)]
    assert len(values) == 10 and all(math.isfinite(v) for v in values)
    assert values[-1] < values[0]
    return values


def test_hf_trainer_with_its_deepspeed_json(hf: dict[str, Any]) -> None:
    part = hf["trainer"]
    # HF's zero3 JSON with "auto" everywhere, filled from TrainingArguments: bf16, accumulation 2, max_grad_norm 1.
    assert (part["stage"], part["compute"], part["accumulation"], part["clip"], part["micro_batch"]) == (
        3, "bf16", 2, 1.0, 2)  # fmt: skip
    assert part["frozen_format"] is None
    values = _falls(part["losses"])
    assert values[-1] < 0.7 * values[0]
    assert part["global_steps"] == 10
    # A second Trainer (other initial weights) resumed from checkpoint-5 logs the same losses for steps 6-10.
    assert [part["resumed"][str(s)] for s in range(6, 11)] == [part["losses"][str(s)] for s in range(6, 11)]
    assert "ds_plugin_engine" in part["checkpoint_files"] and "optimizer.pt" not in part["checkpoint_files"]
    assert "model.safetensors" in part["saved_files"]
    assert part["reload_max_diff"] < 5e-2  # from_pretrained vs the trained model's bf16 forward
    # stage3_gather_16bit_weights_on_model_save (HF's JSON): bf16 weights, the masters rounded once, none left out
    # (a tied lm_head is saved once, under the input embedding's name).
    assert part["saved_dtypes"] == ["torch.bfloat16"]
    assert part["saved_keys_missing"] in ([], ["lm_head.weight"])
    assert part["saved_vs_bf16_masters"] == 0.0 < part["saved_vs_fp32_masters"]


def test_trl_dpo_with_lora(hf: dict[str, Any]) -> None:
    if "dpo" not in hf:
        pytest.skip("trl is not installed (pip install -e '.[dev]')")
    part = hf["dpo"]
    assert part["stage"] == 3 and part["model"].endswith("PeftModelForCausalLM")
    assert part["frozen_format"] == "int8"
    assert "ZeRO stage 3 + frozen int8 on 2 ranks: compute bf16" in hf["output"]  # DPOConfig's bf16 fills "auto"
    values = _falls(part["losses"])
    # Policy == reference at the start: log 2, as trl logs it (trl 1.14, what Python 3.10 resolves to, logs the
    # bf16 loss: 0.69140625, within half a bf16 step of log 2).
    assert values[0] == pytest.approx(math.log(2), abs=2e-3)
    assert "adapter_model.safetensors" in part["saved_files"]
    assert part["reload_max_diff"] < 1e-2 < part["base_max_diff"]  # the adapter reloads, and it matters
    # Its Trainer checkpoint: the LoRA weights (and their optimizer state), none of the INT8 base.
    assert len(part["checkpoint_model_keys"]) == len(part["trainable"]) > 0
    assert all("lora_" in k for k in part["checkpoint_model_keys"]) and part["checkpoint_frozen_excluded"] > 0
    assert part["checkpoint_reload_diff"] == 0.0  # loaded back through the Trainer's resume hook


def test_model_first_then_optimizer_fp16_stage1(one_process: dict[str, Any]) -> None:
    """The FSDP2-style order, fp16 with the engine's loss scaler (overflow steps skipped), stage 1, one process."""
    result = result_of(one_process, "delayed")
    assert (result["stage"], result["compute"], result["optimizer_is_engines"]) == (1, "fp16", True)
    assert result["loss_scale"] is not None and result["loss_scale"] <= 2.0**16
    assert result["global_steps"] == len(result["losses"]) == 24
    assert result["losses"][-1] < 0.5 * result["losses"][0]
    # The scheduler, built on the user's optimizer before prepare, follows the engine's: one step per applied step.
    assert result["optimizer_lr"] == result["lr"] == pytest.approx(1e-2 * 0.9 ** (24 - result["skipped"]))
