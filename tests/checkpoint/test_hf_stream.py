"""`load_pretrained`: the streaming, sharded load of a Hugging Face safetensors checkpoint.

One spawn of 2 gloo ranks holds the multi-process checks: each case loads a tiny Llama saved with `save_pretrained`
in 2 shards both ways, `from_pretrained` + the engine's `quantize_frozen_` (the reference) and `load_pretrained`, and
the logits must be bit-identical before and after one optimizer step (ZeRO-3 INT4 with LoRA and `modules_to_save`;
stage 1 NF4, where each rank quantizes its share of the rows and the codes are gathered; tied embeddings at ZeRO-3
INT8). In the same spawn a larger checkpoint is loaded while the rank's resident memory is sampled, and the loader's
own tracking of its full-precision tensors is checked: at most one tensor's rows at a time beyond the shards. The
4-rank run (fewer shards than ranks) is in the `long` tier. Bad checkpoints are single-process: one line naming the
file and the tensor, raised before anything is allocated, nothing written.
"""

from __future__ import annotations

import json
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from ds_plugin.launch import run_ranks
from tests._memory import resident_bytes

pytestmark = pytest.mark.slow

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VOCAB = 96


def save_llama(path: Path, *, tied: bool = False, hidden: int = 64, layers: int = 2, vocab: int = VOCAB,
               shard: str = "100KB") -> Path:  # fmt: skip
    """A random Llama saved in bf16 with save_pretrained, in shards of `shard`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                         dtype="bfloat16")  # fmt: skip
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path, max_shard_size=shard)
    return path


def _lora(modules_to_save: list[str] | None = None):
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, modules_to_save=modules_to_save)


def _both_ways(path: str, stage: int, fmt: str, lora) -> dict:
    """Logits of the reference and of the streamed model, at load and after one identical AdamW step."""
    from transformers import AutoModelForCausalLM

    import ds_plugin
    from ds_plugin.checkpoint.hf_stream import LoadStats, load_pretrained

    config = {"zero_optimization": {"stage": stage, "frozen_format": fmt}, "gradient_clipping": 0.0}
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    out = {}
    for way in ("reference", "streamed"):
        torch.manual_seed(1)  # the LoRA draws
        stats = LoadStats()
        if way == "reference":
            model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), lora)
        else:
            model = load_pretrained(path, config, peft_config=lora, stats=stats)
        engine = ds_plugin.initialize(model, config, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
        with torch.no_grad():
            before = engine(input_ids=ids).logits.detach().clone()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        with torch.no_grad():
            after = engine(input_ids=ids).logits.detach().clone()
        quantized = {n: {k: v.clone() for k, v in q.parts.items()} for n, q in _quantized(engine.module).items()}
        out[way] = {"before": before, "after": after, "quantized": quantized, "stats": stats}
    return out


def _quantized(model) -> dict:
    from ds_plugin.quant.frozen.quantize import quantized_weights

    return quantized_weights(model)


def _peak_rss_during(fn) -> tuple[object, int, int]:
    """fn()'s result, the resident memory it added at its peak and at its end (sampled every millisecond)."""
    base, peak, done = resident_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], resident_bytes())
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        result = fn()
    finally:
        done.set()
        thread.join()
    end = resident_bytes()
    return result, max(peak[0], end) - base, end - base


def _memory_case(path: str, warm_up: str) -> dict:
    from ds_plugin.checkpoint.hf_stream import LoadStats, load_pretrained

    # Everything a load imports (peft's tuners, transformers' model code) is imported before measuring.
    load_pretrained(warm_up, {"zero_optimization": {"stage": 3, "frozen_format": "int8"}}, peft_config=_lora())
    stats = LoadStats()
    config = {"zero_optimization": {"stage": 3, "frozen_format": "int8"}}
    model, peak, end = _peak_rss_during(lambda: load_pretrained(path, config, peft_config=_lora(), stats=stats))
    local = 0
    for p in model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        parts = getattr(t, "parts", None)
        local += sum(x.nbytes for x in parts.values()) if parts else t.numel() * t.element_size()
    return {"stats": stats, "peak": peak, "end": end, "local_bytes": local}


def _cases(rank: int, world: int, untied: str, tied: str, bigger: str | None) -> dict:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    out = {
        "zero3_int4": _both_ways(untied, 3, "int4", _lora(modules_to_save=["lm_head"])),
        "zero1_nf4": _both_ways(untied, 1, "nf4", _lora()),
        "zero3_int8_tied": _both_ways(tied, 3, "int8", _lora()),
    }
    if bigger is not None:
        out["memory"] = _memory_case(bigger, untied)
    return out


def _check_identical(results: list[dict], name: str, world: int) -> None:
    for rank, result in enumerate(results):
        ref, got = result[name]["reference"], result[name]["streamed"]
        assert torch.equal(ref["before"], got["before"]), (name, rank, (ref["before"] - got["before"]).abs().max())
        assert torch.equal(ref["after"], got["after"]), (name, rank, (ref["after"] - got["after"]).abs().max())
        assert not torch.equal(got["before"], got["after"]), (name, "the optimizer step changed nothing")
        assert ref["quantized"].keys() == got["quantized"].keys() and got["quantized"], (name, rank)
        for weight, parts in ref["quantized"].items():
            for part, value in parts.items():
                assert torch.equal(value, got["quantized"][weight][part]), (name, rank, weight, part)
        stats = got["stats"]
        # One tensor's rows at a time (as read, and in the load dtype), nothing else in full precision.
        assert 0 < stats.peak_live_bytes <= stats.largest_tensor_bytes, (name, stats)


