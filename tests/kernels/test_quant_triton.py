"""Triton blockwise INT8/INT4 kernels against the plain-torch reference (`ds_plugin.quant.comm.format`), bit for bit.

On CPU the kernels run in Triton's interpreter: ``TRITON_INTERPRET`` is read when ``triton.jit`` wraps a function,
and ``ds_plugin.kernels.quant_triton`` wraps its kernels on first use per mode, so setting the variable with
``monkeypatch`` inside a test is enough (no subprocess). On a GPU the compiled kernels are compared as well.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from ds_plugin.kernels import quant_triton
from ds_plugin.quant import KernelLaunchError
from ds_plugin.quant.comm import dispatch, fused
from ds_plugin.quant.comm.format import dequantize_reference, quantize_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert quant_triton.interpreter_enabled()


@pytest.fixture
def compiled(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def make_input(numel: int, block_size: int, bits: int, dtype: torch.dtype, seed: int, device="cpu") -> torch.Tensor:
    """Random values over many magnitudes plus the blocks that stress the rules: exact ties, zeros, inf/nan."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * 10.0 ** torch.randint(-3, 4, (numel,), generator=g)
    qmax = 127 if bits == 8 else 7
    n_blocks = math.ceil(numel / block_size)
    if n_blocks >= 2:
        # amax == qmax * 2**-3 gives a scale of exactly 2**-3, so every (k + 0.5) * 2**-3 is a rounding tie.
        ties = (torch.randint(-qmax, qmax, (block_size,), generator=g) + 0.5) * 0.125
        ties[0] = qmax * 0.125
        x[:block_size] = ties
    if n_blocks >= 3:
        x[block_size : 2 * block_size] = 0.0
    if n_blocks >= 4:
        x[2 * block_size + 1] = math.inf
        x[3 * block_size - 1] = math.nan
    return x.to(dtype).to(device)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bit patterns; nan positions must match but a nan's payload may differ (GPUs canonicalise nan)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    actual, expected = actual.cpu(), expected.cpu()
    if actual.is_floating_point():
        nan = torch.isnan(expected)
        assert torch.equal(torch.isnan(actual), nan)
        view = _INT_VIEW[actual.dtype]
        actual, expected = actual[~nan].view(view), expected[~nan].view(view)
    mismatch = (actual != expected).nonzero().flatten()
    assert mismatch.numel() == 0, f"{mismatch.numel()} of {actual.numel()} differ, first at {mismatch[:5].tolist()}"


def assert_dequant_matches(
    triton_out: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, block_size: int, bits: int, *, interpreted: bool
) -> None:
    """The Triton dequantization of ``(data, scales)`` equals the reference's (flat, in ``triton_out``'s dtype)."""
    numel, dtype = triton_out.numel(), triton_out.dtype
    reference = dequantize_reference(data, scales, block_size, numel, bits, dtype)
    if interpreted and dtype == torch.bfloat16:
        # Triton's interpreter casts fp32 -> bf16 by truncation where compiled kernels (and torch) round to nearest
        # even; accept either, and hold the compiled kernels to exact equality in the GPU tests.
        product = dequantize_reference(data, scales, block_size, numel, bits, torch.float32).cpu()
        truncated = (product.view(torch.int32) >> 16).to(torch.int16)
        out, ref = triton_out.cpu(), reference.cpu()
        rounded_or_truncated = (out.view(torch.int16) == ref.view(torch.int16)) | (out.view(torch.int16) == truncated)
        assert bool((rounded_or_truncated | (torch.isnan(out) & torch.isnan(ref))).all())
        return
    assert_same_bits(triton_out, reference)


