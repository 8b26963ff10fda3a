"""Every example the README shows, run as a user runs it (2 CPU processes, in a subprocess with a timeout), then
checked from what it leaves behind.

The recipes teach; this file checks them. Each recipe runs once, in its short `--smoke` form (or with fewer steps),
and ends with one JSON line `{"recipe", "metric", "before", "after", "seconds"}`; each test checks the exit code,
that line and the direction of the learning signal, the summary.json the recipe wrote, and what the recipe saved:
the adapter (or prefix) is reloaded here, onto a fresh base stored the same way, and must reproduce the ENGINE's own
outputs of the run (its last held-out answers, held-out loss and generations). Every run writes into a temporary
directory, never into the checkout. The `--model PATH` errors are checked in this process (each recipe's `__main__`
run with `runpy`, a fraction of a second once its imports are loaded); one real `--model` run is at the end.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path
from types import ModuleType

import pytest
import unseen_data

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
    assert {"recipe", "metric", "before", "after", "seconds"} <= set(result) and result["recipe"] == recipe, result
    return result


def recipe(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A recipe imported as a module (its `main()` does not run), for its model builders and evaluation code:
    the checks below reload what it saved with the recipe's own functions."""
    monkeypatch.syspath_prepend(str(EXAMPLES))  # for `_recipe_common`, as running the script would
    spec = importlib.util.spec_from_file_location(f"recipe_{Path(name).stem}", EXAMPLES / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flip_one_byte(out_dir: Path, name: str, dest: Path, element: int | None = None) -> Path:
    """A copy of a recipe's --out-dir with one byte of `name`'s weights file changed (the top byte of the middle
    element, or `element`, of its first q_proj tensor, else of its first tensor: a value every held-out logit
    depends on); returns the altered folder."""
    shutil.copytree(out_dir, dest, ignore=shutil.ignore_patterns("*.png"))
    weights = next((dest / name).glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    length = int.from_bytes(data[:8], "little")
    tensors = {k: v for k, v in json.loads(data[8 : 8 + length]).items() if k != "__metadata__"}
    tensor = tensors[next((k for k in sorted(tensors) if "q_proj" in k), sorted(tensors)[0])]
    size = {"F32": 4, "BF16": 2, "F16": 2}[tensor["dtype"]]
    start, end = tensor["data_offsets"]
    index = (end - start) // size // 2 if element is None else element
    data[8 + length + start + index * size + size - 1] ^= 0x40  # little-endian: the top byte
    weights.write_bytes(bytes(data))
    return dest / name


def check_reload_fails_when_altered(out_dir: Path, name: str, reload, tmp_path: Path, element: int | None = None):
    """The recipe's reload check (its held-out input and the engine's logits, kept beside the weights) passes on
    what the recipe saved and fails once one byte of the weights file is changed (`flip_one_byte`)."""
    common = importlib.import_module("_recipe_common")
    diff, problem = common.reload_mismatch(reload(out_dir / name), out_dir / name)
    assert problem is None, problem
    altered = flip_one_byte(out_dir, name, tmp_path / f"altered_{name}", element)
    diff, problem = common.reload_mismatch(reload(altered), altered)
    assert problem and problem.startswith(f"reload check failed: {altered} reloaded onto a fresh base"), (diff, problem)


def chat(path: Path, prompts: list[str], monkeypatch, capsys, *extra: str) -> list[str]:
    """examples/chat.py on a recipe's --out-dir, in this process: the lines it prints, one answer per prompt (an
    answer may hold newlines of its own)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    args = [str(EXAMPLES / "chat.py"), "--path", str(path), *(a for p in prompts for a in ("--prompt", p)), *extra]
    monkeypatch.setattr(sys, "argv", args)
    capsys.readouterr()
    runpy.run_path(str(EXAMPLES / "chat.py"), run_name="__main__")
    answers = capsys.readouterr().out.splitlines()
    assert len(answers) >= len(prompts), answers
    return answers


@pytest.mark.long
def test_quickstart(tmp_path):
    out = run([*TORCHRUN, str(EXAMPLES / "quickstart.py"), "--steps", "40"], tmp_path, timeout=480)
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+) in 40 steps on 2 ranks", out).groups())
    assert last < first - 1.0, out[-2000:]


@pytest.mark.long
def test_lightning_zeropp(tmp_path):
    out = run([sys.executable, str(EXAMPLES / "lightning_zeropp.py"), "--max-steps", "20"], tmp_path, timeout=480)
    loss = float(re.search(r"loss ([\d.]+) after 20 steps", out).group(1))
    assert loss < 4.0, out[-2000:]  # from ln(256) = 5.5 at the start
    assert (tmp_path / "runs/lightning_zeropp/checkpoints/last.ckpt").is_dir()  # a sharded checkpoint


@pytest.mark.long
def test_lora_sft(tmp_path, monkeypatch, capsys):
    out = run([sys.executable, str(EXAMPLES / "lora_sft.py"), "--smoke", "--out-dir", str(tmp_path)], tmp_path, 480)
    result = summary(out, "lora_sft")
    assert result["metric"] == "heldout_exact_match" and result["after"] > result["before"], result
    loss0, loss1 = result["heldout_answer_loss"]
    assert loss1 < loss0 - 1.0, result  # nats per answer token, held out
    assert "ZeRO stage 3, int4 frozen base (a tiny random Llama); LoRA r=16, 2 ranks" in out, out[-2000:]
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert [step for step, _ in saved["history"]] == [0, 120] and saved["history"][-1][1] == result["after"], saved
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapter").iterdir()}
    assert (tmp_path / "lora_sft.png").is_file() or not HAS_MATPLOTLIB
    # The recipe reloaded its adapter onto a fresh INT4 base and compared the logits with the engine's (asserted
    # there: it would have exited 1); the same check here, and once more with one byte of the adapter changed.
    # With qwZ off for the engine's side of the check (its INT8 rounding is not in the saved file): fp32, exact.
    assert saved["reload_max_diff"] <= 1e-5 and "on a fresh base, logits within" in out, saved["reload_max_diff"]
    chat_recipe = recipe("chat.py", monkeypatch)
    check_reload_fails_when_altered(tmp_path, "adapter", lambda f: chat_recipe.load(f, None, None), tmp_path)
    answers = chat(tmp_path, ["What is 3 plus 4? ", "2 + 2 = "], monkeypatch, capsys)
    assert all(a.strip().isdigit() for a in answers), answers  # the adapter answers with a number


@pytest.mark.long
def test_accelerate_lora_sft(tmp_path, monkeypatch, capsys):
    # The README's command: Accelerate's launcher, ds_plugin's bootstrap, the zeropp preset as the DeepSpeed config;
    # on data the recipe has never seen: chat rows (a system turn, two user/assistant exchanges) asking for a word
    # spelled backwards, held-out words in --eval-data.
    train, held_out = unseen_data.write(tmp_path, "reverse_chat")
    cmd = [ACCELERATE, "launch", "--config_file", str(EXAMPLES / "with_accelerate/cpu_2proc.yaml"),
           "-m", "ds_plugin.accelerate", "--ds-config", "zeropp", str(EXAMPLES / "accelerate_lora_sft.py"), "--smoke",
           "--data", str(train), "--eval-data", str(held_out), "--out-dir", str(tmp_path / "out")]  # fmt: skip
    out = run(cmd, tmp_path, timeout=480)
    result = summary(out, "accelerate_lora_sft")
    loss0, loss1 = result["heldout_answer_loss"]
    assert loss1 < loss0 - 1.0, result  # held-out answer loss, nats per answer token (measured 4.87 -> 3.05)
    assert result["metric"] == "heldout_exact_match" and result["after"] >= result["before"], result
    assert "ZeRO stage 3 + qwZ" in out and "on 2 ranks" in out, out[-2000:]  # the --ds-config preset, two processes
    saved = json.loads((tmp_path / "out/summary.json").read_text())
    assert [step for step, _ in saved["history"]] == [0, 120] and saved["history"][-1][1] == result["after"], saved
    assert (tmp_path / "out/accelerate_lora_sft.png").is_file() or not HAS_MATPLOTLIB
    assert saved["reload_max_diff"] <= 1e-5, saved["reload_max_diff"]  # zeropp, compared with qwZ off
    chat_recipe = recipe("chat.py", monkeypatch)
    check_reload_fails_when_altered(tmp_path / "out", "adapter", lambda f: chat_recipe.load(f, None, None), tmp_path)
    chat(tmp_path / "out", ["User: Spell backwards: lamp\nAssistant: "], monkeypatch, capsys, "--raw")


@pytest.mark.long
def test_chatglm_ptuning(tmp_path, monkeypatch, capsys):
    # bf16 (the GPU default; ~8x slower than fp32 on a CPU without bf16 units, hence 12 steps) with the prefix
    # projection: the saved prefix is then what the MLP computes, and must still reload to the engine's outputs.
    cmd = [*TORCHRUN, str(EXAMPLES / "chatglm_ptuning.py"), "--smoke", "--precision", "bf16", "--prefix-projection",
           "--pre-seq-len", "32", "--steps", "12", "--rouge-rows", "4", "--out-dir", str(tmp_path)]  # fmt: skip
    out = run(cmd, tmp_path, timeout=480)
    result = summary(out, "chatglm_ptuning")
    assert result["metric"] == "heldout_answer_loss" and result["after"] < result["before"], result
    assert "ZeRO-3 bf16" in out and "held-out ROUGE-L (F1 x 100, greedy, 4 rows)" in out, out[-2000:]
    assert 0 <= min(result["heldout_rouge_l"]) <= max(result["heldout_rouge_l"]) <= 100, result
    assert out.count("before: ") == 3 and out.count("after:  ") == 3  # greedy generations before and after
    saved = json.loads((tmp_path / "summary.json").read_text())
    (_, loss0, acc0), *_, (last, loss1, acc1) = saved["evals"]
    assert last == 12 and (loss0, loss1) == (result["before"], result["after"]) and acc1 > acc0, saved["evals"]
    assert (tmp_path / "chatglm_ptuning.png").is_file() or not HAS_MATPLOTLIB
    from safetensors.torch import load_file

    # Only the prefix is saved: one tensor of pre_seq_len x (layers * 2 * kv width), not the MLP or the GLM.
    prefix = load_file(tmp_path / "prefix/adapter_model.safetensors")
    assert [tuple(v.shape) for v in prefix.values()] == [(32, 4 * 2 * 128)], {k: v.shape for k, v in prefix.items()}

    # The recipe's reload check (on a CPU, bf16 too: the same operations, bit for bit), passing, and failing on a
    # changed byte.
    assert saved["reload_max_diff"] == 0.0 and "on a fresh base, logits within" in out, saved["reload_max_diff"]
    import torch

    glm = recipe("chatglm_ptuning.py", monkeypatch)
    reload = partial(glm.reload_prefix, model_path=None, precision="bf16", frozen_format="none")
    # The byte changed: the exponent's top bit of the smallest of the last layer's values in prefix row 16, which
    # makes it ~1e38 times larger. The default element (the middle one: a key of layer 0, |v| 14.3) only shrinks
    # to ~0 (as do most: the projected prefix is large), which moved the bf16 logits by 0.031, within the 0.1.
    row = prefix[next(iter(prefix))][16]
    last_values = 7 * 128 + int(row[7 * 128 :].float().abs().argmin())
    check_reload_fails_when_altered(tmp_path, "prefix", reload, tmp_path, element=16 * 1024 + last_values)
    # The attention mask covers the prefix and hides the padding: a row alone gives its logits in a padded batch.
    # The tiny GLM reads the words of the training rows (one token each), the vocabulary saved beside the prefix.
    tok = glm.WordTokenizer.saved(tmp_path / "prefix")
    assert tok is not None and " jacket" in tok.words and "tokens: " in out, out[-2000:]
    model, cpu = reload(tmp_path / "prefix"), torch.device("cpu")
    assert model.get_input_embeddings().num_embeddings == tok.vocab_size
    held_out = importlib.import_module("_recipe_data").load_rows(None, None, 0.1, ("adgen",), glm.DATA)[1]
    ids, _, mask = glm.collate(tok, held_out[:4], cpu)
    short = int(mask.sum(1).argmin())
    length = int(mask[short].sum())
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask).logits[short, :length].float()
        alone = model(input_ids=ids[short : short + 1, :length]).logits[0].float()
    assert (alone - padded).abs().max().item() < 0.05, (alone - padded).abs().max().item()
    chat(tmp_path, ["type#coat*color#red*style#casual*fit#loose"], monkeypatch, capsys)


@pytest.mark.long
def test_rlhf(tmp_path, monkeypatch, capsys):
    # --step all: SFT, reward model, PPO (DeepSpeed-Chat's three steps); then DPO on the same SFT and reward model.
    out = run([*TORCHRUN, str(EXAMPLES / "rlhf.py"), "--smoke", "--out-dir", str(tmp_path)], tmp_path, timeout=480)
    result = summary(out, "rlhf")
    assert result["metric"] == "reward_model_score" and result["after"] > result["before"], result
    steps = json.loads((tmp_path / "summary.json").read_text())
    assert list(steps) == ["sft", "reward", "ppo"], list(steps)
    assert steps["sft"]["after"] < steps["sft"]["before"], steps["sft"]
    assert steps["reward"]["after"] > steps["reward"]["before"], steps["reward"]
    assert (steps["ppo"]["before"], steps["ppo"]["after"]) == (result["before"], result["after"]), steps["ppo"]
    # Before PPO the actor is its reference (a fresh adapter on the SFT model): no KL; after, some.
    assert result["ppo_kl_to_reference"] == steps["ppo"]["kl"] and steps["ppo"]["kl"][0] == 0.0 < steps["ppo"]["kl"][1]
    assert len(steps["ppo"]["iterations"]) == 8 and len(steps["ppo"]["examples"]) == 3, steps["ppo"]
    # Every step's held-out signal is in the JSON line too.
    assert result["reward_heldout_pairwise_accuracy"] == [steps["reward"]["before"], steps["reward"]["after"]], result
    assert (tmp_path / "rlhf.png").is_file() or not HAS_MATPLOTLIB
    # Each step reloaded what it saved onto a fresh base stored the same way: fp32 with the engine's operations,
    # so the engine's logits bit for bit; each check fails once one byte of the weights is changed.
    diffs = {name: s["reload_max_diff"] for name, s in steps.items()}
    assert diffs == {"sft": 0.0, "reward": 0.0, "ppo": 0.0}, diffs

    out = run([*TORCHRUN, str(EXAMPLES / "rlhf.py"), "--step", "dpo", "--smoke", "--out-dir", str(tmp_path)], tmp_path,
              timeout=300)  # fmt: skip
    result, dpo = summary(out, "rlhf"), json.loads((tmp_path / "summary.json").read_text())["dpo"]
    assert result["metric"] == "reward_model_score" and result["after"] > result["before"], result
    (_, acc0, margin0, _), (_, acc1, margin1, _) = dpo["evals"]
    assert acc0 == 0.5 and margin0 == 0.0 and acc1 > acc0 and margin1 > margin0, dpo["evals"]
    assert result["dpo_heldout_preference_accuracy"] == [acc0, acc1], result
    assert len(dpo["examples"]) == 3 and dpo["reload_max_diff"] == 0.0, dpo
    from transformers import AutoModelForSequenceClassification

    chat_recipe = recipe("chat.py", monkeypatch)
    for name in ("sft_adapter", "ppo_adapter", "dpo_adapter"):
        check_reload_fails_when_altered(tmp_path, name, lambda f: chat_recipe.load(f, None, None), tmp_path)
    reward = AutoModelForSequenceClassification.from_pretrained
    check_reload_fails_when_altered(tmp_path, "reward_model", reward, tmp_path)
    answers = chat(tmp_path, ["What color is the grass?"], monkeypatch, capsys, "--temperature", "0.7")  # PPO's
    assert answers[0].startswith(" I"), answers  # " It is ..." or " I do not know ...": the shape SFT taught


# --model PATH: every recipe checks the path, config.json's architecture and (building it on the meta device) what
# only transformers can tell, right after parsing its arguments and before it loads anything or starts a process
# group. Each recipe's `__main__` runs here, in this process; it must exit 2 with one line on stderr.
RECIPES = ["lora_sft.py", "accelerate_lora_sft.py", "chatglm_ptuning.py", "rlhf.py"]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    """A directory holding only a tiny BERT config.json: not a causal LM."""
    from transformers import BertConfig

    path = tmp_path_factory.mktemp("bert")
    BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37).save_pretrained(path)
    return path


def fails_with_one_line(script: str, args: list[str], monkeypatch, capsys) -> str:
    """Run the recipe's `__main__` with `args`; it must exit 2 with nothing on stdout and one line on stderr, which
    is returned."""
    monkeypatch.syspath_prepend(str(EXAMPLES))  # as `python examples/x.py` puts the script's directory first
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / script), *args])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and not out, (exit_.value.code, out[-2000:], err[-2000:])
    assert err.endswith("\n") and err.count("\n") == 1, err[-2000:]
    return err.strip()


@pytest.mark.parametrize("script", RECIPES)
def test_model_arg_errors(script, tmp_path, bert_dir, monkeypatch, capsys):
    def fails(path: Path) -> str:
        return fails_with_one_line(script, ["--smoke", "--model", str(path)], monkeypatch, capsys)

    missing = fails(tmp_path / "nonexistent")
    assert missing.startswith(f"{script}: error: --model {tmp_path / 'nonexistent'}: no such directory"), missing
    assert "expected a local transformers checkpoint: a directory with config.json" in missing, missing
    bert = fails(bert_dir)
    assert bert.startswith(f"{script}: error: --model {bert_dir}: unsupported architecture"), bert
    assert "model_type 'bert'" in bert and "this recipe supports" in bert, bert
    if script == "chatglm_ptuning.py":  # a causal LM, but not a GLM
        (tmp_path / "llama").mkdir()
        (tmp_path / "llama/config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
        llama = fails(tmp_path / "llama")
        assert "unsupported architecture LlamaForCausalLM" in llama and "GlmForCausalLM or Glm4ForCausalLM" in llama
    if "lora_sft" in script:  # a causal LM whose files are all there, but without Llama's projections for LoRA
        from transformers import GPTNeoXConfig

        neox = GPTNeoXConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                             architectures=["GPTNeoXForCausalLM"])  # fmt: skip
        neox.save_pretrained(tmp_path / "neox")
        for name in ("model.safetensors", "tokenizer.json"):
            (tmp_path / "neox" / name).touch()  # only their presence is checked before the model is built
        no_proj = fails(tmp_path / "neox")
        assert "unsupported architecture GPTNeoXForCausalLM" in no_proj, no_proj
        assert "no q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj modules" in no_proj, no_proj


@pytest.mark.parametrize("script", ["lora_sft.py", "accelerate_lora_sft.py", "rlhf.py"])
def test_bad_checkpoint_fails_before_anything(script, tmp_path, monkeypatch, capsys):
    # A checkpoint whose weights file was cut short: one line naming the file and the tensor, exit 2, before any
    # process group starts or anything is written.
    tiny_checkpoint(tmp_path / "model")
    weights = tmp_path / "model" / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - 64)
    capsys.readouterr()  # save_pretrained's progress bar
    out = tmp_path / "out"
    err = fails_with_one_line(script, ["--smoke", "--model", str(tmp_path / "model"), "--out-dir", str(out)],
                              monkeypatch, capsys)  # fmt: skip
    assert f"--model {tmp_path / 'model'}: {weights}: tensor " in err and "truncated" in err, err
    assert not out.exists(), sorted(out.rglob("*"))


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
def test_lora_sft_local_model(tmp_path, monkeypatch):
    # The cheapest real --model run: 4 steps on 2 ranks with a random tiny Llama (no learning signal expected), and
    # no held-out evaluation (--evals 0 once divided by zero).
    model_path = str(tmp_path / "model")
    params = tiny_checkpoint(tmp_path / "model")
    cmd = [sys.executable, str(EXAMPLES / "lora_sft.py"), "--model", model_path, "--steps", "4",
           "--evals", "0", "--micro-batch", "4", "--out-dir", str(tmp_path / "out")]  # fmt: skip
    out = run(cmd, tmp_path, timeout=480)
    result = summary(out, "lora_sft")
    assert result["before"] is None and result["after"] is None and "held-out" not in out, result
    assert f"int4 frozen base ({model_path}, {params:,} parameters)" in out, out[-2000:]
    adapter = json.loads((tmp_path / "out/adapter/adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == model_path, adapter
    # The recipe reloaded the adapter onto the checkpoint (stored INT4, read row by row) and compared the logits
    # with the engine's, in the checkpoint's tokenizer (no pad token: the recipe pads with EOS).
    saved = json.loads((tmp_path / "out/summary.json").read_text())
    assert saved["reload_max_diff"] <= 1e-5, saved["reload_max_diff"]  # zeropp, compared with qwZ off
    monkeypatch.syspath_prepend(str(EXAMPLES))
    common = importlib.import_module("_recipe_common")
    adapter = tmp_path / "out/adapter"
    assert common.reload_mismatch(common.reload_lora(adapter, model_path, "int4"), adapter)[1] is None


def test_chat_needs_a_recipe_output(tmp_path, monkeypatch, capsys):
    err = fails_with_one_line("chat.py", ["--path", str(tmp_path), "--prompt", "hi"], monkeypatch, capsys)
    assert err.startswith(f"chat.py: error: --path {tmp_path}: no saved adapter or prefix in it (looked for "), err
