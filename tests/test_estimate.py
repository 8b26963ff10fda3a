"""`ds-plugin estimate`: the ZeRO paper's formulas and its 7.5B-on-64-GPUs example."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ds_plugin.cli import main
from ds_plugin.estimate import (
    DEFAULT_GROUP_SIZE,
    ModelShape,
    estimate,
    frozen_base_bytes,
    lora_params,
    shape_from_hf_config,
)


def _run(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_zero_paper_example(capsys):
    # ZeRO paper, Figure 1: Ψ = 7.5B, N = 64, K = 12 -> 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device.
    out = _run(capsys, "estimate", "--params", "7.5e9", "--world-size", "64", "--json")
    assert out["params"] == 7_500_000_000 and out["world_size"] == 64
    gb = {stage: round(b / 1e9, 1) for stage, b in out["stages"].items()}
    assert gb == {"0": 120.0, "1": 31.4, "2": 16.6, "3": 1.9}


def test_stage3_scales_with_ranks():
    one = estimate(ModelShape(params=1_000_000), 1)["stages"]
    eight = estimate(ModelShape(params=1_000_000), 8)["stages"]
    assert one["0"] == one["1"] == one["2"] == one["3"] == 16_000_000
    assert eight["3"] == 2_000_000 and eight["0"] == 16_000_000


def test_lora_frozen_formats_shrink_memory(capsys):
    args = [
        "estimate",
        "--params",
        "7e9",
        "--world-size",
        "8",
        "--lora-rank",
        "16",
        "--hidden-size",
        "4096",
        "--num-layers",
        "32",
        "--json",
    ]
    by_format = {f: _run(capsys, *args, "--frozen-format", f)["lora"] for f in ("bf16", "int8", "int4", "nf4", "fp6")}
    trainable = by_format["bf16"]["trainable_params"]
    assert trainable == 32 * 16 * (4 * 4096 * 2)  # q, k, v, o: A (r x 4096) + B (4096 x r) each
    # Stage 0: frozen weights replicated at their storage size + 16 bytes per adapter parameter.
    assert by_format["bf16"]["stages"]["0"] == 2 * 7_000_000_000 + 16 * trainable
    # Stage 3 shards the frozen weights too.
    assert by_format["int8"]["stages"]["3"] < by_format["bf16"]["stages"]["3"] / 1.9
    order = [by_format[f]["stages"]["0"] for f in ("bf16", "int8", "fp6", "int4")]
    assert order == sorted(order, reverse=True)


def test_model_config_matches_transformers_param_count(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    for cfg in (
        transformers.LlamaConfig(
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=2,
            vocab_size=1000,
        ),
        transformers.GPT2Config(n_embd=128, n_layer=3, n_head=4, vocab_size=1000, n_positions=64),
    ):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        real = sum(p.numel() for p in model.parameters())
        path = tmp_path / f"{cfg.model_type}.json"
        path.write_text(cfg.to_json_string())
        out = _run(capsys, "estimate", "--model-config", str(path), "--world-size", "2", "--json")
        assert out["params"] == real, cfg.model_type
        shape = shape_from_hf_config(json.loads(path.read_text()))
        assert lora_params(shape, 4) > 0


@pytest.mark.parametrize(
    "argv",
    [
        ["estimate", "--world-size", "8"],
        ["estimate", "--params", "-5", "--world-size", "8"],
        ["estimate", "--params", "1e9", "--world-size", "0"],
        ["estimate", "--params", "1e9", "--world-size", "8", "--nodes", "3"],
        ["estimate", "--params", "1e9", "--world-size", "8", "--lora-rank", "8"],
        ["estimate", "--params", "1e9", "--world-size", "8", "--frozen-format", "int3"],
        ["estimate", "--model-config", "/nonexistent/config.json", "--world-size", "8"],
    ],
)
def test_bad_arguments_are_one_line_errors(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err


RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "lora_memory_cpu.json"


def test_lora_estimate_matches_the_committed_lora_memory_run(tmp_path, capsys):
    # `ds-plugin bench lora-memory` measured these bytes from storage; the estimate must land within 5%.
    report = json.loads(RESULTS.read_text())
    config = tmp_path / "config.json"
    config.write_text(json.dumps(report["model_config"]))
    world = str(report["world_size"])
    measured = {r["name"]: r["model_state_bytes_per_rank"] for r in report["runs"] if r["name"] != "bnb_qlora"}
    assert set(measured) == {"bf16", "int8", "int4", "nf4"}
    for fmt, got in measured.items():
        argv = ["estimate", "--model-config", str(config), "--world-size", world, "--lora-rank", "16"]
        out = _run(capsys, *argv, "--frozen-format", fmt, "--lora-targets", "q,k,v,o", "--json")
        assert out["params"] == report["params"]
        assert out["lora"]["trainable_params"] == report["trainable_params"]
        predicted = out["lora"]["stages"]["3"]
        assert abs(got / predicted - 1) <= 0.05, (fmt, got, predicted)


def test_frozen_linear_bytes_are_the_formats_exact_bytes():
    from ds_plugin.quant.frozen.codecs import DEFAULT_GROUP_SIZE as FORMAT_GROUPS
    from ds_plugin.quant.frozen.codecs import weight_nbytes

    assert DEFAULT_GROUP_SIZE == FORMAT_GROUPS
    cfg = {
        "model_type": "llama",
        "hidden_size": 256,
        "num_hidden_layers": 3,
        "intermediate_size": 640,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "tie_word_embeddings": False,
    }
    shape = shape_from_hf_config(cfg)
    weights = [(256, 256), (64, 256), (64, 256), (256, 256), (640, 256), (640, 256), (256, 640)]
    linear_numel = 3 * sum(n * k for n, k in weights)
    for fmt in ("int8", "int4", "nf4"):
        for group in (None, 32):
            got = frozen_base_bytes(shape, fmt, group)
            want = 3 * sum(weight_nbytes(w, fmt, group) for w in weights)
            assert got["linear_bytes"] == want, (fmt, group)
            # Embeddings, the untied head and the norms stay bf16.
            assert got["bytes"] == want + 2 * (shape.params - linear_numel)
    assert frozen_base_bytes(shape, "bf16")["bytes"] == 2 * shape.params
    # Stages 2 and 3 shard the frozen base (FSDP2); 0 and 1 keep it whole. Adapters: q/k/v/o, A and B each.
    out = estimate(shape, 4, lora_rank=8, frozen_format="int4")["lora"]
    trainable = 3 * 8 * ((256 + 256) + 2 * (256 + 64) + (256 + 256))
    assert out["trainable_params"] == trainable
    frozen = frozen_base_bytes(shape, "int4")["bytes"]
    assert out["stages"]["1"] == math.ceil(4 * trainable + 12 * trainable / 4 + frozen)
    assert out["stages"]["2"] == math.ceil(2 * trainable + 14 * trainable / 4 + frozen / 4)
    assert out["stages"]["3"] == math.ceil(16 * trainable / 4 + frozen / 4)


def test_lora_targets(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}
            | {"num_attention_heads": 4, "vocab_size": 100}
        )
    )
    base = ["estimate", "--model-config", str(path), "--world-size", "2", "--lora-rank", "4", "--json"]
    qkvo = _run(capsys, *base)["lora"]["trainable_params"]
    assert qkvo == 2 * 4 * 4 * (64 + 64)
    every = _run(capsys, *base, "--lora-targets", "all-linear")["lora"]["trainable_params"]
    assert every == qkvo + 2 * 4 * 3 * (64 + 128)
    assert _run(capsys, *base, "--lora-targets", "q_proj,v")["lora"]["trainable_params"] == qkvo // 2
    # GPT-2: q, k and v are one fused Conv1D (c_attn), adapted once; Conv1D is not quantized (stays bf16).
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100}))
    g = ["estimate", "--model-config", str(gpt2), "--world-size", "2", "--lora-rank", "4", "--json"]
    out = _run(capsys, *g, "--frozen-format", "int4")["lora"]
    assert out["trainable_params"] == 2 * 4 * ((64 + 3 * 64) + (64 + 64))
    assert out["frozen_bytes"] == 2 * out["frozen_params"]


@pytest.mark.parametrize(
    "extra",
    [
        ["--lora-targets", "qq"],
        ["--lora-targets", ","],
        ["--frozen-format", "bf16", "--frozen-group-size", "64"],
        ["--frozen-format", "int4", "--frozen-group-size", "48"],
    ],
)
def test_bad_lora_arguments_are_one_line_errors(extra, capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 10}))
    argv = ["estimate", "--model-config", str(path), "--world-size", "2", "--lora-rank", "4", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
