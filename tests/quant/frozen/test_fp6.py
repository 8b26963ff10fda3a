"""FP6 e3m2: the 64 codes, round-to-nearest-even, the bit-plane packing, and the ``fp6`` frozen-weight format."""

from __future__ import annotations

import pytest
import torch

from ds_plugin.quant.frozen import fp6
from ds_plugin.quant.frozen.codecs import check_weight, dequantize_weight, quantize_weight, weight_nbytes


def test_the_64_codes_are_e3m2():
    v = fp6.E3M2_VALUES
    assert v.shape == (64,) and torch.equal(v[32:], -v[:32])
    assert v[31] == 28.0 == fp6.E3M2_MAX and v[4] == 0.25 == fp6.E3M2_MIN_NORMAL
    assert v[:4].tolist() == [0.0, 0.0625, 0.125, 0.1875]  # subnormals: mantissa / 16
    assert torch.signbit(v[32]) and v[32] == 0  # -0
    assert bool((v[1:32].diff() > 0).all())  # no inf/nan, strictly increasing magnitudes
    for e in range(1, 8):  # normals: 2^(e - 3) * (1 + m / 4)
        assert v[4 * e : 4 * e + 4].tolist() == [2.0 ** (e - 3) * (1 + m / 4) for m in range(4)]


def test_every_code_round_trips():
    codes = torch.arange(64, dtype=torch.uint8)
    assert torch.equal(fp6.encode_e3m2(fp6.decode_e3m2(codes)), codes)


def _nearest_even(values: torch.Tensor) -> torch.Tensor:
    """Brute force: the nearest of the 32 magnitudes, a tie going to the even code, the sign put back."""
    mags = fp6.E3M2_VALUES[:32].double()
    a = values.double().abs().clamp(max=28.0)
    dist = (a[:, None] - mags[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    tied = dist == best
    # Of the (at most two) nearest codes, the even one; codes are ordered by magnitude, so its mantissa is even.
    even = tied & (torch.arange(32) % 2 == 0)
    pick = torch.where(even.any(dim=1), even.double().argmax(dim=1), tied.double().argmax(dim=1))
    return pick.to(torch.uint8) | (torch.signbit(values).to(torch.uint8) << 5)


def test_rounding_is_nearest_ties_to_even():
    g = torch.Generator().manual_seed(0)
    mags = fp6.E3M2_VALUES[:32]
    midpoints = (mags[:-1] + mags[1:]) / 2  # every tie, including the binade and subnormal edges
    values = torch.cat(
        [
            torch.randn(20000, generator=g) * 10.0 ** torch.randint(-3, 2, (20000,), generator=g),
            midpoints,
            -midpoints,
            torch.tensor([30.0, -1e6, 28.0, 1e-9, -1e-9, 0.0, -0.0, 0.03125, 0.0937, 0.09375]),
        ]
    )
    assert torch.equal(fp6.encode_e3m2(values), _nearest_even(values))
    assert fp6.decode_e3m2(fp6.encode_e3m2(torch.tensor([0.28125, 7.5, 26.0, 22.0, 1e3]))).tolist() == [
        0.25,  # tie between mantissas 0 and 1: even
        8.0,  # a tie that carries into the next binade
        24.0,
        24.0,
        28.0,  # clamped, never inf
    ]


def test_packing_is_a_bijection():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 64, (7, 96), generator=g, dtype=torch.uint8)
    packed = fp6.pack_fp6(codes)
    assert packed.shape == (7, 72) and packed.dtype == torch.uint8 and fp6.packed_cols(96) == 72
    assert torch.equal(fp6.unpack_fp6(packed), codes)
    raw = torch.randint(0, 256, (5, 48), generator=g, dtype=torch.uint8)  # any bytes are some codes
    assert torch.equal(fp6.pack_fp6(fp6.unpack_fp6(raw)), raw)
    # Rows are independent, and a strided row view unpacks like a contiguous copy.
    wide = torch.cat([packed, torch.zeros(7, 8, dtype=torch.uint8)], dim=1)[:, :72]
    assert torch.equal(fp6.unpack_fp6(wide), codes)
    with pytest.raises(ValueError, match="chunks of 16"):
        fp6.pack_fp6(codes[:, :40])


@pytest.mark.parametrize("k", range(16))
def test_bit_positions_are_as_documented(k):
    # One code set to 0b111111 in a 16-code chunk: its 4 nibble bits and its e2 / sign bits, where the docs say.
    codes = torch.zeros(1, 16, dtype=torch.uint8)
    codes[0, k] = 63
    packed = fp6.pack_fp6(codes)[0].long()
    u, t, h = k // 8, (k % 8) // 2, k % 2
    nibble_word = sum(int(packed[4 * u + j]) << (8 * j) for j in range(4))
    top_word = sum(int(packed[8 + j]) << (8 * j) for j in range(4))
    assert nibble_word == 0xF << (4 * t + 16 * h)
    assert top_word == (1 << (4 * u + t + 16 * h)) | (1 << (8 + 4 * u + t + 16 * h))
    assert int(packed[4 * (1 - u) : 4 * (1 - u) + 4].sum()) == 0


def test_fp6_weight_format():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 256, generator=g) * torch.rand(64, 1, generator=g) * 3
    w[3, :128] = 0.0  # an all-zero group: scale 1, zero codes
    parts = quantize_weight(w, "fp6")
    assert list(parts) == ["codes", "scales"]
    assert parts["codes"].shape == (64, 192) and parts["scales"].shape == (64, 2)
    assert parts["scales"].dtype == torch.bfloat16 and parts["scales"][3, 0] == 1
    assert weight_nbytes((64, 256), "fp6") == sum(t.numel() * t.element_size() for t in parts.values())
    assert weight_nbytes((4096, 4096), "fp6") / (4096 * 4096 * 2) == pytest.approx(0.3828, abs=1e-4)
    out = dequantize_weight(parts, "fp6", 128, torch.float32)
    assert ((out - w).norm() / w.norm()).item() < 0.06
    # The scale is amax / 28 rounded up to bf16, so the largest element maps to at most 28: nothing clips.
    scaled = w.view(64, 2, 128).abs().amax(-1) / parts["scales"].float()
    assert bool((scaled <= 28).all()) and bool((scaled > 27.7).any())
    # The row contract: a row slice's components are the slice of the whole's, bit for bit.
    piece = quantize_weight(w[10:30], "fp6")
    assert all(torch.equal(piece[n], parts[n][10:30]) for n in parts)
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(dequantize_weight(parts, "fp6", 128, dtype), out.to(dtype))


def test_fp6_group_sizes_and_errors():
    w = torch.randn(8, 96)
    for group in (16, 32, 96):
        parts = quantize_weight(w, "fp6", group)
        assert parts["scales"].shape == (8, 96 // group)
    with pytest.raises(ValueError, match="multiple of 16") as info:
        check_weight("fp6", (8, 96), 24)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="K=100"):
        check_weight("fp6", (8, 100), 32)
    with pytest.raises(ValueError, match="3 bytes per 4"):
        dequantize_weight({"codes": torch.zeros(8, 70, dtype=torch.uint8)}, "fp6", 16, torch.float32)
