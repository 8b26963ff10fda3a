"""The fast quantizers against the first implementation (``_reference_quantize``, kept here only as a reference).

INT8, INT4 absmax, NF4 and FP6 compute the same values by other means (table lookups, fp8 rounding, integer bit
moves), so their components must equal the reference's bit for bit. INT4's searched scales use a different, cheaper
search, so there the claim is an error no larger than the reference's on the same weights.
"""

from __future__ import annotations

import sys

import _reference_quantize as reference
import pytest
import torch

from ds_plugin.quant.frozen import fp6
from ds_plugin.quant.frozen.codecs import (
    DEFAULT_GROUP_SIZE,
    NF4_CODEBOOK,
    _nf4_codes,
    dequantize_weight,
    quantize_weight,
)

EXACT = [("int8", "absmax"), ("int4", "absmax"), ("nf4", "double_quant"), ("nf4", "no_double_quant"), ("fp6", "absmax")]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _llama_like(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * 0.02
    w[:, torch.randperm(cols, generator=gen)[: max(1, cols // 200)]] *= 15
    return w


def _gaussian(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.02


def _student_t(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Chi-squared with 3 degrees of freedom as a sum of 3 squared normals, from the seeded generator (a
    # torch.distributions sample would draw from the global generator, so depend on the tests run before).
    chi2 = torch.randn(3, rows, cols, generator=gen).square().sum(0)
    return torch.randn(rows, cols, generator=gen) / (chi2 / 3).sqrt() * 0.02


def _weights() -> list[torch.Tensor]:
    torch.manual_seed(0)
    special = torch.randn(12, 512) * 100
    special[0] = 0  # a whole row
    special[1, 64:192] = 0  # zero groups among large ones
    special[2] = 1e-3
    special[2, 256:320] = 0
    special[3] *= 1e-38  # subnormal-sized values
    special[4] = torch.rand(512) * 2e38 - 1e38  # near fp32's max
    special[5, ::64] = 1e4  # one outlier per group
    special[6] = -special[6].abs()  # all negative
    special[7, :256] = -0.0
    return [
        _llama_like(40, 1024, 1),
        _student_t(24, 768, 2),
        torch.randn(8, 384) * torch.logspace(-3, 3, 8)[:, None],
        special,
    ]


@pytest.mark.parametrize(("fmt", "method"), EXACT)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_components_equal_the_reference(fmt, method, dtype):
    for weight in _weights():
        weight = weight.to(dtype)
        if not torch.isfinite(weight).all():  # 1e38 overflows fp16
            continue
        for group in {DEFAULT_GROUP_SIZE[fmt], 32}:
            fast = quantize_weight(weight, fmt, group, method=method)
            ref = reference.quantize_weight(weight, fmt, group, method=method)
            assert list(fast) == list(ref)
            for name in ref:
                assert fast[name].dtype == ref[name].dtype and fast[name].is_contiguous(), (fmt, name)
                assert torch.equal(fast[name], ref[name]), (fmt, method, dtype, group, name)


def _near(values: torch.Tensor, ulps: int) -> torch.Tensor:
    out = [values]
    for direction in (-1.0, 1.0):
        step = values
        for _ in range(ulps):
            step = torch.nextafter(step, torch.full_like(step, direction * 1e30))
            out.append(step)
    return torch.cat(out)


def test_fp6_encoding_equals_the_reference():
    values = fp6.E3M2_VALUES
    ties = (values[:31].sort().values[:-1] + values[:31].sort().values[1:]) / 2  # every rounding boundary, > 0
    probes = torch.cat(
        [
            torch.linspace(-40, 40, 400_001),
            _near(torch.cat([values, ties, -ties, torch.tensor([28.0, 0.25, 0.0625, 0.03125])]), 4),
            torch.randn(100_000) * 4,
            torch.rand(100_000) * 0.3,
            torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-45, 3e38, -3e38]),
        ]
    )
    assert torch.equal(fp6.encode_e3m2(probes), reference.encode_e3m2(probes))


@pytest.mark.parametrize("rows", [1, 7, 33])
def test_fp6_packing_equals_the_reference(rows):
    codes = torch.randint(0, 64, (rows, 1024), dtype=torch.uint8)
    codes[0, :16] = 63  # every bit set, the sign bits at bit 31 of the top words included
    packed = fp6.pack_fp6(codes)
    assert torch.equal(packed, reference.pack_fp6(codes))
    assert torch.equal(fp6._pack_fp6_words(codes), packed)  # the path for big-endian hosts
    assert torch.equal(fp6.unpack_fp6(packed), codes)


def test_nf4_lookup_equals_bucketize():
    # Every value whose low 16 bits are 0 or 0xFFFF (each table bin's two ends), the midpoints and their neighbours.
    tops = torch.arange(1 << 16, dtype=torch.int64) << 16
    edges = torch.cat([tops, tops | 0xFFFF]).to(torch.int32).view(torch.float32)
    midpoints = (NF4_CODEBOOK[:-1] + NF4_CODEBOOK[1:]) / 2
    probes = torch.cat([edges[~edges.isnan()], _near(midpoints, 8), torch.rand(100_000) * 2.2 - 1.1])
    expected = torch.bucketize(probes.clamp(-1, 1), midpoints, out_int32=True).to(torch.uint8)
    assert torch.equal(_nf4_codes(probes), expected)


def _rel_error(parts: dict[str, torch.Tensor], weight: torch.Tensor) -> float:
    out = dequantize_weight(parts, "int4", DEFAULT_GROUP_SIZE["int4"], torch.float32).double()
    return ((out - weight.double()).norm() / weight.double().norm()).item()


@pytest.mark.parametrize("make", [_gaussian, _student_t, _llama_like], ids=["gauss", "student_t3", "llama_like"])
def test_int4_search_error_is_no_larger_than_the_reference(make):
    # Summed over three weights: on one small weight the two searches' errors differ by noise (+-0.05%).
    fast = ref = 0.0
    for seed in (3, 4, 5):
        weight = make(96, 2048, seed).to(torch.bfloat16)
        fast += _rel_error(quantize_weight(weight, "int4"), weight) ** 2
        ref += _rel_error(reference.quantize_weight(weight, "int4"), weight) ** 2
    assert fast <= ref, (fast, ref)


def test_int4_search_picks_the_first_best_candidate():
    # Equal rows get equal parts however the candidates tie (a constant group: every candidate's error is the same).
    weight = torch.randn(2, 128)
    weight[1] = weight[0]
    weight[:, 64:] = 0.5
    parts = quantize_weight(weight, "int4")
    assert all(torch.equal(p[0], p[1]) for p in parts.values())
    out = dequantize_weight(parts, "int4", 64, torch.float32)
    assert (out[:, 64:] - 0.5).abs().max() < 0.5 / 64


@pytest.mark.skipif(sys.byteorder != "little", reason="the views below assume a little-endian host")
def test_nibble_packing_order():
    codes = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    parts = quantize_weight(torch.tensor([[-1.0, 1.0] * 32]), "nf4", method="no_double_quant")
    assert parts["codes"][0, 0].item() == 0x0F
    from ds_plugin.quant.frozen.codecs import _pack_nibbles

    assert _pack_nibbles(codes).tolist() == [[0x12, 0x34]]


@pytest.mark.parametrize(("fmt", "method"), EXACT)
def test_codes_do_not_depend_on_how_a_backend_divides_by_a_scalar(monkeypatch, fmt, method):
    # CUDA computes tensor / python_scalar as tensor * (1 / scalar), which rounds differently from a division; the
    # first GPU run found int4 and fp6 scales and codes that differed from the CPU's that way. Simulated here: the
    # parts must not change, so a weight quantizes to the same bytes on either device.
    weight = _llama_like(64, 1024, 5).to(torch.bfloat16)
    expected = quantize_weight(weight, fmt, method=method)
    divide = torch.Tensor.__truediv__

    def like_cuda(a, b):
        return a * (1.0 / b) if isinstance(b, (int, float)) and a.dtype == torch.float32 else divide(a, b)

    monkeypatch.setattr(torch.Tensor, "__truediv__", like_cuda)
    values = torch.linspace(1.0, 2.0, 1000)
    assert (values / 7.0 != divide(values, 7.0)).any()  # the simulation rounds differently somewhere
    got = quantize_weight(weight, fmt, method=method)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("fmt", "method"), [*EXACT, ("int4", "search")])
def test_cuda_quantizes_on_the_gpu(fmt, method):
    weight = _llama_like(64, 1024, 5).to(torch.bfloat16)
    on_gpu = quantize_weight(weight.cuda(), fmt, method=method)
    on_cpu = quantize_weight(weight, fmt, method=method)
    assert all(t.is_cuda for t in on_gpu.values())
    if (fmt, method) == ("int4", "search"):
        # Reductions may sum in another order on the GPU, so a near-tie can pick another candidate; the error holds.
        gpu = {k: v.cpu() for k, v in on_gpu.items()}
        assert _rel_error(gpu, weight) <= _rel_error(on_cpu, weight) * 1.001
        return
    for name in on_cpu:
        assert torch.equal(on_gpu[name].cpu(), on_cpu[name]), name
