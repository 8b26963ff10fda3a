"""The fp6 / int4 / int8 GEMM kernels and the ``ds_plugin::quantized_linear`` op, against their torch references.

On CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET`` set per test; the kernels are jitted per
mode): tiny shapes, a few tilings chosen to hit M = 1, odd M, N not a multiple of the tile, K not a multiple of
BLOCK_K, split-K and both ways of scaling. Interpreted bf16 rounds by truncation where compiled kernels round to
nearest, so outputs are held to one rounding of W and one of y (``_check``); the GPU tests compare compiled kernels
the same way, on the shapes and tilings they run for real.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from ds_plugin.env import _interpreter_row
from ds_plugin.kernels import quant_linear_reference as ref
from ds_plugin.kernels import quant_linear_tilings
from ds_plugin.kernels import quant_linear_triton as qlt
from ds_plugin.quant import KernelLaunchError, strict_kernels
from ds_plugin.quant.frozen import linear_op
from ds_plugin.quant.frozen.codecs import dequantize_weight, quantize_weight

FORMATS = ["fp6", "int4", "int8"]
DTYPES = [torch.bfloat16, torch.float16]
# Two roundings, of W's element and of y's: an ulp each (2^-7 relative) for bf16, which the interpreter truncates;
# half an ulp each (2^-11) for fp16, which it rounds to nearest like compiled kernels.
EPS = {torch.bfloat16: 2.0**-6, torch.float16: 2.0**-10}
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def interpreter(monkeypatch):
    if problem := qlt.interpreter_problem():
        pytest.skip(problem)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert qlt.interpreter_enabled()


@pytest.fixture
def compiled(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _parts(fmt: str, n: int, k: int, group: int, seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-1, 1, n)[:, None]  # rows of different magnitudes
    return {name: t.to(device) for name, t in quantize_weight(w, fmt, group).items()}


def _args(fmt: str, parts: dict[str, torch.Tensor]) -> tuple:
    return parts["codes"], parts["scales"], parts.get("zeros")


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """``got`` is ``x @ w.T + bias`` up to one rounding of each weight and of the output, in x's dtype."""
    want = x.float() @ w.float().T + (0 if bias is None else bias.float())
    bound = EPS[x.dtype] * (x.float().abs() @ w.float().abs().T + (0 if bias is None else bias.float().abs()))
    assert got.dtype == x.dtype and got.shape == want.shape
    excess = ((got.float() - want).abs() - bound - 1e-6).max().item()
    assert excess <= 0, excess


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_references_equal_the_format_bit_for_bit(fmt):
    # Two readings of the layouts: the kernels' bit operations (in torch) and the format's own unpacking.
    group = 64 if fmt == "int4" else 32
    parts = _parts(fmt, 24, 192, group)
    for dtype in (*DTYPES, torch.float32):
        want = dequantize_weight(parts, fmt, group, dtype)
        got = ref.dequantize_reference(fmt, *_args(fmt, parts), group, 192, dtype)
        if dtype != torch.float32:  # the GEMM reference on the same weight
            x = torch.randn(3, 192).to(dtype)
            assert torch.equal(ref.linear_reference(x, fmt, *_args(fmt, parts), group, None), F.linear(x, want))
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        assert got.dtype == dtype and torch.equal(got.view(bits), want.view(bits)), dtype


