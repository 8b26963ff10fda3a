"""FP8 quantization (bit-exact against loop references), the scaled-matmul dispatch, Fp8Linear and conversion."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ds_plugin.precision import fp8 as fp8_mod
from ds_plugin.precision.fp8 import (
    ScaledFp8,
    dequantize,
    fp8_dtype,
    fp8_max,
    quantize_activation,
    quantize_blocks,
    quantize_weight,
    scaled_mm,
    scaled_mm_emulated,
)
from ds_plugin.precision.fp8_linear import Fp8Linear, convert_to_fp8_training

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
LIMITS = {E4M3: 448.0, E5M2: 57344.0}


def reference_quantize(x: torch.Tensor, tile: tuple[int, int], dtype: torch.dtype):
    """Tile by tile: scale = max(amax, 1e-12) / fp8_max (1 for an all-zero tile), q = clamp(x / scale)."""
    x = x.float()
    rows, cols = x.shape
    limit = LIMITS[dtype]
    q = torch.empty(rows, cols, dtype=dtype)
    scale_rows = []
    for i in range(0, rows, tile[0]):
        scale_row = []
        for j in range(0, cols, tile[1]):
            part = x[i : i + tile[0], j : j + tile[1]]
            amax = part.abs().max()
            s = torch.tensor(1.0) if amax == 0 else torch.clamp(amax, min=1e-12) / limit
            q[i : i + tile[0], j : j + tile[1]] = torch.clamp(part / s, -limit, limit).to(dtype)
            scale_row.append(s)
        scale_rows.append(torch.stack(scale_row))
    return q, torch.stack(scale_rows)


def reference_dequantize(q: torch.Tensor, scales: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    out = torch.empty(q.shape)
    for bi, i in enumerate(range(0, q.shape[0], tile[0])):
        for bj, j in enumerate(range(0, q.shape[1], tile[1])):
            out[i : i + tile[0], j : j + tile[1]] = q[i : i + tile[0], j : j + tile[1]].float() * scales[bi, bj]
    return out


def assert_bits_equal(q: ScaledFp8, ref_q: torch.Tensor, ref_scale: torch.Tensor) -> None:
    assert q.data.dtype == ref_q.dtype
    assert torch.equal(q.data.view(torch.uint8), ref_q.view(torch.uint8))
    assert q.scale.dtype == torch.float32
    assert torch.equal(q.scale, ref_scale)


def _sample(shape, seed, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    # Outlier rows/columns and an all-zero tile, as real activations have.
    x[0, :] *= 300.0
    x[:, -1] *= 1e-3
    x[-3:, :7] = 0.0
    return x.to(dtype)


RECIPE_TILES = {
    # recipe -> (activation tile, weight tile) as functions of the (rows, cols) shape
    "tensorwise": (lambda r, c: (r, c), lambda r, c: (r, c)),
    "rowwise": (lambda r, c: (1, c), lambda r, c: (1, c)),
    "blockwise": (lambda r, c: (1, 128), lambda r, c: (128, 128)),
}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("shape", [(256, 384), (70, 300), (5, 128)])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_recipe_quantize_matches_loop_reference(recipe, shape, src_dtype, fmt) -> None:
    dtype = fp8_dtype(fmt)
    expected_dtype = E4M3 if recipe == "blockwise" else dtype  # DeepSeek-V3: E4M3 everywhere
    x = _sample(shape, seed=hash((recipe, shape)) % 1000, dtype=src_dtype)
    act_tile, weight_tile = (f(*shape) for f in RECIPE_TILES[recipe])
    for quantize, tile in ((quantize_activation, act_tile), (quantize_weight, weight_tile)):
        q = quantize(x, recipe, dtype)
        ref_q, ref_scale = reference_quantize(x, tile, expected_dtype)
        assert_bits_equal(q, ref_q, ref_scale)
        assert torch.equal(dequantize(q), reference_dequantize(ref_q, ref_scale, tile))
        assert not torch.isnan(dequantize(q)).any()


def test_scale_shapes_per_recipe() -> None:
    x = torch.randn(300, 384)
    assert quantize_activation(x, "tensorwise").scale.numel() == 1
    assert quantize_activation(x, "rowwise").scale.shape == (300, 1)
    assert quantize_activation(x, "blockwise").scale.shape == (300, 3)
    assert quantize_weight(x, "rowwise").scale.shape == (300, 1)
    assert quantize_weight(x, "blockwise").scale.shape == (3, 3)
    assert quantize_weight(x, "rowwise").t().scale.shape == (1, 300)


def test_zeros_quantize_to_exact_zeros_and_saturation() -> None:
    zeros = torch.zeros(4, 256)
    for recipe in ("tensorwise", "rowwise", "blockwise"):
        q = quantize_activation(zeros, recipe)
        assert torch.equal(q.scale, torch.ones_like(q.scale))
        assert torch.equal(dequantize(q), zeros)
    x = torch.tensor([[3.0, -12.0, 0.5, 1e-30]])
    q = quantize_blocks(x, (1, 4), E4M3)
    assert q.scale.item() == pytest.approx(12.0 / 448.0)
    assert q.data.float()[0, 1].item() == -448.0  # the amax element lands exactly on -fp8_max
    assert fp8_max(E4M3) == 448.0 and fp8_max(E5M2) == 57344.0
    with pytest.raises(ValueError, match="e4m3"):
        fp8_dtype("e3m4")


@pytest.mark.parametrize("block", [(1, 128), (128, 1), (128, 128), (1, 64), (70, 300)])
def test_transpose_commutes_with_quantization(block) -> None:
    x = _sample((200, 300), seed=3)
    direct = quantize_blocks(x.t(), (block[1], block[0]))
    transposed = quantize_blocks(x, block).t()
    assert torch.equal(direct.data.view(torch.uint8), transposed.data.contiguous().view(torch.uint8))
    assert torch.equal(direct.scale, transposed.scale)


def _assert_within_fp32_sum_bound(product: torch.Tensor, a, b) -> None:
    """|product - exact| <= K * eps32 * (|a| @ |b|): any fp32 summation order of a tensorwise-scaled fp8 GEMM."""
    scale = a.scale.double() * b.scale.double()
    exact = (a.data.double() @ b.data.double()) * scale
    bound = a.data.shape[1] * torch.finfo(torch.float32).eps * (a.data.double().abs() @ b.data.double().abs()) * scale
    assert ((product.double() - exact).abs() <= bound).all()


def test_emulation_matches_torch_scaled_mm_on_cpu() -> None:
    x, w = _sample((64, 256), seed=1), _sample((96, 256), seed=2)
    a, b = quantize_activation(x, "tensorwise"), quantize_weight(w, "tensorwise").t()
    hw = torch._scaled_mm(a.data, b.data, a.scale.reshape(()), b.scale.reshape(()), out_dtype=torch.float32)
    # Bit-exact where torch's CPU kernel sums in the same order (AVX2 machines); oneDNN's fp8 kernel (AVX-512/AMX)
    # sums in another order, so both must sit within fp32's summation bound of the exact product.
    _assert_within_fp32_sum_bound(scaled_mm_emulated(a, b), a, b)
    _assert_within_fp32_sum_bound(hw, a, b)
    a, b = quantize_activation(x, "rowwise"), quantize_weight(w, "rowwise").t()
    try:
        hw = torch._scaled_mm(a.data, b.data, a.scale, b.scale, out_dtype=torch.float32)
    except RuntimeError as e:  # torch 2.11's CPU kernel takes per-tensor scales only: the dequantized product
        assert "per-tensor" in str(e), e
        hw = (a.data.float() * a.scale) @ (b.data.float() * b.scale)
    torch.testing.assert_close(scaled_mm_emulated(a, b), hw, rtol=1e-5, atol=1e-5)
    assert scaled_mm_emulated(a, b, torch.bfloat16).dtype == torch.bfloat16


def test_blockwise_emulation_equals_dequantized_fp32_product() -> None:
    x, w = _sample((130, 384), seed=4), _sample((256, 384), seed=5)
    xq, xs = reference_quantize(x, (1, 128), E4M3)
    wq, ws = reference_quantize(w, (128, 128), E4M3)
    expected = reference_dequantize(xq, xs, (1, 128)) @ reference_dequantize(wq, ws, (128, 128)).t()
    got = scaled_mm(quantize_activation(x, "blockwise"), quantize_weight(w, "blockwise").t())
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)


def test_dispatch_uses_emulation_on_cpu(monkeypatch) -> None:
    def forbidden(*args, **kwargs):
        raise AssertionError("_scaled_mm must not run on CPU tensors")

    monkeypatch.setattr(torch, "_scaled_mm", forbidden)
    a = quantize_activation(torch.randn(32, 64), "tensorwise")
    b = quantize_weight(torch.randn(48, 64), "tensorwise").t()
    assert scaled_mm(a, b).shape == (32, 48)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_hardware_path_layouts_run_on_cpu_scaled_mm(monkeypatch, recipe) -> None:
    # Pretend the CPU is fp8 hardware: the dispatch's own operand/scale layouts must satisfy _scaled_mm.
    monkeypatch.setattr(fp8_mod, "_hardware_ok", lambda a, b, kinds: True)
    monkeypatch.setattr(fp8_mod, "_UNSUPPORTED", set())
    calls = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, w = _sample((64, 256), seed=6), _sample((96, 256), seed=7)
    a, b = quantize_activation(x, recipe), quantize_weight(w, recipe).t()
    got = scaled_mm(a, b, torch.float32)
    assert calls
    if recipe == "tensorwise":
        _assert_within_fp32_sum_bound(got, a, b)
    else:  # rowwise asks the kernel for bf16, as on CUDA
        torch.testing.assert_close(got, scaled_mm_emulated(a, b), rtol=1e-2, atol=1e-1)


def test_hardware_failure_falls_back_to_emulation_once(monkeypatch, caplog) -> None:
    monkeypatch.delenv("DS_PLUGIN_STRICT_KERNELS", raising=False)  # strict mode raises instead (below)
    monkeypatch.setattr(fp8_mod, "_hardware_ok", lambda a, b, kinds: True)
    monkeypatch.setattr(fp8_mod, "_UNSUPPORTED", set())
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("Invalid scaling configuration")

    monkeypatch.setattr(torch, "_scaled_mm", broken)
    a = quantize_activation(torch.randn(128, 256), "blockwise")
    b = quantize_weight(torch.randn(128, 256), "blockwise").t()
    with caplog.at_level(logging.WARNING, logger="ds_plugin.precision.fp8"):
        first = scaled_mm(a, b)
        second = scaled_mm(a, b)
    assert len(calls) == 1 and "emulation" in caplog.text
    assert torch.equal(first, scaled_mm_emulated(a, b)) and torch.equal(first, second)


def test_strict_kernels_make_a_hardware_failure_an_error(monkeypatch) -> None:
    # DS_PLUGIN_STRICT_KERNELS=1 (the GPU checks): no silent emulation to be timed as FP8.
    from ds_plugin.quant import KernelLaunchError

    monkeypatch.setenv("DS_PLUGIN_STRICT_KERNELS", "1")
    monkeypatch.setattr(fp8_mod, "_hardware_ok", lambda a, b, kinds: True)
    monkeypatch.setattr(fp8_mod, "_UNSUPPORTED", set())

    def broken(*args, **kwargs):
        raise RuntimeError("Invalid scaling configuration")

    monkeypatch.setattr(torch, "_scaled_mm", broken)
    a = quantize_activation(torch.randn(128, 256), "blockwise")
    b = quantize_weight(torch.randn(128, 256), "blockwise").t()
    with pytest.raises(KernelLaunchError, match=r"^torch._scaled_mm failed for .*Invalid scaling configuration"):
        scaled_mm(a, b)


def test_blockwise_hardware_scale_layouts() -> None:
    # torch's ScaledBlas.cpp: 1x128 lhs scale (M, K/128) with strides (1, M); 128x128 lhs scale row-major; the
    # rhs is checked as b.t() against scale_b.t().
    m, k, n = 256, 384, 512
    a = quantize_activation(torch.randn(m, k), "blockwise")
    w = quantize_weight(torch.randn(n, k), "blockwise")
    sa, sb = fp8_mod._hardware_scales(a, w.t(), ("1x128", "128x128"))
    assert sa.shape == (m, k // 128) and sa.stride() == (1, m)
    assert sb.t().shape == (n // 128, k // 128) and sb.t().stride() == (k // 128, 1)
    dy = quantize_blocks(torch.randn(k, m), (128, 1)).t()  # wgrad lhs: 1x128 tiles along the tokens
    x = quantize_blocks(torch.randn(k, n), (128, 1))
    sa, sb = fp8_mod._hardware_scales(dy, x, ("1x128", "1x128"))
    assert sa.shape == (m, k // 128) and sa.stride() == (1, m)
    assert sb.t().shape == (n, k // 128) and sb.t().stride() == (1, n)
    assert torch.equal(sa, dy.scale) and torch.equal(sb, x.scale)


def test_scaling_pairing_per_gemm() -> None:
    x, w = torch.randn(256, 128), torch.randn(384, 128)
    pick = fp8_mod._pick_kinds
    assert pick(quantize_activation(x, "tensorwise"), quantize_weight(w, "tensorwise").t()) == ("tensor", "tensor")
    assert pick(quantize_activation(x, "rowwise"), quantize_weight(w, "rowwise").t()) == ("row", "row")
    # K == 128: a 1x128 activation tile is also a whole row; the pairing with 128x128 weights must still be found.
    assert pick(quantize_activation(x, "blockwise"), quantize_weight(w, "blockwise").t()) == ("1x128", "128x128")
    dy = torch.randn(256, 384)
    dgrad = pick(quantize_blocks(dy, (1, 128)), quantize_weight(w, "blockwise"))
    wgrad = pick(quantize_blocks(dy, (128, 1)).t(), quantize_blocks(x, (128, 1)))
    assert dgrad == ("1x128", "128x128") and wgrad == ("1x128", "1x128")
    assert pick(quantize_blocks(x, (1, 64)), quantize_weight(w, "blockwise").t()) is None


# ----------------------------------------------------------------------------------------------- Fp8Linear


def _reference_linear_grads(x, w, b, dy, recipe, grad_dtype):
    """The three GEMMs composed from the loop reference quantizers, with the scaling axes Fp8Linear documents."""
    m, k = x.shape
    n = w.shape[0]
    tiles = {
        "tensorwise": dict(x=(m, k), w=(n, k), dy=(m, n), wd=(n, k), dyw=(m, n), xw=(m, k)),
        "rowwise": dict(x=(1, k), w=(1, k), dy=(1, n), wd=(n, 1), dyw=(m, 1), xw=(m, 1)),
        "blockwise": dict(x=(1, 128), w=(128, 128), dy=(1, 128), wd=(128, 128), dyw=(128, 1), xw=(128, 1)),
    }[recipe]
    gd = E4M3 if recipe == "blockwise" else grad_dtype

    def qd(t, tile, dtype=E4M3):
        return reference_dequantize(*reference_quantize(t, tile, dtype), tile)

    y = qd(x, tiles["x"]) @ qd(w, tiles["w"]).t() + b
    dx = qd(dy, tiles["dy"], gd) @ qd(w, tiles["wd"])
    dw = qd(dy, tiles["dyw"], gd).t() @ qd(x, tiles["xw"])
    return y, dx, dw, dy.sum(0)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("gradient_format", ["e4m3", "e5m2"])
def test_fp8_linear_equals_reference_composition(recipe, gradient_format) -> None:
    torch.manual_seed(0)
    layer = Fp8Linear(256, 384, recipe=recipe, gradient_format=gradient_format)
    x = _sample((200, 256), seed=8).requires_grad_()
    dy = _sample((200, 384), seed=9) * 1e-3
    y = layer(x)
    y.backward(dy)
    ry, rdx, rdw, rdb = _reference_linear_grads(
        x.detach(), layer.weight.detach(), layer.bias.detach(), dy, recipe, fp8_dtype(gradient_format)
    )
    torch.testing.assert_close(y, ry, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, rdx, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(layer.weight.grad, rdw, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(layer.bias.grad, rdb, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_fp8_linear_close_to_fp32_linear(recipe) -> None:
    torch.manual_seed(1)
    ref = nn.Linear(256, 384)
    layer = Fp8Linear.from_linear(ref, recipe)
    assert layer.weight is ref.weight and layer.bias is ref.bias
    x = torch.randn(4, 50, 256)
    x_ref, x_fp8 = x.clone().requires_grad_(), x.clone().requires_grad_()
    dy = torch.randn(4, 50, 384)
    y_ref = ref(x_ref)
    y_ref.backward(dy)
    grads_ref = (x_ref.grad, ref.weight.grad.clone(), ref.bias.grad.clone())
    ref.zero_grad()
    y = layer(x_fp8)
    y.backward(dy)
    assert y.shape == y_ref.shape and y.dtype == torch.float32

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    # E4M3 keeps 3 mantissa bits: ~3.6% relative rounding noise per operand on random data; e5m2 grads (the
    # tensorwise default) ~6%.
    grad_tol = 0.08 if recipe == "tensorwise" else 0.05
    assert rel(y, y_ref) < 0.05
    assert rel(x_fp8.grad, grads_ref[0]) < grad_tol
    assert rel(ref.weight.grad, grads_ref[1]) < grad_tol
    torch.testing.assert_close(ref.bias.grad, grads_ref[2])


def test_fp8_linear_dtypes_under_autocast_and_bf16() -> None:
    layer = Fp8Linear(128, 256, bias=False, recipe="blockwise")
    x = torch.randn(8, 128, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32
    bf16_layer = Fp8Linear(128, 256, recipe="rowwise", dtype=torch.bfloat16)
    xb = torch.randn(2, 3, 128, dtype=torch.bfloat16, requires_grad=True)
    yb = bf16_layer(xb)
    assert yb.dtype == torch.bfloat16 and yb.shape == (2, 3, 256)
    yb.sum().backward()
    assert xb.grad.dtype == torch.bfloat16 and bf16_layer.weight.grad.dtype == torch.bfloat16
    assert bf16_layer.bias.grad.dtype == torch.bfloat16
    assert "recipe=rowwise" in repr(bf16_layer)


def test_blockwise_ignores_e5m2_and_rejects_bad_recipe() -> None:
    assert Fp8Linear(128, 128, recipe="blockwise", gradient_format="e5m2").gradient_format == "e4m3"
    assert Fp8Linear(128, 128, recipe="tensorwise").gradient_format == "e5m2"
    with pytest.raises(ValueError, match="recipe"):
        Fp8Linear(128, 128, recipe="mxfp8")


# ----------------------------------------------------------------------------------------------- conversion


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(128)
        self.q_proj = nn.Linear(128, 128)
        self.small = nn.Linear(128, 48)  # multiple of 16, not of 128
        self.odd = nn.Linear(128, 100)  # multiple of neither
        self.attn = nn.MultiheadAttention(128, 4)  # out_proj is a Linear subclass whose forward is never called


class _TinyLM(nn.Module):
    def __init__(self, head_name: str = "lm_head") -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 128)
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.head_name = head_name
        self.add_module(head_name, nn.Linear(128, 256, bias=False))

    def get_output_embeddings(self) -> nn.Module:
        return getattr(self, self.head_name)


def _converted(model: nn.Module) -> set[str]:
    return {name for name, m in model.named_modules() if isinstance(m, Fp8Linear)}


def test_convert_picks_eligible_layers_per_recipe() -> None:
    model = _TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    q_weight = model.layers[0].q_proj.weight
    assert convert_to_fp8_training(model, "tensorwise") is model
    assert _converted(model) == {f"layers.{i}.{n}" for i in (0, 1) for n in ("q_proj", "small")}
    assert model.layers[0].q_proj.weight is q_weight  # the optimizer still owns the same parameter
    assert isinstance(model.embed, nn.Embedding) and type(model.lm_head) is nn.Linear
    assert type(model.layers[0].attn.out_proj) is not Fp8Linear
    before = q_weight.detach().clone()
    model.layers[0].q_proj(torch.randn(4, 128)).sum().backward()
    optimizer.step()
    assert not torch.equal(before, q_weight)

    blockwise = convert_to_fp8_training(_TinyLM(), "blockwise")
    assert _converted(blockwise) == {"layers.0.q_proj", "layers.1.q_proj"}
    assert all(m.recipe == "blockwise" for m in blockwise.modules() if isinstance(m, Fp8Linear))


def test_convert_output_embeddings_skip_modules_and_filter() -> None:
    model = convert_to_fp8_training(_TinyLM(head_name="proj_out"), "tensorwise")
    assert type(model.proj_out) is nn.Linear  # found through get_output_embeddings()
    config = SimpleNamespace(recipe="rowwise", gradient_format="e5m2", skip_modules=("layers.1",), all_gather=True)
    model = convert_to_fp8_training(_TinyLM(), config)
    assert _converted(model) == {"layers.0.q_proj", "layers.0.small"}
    assert model.layers[0].q_proj.gradient_format == "e5m2"
    model = convert_to_fp8_training(
        _TinyLM(), "tensorwise", module_filter_fn=lambda name, m: "q_proj" in name or "lm" in name
    )
    assert _converted(model) == {"layers.0.q_proj", "layers.1.q_proj", "lm_head"}


def test_convert_bare_linear_and_shared_module() -> None:
    assert isinstance(convert_to_fp8_training(nn.Linear(64, 32), "rowwise"), Fp8Linear)
    shared = nn.Linear(128, 128)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    convert_to_fp8_training(model, "blockwise")
    assert isinstance(model[0], Fp8Linear) and model[0] is model[2]


def test_convert_without_eligible_layer_raises() -> None:
    with pytest.raises(ValueError, match=r"no nn.Linear in Sequential is eligible .*multiples of 16") as info:
        convert_to_fp8_training(nn.Sequential(nn.Linear(10, 30), nn.Linear(30, 7)), "tensorwise")
    assert "\n" not in str(info.value) and "make in/out features multiples of 16" in str(info.value)
    with pytest.raises(ValueError, match=r"multiples of 128, or use recipe='tensorwise'"):
        convert_to_fp8_training(nn.Sequential(nn.Linear(64, 64)), "blockwise")
    with pytest.raises(ValueError, match=r"7 seen: 0 with .* 7 excluded .*pass module_filter_fn="):
        convert_to_fp8_training(_TinyLM(), SimpleNamespace(recipe="tensorwise", skip_modules=("layers",)))
    with pytest.raises(ValueError, match="it has none"):
        convert_to_fp8_training(nn.Sequential(nn.Embedding(4, 16), nn.LayerNorm(16)), "tensorwise")
    with pytest.raises(ValueError, match="recipe"):
        convert_to_fp8_training(nn.Linear(16, 16), "int8")
