"""`Trainer(strategy=...)` and `Fabric(strategy=...)` on 2 CPU ranks (gloo): one killed run, then one launch of
scripts/suite.py whose parts the tests below read (see the scripts for what each part does).

The training runs use data the models can learn (`cycle_loader`, `fit_loader` in scripts/_tiny_lightning.py), and
the tests check that the reference learned, so a run whose optimizer never steps fails them
(`DS_PLUGIN_TEST_NOOP_STEP=1`, see tests/_break.py) even where it would equal an equally broken reference.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _launch import clean_env, run_script

pytestmark = pytest.mark.slow

REL = 1e-5  # fp32 per-step losses against strategy="ddp"
# The causal LMs on `cycle_loader`: an untrained model scores about ln(128) on every batch (they all have the same
# statistics), learning which 16 tokens occur is worth ln(128 / 16) = 2.1 nats. Demand a third of that in 8 steps.
LM_MIN_FALL = 0.7
# The TinyMLP runs' first and last optimizer steps each cover all of fit_loader's 16 rows (2 micro-batches x 2 ranks
# x 4): a run that never steps scores them the same (ratio 1). Two AdamW steps at lr 3e-2 on its linear target must
# cut that loss by more than 30%.
FIT_RATIO = 0.7


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("killed")
    # Rank 1 SIGKILLs itself mid-step; the job must end by itself (within the 240 s here, though the collective
    # timeout is 10 minutes: the dead peer's sockets break at once). Either rank 0 reports the RankFailureError it
    # got, naming the resume path, or Lightning's launcher, which polls its children, killed the job first.
    result = run_script("resume.py", "--mode", "kill", workdir=workdir, timeout=240, expect_result=False)
    written = list(workdir.glob("resume-*.json"))  # rank 0's own report, if it got to write it
    if written:
        last = json.loads(written[0].read_text())["error"].strip().splitlines()[-1]
        assert last.startswith("ds_plugin.runtime.faults.RankFailureError: rank 0 of 2: "), result["output"][-3000:]
        assert "another rank died" in last and 'Trainer.fit(..., ckpt_path="last") resumes' in last, last
    else:
        assert "terminated with code -9. Forcefully terminating all other processes" in result["output"], result
    assert (workdir / "ckpt" / "last.ckpt" / "ds_plugin_checkpoint.json").is_file(), result["output"][-3000:]
    return workdir


@pytest.fixture(scope="module")
def suite(killed: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("suite")
    result = run_script("suite.py", "--killed", str(killed), workdir=workdir, timeout=420)
    result["workdir"] = workdir
    return result


def part(suite: dict[str, Any], name: str) -> dict[str, Any]:
    result = suite[name]
    if "error" in result:
        pytest.fail(f"suite part {name!r} failed:\n{result['error']}", pytrace=False)
    return result


def assert_close(losses: list[float], reference: list[float], rel: float) -> None:
    assert len(losses) == len(reference) > 0
    for step, (a, b) in enumerate(zip(losses, reference, strict=True)):
        assert a == pytest.approx(b, rel=rel), f"step {step}: {a} vs {b} ({losses} vs {reference})"


def assert_lm_learns(losses: list[float], what: str) -> None:
    assert losses[-1] < losses[0] - LM_MIN_FALL, f"{what} did not learn cycle_loader's tokens: {losses}"


def assert_fits(losses: list[float], what: str) -> None:
    """The loss on fit_loader's rows in the last optimizer step against the first (2 micro-batches a step)."""
    before, after = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    assert after < FIT_RATIO * before, f"{what} did not fit fit_loader's batches: {before:.4f} -> {after:.4f}"


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_fp32_losses_match_ddp(suite: dict[str, Any], kind: str, strategy: str) -> None:
    losses = part(suite, "parity")["parity"][kind]
    assert_lm_learns(losses["ddp"], f"ddp {kind}")  # equal to a reference that learns
    assert_close(losses[strategy], losses["ddp"], REL)


@pytest.mark.parametrize("name", ["zero0", "zero1", "zero3_offload"])
def test_names_with_accumulation_and_clipping_match_ddp(suite: dict[str, Any], name: str) -> None:
    names = part(suite, "parity")["names"]
    assert_fits(names["ddp"]["losses"], "ddp")
    assert_close(names[name]["losses"], names["ddp"]["losses"], REL)
    cfg = names[name]["config"]
    assert cfg["gradient_accumulation_steps"] == 2 and cfg["gradient_clipping"] == 0.05
    assert (cfg["engine_global_steps"], cfg["engine_micro_steps"]) == (3, 6)