def check_against_reference(
    x: torch.Tensor, bits: int, block_size: int, *, interpreted: bool, scale_dtype: torch.dtype = torch.float32
) -> None:
    """The flat Triton quantize / dequantize of ``x`` (one run of blocks) against the format's reference."""
    ref_data, ref_scales = quantize_reference(x, bits, block_size, scale_dtype)
    data, scales = quant_triton.quantize_blockwise_triton(x, block_size, bits, scale_dtype)
    assert_same_bits(data, ref_data)
    assert_same_bits(scales, ref_scales)
    out = quant_triton.dequantize_blockwise_triton(data, scales, block_size, x.numel(), bits, x.dtype)
    assert out.shape == (x.numel(),) and out.dtype == x.dtype
    assert_dequant_matches(out, ref_data, ref_scales, block_size, bits, interpreted=interpreted)


CASES = [(1, 2), (7, 4), (9, 2), (300, 64), (1001, 100), (700, 128), (2 * 2048 + 7, 2048)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("numel", "block_size"), CASES, ids=str)
def test_interpreted_kernels_match_reference(interpreter, numel, block_size, bits, dtype):
    check_against_reference(make_input(numel, block_size, bits, dtype, seed=numel), bits, block_size, interpreted=True)


@settings(max_examples=20, deadline=None)
@given(
    numel=st.integers(0, 700),
    half_block=st.integers(1, 150),
    bits=st.sampled_from([8, 4]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31),
)
def test_interpreted_kernels_match_reference_random_shapes(numel, half_block, bits, dtype, seed):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        x = make_input(numel, 2 * half_block, bits, dtype, seed)
        check_against_reference(x, bits, 2 * half_block, interpreted=True)


@pytest.mark.parametrize("block_size", [1, 3, 5, 127])
def test_interpreted_int8_odd_block_sizes(interpreter, block_size):
    # Only INT4 needs even blocks; block_size == 1 is also the value Triton specialises as a constant.
    for dtype in DTYPES:
        check_against_reference(make_input(260, block_size, 8, dtype, seed=block_size), 8, block_size, interpreted=True)


@pytest.mark.parametrize("bits", [8, 4])
def test_interpreted_kernels_handle_shapes(interpreter, bits):
    for shape in [(), (0,), (3, 0), (4, 5, 6)]:
        check_against_reference(torch.randn(shape, dtype=torch.bfloat16), bits, 8, interpreted=True)
    check_against_reference(torch.randn(30, 20).t(), bits, 16, interpreted=True)


_FP32 = torch.finfo(torch.float32)
EXTREME_BLOCKS = [
    [_FP32.max, -_FP32.max, 1.0, -0.0],  # scale clamped so qmax * scale stays finite
    [_FP32.smallest_normal * _FP32.eps, -1e-40, 3e-39, 0.0],  # subnormal inputs and a subnormal scale
    [1e-45, -1e-45, 0.0, -0.0],  # amax / qmax underflows: scale becomes 1
    [-0.0, 0.0, -0.0, 0.0],
    [math.inf, 1.0, 2.0, 3.0],
    [-math.inf, math.nan, 2.0, 1e38],
    [0.5, -2.5, 3.5, 7.0],  # ties with a scale of exactly 1 for INT4
]


@pytest.mark.parametrize("bits", [8, 4])
def test_interpreted_kernels_match_reference_on_extremes(interpreter, bits):
    x = torch.tensor(EXTREME_BLOCKS).flatten()
    check_against_reference(x, bits, 4, interpreted=True)
    check_against_reference(x.half(), bits, 4, interpreted=True)
    # The interpreter also mis-converts bf16 subnormals to fp32 (compiled kernels shift bits exactly), so the bf16
    # run leaves the subnormal block out.
    bf16 = torch.tensor(EXTREME_BLOCKS[:1] + EXTREME_BLOCKS[2:]).flatten().bfloat16()
    check_against_reference(bf16, bits, 4, interpreted=True)


def test_interpreted_nonfinite_block_gets_a_nan_scale(interpreter):
    # The nan scale is what a caller's inf/nan check reads (tests/quant/comm/test_blockwise_format.py).
    x = torch.randn(64)
    x[3] = math.nan
    _, scales = quant_triton.quantize_blockwise_triton(x, 16, 8)
    assert torch.isnan(scales).tolist() == [True, False, False, False]


