"""Every example the README shows, run as a user runs it (2 CPU processes, in a subprocess with a timeout).

The recipes run in their `--smoke` mode, which asserts the direction of the learning signal and ends with one
JSON line `{"recipe", "metric", "before", "after", "seconds"}`; each test checks the exit code, that line, and what
the recipe leaves on disk (adapters that reload, the loss-curve PNG). Every run writes into a temporary directory,
never into the checkout. The whole file took 2 min 49 s on an otherwise idle 2-core machine (3 min 50 s while it was
shared with other jobs). The `--model PATH` tests at the end add ~1 s for the errors and ~30-40 s for one real run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
ACCELERATE = str(Path(sys.executable).parent / "accelerate")
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
# Launcher variables an enclosing torchrun or Lightning run may have left: with LOCAL_RANK set, Lightning would
# believe its processes were already started and never launch the second one.
_LAUNCH_VARS = {"LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED", "ACCELERATE_USE_CPU",
                "DS_PLUGIN_CONFIG"}  # fmt: skip


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", MPLBACKEND="Agg")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def run(cmd: list[str], cwd: Path, timeout: float) -> str:
    """Run `cmd` in its own process group (killed whole at the timeout); returns stdout+stderr, exit code 0 or fail."""
    env = _env()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out = proc.communicate(timeout=timeout)[0].decode(errors="replace")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        tail = proc.communicate()[0].decode(errors="replace")[-4000:]
        raise AssertionError(f"{' '.join(cmd[-6:])} timed out after {timeout}s:\n{tail}") from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # a rank left behind, if any
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{out[-4000:]}"
    return out


def summary(out: str, recipe: str) -> dict:
    """The recipe's final JSON line."""
    lines = [line for line in out.splitlines() if line.startswith('{"recipe"')]
    assert lines, f"no JSON summary line:\n{out[-3000:]}"
    result = json.loads(lines[-1])
    assert set(result) == {"recipe", "metric", "before", "after", "seconds"} and result["recipe"] == recipe, result
    return result


@pytest.mark.long
def test_quickstart(tmp_path):
    out = run([*TORCHRUN, str(EXAMPLES / "quickstart.py"), "--steps", "40"], tmp_path, timeout=180)
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+) in 40 steps on 2 ranks", out).groups())
    assert last < first - 1.0, out[-2000:]


@pytest.mark.long
def test_lightning_zeropp(tmp_path):
    out = run([sys.executable, str(EXAMPLES / "lightning_zeropp.py"), "--max-steps", "20"], tmp_path, timeout=180)
    loss = float(re.search(r"loss ([\d.]+) after 20 steps", out).group(1))
    assert loss < 4.0, out[-2000:]  # from ln(256) = 5.5 at the start
    assert (tmp_path / "runs/lightning_zeropp/checkpoints/last.ckpt").is_dir()  # a sharded checkpoint


@pytest.mark.long
def test_lora_sft(tmp_path):
    out = run([sys.executable, str(EXAMPLES / "lora_sft.py"), "--smoke", "--out-dir", str(tmp_path)], tmp_path, 180)
    result = summary(out, "lora_sft")
    assert result["metric"] == "heldout_exact_match" and result["after"] > result["before"], result
    # The recipe reloaded the saved adapter onto a fresh INT4 base and checked its logits (it exits 1 otherwise).
    assert "logits within 0.0e+00 of the trained weights'" in out, out[-2000:]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapter").iterdir()}
    assert (tmp_path / "lora_sft.png").is_file() or not HAS_MATPLOTLIB


@pytest.mark.long
def test_accelerate_lora_sft(tmp_path):
    # The README's command: Accelerate's launcher, ds_plugin's bootstrap, the zeropp preset as the DeepSpeed config.
    cmd = [ACCELERATE, "launch", "--config_file", str(EXAMPLES / "accelerate/cpu_2proc.yaml"),
           "-m", "ds_plugin.accelerate", "--ds-config", "zeropp",
           str(EXAMPLES / "accelerate/lora_sft.py"), "--smoke", "--out-dir", str(tmp_path)]  # fmt: skip
    out = run(cmd, tmp_path, timeout=180)
    result = summary(out, "accelerate_lora_sft")
    assert result["metric"] == "heldout_exact_match" and result["after"] > result["before"], result
    assert "ZeRO stage 3 + qwZ" in out and "on 2 ranks" in out, out[-2000:]  # the --ds-config preset, two processes
    assert "logits within 0.0e+00 of the trained weights'" in out, out[-2000:]
    assert (tmp_path / "accelerate_lora_sft.png").is_file() or not HAS_MATPLOTLIB


