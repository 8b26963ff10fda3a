"""`ds-plugin estimate`: the ZeRO paper's formulas and its 7.5B-on-64-GPUs example."""

from __future__ import annotations

import json

import pytest

from ds_plugin.cli import main
from ds_plugin.estimate import ModelShape, estimate, lora_params, shape_from_hf_config


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