def test_streamed_equals_from_pretrained_two_ranks(tmp_path):
    untied = save_llama(tmp_path / "untied")
    tied = save_llama(tmp_path / "tied", tied=True)
    bigger = save_llama(tmp_path / "bigger", hidden=512, layers=12, vocab=1024, shard="20MB")
    shards = sorted(p.name for p in untied.glob("*.safetensors"))
    assert len(shards) == 2 and (untied / "model.safetensors.index.json").is_file(), shards
    results = run_ranks(_cases, 2, timeout=420, untied=str(untied), tied=str(tied), bigger=str(bigger))
    for name in ("zero3_int4", "zero1_nf4", "zero3_int8_tied"):
        _check_identical(results, name, 2)
    # ZeRO-3: each rank read only its rows, about half the checkpoint; stage 1 reads the whole of what it keeps.
    total = sum(p.stat().st_size for p in untied.glob("*.safetensors"))
    for result in results:
        assert result["zero3_int4"]["streamed"]["stats"].read_bytes < 0.6 * total, (total, result["zero3_int4"])
    # The larger model: resident memory grew by the rank's shards and about one tensor, never the whole model in
    # fp32 (what from_pretrained holds on every rank first).
    naive = sum(p.numel() for p in _meta_llama(bigger).parameters()) * 4
    for rank, result in enumerate(results):
        memory = result["memory"]
        stats = memory["stats"]
        assert stats.read_bytes < 0.6 * sum(p.stat().st_size for p in bigger.glob("*.safetensors")), stats
        assert 0 < stats.peak_live_bytes <= stats.largest_tensor_bytes < naive / 10, (stats, naive)
        beyond = memory["peak"] - memory["local_bytes"]
        # (the resident memory also keeps what the allocator freed, and the heap's fragments: hence the slack)
        assert memory["peak"] < naive / 3 and beyond < 4 * stats.largest_tensor_bytes + 16 * 2**20, (rank, memory)


def _meta_llama(path: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))


def _four_ranks(rank: int, world: int, untied: str) -> dict:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    return {"zero3_int4": _both_ways(untied, 3, "int4", _lora()), "zero2_fp6": _both_ways(untied, 2, "fp6", _lora())}


@pytest.mark.long
def test_streamed_equals_from_pretrained_four_ranks(tmp_path):
    # Four ranks, two shards: ranks read rows from files other ranks read too.
    untied = save_llama(tmp_path / "untied")
    results = run_ranks(_four_ranks, 4, timeout=600, untied=str(untied))
    _check_identical(results, "zero3_int4", 4)
    _check_identical(results, "zero2_fp6", 4)


# ---------------------------------------------------------------------- bad checkpoints: one line, nothing written


def _error(path: Path) -> str:
    from ds_plugin.checkpoint.hf_stream import CheckpointLoadError, load_pretrained

    before = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir())
    with pytest.raises(CheckpointLoadError) as info:
        load_pretrained(path, frozen_format="int4", peft_config=_lora())
    message = str(info.value)
    assert "\n" not in message, message
    assert sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir()) == before
    return message


def test_bad_checkpoints(tmp_path):
    import shutil

    from ds_plugin.checkpoint.hf_stream import load_pretrained

    good = save_llama(tmp_path / "good")
    index = json.loads((good / "model.safetensors.index.json").read_text())["weight_map"]
    second = sorted(set(index.values()))[1]
    in_second = sorted(k for k, v in index.items() if v == second)[0]

    def copy(name: str) -> Path:
        return Path(shutil.copytree(good, tmp_path / name))

    # A missing shard: the index names it.
    missing = copy("missing")
    (missing / second).unlink()
    message = _error(missing)
    assert str(missing / second) in message and f"for tensor {in_second}" in message and "no such file" in message

    # An index naming a file that is not there.
    renamed = copy("renamed")
    weight_map = dict(index, **{in_second: "model-00009-of-00002.safetensors"})
    (renamed / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    message = _error(renamed)
    assert "model-00009-of-00002.safetensors" in message and in_second in message, message

    # A truncated file: the tensor whose bytes are cut off is named.
    truncated = copy("truncated")
    size = (truncated / second).stat().st_size
    with open(truncated / second, "r+b") as f:
        f.truncate(size - 100)
    message = _error(truncated)
    assert str(truncated / second) in message and "truncated" in message and "tensor " in message, message

    # A shape the config does not give: config.json says a wider MLP than the files hold.
    shape = copy("shape")
    cfg = json.loads((shape / "config.json").read_text())
    (shape / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 256}))
    message = _error(shape)
    assert "mlp." in message and "has shape" in message and ".safetensors" in message, message

    # A dtype the config does not declare.
    dtype = copy("dtype")
    (dtype / "config.json").write_text(json.dumps({**cfg, "dtype": "float16"}))
    message = _error(dtype)
    assert "torch.bfloat16" in message and "torch.float16" in message and ".safetensors: tensor " in message, message

    # The good checkpoint, one process, no ZeRO: the INT4 model from_pretrained + quantize_frozen_ gives.
    from transformers import AutoModelForCausalLM

    import ds_plugin

    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    reference = AutoModelForCausalLM.from_pretrained(good, dtype=torch.float32).requires_grad_(False)
    ds_plugin.quantize_frozen_(reference, "int4")
    streamed = load_pretrained(good, frozen_format="int4", frozen=True)
    with torch.no_grad():
        assert torch.equal(reference(input_ids=ids).logits, streamed(input_ids=ids).logits)