def test_auto_dispatch(monkeypatch):
    x = torch.randn(8)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert dispatch.triton_kernels(x, "auto") is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.triton_kernels(x, "auto") is quant_triton
    assert dispatch.triton_kernels(x, "torch") is None


def test_kernels_are_jitted_per_mode(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    interpreted = quant_triton._jit(quant_triton._quantize_kernel)
    monkeypatch.delenv("TRITON_INTERPRET")
    compiled_kernel = quant_triton._jit(quant_triton._quantize_kernel)
    assert type(interpreted) is not type(compiled_kernel)
    assert quant_triton._jit(quant_triton._quantize_kernel) is compiled_kernel


GPU_CASES = [(1, 2), (10007, 100), (65536 + 3, 64), ((1 << 20) + 3, 2048), (3 * 4096 + 1, 4096), (50000, 8192)]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("numel", "block_size"), GPU_CASES, ids=str)
def test_compiled_kernels_match_reference(compiled, numel, block_size, bits, dtype):
    x = make_input(numel, block_size, bits, dtype, seed=numel, device="cuda")
    assert dispatch.triton_kernels(x, "auto") is quant_triton
    check_against_reference(x, bits, block_size, interpreted=False)
    # The CUDA kernels also agree with the reference computed on CPU.
    cpu_data, cpu_scales = quantize_reference(x.cpu(), bits, block_size)
    gpu_data, gpu_scales = quant_triton.quantize_blockwise_triton(x, block_size, bits)
    assert_same_bits(gpu_data, cpu_data)
    assert_same_bits(gpu_scales, cpu_scales)
    on_cpu = dequantize_reference(cpu_data, cpu_scales, block_size, numel, bits, dtype)
    assert_same_bits(
        quant_triton.dequantize_blockwise_triton(gpu_data, gpu_scales, block_size, numel, bits, dtype), on_cpu
    )


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("bits", [8, 4])
def test_compiled_kernels_handle_shapes(compiled, bits):
    for shape in [(), (0,), (3, 0), (4, 5, 6)]:
        check_against_reference(torch.randn(shape, device="cuda"), bits, 8, interpreted=False)
    check_against_reference(torch.randn(300, 200, device="cuda").t(), bits, 128, interpreted=False)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [8, 4])
def test_compiled_kernels_match_reference_on_extremes(compiled, bits, dtype):
    x = torch.tensor(EXTREME_BLOCKS).flatten().to(dtype).cuda()
    check_against_reference(x, bits, 4, interpreted=False)


# The row steps of the ZeRO++ collectives: dispatch sends CUDA tensors (here: the interpreter) to the row kernels,
# which must reproduce the torch backend (`fused`, itself the format's reference) bit for bit.
ROW_SHAPES = [(3, 1000, 64), (2, 4097, 4096), (1, 10, 4), (4, 130, 64), (2, 7, 8), (1, 5, 1)]