def test_zeropp_fits_with_hpz_resolved_to_ranks_per_node(suite: dict[str, Any]) -> None:
    names = part(suite, "parity")["names"]
    cfg = names["zeropp"]["config"]
    assert cfg["stage"] == 3 and cfg["hpz"] == 2
    ddp, zeropp = names["ddp"]["losses"], names["zeropp"]["losses"]
    assert_fits(ddp, "ddp")
    assert_fits(zeropp, "zeropp")
    # qwZ/qgZ quantize the collectives: close to DDP, not bit-equal. Before the first step only qwZ's INT8 weights
    # differ, each within half a code (1/254) of its block's largest: well under 1% on the loss.
    assert_close(zeropp[:2], ddp[:2], rel=1e-2)
    # After it, qgZ's INT4 gradients (to within 1/14 of their block's largest) change the steps: AdamW normalises
    # each element, so mostly the elements rounded to zero, which skip their step. ZeRO++ then trains like DDP up to
    # a fraction of what the steps do: allow each loss a tenth of DDP's fall. A run that did not step misses by all.
    fall = sum(ddp[:2]) / 2 - sum(ddp[-2:]) / 2
    gaps = [abs(a - b) for a, b in zip(zeropp, ddp, strict=True)]
    assert max(gaps) <= 0.1 * fall, f"zeropp {zeropp} vs ddp {ddp}: gaps {gaps}, DDP fell by {fall:.4f}"
    assert zeropp != ddp


def test_bf16_mixed_sets_the_bf16_block(suite: dict[str, Any]) -> None:
    bf16 = part(suite, "parity")["bf16"]
    assert bf16["config"]["compute_dtype"] == "bf16"
    assert_lm_learns(bf16["losses"], "bf16-mixed zero3")
    # bf16 keeps 8 significant bits: the first loss, from bf16-rounded weights and activations averaged over the
    # batch's tokens, is within one bf16 spacing (2**-8 relative) of fp32's. Each of the 8 steps at lr 1e-2 then
    # follows gradients a bf16 rounding away from fp32's, and the runs drift: allow two spacings, 2**-7, still a
    # small part of the 2-8% one step changes the loss by (a step lost or skipped misses by that much).
    assert_close(bf16["losses"], bf16["fp32"], rel=2**-7)


def test_sharded_initialisation_in_configure_model(suite: dict[str, Any]) -> None:
    meta = part(suite, "parity")["meta_init"]
    assert meta["losses"][0] == pytest.approx(4.85, abs=0.1)  # ln(128): a properly initialised LM
    assert meta["wte_std"] == pytest.approx(0.02, rel=0.2)  # GPT-2's initializer_range, not garbage
    assert meta["ln_weight"] == pytest.approx(1.0, abs=1e-2)  # LayerNorm weights start at one


def test_strategy_collectives(suite: dict[str, Any]) -> None:
    c = part(suite, "parity")["collectives"]
    assert c["reduce_sum"] == 3.0 and c["reduce_mean"] == 1.5
    assert c["all_gather"] == [1.0, 2.0]
    assert c["broadcast"] == {"from": 0}
    assert c["any"] is True and c["all"] is False


def test_qlora_zeropp_on_an_nf4_base_saves_a_whole_adapter(suite: dict[str, Any]) -> None:
    qlora = part(suite, "qlora")
    assert qlora["stage"] == 3 and qlora["quantized"] == 14 and qlora["sharded"] > 14
    assert len(qlora["losses"]) == 8
    assert qlora["adapter_keys"] == 16 and qlora["adapter_loaded"]  # 2 layers x q/k/v/o x (A, B), whole
    assert qlora["lora_b_max"] > 0  # LoRA B starts at zero: it trained
    assert "adapter_model.safetensors" in qlora["files"]
    # That the saved adapter reproduces the trained model is checked once, in tests/zero/test_frozen_zero.py.


def test_lora_zeropp_adapter_reloads(suite: dict[str, Any]) -> None:
    lora = part(suite, "lora")
    assert (lora["stage"], lora["hpz"], lora["qwz"], lora["qgz"]) == (3, 2, True, True)
    assert len(lora["adapter_keys"]) == 4 and all("lora_" in k for k in lora["adapter_keys"])
    assert "adapter_model.safetensors" in lora["files"]
    assert lora["lora_b_max"] > 0  # LoRA B starts at zero: it trained
    assert lora["base_changed"] == 0.0  # the frozen base did not move
    assert lora["reloaded_adapter_diff"] == 0.0
    assert lora["logits_diff"] < 1e-5
    # exclude_frozen_parameters: the checkpoint holds the LoRA weights only; restored onto the same base it is the
    # trained model, bit for bit.
    assert len(lora["checkpoint_model_keys"]) == 4 and all("lora_" in k for k in lora["checkpoint_model_keys"])
    assert lora["restored_global_step"] == 8 and lora["restored_diff"] == 0.0


@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_fabric_losses_match_ddp(suite: dict[str, Any], strategy: str) -> None:
    losses = part(suite, "fabric")["losses"]
    assert_fits(losses["ddp"], "fabric ddp")
    assert_close(losses[strategy], losses["ddp"], REL)


