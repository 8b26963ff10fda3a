"""The blockwise INT8/INT4 format of qwZ / qgZ (`ds_plugin.quant.comm.format`): error bound, packing, edge shapes,
inf/nan, byte counts. Whole tensors go through the format's reference by way of the flat shell in
`_blockwise_reference.py`; the packing, byte and scale helpers and the backend rule are the library's own."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _blockwise_reference import (
    QuantizedBlocks,
    dequantize_blockwise,
    dequantize_int4_blockwise,
    dequantize_int8_blockwise,
    quantize_blockwise,
    quantize_int4_blockwise,
    quantize_int8_blockwise,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_plugin.quant.comm import dispatch
from ds_plugin.quant.comm.format import max_finite_scale, pack_int4, quantized_nbytes, unpack_int4

QMAX = {8: 127, 4: 7}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Magnitudes (exact in fp32) whose cast to the dtype stays finite: bf16 rounds values just under fp32's max up to inf.
DTYPE_RANGE = {torch.float32: None, torch.bfloat16: 1.5 * 2.0**127, torch.float16: 6.0e4}
REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _torch_backend_only(monkeypatch):
    # The backend-rule checks below need "auto" to mean torch on CPU: no interpreter requested.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _per_element(values: torch.Tensor, block_size: int, numel: int) -> torch.Tensor:
    return values.repeat_interleave(block_size)[:numel]


def assert_within_half_step(x: torch.Tensor, qb: QuantizedBlocks) -> None:
    """|x - dq(q(x))| <= scale / 2 per element, plus the float rounding the format cannot avoid."""
    numel = x.numel()
    xf = x.reshape(-1).float()
    dq = qb.dequantize().reshape(-1).float()
    scale = _per_element(qb.scales, qb.block_size, numel)
    n_blocks = qb.scales.numel()
    padded = torch.nn.functional.pad(xf.abs(), (0, n_blocks * qb.block_size - numel))
    amax = _per_element(padded.view(n_blocks, qb.block_size).amax(dim=1), qb.block_size, numel)
    finfo = torch.finfo(x.dtype)
    bound = (
        scale / 2
        + amax * 2.0**-22  # fp32 rounding of x / scale and of the scale itself
        + QMAX[qb.bits] * 2.0**-149  # a subnormal scale is only accurate to half of fp32's smallest step
        + finfo.eps * (dq.abs() + finfo.smallest_normal)  # rounding the result to the output dtype
    )
    err = (xf - dq).abs()
    if numel:
        worst = int(torch.argmax(err - bound))
        assert bool((err <= bound).all()), f"element {worst}: x={xf[worst]}, dq={dq[worst]}, bound={bound[worst]}"


@st.composite
def float_tensors(draw, dtype: torch.dtype, max_numel: int = 300) -> torch.Tensor:
    limit = DTYPE_RANGE[dtype]
    values = draw(
        st.lists(
            st.floats(-limit if limit else None, limit, allow_nan=False, allow_infinity=False, width=32),
            min_size=0,
            max_size=max_numel,
        )
        | st.builds(
            lambda n, seed, exp: (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 10.0**exp).tolist(),
            st.integers(0, 5000),
            st.integers(0, 2**31),
            st.integers(-30, 30 if dtype != torch.float16 else 3),
        )
    )
    return torch.tensor(values, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [8, 4])
@settings(max_examples=40, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([2, 4, 6, 64, 100, 2048]))
def test_error_within_half_a_step(dtype, bits, data, block_size):
    x = data.draw(float_tensors(dtype))
    qb = quantize_blockwise(x, bits, block_size)
    assert qb.data.dtype == (torch.int8 if bits == 8 else torch.uint8)
    assert qb.scales.dtype == torch.float32 and qb.scales.numel() == math.ceil(x.numel() / block_size)
    assert bool((qb.scales > 0).all()) and bool(torch.isfinite(qb.scales).all())
    codes = qb.data if bits == 8 else unpack_int4(qb.data, x.numel())
    assert bool((codes.abs() <= QMAX[bits]).all())
    assert_within_half_step(x, qb)


@pytest.mark.parametrize("bits", [8, 4])
def test_ties_round_half_to_even(bits):
    qmax = QMAX[bits]
    # amax == qmax makes the scale exactly 1, so every x.5 below is an exact tie after the division.
    x = torch.tensor([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, -3.5, qmax])
    q, scales = (quantize_int8_blockwise if bits == 8 else quantize_int4_blockwise)(x, block_size=10)
    codes = q if bits == 8 else unpack_int4(q, x.numel())
    assert scales.tolist() == [1.0]
    assert codes.tolist() == [0, 2, 2, 4, 0, -2, -2, -4, qmax]


def test_codes_are_exact_for_representable_values():
    x = torch.arange(-127, 128, dtype=torch.float32) * 0.25  # scale = 0.25 exactly
    q, scales = quantize_int8_blockwise(x, block_size=x.numel())
    assert scales.tolist() == [0.25]
    assert torch.equal(q, torch.arange(-127, 128, dtype=torch.int8))
    assert torch.equal(dequantize_int8_blockwise(q, scales, x.numel(), x.shape), x)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_zero_blocks_have_unit_scale_and_dequantize_to_zero(bits, dtype):
    x = torch.randn(3 * 64 + 10).to(dtype)
    x[64:128] = 0
    x[-10:] = -0.0
    qb = quantize_blockwise(x, bits, 64)
    assert qb.scales[1].item() == 1.0 and qb.scales[3].item() == 1.0
    dq = qb.dequantize()
    assert dq.dtype == dtype
    assert bool((dq[64:128] == 0).all()) and bool((dq[-10:] == 0).all())
    assert_within_half_step(x, qb)
    zeros = quantize_blockwise(torch.zeros(5, 7, dtype=dtype), bits, 4)
    assert bool((zeros.scales == 1.0).all())
    assert torch.equal(zeros.dequantize(), torch.zeros(5, 7, dtype=dtype))


def test_underflowing_scale_is_replaced_like_a_zero_block():
    x = torch.tensor([1e-45, -1e-45, 0.0, 1e-45])  # amax / 127 rounds to 0 in fp32
    q, scales = quantize_int8_blockwise(x, block_size=4)
    assert scales.tolist() == [1.0] and q.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("bits", [8, 4])
def test_largest_finite_values_stay_finite(bits):
    fp32_max = torch.finfo(torch.float32).max
    x = torch.tensor([fp32_max, -fp32_max, 1.0, 0.5])
    qb = quantize_blockwise(x, bits, 4)
    # fp32(fp32_max / 127) rounds up so far that 127 * scale would be inf; the scale is clamped instead.
    assert qb.scales.item() == max_finite_scale(bits) <= fp32_max / QMAX[bits]
    assert bool(torch.isfinite(qb.dequantize()).all())
    assert_within_half_step(x, qb)
    assert math.isfinite(max_finite_scale(bits) * QMAX[bits])


@pytest.mark.parametrize("bits", [8, 4])
def test_partial_last_block_matches_quantizing_it_alone(bits):
    x = torch.randn(2 * 2048 + 901)
    qb = quantize_blockwise(x, bits, 2048)
    assert qb.scales.numel() == 3
    tail = quantize_blockwise(x[2 * 2048 :], bits, 2048)
    assert torch.equal(qb.scales[2:], tail.scales)
    codes = qb.data if bits == 8 else unpack_int4(qb.data, x.numel())
    tail_codes = tail.data if bits == 8 else unpack_int4(tail.data, tail.numel)
    assert torch.equal(codes[2 * 2048 :], tail_codes)
    assert codes.numel() == x.numel()
    assert qb.data.untyped_storage().nbytes() == qb.data.numel()  # no padding kept behind the view


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (5, 7), (2, 3, 33)], ids=str)
def test_shapes_and_dtypes_round_trip(bits, dtype, shape):
    x = (torch.randn(shape) * 3).to(dtype)
    qb = quantize_blockwise(x, bits, 16)
    assert qb.shape == x.shape and qb.dtype == dtype
    assert qb.data.numel() == (x.numel() if bits == 8 else math.ceil(x.numel() / 2))
    dq = qb.dequantize()
    assert dq.shape == x.shape and dq.dtype == dtype
    assert_within_half_step(x, qb)


def test_zero_dim_tensor():
    x = torch.tensor(-2.5)
    q, scales = quantize_int8_blockwise(x)
    assert q.shape == (1,) and q.item() == -127
    dq = dequantize_int8_blockwise(q, scales, 2048, x.shape)
    assert dq.shape == () and abs(dq.item() + 2.5) < 1e-6


def test_non_contiguous_input():
    x = torch.randn(40, 30).t()
    qb = quantize_blockwise(x, 8, 64)
    assert torch.equal(qb.data, quantize_blockwise(x.contiguous(), 8, 64).data)
    assert_within_half_step(x, qb)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_non_finite_input_raises_by_default(bits, bad):
    x = torch.randn(300)
    x[123] = bad
    with pytest.raises(ValueError, match=r"inf/nan \(1 of 3 blocks"):
        quantize_blockwise(x, bits, 128)
    with pytest.raises(ValueError, match="inf/nan"):
        (quantize_int8_blockwise if bits == 8 else quantize_int4_blockwise)(x, 128)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_finite_block_propagates_as_nan_when_unchecked(bits, dtype):
    x = torch.randn(3 * 128 - 5).to(dtype)
    x[130] = math.inf
    x[200] = math.nan
    qb = quantize_blockwise(x, bits, 128, check_finite=False)
    assert torch.isnan(qb.scales).tolist() == [False, True, False]
    codes = qb.data if bits == 8 else unpack_int4(qb.data, x.numel())
    assert bool((codes[128:256] == 0).all())
    dq = qb.dequantize()
    # The whole block comes back nan, so an fp16 loss scaler still detects the overflow after qgZ.
    assert bool(torch.isnan(dq[128:256]).all())
    assert bool(torch.isfinite(dq[:128]).all()) and bool(torch.isfinite(dq[256:]).all())
    clean = torch.cat([x[:128], x[256:]])
    clean_qb = quantize_blockwise(clean, bits, 128)
    assert torch.equal(clean_qb.scales, qb.scales[[0, 2]])
    assert torch.equal(clean_qb.dequantize(), torch.cat([dq[:128], dq[256:]]))


def test_fp16_overflow_reaches_the_loss_scaler():
    grad = torch.full((4096,), 1.0, dtype=torch.float16)
    grad[17] = grad[17] * 70000  # overflows fp16, as a too-large loss scale would
    q, scales = quantize_int4_blockwise(grad, block_size=2048, check_finite=False)
    dq = dequantize_int4_blockwise(q, scales, 2048, grad.shape, torch.float16)
    assert not bool(torch.isfinite(dq).all())


@settings(max_examples=60, deadline=None)
@given(codes=st.lists(st.integers(-8, 7), max_size=257))
def test_int4_pack_round_trip(codes):
    q = torch.tensor(codes, dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(len(codes) / 2)
    assert torch.equal(unpack_int4(packed, len(codes)), q)


def test_int4_packing_layout():
    # Element 2i in the low nibble, 2i + 1 in the high nibble, 4-bit two's complement, odd tail padded with 0.
    assert pack_int4(torch.tensor([1, -1], dtype=torch.int8)).tolist() == [0xF1]
    assert pack_int4(torch.tensor([3, 4, -8], dtype=torch.int8)).tolist() == [0x43, 0x08]
    assert pack_int4(torch.tensor([[7, -7], [0, -2]], dtype=torch.int8)).tolist() == [0x97, 0xE0]
    assert pack_int4(torch.empty(0, dtype=torch.int8)).numel() == 0


def test_int4_packing_rejects_bad_input():
    with pytest.raises(TypeError, match="int8"):
        pack_int4(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(TypeError, match="uint8"):
        unpack_int4(torch.zeros(2, dtype=torch.int8), 4)
    with pytest.raises(ValueError, match="cannot hold exactly 5"):
        unpack_int4(torch.zeros(2, dtype=torch.uint8), 5)


def test_byte_accounting():
    numel = 1 << 20
    bf16_bytes = 2 * numel
    int8 = quantized_nbytes(numel, 8, 2048)
    int4 = quantized_nbytes(numel, 4, 2048)
    assert int8 == numel + 4 * 512 and int4 == numel // 2 + 4 * 512
    assert 0.5 < int8 / bf16_bytes < 0.501
    assert 0.25 < int4 / bf16_bytes < 0.251
    assert quantized_nbytes(0, 4, 64) == 0
    assert quantized_nbytes(5, 4, 4) == 3 + 8
    for bits, numel_, block in [(8, 4099, 2048), (4, 4099, 2048), (4, 1, 2), (8, 0, 16)]:
        qb = quantize_blockwise(torch.randn(numel_), bits, block)
        assert qb.nbytes == quantized_nbytes(numel_, bits, block)


def test_function_api_matches_quantized_blocks():
    x = torch.randn(6, 50, dtype=torch.bfloat16)
    q, scales = quantize_int4_blockwise(x, 32)
    qb = quantize_blockwise(x, 4, 32)
    assert torch.equal(q, qb.data) and torch.equal(scales, qb.scales)
    assert torch.equal(dequantize_int4_blockwise(q, scales, 32, x.shape, torch.bfloat16), dequantize_blockwise(qb))


def test_argument_validation():
    x = torch.randn(10)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        quantize_blockwise(x, 2)
    with pytest.raises(ValueError, match="positive int"):
        quantize_blockwise(x, 8, 0)
    with pytest.raises(ValueError, match="even block_size"):
        quantize_blockwise(x, 4, 7)
    with pytest.raises(TypeError, match="fp32, bf16 or fp16"):
        quantize_blockwise(torch.arange(10), 8)
    with pytest.raises(TypeError, match="fp32, bf16 or fp16"):
        quantize_blockwise(x.double(), 8)
    q, scales = quantize_int8_blockwise(x, 4)
    with pytest.raises(ValueError, match=r"must be torch\.int8 with 12 elements"):
        dequantize_int8_blockwise(q, scales, 4, (12,))
    with pytest.raises(ValueError, match="expected 5 fp32 or bf16 scales"):
        dequantize_int8_blockwise(q, scales, 2, (10,))
    with pytest.raises(TypeError, match="produces fp32, bf16 or fp16"):
        dequantize_int8_blockwise(q, scales, 4, (10,), torch.int32)
    with pytest.raises(ValueError, match="backend"):
        dispatch.triton_kernels(x, "cuda")


def test_forcing_triton_on_cpu_without_interpreter_fails_clearly():
    with pytest.raises(RuntimeError, match="backend='triton' cannot run here"):
        dispatch.triton_kernels(torch.randn(8), "triton")
    with pytest.raises(RuntimeError, match="backend='triton' cannot run here"):
        dispatch.quantize_rows(torch.randn(2, 8), 4, 8, backend="triton")


def test_imports_and_runs_without_triton():
    # Block triton entirely (even with the interpreter requested): the dispatch's torch path must still work.
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, ds_plugin.quant\n"
        "from ds_plugin.quant.comm.dispatch import dequantize_rows_into, quantize_rows\n"
        "x = torch.full((2, 10), 127.0)\n"  # a scale of exactly 1, even as bf16
        "codes, scales = quantize_rows(x, 4, 8)\n"
        "out = torch.empty(2, 10)\n"
        "dequantize_rows_into(out, codes.contiguous(), scales, 4)\n"
        "assert torch.equal(out, x)\n"
        "assert quantize_rows(torch.ones(2, 10), 4, 4)[0].shape == (2, 5)\n"
        "assert 'ds_plugin.kernels.quant_triton' not in sys.modules\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("bits", [8, 4])
def test_bf16_scales_round_up_and_keep_the_error_bound(bits):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5000, generator=gen) * torch.logspace(-6, 3, 5000)
    ref = quantize_blockwise(x, bits, 64)
    qb = quantize_blockwise(x, bits, 64, scale_dtype=torch.bfloat16)
    assert qb.scales.dtype == torch.bfloat16
    s16, s32 = qb.scales.float(), ref.scales
    # Rounded up to the next bf16 value: never smaller (no clipping), at most one bf16 ulp (2**-7) larger.
    assert (s16 >= s32).all() and (s16 <= s32 * (1 + 2**-7)).all()
    err = (qb.dequantize() - x).abs()
    assert (err <= s16.repeat_interleave(64)[: x.numel()] * 0.5 * (1 + 1e-6)).all()
    assert quantized_nbytes(5000, bits, 64, scale_bytes=2) == qb.data.numel() + 2 * qb.scales.numel()


def test_bf16_scales_keep_nonfinite_blocks_nan():
    x = torch.randn(256)
    x[70] = float("inf")
    qb = quantize_blockwise(x, 4, 64, check_finite=False, scale_dtype=torch.bfloat16)
    out = qb.dequantize()
    assert torch.isnan(out[64:128]).all() and torch.isfinite(out[:64]).all() and torch.isfinite(out[128:]).all()
