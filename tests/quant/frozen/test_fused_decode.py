"""The compiled frozen-weight decode (`ds_plugin.quant.frozen.fused`) gives `dequantize_weight`'s eager bits, for
INT4, NF4 and INT8 into bf16 and fp32, and it is what runs for a large CPU weight by default."""

import shutil

import pytest
import torch

from ds_plugin.quant import cpu_compile
from ds_plugin.quant.frozen import fused
from ds_plugin.quant.frozen.codecs import dequantize_weight, quantize_weight

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="torch.compile on CPU needs a C++ compiler")

GROUP = {"int4": 64, "nf4": 64, "int8": 128}
STEP = {"int4": fused._decode_int4_pairs, "nf4": fused._decode_nf4_pairs, "int8": fused._decode_int8}


def _weight(rows: int, cols: int) -> torch.Tensor:
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols)) * 0.02
    w[0] = 0  # all-zero groups
    w[1 % rows, :64] *= 1e4  # a group far larger than the rest of its row
    w[-1, 64:128] = torch.linspace(-1e-6, 1e-6, 64)  # tiny values
    return w


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("fmt", ["int4", "nf4", "int8"])
def test_compiled_decode_equals_eager_bit_for_bit(fmt, monkeypatch):
    for rows, cols in ((300, 1024), (1, 4096), (17, 384)):
        parts = quantize_weight(_weight(rows, cols), fmt)
        for dtype in (torch.bfloat16, torch.float32):
            monkeypatch.setenv("DS_PLUGIN_QUANT_COMPILE", "0")
            eager = dequantize_weight(parts, fmt, GROUP[fmt], dtype)
            cpu_compile.COMPILED_RUNS.discard(STEP[fmt])
            monkeypatch.setenv("DS_PLUGIN_QUANT_COMPILE", "1")
            compiled = dequantize_weight(parts, fmt, GROUP[fmt], dtype)
            # The compiled step ran (not the eager fallback after a failed compile), and gave the eager bits.
            assert STEP[fmt] in cpu_compile.COMPILED_RUNS, (fmt, dtype)
            assert torch.equal(_bits(compiled), _bits(eager)), (fmt, rows, cols, dtype)
    assert not cpu_compile.COMPILE_FAILED, f"torch.compile failed for {cpu_compile.COMPILE_FAILED}"


@pytest.mark.parametrize("fmt", ["int4", "nf4", "int8"])
def test_gathered_codes_rows_of_a_wider_buffer_decode_compiled(fmt, monkeypatch):
    # FSDP2 hands the decode each weight's codes as rows of its all-gather buffer: a row stride over their width.
    parts = quantize_weight(_weight(64, 512), fmt)
    codes = parts["codes"]
    wide = torch.zeros(codes.shape[0], codes.shape[1] + 32, dtype=torch.uint8)
    wide[:, : codes.shape[1]] = codes
    strided = {**parts, "codes": wide[:, : codes.shape[1]]}
    assert not strided["codes"].is_contiguous()
    monkeypatch.setenv("DS_PLUGIN_QUANT_COMPILE", "0")
    eager = dequantize_weight(parts, fmt, GROUP[fmt], torch.bfloat16)
    cpu_compile.COMPILED_RUNS.discard(STEP[fmt])
    monkeypatch.setenv("DS_PLUGIN_QUANT_COMPILE", "1")
    compiled = dequantize_weight(strided, fmt, GROUP[fmt], torch.bfloat16)
    assert STEP[fmt] in cpu_compile.COMPILED_RUNS, fmt
    assert torch.equal(_bits(compiled), _bits(eager)), fmt


def test_which_weights_take_the_compiled_decode(monkeypatch):
    monkeypatch.delenv("DS_PLUGIN_QUANT_COMPILE", raising=False)
    parts = quantize_weight(_weight(8, 256), "int4")
    out = torch.empty(8, 256, dtype=torch.bfloat16)
    factors = (parts["scales"].float(), parts["zeros"].float())
    # Below COMPILE_MIN_NUMEL by default, fp16 results, FP6 and non-CPU tensors take the eager decode.
    assert not fused.dequantize_into(out, parts["codes"], factors, "int4", 64)
    assert not fused.dequantize_into(out.half(), parts["codes"], factors, "int4", 64)
    assert not fused.dequantize_into(out, parts["codes"], factors, "fp6", 64)
    monkeypatch.setenv("DS_PLUGIN_QUANT_COMPILE", "1")
    assert fused.dequantize_into(out, parts["codes"], factors, "int4", 64)
    strided = parts["codes"].t().contiguous().t()  # the same codes, column-major: the eager decode takes them
    assert not fused.dequantize_into(out, strided, factors, "int4", 64)
    big = torch.empty(1024, 1024, dtype=torch.bfloat16)
    monkeypatch.delenv("DS_PLUGIN_QUANT_COMPILE")
    assert big.numel() >= cpu_compile.COMPILE_MIN_NUMEL
    big_parts = quantize_weight(_weight(1024, 1024), "int4")
    big_factors = (big_parts["scales"].float(), big_parts["zeros"].float())
    assert fused.dequantize_into(big, big_parts["codes"], big_factors, "int4", 64)