def test_fabric_save_load_across_stages(suite: dict[str, Any]) -> None:
    f = part(suite, "fabric")
    assert f["engine_steps"] == [3, 6]
    assert f["weights_diff"] == 0.0
    assert f["step"] == 6 and f["remainder"] == {"note": "hello"}
    assert f["scheduler_epoch"][0] == f["scheduler_epoch"][1] and f["lr"][0] == f["lr"][1]
    assert f["optimizer_steps"] == [3, 3]


def test_trainer_clips_by_value_like_ddp(suite: dict[str, Any]) -> None:
    runs = part(suite, "parity")["clip_value"]
    for name in ("zero1", "zero3"):
        assert_close(runs[name]["losses"], runs["ddp"]["losses"], REL)
        assert runs[name]["config"]["gradient_clipping"] == 0.0  # by value, not the config's norm clipping
    by_norm = part(suite, "parity")["names"]["ddp"]["losses"]  # same run, clipped by norm 0.05 instead
    assert max(abs(a - b) for a, b in zip(runs["ddp"]["losses"][2:], by_norm[2:], strict=True)) > 1e-4


@pytest.mark.parametrize("clip", ["norm", "value"])
def test_fabric_clip_gradients_matches_ddp(suite: dict[str, Any], clip: str) -> None:
    f = part(suite, "fabric")
    runs = {strategy: list(losses) for strategy, losses in f[f"clip_{clip}"].items()}
    unclipped = f["losses"]["ddp"]
    if clip == "norm":
        norms = {strategy: losses.pop() for strategy, losses in runs.items()}
        for strategy in ("zero1", "zero3"):
            assert_close(norms[strategy], norms["ddp"], REL)  # the unsharded model's norm, before clipping
        assert min(norms["ddp"]) > 0.05 * 2  # so clipping to 0.05 changed every step
    for losses in runs.values():
        assert_close(losses, runs["ddp"], REL)
    # Clipping acted: after the first step the clipped runs train differently from the unclipped one.
    assert max(abs(a - b) for a, b in zip(runs["ddp"][2:], unclipped[2:], strict=True)) > 1e-3


def test_fabric_sharded_initialisation(suite: dict[str, Any]) -> None:
    meta = part(suite, "fabric")["meta_init"]
    assert meta["built_on_meta"] and len(meta["losses"]) == 4
    # Plain single-process torch from the weights the shards were materialised with, on both ranks' rows: fp32
    # throughout, so only the order of the reductions differs.
    assert_close(meta["losses"], meta["reference"], REL)
    # The same batch at every step: 3 AdamW steps at lr 3e-2 on fit_loader's linear target at least halve its loss.
    assert meta["losses"][-1] < 0.5 * meta["losses"][0], f"the loss on a repeated batch did not halve: {meta['losses']}"
    assert 0.05 < meta["weight_std"] < 1.0  # nn.Linear's reset_parameters, not uninitialised memory


def test_resume_last_after_kill_matches_uninterrupted(suite: dict[str, Any]) -> None:
    r = part(suite, "resume")
    assert r["resumed_batches"] == 4 < r["full_batches"] == 12  # it resumed, it did not start over
    assert r["resumed_step"] == r["full_step"] == r["resumed_engine_steps"] == 6
    assert r["resumed_lr"] == r["full_lr"]
    assert r["changed"] > 0 and r["resume_diff"] == 0.0
    assert r["zero1_resumed_batches"] == 4 and r["zero1_resume_diff"] == 0.0
    assert r["cross_stage_diff"] == 0.0 and r["validate"][0]["val_loss"] > 0


def test_ds_plugin_export_converts_a_trainer_checkpoint(suite: dict[str, Any], tmp_path: Path) -> None:
    r = part(suite, "resume")
    script = Path(sys.executable).parent / "ds-plugin"  # the installed console script
    cmd = (
        [str(script)]
        if script.is_file()
        else [sys.executable, "-c", "from ds_plugin.cli import main; raise SystemExit(main())"]
    )
    done = subprocess.run(
        [*cmd, "export", r["final_ckpt"], str(tmp_path)], env=clean_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "config.json" in done.stdout
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    expected = load_file(suite["workdir"] / "resumed.safetensors")
    state = model.state_dict()
    assert set(state) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0)


def test_initialize_trainer_and_fabric_resolve_one_plan_and_train_alike(suite: dict[str, Any]) -> None:
    p = part(suite, "plans")
    plans, losses = p["plans"], p["losses"]
    assert plans["trainer"] == plans["fabric"] == plans["initialize"]
    plan = plans["initialize"]
    assert (plan["stage"], plan["compute_dtype"], plan["gradient_clipping"]) == (3, "bf16", 0.5)
    assert plan["quantized_weights_block"] == 4096 and plan["world_size"] == 2
    # Same model, same batches per rank: the first loss (before any step) and the ones after each step agree.
    assert len(losses["trainer"]) == 3
    assert_close(losses["fabric"], losses["trainer"], 1e-6)
    assert_close(losses["initialize"], losses["trainer"], 1e-6)