@pytest.mark.long
def test_chatglm_ptuning(tmp_path):
    # bf16 (the GPU default; ~8x slower than fp32 on a CPU without bf16 units, hence 12 steps) with the prefix
    # projection: the saved prefix is then what the MLP computes, and must still reload exactly.
    cmd = [*TORCHRUN, str(EXAMPLES / "chatglm_ptuning.py"), "--smoke", "--precision", "bf16", "--prefix-projection",
           "--steps", "12", "--out-dir", str(tmp_path)]  # fmt: skip
    out = run(cmd, tmp_path, timeout=180)
    result = summary(out, "chatglm_ptuning")
    assert result["metric"] == "heldout_answer_loss" and result["after"] < result["before"], result
    assert "ZeRO-3 bf16" in out and "on a fresh base: the same logits and generations" in out, out[-2000:]
    assert out.count("before: ") == 3 and out.count("after:  ") == 3  # greedy generations before and after
    from safetensors.torch import load_file

    # Only the prefix is saved: one tensor of pre_seq_len x (layers * 2 * kv width), not the MLP or the GLM.
    saved = load_file(tmp_path / "prefix/adapter_model.safetensors")
    assert [tuple(v.shape) for v in saved.values()] == [(32, 4 * 2 * 64)], {k: v.shape for k, v in saved.items()}
    assert (tmp_path / "chatglm_ptuning.png").is_file() or not HAS_MATPLOTLIB


@pytest.mark.long
def test_rlhf(tmp_path):
    out = run([*TORCHRUN, str(EXAMPLES / "rlhf.py"), "--smoke", "--out-dir", str(tmp_path)], tmp_path, timeout=180)
    result = summary(out, "rlhf")
    assert result["metric"] == "reward_model_score" and result["after"] > result["before"], result
    steps = json.loads((tmp_path / "summary.json").read_text())
    assert steps["sft"]["after"] < steps["sft"]["before"], steps["sft"]
    assert steps["reward"]["after"] > steps["reward"]["before"], steps["reward"]
    (_, acc0, margin0, _), (_, acc1, margin1, _) = steps["dpo"]["evals"]
    assert acc0 == 0.5 and margin0 == 0.0 and acc1 > acc0 and margin1 > margin0, steps["dpo"]["evals"]
    for name in ("sft_adapter", "reward_model", "dpo_adapter"):
        assert (tmp_path / name).is_dir(), name
    assert (tmp_path / "rlhf.png").is_file() or not HAS_MATPLOTLIB


# --model PATH: every recipe checks the path and config.json's architecture before it imports torch, let alone
# starts a process group, so these run the script directly (a fraction of a second each) and want one line on
# stderr, exit code 2. What only transformers can tell (LoRA's target modules, a reward-model class) is checked
# after the imports, still before any process group: tried by hand, not here (each run would import torch).
RECIPES = ["lora_sft.py", "accelerate/lora_sft.py", "chatglm_ptuning.py", "rlhf.py"]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    """A directory holding only a tiny BERT config.json: not a causal LM."""
    from transformers import BertConfig

    path = tmp_path_factory.mktemp("bert")
    BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37).save_pretrained(path)
    return path


def fails_with_one_line(cmd: list[str], cwd: Path) -> str:
    """Run `cmd`; it must exit 2 with nothing on stdout and one line on stderr, which is returned."""
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and not proc.stdout, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert proc.stderr.endswith("\n") and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    return proc.stderr.strip()


@pytest.mark.parametrize("script", RECIPES)
def test_model_arg_errors(script, tmp_path, bert_dir):
    cmd = [sys.executable, str(EXAMPLES / script), "--smoke", "--model"]
    name = Path(script).name
    missing = fails_with_one_line([*cmd, str(tmp_path / "nonexistent")], tmp_path)
    assert missing.startswith(f"{name}: error: --model {tmp_path / 'nonexistent'}: no such directory"), missing
    assert "expected a local transformers checkpoint: a directory with config.json" in missing, missing
    bert = fails_with_one_line([*cmd, str(bert_dir)], tmp_path)
    assert bert.startswith(f"{name}: error: --model {bert_dir}: unsupported architecture"), bert
    assert "model_type 'bert'" in bert and "this recipe supports" in bert, bert
    if script == "chatglm_ptuning.py":  # a causal LM, but not a GLM
        (tmp_path / "llama").mkdir()
        (tmp_path / "llama/config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
        llama = fails_with_one_line([*cmd, str(tmp_path / "llama")], tmp_path)
        assert "unsupported architecture LlamaForCausalLM" in llama and "GlmForCausalLM or Glm4ForCausalLM" in llama


def tiny_checkpoint(path: Path) -> int:
    """A random tiny Llama saved with a tokenizer built here (byte-level, every byte one token, no merges, no pad
    token: the recipe pads with EOS); nothing is downloaded. Returns the parameter count."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<s>", "</s>", *sorted(pre_tokenizers.ByteLevel.alphabet())])}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>").save_pretrained(path)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, bos_token_id=0, eos_token_id=1)  # fmt: skip
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.long
def test_lora_sft_local_model(tmp_path):
    # The cheapest real --model run: 4 steps on 2 ranks with a random tiny Llama (no learning signal expected).
    params = tiny_checkpoint(tmp_path / "model")
    cmd = [sys.executable, str(EXAMPLES / "lora_sft.py"), "--model", str(tmp_path / "model"), "--steps", "4",
           "--evals", "1", "--micro-batch", "4", "--out-dir", str(tmp_path / "out")]  # fmt: skip
    out = run(cmd, tmp_path, timeout=180)
    summary(out, "lora_sft")
    assert f"int4 frozen base ({tmp_path / 'model'}, {params:,} parameters)" in out, out[-2000:]
    assert "logits within 0.0e+00 of the trained weights'" in out, out[-2000:]  # the saved adapter reloaded
    adapter = json.loads((tmp_path / "out/adapter/adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(tmp_path / "model"), adapter