# (M, N, K, group, tiling): the interpreted tiling is 16 x 32 x 32; N = 40 leaves a partial column tile.
FORWARD_CASES = [
    (1, 40, 96, 32, None),  # post-scaled tiles, one group each
    (5, 40, 96, 32, qlt.Config(16, 32, 64, post_scale=False)),  # K = 96 is not a multiple of BLOCK_K = 64
    (17, 24, 64, 16, qlt.Config(16, 32, 32, split_k=2)),  # two row tiles; BLOCK_K cut to the group of 16; split-K
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_interpreted_forward_matches_reference(interpreter, fmt, dtype):
    for m, n, k, group, config in FORWARD_CASES:
        parts = _parts(fmt, n, k, group, seed=m)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        bias = torch.randn(n) if m == 1 else None
        got = qlt.linear_forward(x, fmt, *_args(fmt, parts), group, bias, config=config)
        _check(got, x, dequantize_weight(parts, fmt, group, torch.float32), bias)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_interpreted_backward_matches_reference(interpreter, fmt, dtype):
    # N = 40 is the reduction here: a partial 32-row step; K = 96 against 64-wide output tiles in the second case.
    for m, config in ((1, None), (5, qlt.Config(16, 32, 64))):
        parts = _parts(fmt, 40, 96, 32, seed=m)
        dy = torch.randn(m, 40, generator=torch.Generator().manual_seed(m)).to(dtype)
        got = qlt.linear_backward(dy, fmt, *_args(fmt, parts), 32, 96, config=config)
        _check(got, dy, dequantize_weight(parts, fmt, 32, torch.float32).T)


def _gathered(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The components as FSDP2's all-gather leaves them (``QuantizedWeight.fsdp_post_all_gather``): strided views
    into one byte buffer, widest first, so the codes start 2 * K / group bytes in (here off 4-byte alignment)."""
    rows = parts["codes"].shape[0]
    names = sorted(parts, key=lambda n: -parts[n].element_size())
    cols = [parts[n].contiguous().view(torch.uint8).view(rows, -1) for n in names]
    width = sum(c.shape[1] for c in cols)
    packed = torch.cat([*cols, torch.zeros(rows, -width % 4, dtype=torch.uint8)], dim=1)
    out, offset = {}, 0
    for name, col in zip(names, cols, strict=True):
        out[name] = packed[:, offset : offset + col.shape[1]].view(parts[name].dtype)
        offset += col.shape[1]
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_interpreted_kernels_read_gathered_views(interpreter, fmt):
    parts = _parts(fmt, 40, 96, 32)
    views = _gathered(parts)
    assert not views["codes"].is_contiguous() and views["codes"].data_ptr() % 4  # 3 bf16 scales: 6 bytes in
    x = torch.randn(3, 96).half()
    want = qlt.linear_forward(x, fmt, *_args(fmt, parts), 32)
    assert torch.equal(qlt.linear_forward(x, fmt, *_args(fmt, views), 32), want)
    _check(want, x, ref.dequantize_reference(fmt, *_args(fmt, views), 32, 96, torch.float32))
    dy = torch.randn(3, 40).half()
    _check(
        qlt.linear_backward(dy, fmt, *_args(fmt, views), 32, 96),
        dy,
        ref.linear_backward_reference(torch.eye(40), fmt, *_args(fmt, views), 32, 96).T,
    )
    assert torch.equal(
        ref.dequantize_reference(fmt, *_args(fmt, views), 32, 96, x.dtype), dequantize_weight(parts, fmt, 32, x.dtype)
    )


def _delta(before: dict, after: dict) -> dict:
    return {key: n - before.get(key, 0) for key, n in after.items() if n != before.get(key, 0)}


def test_the_op_runs_the_kernels_under_the_interpreter_with_autograd(interpreter, monkeypatch):
    monkeypatch.setattr(linear_op, "_state", linear_op._new_state())
    parts = _parts("fp6", 40, 96, 32)
    launches = linear_op.kernel_launches()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 96, generator=g).bfloat16().requires_grad_()
    bias = torch.randn(40, generator=g, requires_grad=True)
    y = linear_op.quantized_linear(x, linear_op.parts_list("fp6", parts), "fp6", 32, bias)
    w = dequantize_weight(parts, "fp6", 32, torch.float32)
    _check(y.view(6, 40), x.detach().view(6, 96), w, bias.detach())
    dy = torch.randn(2, 3, 40, generator=g).bfloat16()
    y.backward(dy)
    # Counted after each launch returned, one per op call here (the interpreter does not autotune).
    assert _delta(launches, linear_op.kernel_launches()) == {("fwd", "fp6"): 1, ("bwd", "fp6"): 1}
    assert linear_op.backend_calls() == {("fwd", "fp6", "triton"): 1, ("bwd", "fp6", "triton"): 1}
    assert linear_op.last_backend() == "triton"
    _check(x.grad.view(6, 96), dy.view(6, 40), w.T)
    torch.testing.assert_close(bias.grad, dy.float().sum((0, 1)), rtol=2**-7, atol=2**-5)  # a bf16 sum


def test_dispatch_rules(monkeypatch):
    x = torch.randn(2, 64).bfloat16()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert linear_op.kernel_backend(x, "fp6", 64, 16) is None  # CPU: the reference
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert linear_op.kernel_backend(x, "fp6", 64, 16) is qlt
    assert linear_op.kernel_backend(x, "nf4", 64, 16) is None  # NF4 stays on the reference
    assert linear_op.kernel_backend(x.float(), "int8", 64, 16) is None  # fp32 activations: the reference
    with linear_op.reference_only(), linear_op.reference_only():  # nested: the reference until the outer one ends
        assert linear_op.kernel_backend(x, "fp6", 64, 16) is None
    assert linear_op.kernel_backend(x, "fp6", 64, 16) is qlt
    assert not qlt.supports("int4", torch.bfloat16, 36, 12)  # codes are read as 32-bit words: K % 8
    assert qlt.supports("int8", torch.float16, 36, 12)


class _Broken:
    """A kernel module whose every launch fails, as a Triton or driver these kernels never met would."""

    @staticmethod
    def forward_configs(*args):
        return [None]

    @staticmethod
    def backward_configs(*args):
        return [None]

    @staticmethod
    def linear_forward(*args, **kwargs):
        raise RuntimeError("no such device feature")

    linear_backward = linear_forward


@pytest.fixture
def broken_kernels(monkeypatch):
    monkeypatch.setattr(linear_op, "kernel_backend", lambda t, fmt, *a: None if fmt == "nf4" else _Broken)
    monkeypatch.setattr(linear_op, "interpreter_requested", lambda: False)
    monkeypatch.setattr(linear_op, "_state", linear_op._new_state())


def test_a_failing_first_launch_falls_back_to_the_reference(broken_kernels, monkeypatch, caplog):
    monkeypatch.delenv("DS_PLUGIN_STRICT_KERNELS", raising=False)
    parts = _parts("int8", 8, 32, 32)
    x = torch.randn(2, 32)
    launches = linear_op.kernel_launches()
    y = linear_op.quantized_linear(x, linear_op.parts_list("int8", parts), "int8", 32, None)
    assert torch.equal(y, F.linear(x, dequantize_weight(parts, "int8", 32, torch.float32)))
    assert ("fwd", "int8", torch.float32) in linear_op._state["failed"] and "first use" in caplog.text
    # What ran is on record: the reference served the call and no kernel launch returned.
    assert linear_op.backend_calls() == {("fwd", "int8", "reference"): 1}
    assert linear_op.last_backend() == "reference" and linear_op.kernel_launches() == launches


def test_strict_kernels_turn_a_failing_launch_into_an_error(broken_kernels, monkeypatch):
    monkeypatch.setenv("DS_PLUGIN_STRICT_KERNELS", "1")
    parts = _parts("int4", 8, 64, 32)
    tensors = linear_op.parts_list("int4", parts)
    x = torch.randn(2, 64).bfloat16()
    pattern = r"^quantized_linear: the fwd Triton kernel failed for int4 weights with bfloat16 activations: "
    with pytest.raises(KernelLaunchError, match=pattern + r"RuntimeError: no such device feature \(DS_PLUGIN_STRICT"):
        linear_op.quantized_linear(x, tensors, "int4", 32, None)
    with pytest.raises(KernelLaunchError, match=r"^quantized_linear_grad_input: the bwd Triton kernel failed for int4"):
        linear_op.quantized_linear_grad_input(torch.randn(2, 8).half(), tensors, "int4", 32, 64)
    assert linear_op.backend_calls() == {} and linear_op.last_backend() is None
    # A combination that failed before strict mode was asked for is tried again, not left on the reference.
    monkeypatch.delenv("DS_PLUGIN_STRICT_KERNELS")
    linear_op.quantized_linear(x, tensors, "int4", 32, None)
    monkeypatch.setenv("DS_PLUGIN_STRICT_KERNELS", "1")
    with pytest.raises(KernelLaunchError, match="no such device feature"):
        linear_op.quantized_linear(x, tensors, "int4", 32, None)


def test_strict_kernels_fail_the_gpu_tiers_path(broken_kernels, monkeypatch):
    # The gpu tier's frozen-Linear path (QuantizedWeight's F.linear into the op): an error, not the reference.
    from ds_plugin import quantize_frozen_

    monkeypatch.setenv("DS_PLUGIN_STRICT_KERNELS", "1")
    layer = torch.nn.Linear(64, 16, dtype=torch.bfloat16).requires_grad_(False)
    quantize_frozen_(layer, "fp6", group_size=32, filter_fn=lambda m, name: True)
    with pytest.raises(KernelLaunchError, match="fp6 weights with bfloat16 activations"):
        layer(torch.randn(3, 64, dtype=torch.bfloat16))


TRITON_TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int8: "i8",
    torch.uint8: "u8",
}
TRITON_TYPES |= {torch.int16: "i16", torch.int32: "i32"}


@pytest.mark.gpu
def test_the_gpu_tier_runs_strict():
    # tests/conftest.py sets DS_PLUGIN_STRICT_KERNELS=1 for every gpu-marked test (this one runs on CPU too).
    assert strict_kernels()


def test_a_launch_is_specialised_as_its_arguments_are(compiled, monkeypatch):
    # The signature Triton compiles a launch to is read from the launch's own arguments: each pointer typed by the
    # tensor actually passed (bias or its placeholder, int4 zeros or the placeholder, the split-K fp32 buffer), every
    # tl.constexpr parameter a constexpr (a kernel rebuilt without its annotations got BM as an i32 and could not
    # compile), nothing but M left unspecialised.
    pytest.importorskip("triton.backends.nvidia")
    launched = []
    monkeypatch.setattr(qlt.Launch, "run", lambda self: launched.append(self))
    n, k = 64, 256
    cases = [("int4", torch.bfloat16, 1, True), ("int4", torch.float16, 2, False), ("int8", torch.bfloat16, 1, False),
             ("fp6", torch.float16, 2, True)]  # fmt: skip
    for fmt, dtype, split_k, with_bias in cases:
        parts = _parts(fmt, n, k, 64)
        bias = torch.randn(n).to(dtype) if with_bias else None
        config = qlt.Config(16, 32, 64, split_k=split_k)
        qlt.linear_forward(torch.randn(5, k).to(dtype), fmt, *_args(fmt, parts), 64, bias, config=config)
        qlt.linear_backward(torch.randn(5, n).to(dtype), fmt, *_args(fmt, parts), 64, k, config=qlt.Config(16, 32, 64))
    assert len(launched) == 2 * len(cases)
    for launch in launched:
        signature, constexprs, _, options = launch.specialisation(90)
        params = list(signature)
        tensors = {p: a for p, a in zip(params, launch.args, strict=False) if isinstance(a, torch.Tensor)}
        for p, t in tensors.items():
            assert signature[p] == "*" + TRITON_TYPES[t.dtype], (p, t.dtype)
        names = {params[i]: v for (i,), v in constexprs.items()}
        assert {p for p in params if signature[p] == "constexpr"} == set(launch.constexprs), signature
        assert all(names[p] == v for p, v in launch.constexprs.items())
        assert signature["M"] == "i32" and options.num_warps == launch.options["num_warps"]
        if launch.kind == "fwd":
            assert names["HAS_BIAS"] == (signature["b_ptr"] != "*i16")
            assert signature["y_ptr"] == ("*fp32" if names["SPLIT_K"] > 1 else signature["x_ptr"])
            assert signature["z_ptr"] == ("*u8" if launch.fmt == "int4" else "*i16")


@pytest.mark.parametrize(("fmt", "method"), [("fp6", "default"), ("int4", "default"), ("int8", "default"),
                                              ("nf4", "double_quant"), ("nf4", "no_double_quant")])  # fmt: skip
def test_opcheck(fmt, method):
    group = 32
    parts = quantize_weight(torch.randn(24, 64), fmt, group, method=method)
    tensors = linear_op.parts_list(fmt, parts)
    x = torch.randn(2, 3, 64, requires_grad=True)
    bias = torch.randn(24, requires_grad=True)
    torch.library.opcheck(torch.ops.ds_plugin.quantized_linear.default, (x, tensors, fmt, group, bias))
    torch.library.opcheck(torch.ops.ds_plugin.quantized_linear.default, (x.detach(), tensors, fmt, group, None))
    dy = torch.randn(5, 24, requires_grad=True)
    torch.library.opcheck(torch.ops.ds_plugin.quantized_linear_grad_input.default, (dy, tensors, fmt, group, 64))


def test_torch_compile_sees_one_opaque_op():
    parts = _parts("fp6", 24, 64, 32)
    tensors = linear_op.parts_list("fp6", parts)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    @torch.compile(backend=backend, fullgraph=True)
    def layer(x):
        return torch.relu(linear_op.quantized_linear(x, tensors, "fp6", 32, None))

    x = torch.randn(4, 64)
    assert torch.equal(layer(x), torch.relu(F.linear(x, dequantize_weight(parts, "fp6", 32, torch.float32))))
    targets = [n.target for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.ds_plugin.quantized_linear.default) == 1, targets
    assert not any("mm" in str(t) or "linear" in str(t).split(".")[-1] for t in targets if "ds_plugin" not in str(t))


def test_a_compiled_model_calls_the_op_in_forward_and_backward():
    # torch.compile over a model whose frozen weights are QuantizedWeight: AOT autograd traces through the
    # subclass's F.linear, and the graphs hold the two opaque ops, never the dequantized weight's matmul.
    from torch._dynamo.backends.common import aot_autograd

    from ds_plugin import quantize_frozen_

    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    quantize_frozen_(model.requires_grad_(False), "fp6", group_size=16, filter_fn=lambda m, name: True)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    compiled_model = torch.compile(
        model, backend=aot_autograd(fw_compiler=capture, bw_compiler=capture), fullgraph=True
    )
    x = torch.randn(4, 64, requires_grad=True)
    y = compiled_model(x)
    y.sum().backward()
    assert torch.equal(y, model(x))
    forward, backward = graphs
    assert forward.count(torch.ops.ds_plugin.quantized_linear.default) == 2
    assert backward.count(torch.ops.ds_plugin.quantized_linear_grad_input.default) == 2
    assert not any("mm" in str(t) for t in forward + backward)


def test_kernels_are_jitted_per_mode(monkeypatch):
    monkeypatch.setattr(qlt, "interpreter_problem", lambda: None)  # jitting launches nothing: any release will do
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    interpreted = qlt._jit(qlt._fwd_kernel)
    monkeypatch.delenv("TRITON_INTERPRET")
    compiled_kernel = qlt._jit(qlt._fwd_kernel)
    assert type(interpreted) is not type(compiled_kernel)
    assert qlt._jit(qlt._fwd_kernel) is compiled_kernel


def test_an_interpreter_that_cannot_run_the_kernels_says_why_in_one_line(monkeypatch):
    problem = qlt.interpreter_problem("3.6.0", "2.5.5")
    assert problem.count("\n") == 0 and "3.6.0" in problem and "2.5.5" in problem and "Triton >= 3.7" in problem
    for fine in (("3.7.0", "2.5.5"), ("3.6.0", "2.4.6"), ("3.10.0rc1", "2.5.0"), ("3.6.0", "1.26.4")):
        assert qlt.interpreter_problem(*fine) is None, fine
    # `ds-plugin env` says so too, where it used to answer yes whenever Triton was installed.
    monkeypatch.setattr(quant_linear_tilings, "interpreter_problem", lambda: problem)
    assert _interpreter_row() == f"quantize kernels only; GEMM kernels no ({problem})"
    monkeypatch.setattr(quant_linear_tilings, "interpreter_problem", lambda: None)
    assert _interpreter_row() == "yes"
    # A launch under such an interpreter stops with that line, not deep in the interpreter's loop handling; and the
    # op, which re-raises interpreter failures rather than falling back to the reference, passes it on.
    monkeypatch.setattr(qlt, "interpreter_problem", lambda: problem)
    monkeypatch.setattr(linear_op, "_state", linear_op._new_state())
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    parts = _parts("int8", 40, 96, 32)
    x = torch.randn(1, 96).to(torch.bfloat16)
    line = r"^Triton 3\.6\.0's interpreter cannot run the kernels' loops under NumPy 2\.5\.5: use Triton >= 3\.7"
    with pytest.raises(RuntimeError, match=line):
        qlt.linear_forward(x, "int8", *_args("int8", parts), 32, None)
    with pytest.raises(RuntimeError, match=line):
        linear_op.quantized_linear(x, linear_op.parts_list("int8", parts), "int8", 32, None)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert qlt._jit(qlt._fwd_kernel) is not None  # compiled mode is not the interpreter's business


# ----------------------------------------------------------------------------------------- compiled, on a GPU

GPU_SHAPES = [(1, 200, 384), (7, 200, 384), (16, 1000, 512), (33, 200, 384), (300, 520, 640)]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_compiled_kernels_match_reference(compiled, fmt, dtype):
    group = 64 if fmt == "int4" else 128
    for m, n, k in GPU_SHAPES:
        parts = _parts(fmt, n, k, group, seed=m, device="cuda")
        w = dequantize_weight(parts, fmt, group, torch.float32)
        x = torch.randn(m, k, device="cuda").to(dtype)
        bias = torch.randn(n, device="cuda")
        configs = qlt.forward_configs(m, group, k)
        # bf16: the first guess, a split-K and a per-element tiling; fp16 the first only (each tiling is a compile).
        others = [c for c in configs if c.split_k > 1 or not c.post_scale][:2] if dtype == torch.bfloat16 else []
        for config in configs[:1] + others:
            _check(qlt.linear_forward(x, fmt, *_args(fmt, parts), group, bias, config=config), x, w, bias)
        dy = torch.randn(m, n, device="cuda").to(dtype)
        _check(qlt.linear_backward(dy, fmt, *_args(fmt, parts), group, k), dy, w.T)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_compiled_per_element_weights_equal_the_reference_bit_for_bit(compiled, fmt):
    # x = identity rows: y = W's rows, as the per-element path rounds them (the reference's one rounding).
    group = 64 if fmt == "int4" else 128
    parts = _parts(fmt, 64, 256, group, device="cuda")
    eye = torch.eye(256, device="cuda", dtype=torch.bfloat16)
    config = qlt.Config(64, 64, 64, post_scale=False)
    got = qlt.linear_forward(eye, fmt, *_args(fmt, parts), group, config=config)
    assert torch.equal(got.T, dequantize_weight(parts, fmt, group, torch.bfloat16))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_frozen_linear_on_cuda_goes_through_the_kernels(compiled, fmt):
    # Counted where the compiled kernel's launch returned, not where the wrapper was called: a kernel that fails
    # raises here (strict, as every gpu test runs), and one that the reference replaced adds no launch.
    from ds_plugin import quantize_frozen_

    layer = torch.nn.Linear(512, 384, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    quantize_frozen_(layer, fmt, filter_fn=lambda m, name: True)
    x = torch.randn(4, 9, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    launches, calls = linear_op.kernel_launches(), linear_op.backend_calls()
    y = layer(x)
    y.float().square().sum().backward()
    torch.cuda.synchronize()
    launched = _delta(launches, linear_op.kernel_launches())
    assert launched.get(("fwd", fmt), 0) >= 1 and launched.get(("bwd", fmt), 0) >= 1, launched
    assert _delta(calls, linear_op.backend_calls()) == {("fwd", fmt, "triton"): 1, ("bwd", fmt, "triton"): 1}
    w = layer.weight.dequantize(torch.float32)
    _check(y.view(36, 384), x.detach().view(36, 512), w, layer.bias)
    _check(x.grad.view(36, 512), (2 * y.float()).to(y.dtype).view(36, 384), w.T)


@pytest.mark.gpu
@requires_cuda
def test_opcheck_on_the_kernel_path(compiled):
    parts = _parts("fp6", 200, 384, 128, device="cuda")
    tensors = linear_op.parts_list("fp6", parts)
    x = torch.randn(2, 3, 384, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(200, device="cuda", requires_grad=True)
    torch.library.opcheck(torch.ops.ds_plugin.quantized_linear.default, (x, tensors, "fp6", 128, bias))
    dy = torch.randn(6, 200, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.library.opcheck(torch.ops.ds_plugin.quantized_linear_grad_input.default, (dy, tensors, "fp6", 128, 384))


@pytest.mark.parametrize("m", [4, 4096])
def test_backward_tiles_lie_within_one_group(compiled, m):
    # Output tiles (bk columns of W) spanning several groups load a scale and offset per element: the first H200 run
    # had int4's backward (groups of 64) at 0.03x bf16 with 128-wide tiles. Narrowed to the group, others untouched.
    wide = qlt.backward_configs(m)
    assert any(c.bk > 64 for c in wide)
    for group in (64, 128, 96):
        configs = qlt.backward_configs(m, group)
        assert configs and all(group % c.bk == 0 for c in configs), (group, configs)
        assert len(configs) <= len(wide) and len(set(configs)) == len(configs)
    assert qlt.backward_configs(m, 128) == [c for c in wide if 128 % c.bk == 0] == wide
    assert qlt.backward_configs(m, 8) == wide  # no power of two >= 16 divides it: left as they were