def _row_input(n: int, numel: int, block: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(n, numel, generator=torch.Generator().manual_seed(n * numel + block)) * 3
    x[0, : min(block, numel)] = 0  # an all-zero block: scale 1, zero codes
    if n > 2:
        x[2, numel // 2] = math.inf  # a non-finite block: nan scale, zero codes
        x[-1, 0] = math.nan
    return x.to(dtype)


def check_rows_against_torch(rows: torch.Tensor, block: int, bits: int) -> None:
    want_codes, want_scales = fused.quantize_rows(rows, block, bits, compiled=False)
    codes, scales = dispatch.quantize_rows(rows, block, bits, backend="triton")
    assert codes.is_contiguous()
    assert_same_bits(codes, want_codes)
    assert_same_bits(scales, want_scales)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [8, 4])
def test_interpreted_quantize_rows_matches_torch(interpreter, bits, dtype):
    for n, numel, block in ROW_SHAPES:
        if bits == 4 and block % 2:
            continue
        check_rows_against_torch(_row_input(n, numel, block, dtype), block, bits)


@pytest.mark.parametrize("bits", [8, 4])
def test_interpreted_quantize_rows_reads_strided_views(interpreter, bits):
    # qgZ's first hop quantizes chunks.view(nodes, local, n).transpose(0, 1)[..., a:b] in place; qwZ a 1-row view.
    nodes, local, numel, block = 2, 3, 250, 64
    chunks = torch.randn(nodes * local, numel).bfloat16()
    view = chunks.view(nodes, local, numel).transpose(0, 1)
    check_rows_against_torch(view, block, bits)
    check_rows_against_torch(view[..., 64:250], block, bits)
    check_rows_against_torch(view[1], block, bits)
    check_rows_against_torch(chunks.view(1, -1), block, bits)
    check_rows_against_torch(torch.randn(2, 3, 4, 40)[..., ::2].transpose(1, 2), 8, bits)  # copied first


def _dequantize_rows_both(out_shape, x: torch.Tensor, block: int, view):
    codes, scales = fused.quantize_rows(x, block, 8, compiled=False)
    codes = codes.contiguous().view(-1)
    got = torch.full(out_shape, 7.0, dtype=x.dtype)
    want = torch.full(out_shape, 7.0, dtype=x.dtype)
    dispatch.dequantize_rows_into(view(got), codes, scales, block, backend="triton")
    fused.dequantize_rows_into(view(want), codes, scales, block, compiled=False)
    return got, want


def assert_rows_dequant_match(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype != torch.bfloat16:
        assert_same_bits(got, want)
        return
    # The interpreter casts fp32 -> bf16 by truncation (see assert_dequant_matches): allow one bf16 ulp towards 0.
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    g, w = got[~nan].view(torch.int16).int(), want[~nan].view(torch.int16).int()
    assert bool(((g == w) | (g == w - 1)).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interpreted_dequantize_rows_into_matches_torch(interpreter, dtype):
    for n, numel, block in ROW_SHAPES:
        x = _row_input(n, numel, block, dtype)
        got, want = _dequantize_rows_both((n, numel), x, block, lambda t: t)
        assert_rows_dequant_match(got, want)


@pytest.mark.parametrize("numel", [256, 250])
def test_interpreted_dequantize_rows_into_transposed_view(interpreter, numel):
    # qwZ's two-level gather writes rank (node, local) at [local, node] through a transposed view of the buffer.
    nodes, local, block = 2, 3, 64
    x = torch.randn(local, nodes, numel)
    got, want = _dequantize_rows_both((nodes, local, numel), x, block, lambda t: t.transpose(0, 1))
    assert_same_bits(got, want)
    # A piece of the rows, as the pipelined gather decodes it.
    x = torch.randn(local, nodes, 100)
    got, want = _dequantize_rows_both((nodes, local, numel), x, block, lambda t: t.transpose(0, 1)[..., 64:164])
    assert_same_bits(got, want)
    # Leading dims that no two strides describe: decoded into contiguous memory, then copied.
    x = torch.randn(3, 2, 2, 40)
    got, want = _dequantize_rows_both((2, 2, 3, 40), x, 16, lambda t: t.transpose(0, 2))
    assert_same_bits(got, want)


def test_row_dispatch_rules(monkeypatch):
    x = torch.randn(2, 64)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    monkeypatch.setattr(quant_triton, "quantize_rows_triton", lambda *a: calls.append(a) or fused.quantize_rows(*a))
    dispatch.quantize_rows(x, 16, 8)
    dispatch.quantize_rows(x, 16, 8, compiled=False)
    assert len(calls) == 2
    # compiled=True is the compiled torch form, and backend="torch" keeps Triton out.
    dispatch.quantize_rows(x, 16, 8, backend="torch")
    assert len(calls) == 2
    with pytest.raises(ValueError, match="compiled=True"):
        dispatch.quantize_rows(x, 16, 8, compiled=True, backend="triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    dispatch.quantize_rows(x, 16, 8)
    assert len(calls) == 2
    with pytest.raises(RuntimeError, match="cannot run here"):
        dispatch.dequantize_rows_into(torch.empty(2, 64), torch.zeros(128, dtype=torch.int8), x, 16, backend="triton")


def test_row_kernel_launches_are_counted_and_strict_mode_raises(monkeypatch, caplog):
    x = torch.randn(2, 64)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(dispatch, "_triton_rows", {"verified": set(), "failed": None})
    before = dispatch.kernel_launches()
    dispatch.quantize_rows(x, 16, 4)
    assert dispatch.kernel_launches()[("quantize", 4)] == before.get(("quantize", 4), 0) + 1

    def broken(*args):
        raise RuntimeError("no such device feature")

    monkeypatch.setattr(quant_triton, "dequantize_rows_into_triton", broken)
    codes, scales = fused.quantize_rows(x, 16, 8, compiled=False)
    args = (torch.empty(2, 64), codes.contiguous().view(-1), scales, 16)
    monkeypatch.setenv("DS_PLUGIN_STRICT_KERNELS", "1")
    with pytest.raises(KernelLaunchError, match=r"^dequantize_rows_into: the Triton kernel failed for float32 rows "):
        dispatch.dequantize_rows_into(*args)
    # Without strict mode the first failure falls back to torch with a warning, as before.
    monkeypatch.delenv("DS_PLUGIN_STRICT_KERNELS")
    dispatch.dequantize_rows_into(*args)
    assert "first use" in caplog.text and dispatch._triton_rows["failed"].startswith("RuntimeError")
    # A fallback recorded before strict mode was asked for does not hide the kernel from it.
    monkeypatch.setenv("DS_PLUGIN_STRICT_KERNELS", "1")
    with pytest.raises(KernelLaunchError, match="no such device feature"):
        dispatch.dequantize_rows_into(*args)


@pytest.mark.parametrize("bits", [8, 4])
def test_interpreted_flat_bf16_scales_match_reference(interpreter, bits):
    # The flat kernels take bf16 scales too.
    for numel, block_size in [(1001, 100), (700, 128), (9, 2)]:
        x = make_input(numel, block_size, bits, torch.float32, seed=numel)
        check_against_reference(x, bits, block_size, interpreted=True, scale_dtype=torch.bfloat16)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [8, 4])
def test_compiled_row_kernels_match_cpu_torch(compiled, bits, dtype):
    # backend="triton": the compiled kernels or an error, never the torch form; and their launches must have returned.
    for n, numel, block in [*ROW_SHAPES, (8, 65536 + 3, 4096)]:
        if bits == 4 and block % 2:
            continue
        x = _row_input(n, numel, block, dtype)
        before = dispatch.kernel_launches()
        codes, scales = dispatch.quantize_rows(x.cuda(), block, bits, backend="triton")
        assert dispatch.kernel_launches().get(("quantize", bits), 0) == before.get(("quantize", bits), 0) + 1
        want_codes, want_scales = fused.quantize_rows(x, block, bits, compiled=False)
        assert_same_bits(codes, want_codes.contiguous())
        assert_same_bits(scales, want_scales)
        if bits == 8:
            out = torch.empty(n, numel, dtype=dtype, device="cuda")
            dispatch.dequantize_rows_into(out, codes.view(-1), scales, block, backend="triton")
            assert dispatch.kernel_launches().get(("dequantize", 8), 0) == before.get(("dequantize", 8), 0) + 1
            want = torch.empty(n, numel, dtype=dtype)
            fused.dequantize_rows_into(want, want_codes.contiguous().view(-1), want_scales, block, compiled=False)
            assert_same_bits(out, want)
