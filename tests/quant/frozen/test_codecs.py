"""Frozen-weight storage formats (INT8, INT4, NF4): error bounds from each format's definition, the row-slice
contract ZeRO-3 sharding relies on, exact byte counts and budgets, error messages, and bitsandbytes' NF4."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ds_plugin.quant.frozen.codecs import (
    DEFAULT_GROUP_SIZE,
    FORMATS,
    METHODS,
    NF4_CODEBOOK,
    check_weight,
    dequantize_weight,
    quantize_weight,
    weight_nbytes,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ALL_METHODS = [(fmt, method) for fmt in FORMATS for method in METHODS[fmt]]
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
# The widest gap between neighbouring NF4 levels is -1.0 .. -0.6961928 (QLoRA's table): half of it bounds the
# rounding error of an element inside [-absmax, absmax] in units of absmax.
NF4_HALF_GAP = (1.0 - 0.6961928009986877) / 2


@pytest.fixture(autouse=True)
def _seed_and_one_thread():
    # The tensors here are small: one thread avoids OpenMP's spinning barriers, which on a loaded CPU made the file
    # several times slower than its CPU time.
    torch.manual_seed(1234)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _bnb():
    try:
        import bitsandbytes.functional as bnb_functional
    except Exception as exc:  # a broken native library raises more than ImportError
        pytest.skip(f"bitsandbytes does not import here: {exc}")
    return bnb_functional


def _student_t(shape: tuple[int, int], df: float = 3.0) -> torch.Tensor:
    return torch.distributions.StudentT(df).sample(shape)


def _groups(x: torch.Tensor, group: int) -> torch.Tensor:
    return x.float().reshape(x.shape[0], -1, group)


def _mse(fmt: str, weight: torch.Tensor, method: str = "default", group: int | None = None) -> float:
    group = group or DEFAULT_GROUP_SIZE[fmt]
    parts = quantize_weight(weight, fmt, group, method=method)
    return (dequantize_weight(parts, fmt, group, torch.float32) - weight.float()).square().mean().item()


# ---------------------------------------------------------------- error bounds


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_error_is_within_half_a_step(dtype):
    weight = (torch.randn(48, 512) * torch.logspace(-3, 2, 48)[:, None]).to(dtype)
    parts = quantize_weight(weight, "int8")
    group = DEFAULT_GROUP_SIZE["int8"]
    scale = parts["scales"].float()[..., None]
    amax = _groups(weight, group).abs().amax(-1, keepdim=True)
    # Scales are amax / 127 rounded up to bf16 (8 significant bits), so never below it and within one bf16 ulp.
    assert parts["scales"].dtype == torch.bfloat16
    assert (scale >= amax / 127).all() and (scale <= amax / 127 * (1 + 2.0**-7)).all()
    out = dequantize_weight(parts, "int8", group, torch.float32)
    err = (_groups(out, group) - _groups(weight, group)).abs()
    assert (err <= scale / 2 * (1 + 2.0**-20) + amax * 2.0**-22).all()
    codes = parts["codes"].view(torch.int8)
    assert codes.abs().max() <= 127


def test_int4_absmax_is_symmetric_and_within_half_a_step():
    weight = torch.randn(32, 256) * 3
    parts = quantize_weight(weight, "int4", method="absmax")
    g = DEFAULT_GROUP_SIZE["int4"]
    assert (parts["zeros"] == 8 * 16).all()
    codes = torch.stack((parts["codes"] >> 4, parts["codes"] & 15), -1).flatten(-2)
    assert codes.min() >= 1 and codes.max() <= 15  # -7..7 around the zero point 8
    scale = parts["scales"].float()[..., None]
    amax = _groups(weight, g).abs().amax(-1, keepdim=True)
    assert (scale >= amax / 7).all() and (scale <= amax / 7 * (1 + 2.0**-7)).all()
    err = (_groups(dequantize_weight(parts, "int4", g, torch.float32), g) - _groups(weight, g)).abs()
    assert (err <= scale / 2 * (1 + 2.0**-20) + amax * 2.0**-22).all()


@pytest.mark.parametrize("make", [torch.randn, _student_t], ids=["gauss", "student_t3"])
def test_int4_search_stores_each_element_at_its_nearest_level(make):
    g = DEFAULT_GROUP_SIZE["int4"]
    weight = make((64, 512))
    parts = quantize_weight(weight, "int4")
    scale = parts["scales"].float()[..., None, None]
    zero = parts["zeros"].float()[..., None, None] / 16
    levels = scale * (torch.arange(16.0) - zero)  # (N, groups, 1, 16): every value a group can hold
    x = _groups(weight, g)[..., None]
    best = (x - levels).abs().amin(-1)
    got = (_groups(dequantize_weight(parts, "int4", g, torch.float32), g) - x[..., 0]).abs()
    assert (got <= best + scale[..., 0] * 1e-5).all()


@pytest.mark.parametrize(("make", "vs_nf4"), [(torch.randn, 0.82), (_student_t, 0.95)], ids=["gauss", "student_t3"])
def test_int4_search_beats_absmax_and_nf4(make, vs_nf4):
    weight = make((256, 1024))
    searched, absmax, nf4 = _mse("int4", weight), _mse("int4", weight, "absmax"), _mse("nf4", weight)
    assert searched < 0.7 * absmax, (searched, absmax)
    # The reason the search exists: within 0.28x bf16 bytes it should store weights better than NF4 does (measured
    # MSE ratios 0.78 Gaussian, 0.92 Student-t(3); without the clipping grid they were 0.85 and 1.00).
    assert searched < vs_nf4 * nf4, (searched, nf4)


@pytest.mark.parametrize(("fmt", "method"), ALL_METHODS)
def test_extreme_magnitudes_stay_finite_and_accurate(fmt, method):
    # 1e38 is near fp32's max: sums of squares, spans and row means of such values must not overflow.
    for magnitude in (1e-30, 1e30, 1e38):
        weight = (torch.rand(8, 256) * 2 - 1) * magnitude
        group = DEFAULT_GROUP_SIZE[fmt]
        out = dequantize_weight(quantize_weight(weight, fmt, method=method), fmt, group, torch.float32)
        assert torch.isfinite(out).all()
        assert ((out - weight).double().norm() / weight.double().norm()).item() < 0.15  # fp64: no underflow


@pytest.mark.parametrize("method", METHODS["nf4"])
def test_nf4_error_bound(method):
    g = DEFAULT_GROUP_SIZE["nf4"]
    weight = torch.randn(64, 512) * torch.logspace(-2, 1, 512)  # group magnitudes spread along each row
    parts = quantize_weight(weight, "nf4", method=method)
    true_absmax = _groups(weight, g).abs().amax(-1)
    if method == "no_double_quant":
        stored = parts["absmax"]
        assert torch.equal(stored, true_absmax)
    else:
        stored = parts["absmax_codes"].view(torch.int8).float() * parts["absmax_scale"] + parts["absmax_offset"]
        # int8 around the row mean: within half a step of the true absmax.
        assert ((stored - true_absmax).abs() <= parts["absmax_scale"] * (0.5 + 1e-5) + 1e-7).all()
    err = (_groups(dequantize_weight(parts, "nf4", g, torch.float32), g) - _groups(weight, g)).abs()
    # Inside the stored range the nearest level is at most half the widest gap away; beyond it, clipping costs at
    # most the distance between the true and the stored absmax.
    bound = NF4_HALF_GAP * stored.clamp(min=0) + (stored - true_absmax).abs() + 1e-6 * true_absmax
    assert (err <= bound[..., None]).all()


# ---------------------------------------------------------------- the row contract and bytes


@pytest.mark.parametrize(("fmt", "method"), ALL_METHODS)
def test_row_slices_quantize_independently(fmt, method):
    weight = _student_t((37, 384)).to(torch.bfloat16)
    whole = quantize_weight(weight, fmt, method=method)
    for name, part in whole.items():
        assert part.shape[0] == 37 and part.is_contiguous(), name
    assert whole["codes"].dtype == torch.uint8
    for rows in (slice(0, 1), slice(5, 6), slice(3, 20), slice(36, 37), slice(10, 10)):
        sliced = quantize_weight(weight[rows], fmt, method=method)
        assert list(sliced) == list(whole)
        for name in whole:
            assert torch.equal(sliced[name], whole[name][rows]), (name, rows)
    # Row shards concatenated, as ZeRO-3's all-gather does, dequantize to the whole weight.
    shards = [quantize_weight(weight[i : i + 10], fmt, method=method) for i in range(0, 37, 10)]
    joined = {name: torch.cat([s[name] for s in shards]) for name in whole}
    group = DEFAULT_GROUP_SIZE[fmt]
    assert torch.equal(
        dequantize_weight(joined, fmt, group, torch.bfloat16), dequantize_weight(whole, fmt, group, torch.bfloat16)
    )


@pytest.mark.parametrize(("fmt", "method"), ALL_METHODS)
@pytest.mark.parametrize(("shape", "group"), [((7, 512), None), ((3, 256), 32), ((5, 1024), 256), ((0, 128), None)])
def test_weight_nbytes_counts_every_component(fmt, method, shape, group):
    parts = quantize_weight(torch.randn(shape), fmt, group, method=method)
    assert weight_nbytes(shape, fmt, group, method=method) == sum(t.numel() * t.element_size() for t in parts.values())


@pytest.mark.parametrize("k", [512, 1024, 4096, 11008])
def test_default_formats_fit_their_byte_budgets(k):
    bf16 = 64 * k * 2
    assert weight_nbytes((64, k), "int8") / bf16 <= 0.52
    assert weight_nbytes((64, k), "int4") / bf16 <= 0.28
    assert weight_nbytes((64, k), "int4", method="absmax") / bf16 <= 0.28
    assert weight_nbytes((64, k), "nf4") / bf16 <= 0.28
    # Without double quantization NF4 pays 4 bytes per 64 weights: over budget, which is why it is not the default.
    assert weight_nbytes((64, k), "nf4", method="no_double_quant") / bf16 > 0.28


# ---------------------------------------------------------------- dtypes and special values


@pytest.mark.parametrize(("fmt", "method"), ALL_METHODS)
@pytest.mark.parametrize("dtype_in", DTYPES)
def test_dtypes_in_and_out(fmt, method, dtype_in):
    weight = torch.randn(6, 256).to(dtype_in)
    parts = quantize_weight(weight, fmt, method=method)
    # Quantization works on the fp32 values, so a bf16 weight stores exactly what its fp32 copy does.
    as_fp32 = quantize_weight(weight.float(), fmt, method=method)
    assert all(torch.equal(parts[n], as_fp32[n]) for n in parts)
    reference = dequantize_weight(parts, fmt, DEFAULT_GROUP_SIZE[fmt], torch.float32)
    for dtype_out in DTYPES:
        out = dequantize_weight(parts, fmt, DEFAULT_GROUP_SIZE[fmt], dtype_out)
        assert out.dtype == dtype_out and out.shape == weight.shape
        assert torch.equal(out, reference.to(dtype_out))  # one rounding, from fp32


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_parameter_that_requires_grad_quantizes_without_autograd(fmt):
    weight = torch.nn.Parameter(torch.randn(4, 256))
    parts = quantize_weight(weight, fmt)
    assert not any(t.requires_grad for t in parts.values())
    assert not dequantize_weight(parts, fmt, DEFAULT_GROUP_SIZE[fmt], torch.float32).requires_grad


@pytest.mark.parametrize(("fmt", "method"), ALL_METHODS)
def test_zero_groups_round_trip_to_zero(fmt, method):
    weight = torch.randn(4, 512) * 100
    weight[0] = 0  # a whole row
    weight[1, 64:192] = 0  # groups of zeros among large ones (NF4 double quant rebuilds their absmax near 0)
    weight[2, :] = 1e-3
    weight[2, 256:320] = 0
    out = dequantize_weight(quantize_weight(weight, fmt, method=method), fmt, DEFAULT_GROUP_SIZE[fmt], torch.float32)
    assert torch.isfinite(out).all()
    assert (out[weight == 0] == 0).all()


def test_nf4_groups_whose_rebuilt_absmax_is_not_positive_store_zeros():
    # Rows mixing huge and tiny groups: the tiny groups' absmax, int8-quantized around the row mean, can rebuild
    # to <= 0; storing their (tiny) values against a non-positive absmax would flip or blow them up.
    weight = torch.randn(32, 1024) * 1e-3
    weight[:, : 12 * 64 : 64] = torch.rand(32, 12) * 900 + 100  # 12 large groups, then 4 tiny ones per row
    parts = quantize_weight(weight, "nf4")
    stored = parts["absmax_codes"].view(torch.int8).float() * parts["absmax_scale"] + parts["absmax_offset"]
    bad = stored <= 0
    assert bad.any()  # the case under test does occur
    out = _groups(dequantize_weight(parts, "nf4", 64, torch.float32), 64)
    assert (out[bad] == 0).all()


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_weights_are_rejected(bad):
    weight = torch.randn(4, 128)
    weight[2, 5] = bad
    with pytest.raises(ValueError, match=r"(inf|nan).*\[2, 5\]"):
        quantize_weight(weight, "int4")


def _one_line_error(match: str, call) -> None:
    with pytest.raises(ValueError, match=match) as info:
        call()
    assert "\n" not in str(info.value)


def test_error_messages_name_the_problem():
    _one_line_error(
        r"K=200.*group_size=64.*pick a group_size that divides K", lambda: check_weight("int4", (8, 200), 64)
    )
    _one_line_error(r"K=100.*group_size=128", lambda: quantize_weight(torch.randn(2, 100), "int8"))
    _one_line_error("even", lambda: check_weight("nf4", (8, 96), 3))
    _one_line_error("unknown weight format 'fp5'", lambda: quantize_weight(torch.randn(2, 64), "fp5"))
    _one_line_error("no method 'search'", lambda: quantize_weight(torch.randn(2, 64), "nf4", method="search"))
    _one_line_error("2-D", lambda: check_weight("int8", (4, 4, 128), 128))
    _one_line_error("fp32, bf16 or fp16", lambda: quantize_weight(torch.ones(2, 128, dtype=torch.int32), "int8"))
    parts = quantize_weight(torch.randn(4, 128), "int4")
    without_zeros = {k: v for k, v in parts.items() if k != "zeros"}
    _one_line_error("'zeros'", lambda: dequantize_weight(without_zeros, "int4", 64, torch.float32))
    narrow = {**parts, "scales": parts["scales"][:, :1]}
    _one_line_error("'scales' should have shape", lambda: dequantize_weight(narrow, "int4", 64, torch.float32))


# ---------------------------------------------------------------- NF4 against bitsandbytes


def test_nf4_nibble_order_and_ties_by_hand():
    # Element 0 at -absmax (level 0) and element 1 at +absmax (level 15): bitsandbytes puts element 0 in the high
    # nibble, so the first byte is 0x0F.
    weight = torch.zeros(1, 64)
    weight[0, 0], weight[0, 1] = -2.0, 2.0
    assert quantize_weight(weight, "nf4", method="no_double_quant")["codes"][0, 0].item() == 0x0F
    # A value exactly halfway between two levels (absmax 2: scaling by 1/2 is exact) goes to the lower level.
    mids = (NF4_CODEBOOK[:-1] + NF4_CODEBOOK[1:]) / 2
    weight = torch.zeros(1, 64)
    weight[0, 0] = 2.0
    weight[0, 2:17] = 2.0 * mids
    codes = quantize_weight(weight, "nf4", method="no_double_quant")["codes"]
    levels = torch.stack((codes >> 4, codes & 15), -1).flatten()
    assert levels[2:17].tolist() == list(range(15))


@pytest.mark.skipif(not HAS_BNB, reason="needs bitsandbytes")
@pytest.mark.parametrize("dtype", DTYPES)
def test_nf4_matches_bitsandbytes_exactly(dtype):
    bnb = _bnb()
    weight = torch.cat([torch.randn(24, 512), _student_t((24, 512)), torch.zeros(1, 512)]).to(dtype)
    mids = (NF4_CODEBOOK[:-1] + NF4_CODEBOOK[1:]) / 2
    weight[-1, 0], weight[-1, 1:16] = 1.0, mids.to(dtype)  # exact ties in fp32, near-ties in bf16 and fp16
    packed, state = bnb.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=False)
    parts = quantize_weight(weight, "nf4", method="no_double_quant")
    assert torch.equal(parts["codes"].reshape(-1), packed.reshape(-1))
    assert torch.equal(parts["absmax"].reshape(-1), state.absmax)
    assert torch.equal(dequantize_weight(parts, "nf4", 64, dtype), bnb.dequantize_4bit(packed, state))


@pytest.mark.skipif(not HAS_BNB, reason="needs bitsandbytes")
def test_nf4_matches_bitsandbytes_at_decision_boundaries():
    bnb = _bnb()
    # Values a few fp32 ulps either side of each boundary (absmax 3, whose reciprocal is inexact): there, dividing
    # by the absmax and multiplying by its reciprocal can pick different levels, so only the same arithmetic agrees.
    absmax = torch.tensor(3.0)
    boundaries = ((NF4_CODEBOOK[:-1] + NF4_CODEBOOK[1:]) / 2) * absmax
    near = [boundaries]
    for direction in (-1.0, 1.0):
        step = boundaries
        for _ in range(2):
            step = torch.nextafter(step, torch.full_like(step, direction * 10))
            near.append(step)
    values = torch.cat(near)  # 75 values
    weight = torch.zeros(2, 64)
    weight[:, 0] = absmax
    weight[0, 1:38], weight[1, 1:39] = values[:37], values[37:]
    scaled = weight / absmax
    assert (
        torch.bucketize(scaled, boundaries / absmax) != torch.bucketize(weight * (1 / absmax), boundaries / absmax)
    ).any()  # the data does hold such a disagreement
    packed, _ = bnb.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=False)
    assert torch.equal(
        quantize_weight(weight, "nf4", method="no_double_quant")["codes"].reshape(-1), packed.reshape(-1)
    )


@pytest.mark.skipif(not HAS_BNB, reason="needs bitsandbytes")
def test_nf4_double_quant_is_close_to_bitsandbytes():
    bnb = _bnb()
    weight = torch.randn(128, 1024) * 0.02
    packed, state = bnb.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)
    theirs = bnb.dequantize_4bit(packed, state)
    ours = dequantize_weight(quantize_weight(weight, "nf4"), "nf4", 64, torch.float32)
    rel = lambda x: ((x - weight).norm() / weight.norm()).item()  # noqa: E731
    # Both double-quantize the absmax; the quantization error should be about the same (measured: ~0.092 each).
    assert rel(ours) <= rel(theirs) * 1.01, (rel(ours), rel(theirs))
    assert ((ours - theirs).norm() / weight.norm()).item() < 0.03
