"""The ZeRO++ row quantizer steps (`ds_plugin.quant.comm.fused`) equal the blockwise reference bit for bit, eager and
compiled, on ragged rows, zero blocks, inf/nan blocks and transposed (strided) inputs."""

import shutil

import pytest
import torch

from ds_plugin.quant import cpu_compile
from ds_plugin.quant.comm import fused
from ds_plugin.quant.comm.format import dequantize_reference, quantize_reference

# (rows, numel, block): whole blocks, a ragged last block, a block larger than the row, odd INT4 counts.
SHAPES = [(3, 1000, 64), (2, 4097, 4096), (1, 10, 4), (4, 130, 64), (2, 7, 8), (3, 256, 64)]
MODES = [
    pytest.param(False, id="eager"),
    pytest.param(
        True,
        id="compiled",
        marks=pytest.mark.skipif(shutil.which("c++") is None, reason="torch.compile on CPU needs a C++ compiler"),
    ),
]


def _rows(n: int, numel: int, dtype: torch.dtype, block: int) -> torch.Tensor:
    x = torch.randn(n, numel, generator=torch.Generator().manual_seed(n * numel + block)) * 3
    x[0, : min(block, numel)] = 0  # an all-zero block: scale 1, zero codes
    if n > 2:
        x[2, numel // 2] = float("inf")  # a non-finite block: nan scale, zero codes
    return x.to(dtype)


def _reference(row: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    # The format's reference on the row as one flat run of blocks, bf16 scales as the collectives send them.
    return quantize_reference(row, bits, block, torch.bfloat16)


@pytest.fixture(autouse=True)
def _fresh_compile_state(monkeypatch):
    monkeypatch.delenv("DS_PLUGIN_QUANT_COMPILE", raising=False)
    yield
    # A compile failure would silently fall back to eager and make the compiled cases test nothing.
    assert not cpu_compile.COMPILE_FAILED, f"torch.compile failed for {cpu_compile.COMPILE_FAILED}"


@pytest.mark.parametrize("compiled", MODES)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_rows_equals_reference(dtype, bits, compiled, monkeypatch):
    # Compiled INT4 has two forms, the pair words and the blocks, chosen by the CPU (`_quantize_in_words`): both run
    # here whatever this CPU is.
    for words in (True, False) if compiled and bits == 4 else (None,):
        monkeypatch.setattr(fused, "_quantize_in_words", lambda words=words: words)
        cpu_compile.COMPILED_RUNS.discard(fused._quantize_int4_words)
        for n, numel, block in SHAPES:
            x = _rows(n, numel, dtype, block)
            codes, scales = fused.quantize_rows(x, block, bits, compiled=compiled)
            per_row = -(-numel // block)
            for r in range(n):
                ref_codes, ref_scales = _reference(x[r], bits, block)
                assert torch.equal(codes[r], ref_codes), (n, numel, block, r, words)
                # Compared as bits: nan scales must match too.
                got_scales = scales[r * per_row : (r + 1) * per_row]
                assert torch.equal(got_scales.view(torch.int16), ref_scales.view(torch.int16))
        # The pair-word form ran when chosen, and only then (fp16 has none).
        ran = fused._quantize_int4_words in cpu_compile.COMPILED_RUNS
        assert ran == (bool(words) and dtype != torch.float16)


def test_int4_quantize_takes_the_word_form_except_on_avx2(monkeypatch):
    for capability, words in (("AVX2", False), ("AVX512", True), ("DEFAULT", True)):
        fused._quantize_in_words.cache_clear()
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda capability=capability: capability)
        assert fused._quantize_in_words() is words
    fused._quantize_in_words.cache_clear()


@pytest.mark.parametrize("compiled", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_rows_into_equals_reference(dtype, compiled):
    for n, numel, block in SHAPES:
        x = _rows(n, numel, dtype, block)
        codes, scales = fused.quantize_rows(x, block, 8, compiled=False)
        out = torch.full((n, numel), 7.0, dtype=dtype)
        fused.dequantize_rows_into(out, codes.contiguous().view(-1), scales, block, compiled=compiled)
        for r in range(n):
            want = dequantize_reference(*_reference(x[r], 8, block), block, numel, 8, dtype)
            assert torch.equal(out[r].isnan(), want.isnan())
            assert torch.equal(out[r].nan_to_num(), want.nan_to_num()), (n, numel, block, r)


@pytest.mark.parametrize("compiled", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_sum_rows_equals_reference(dtype, compiled):
    for n, numel, block in SHAPES:
        x = _rows(n, numel, dtype, block)
        x[-1, numel - 1] = float("nan")
        packed, scales = fused.quantize_rows(x, block, 4, compiled=False)
        for me in range(n):
            got = fused.dequantize_sum_rows(packed.contiguous(), scales, x[me], me, block, compiled=compiled)
            rows = [
                x[r].float()
                if r == me
                else dequantize_reference(*_reference(x[r], 4, block), block, numel, 4, torch.float32)
                for r in range(n)
            ]
            want = torch.stack(rows).sum(dim=0)
            # Into a slice of a larger buffer, as qgZ lands each piece in its result.
            buffer = torch.full((numel + 2 * block,), 7.0)
            into = fused.dequantize_sum_rows(
                packed.contiguous(), scales, x[me], me, block, compiled=compiled, out=buffer[block : block + numel]
            )
            assert into.data_ptr() == buffer[block:].data_ptr()
            assert (buffer[:block] == 7).all() and (buffer[block + numel :] == 7).all()
            for result in (got, into):
                assert result.dtype == torch.float32
                assert torch.equal(result.isnan(), want.isnan())
                assert torch.equal(result.nan_to_num(), want.nan_to_num()), (n, numel, block, me)
            # An averaged reduction's output (qgZ's landing): divided and rounded while decoding, the same bits as
            # dividing and rounding the sum afterwards; 3 does not divide exactly.
            for divide, round_to in ((n, torch.bfloat16), (3, torch.bfloat16), (3, torch.float32), (2, torch.float16)):
                averaged = fused.dequantize_sum_rows(
                    packed.contiguous(), scales, x[me], me, block, compiled=compiled, out=torch.empty(numel),
                    divide=divide, round_to=round_to,
                )  # fmt: skip
                expect = (want / divide).to(round_to).float()
                assert torch.equal(averaged.isnan(), expect.isnan())
                assert torch.equal(averaged.nan_to_num(), expect.nan_to_num()), (n, numel, block, me, divide, round_to)
    if compiled:  # whole blocks took the pair-word form
        assert fused._dequantize_sum_words in cpu_compile.COMPILED_RUNS


@pytest.mark.parametrize("compiled", MODES)
def test_transposed_rows_quantize_in_view_order(compiled):
    # qgZ's first hop quantizes chunks.view(nodes, local, n).transpose(0, 1) in place; the codes must come out
    # as if that view had been copied to contiguous memory first.
    nodes, local, numel, block = 2, 3, 256, 64
    chunks = torch.randn(nodes * local, numel).bfloat16()
    view = chunks.view(nodes, local, numel).transpose(0, 1)
    codes, scales = fused.quantize_rows(view, block, 4, compiled=compiled)
    want_codes, want_scales = fused.quantize_rows(view.contiguous(), block, 4, compiled=False)
    assert codes.shape == (local, nodes, numel // 2)
    assert torch.equal(codes, want_codes)
    assert torch.equal(scales.view(torch.int16), want_scales.view(torch.int16))
    own = view[1]
    got = fused.dequantize_sum_rows(codes.contiguous(), scales, own, 1, block, compiled=compiled)
    want = fused.dequantize_sum_rows(want_codes.contiguous(), want_scales, own.contiguous(), 1, block, compiled=False)
    assert torch.equal(got, want)


def test_compile_choice_follows_size_and_environment(monkeypatch):
    small, large = torch.empty(10), torch.empty(fused.COMPILE_MIN_NUMEL)
    assert not fused.use_compiled(small) and fused.use_compiled(large)
    monkeypatch.setenv("DS_PLUGIN_QUANT_COMPILE", "0")
    assert not fused.use_compiled(large)
    monkeypatch.setenv("DS_PLUGIN_QUANT_COMPILE", "1")
    assert fused.use_compiled(small)


@pytest.mark.parametrize("compiled", MODES)
@pytest.mark.parametrize("numel", [256, 250])
def test_dequantize_into_transposed_view(compiled, numel):
    # qwZ's two-level gather receives rank (node, local) at [local, node] and writes through a transposed view.
    nodes, local, block = 2, 3, 64
    x = torch.randn(local, nodes, numel).bfloat16()
    codes, scales = fused.quantize_rows(x, block, 8, compiled=False)
    buffer = torch.zeros(nodes, local, numel, dtype=torch.bfloat16)
    fused.dequantize_rows_into(buffer.transpose(0, 1), codes.contiguous(), scales, block, compiled=compiled)
    want = torch.empty(local, nodes, numel, dtype=torch.bfloat16)
    fused.dequantize_rows_into(want, codes.contiguous(), scales, block, compiled=False)
    assert torch.equal(buffer, want.transpose(0, 1))


@pytest.mark.skipif(shutil.which("c++") is None, reason="torch.compile on CPU needs a C++ compiler")
def test_compile_report_names_the_steps_that_ran_compiled():
    fused.quantize_rows(torch.randn(2, 128), 64, 8, compiled=True)
    report = fused.compile_report()
    assert "_quantize_blocks" in report["compiled_steps"]
    assert report["compile_failed"] == [] and report["compile_min_numel"] == fused.COMPILE_MIN_NUMEL


@pytest.mark.parametrize("compiled", MODES)
def test_bf16_rounding_in_integers_matches_the_cast(compiled):
    # qgZ's averaged landing rounds to bf16 with integer ops (inductor drops a float round trip): ties to even,
    # overflow to infinity, signed zeros, subnormals, infinities as `.to(torch.bfloat16)`; nan stays nan.
    one = 1.0 + 2.0**-8  # exactly halfway between two bf16 values: rounds down to the even one
    big = torch.finfo(torch.float32).max  # above bf16's largest finite value by more than half a step
    special = [0.0, -0.0, one, 1.0 + 3 * 2.0**-8, -one, big, -big, 1e-40, -1e-40, 1e-45]
    x = torch.cat([torch.tensor(special), torch.randn(4096, generator=torch.Generator().manual_seed(3)) * 1e3])
    x = torch.cat([x, torch.tensor([float("inf"), float("-inf"), float("nan")])])
    fn = torch.compile(cpu_compile.bf16_bits, dynamic=True) if compiled else cpu_compile.bf16_bits
    got = fn(x).view(torch.float32)
    want = x.to(torch.bfloat16).float()
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(got[finite].view(torch.int32), want[finite].view(torch.int32))
    assert got[5].item() == float("inf") and got[6].item() == float("-inf") and got[2].item() == 1.0  # overflow, tie
