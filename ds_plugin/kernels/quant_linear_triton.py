"""Triton GEMMs on frozen weights stored as fp6 / int4 / int8 codes, the dequantization fused into the GEMM.

``linear_forward``: ``y = x @ dequant(W).T (+ b)``; ``linear_backward``: ``dx = dy @ dequant(W)``; bf16 or fp16
activations, fp32 accumulation, weights as the components of :mod:`ds_plugin.quant.frozen.codecs` (any row
stride), and no dequantized copy of W in memory. Their plain-torch references, by the same bit operations, sit
beside them in :mod:`ds_plugin.kernels.quant_linear_reference`. This module imports nothing from ds_plugin.quant
(the layering of ``tests/test_layering.py``; its tilings live in
:mod:`ds_plugin.kernels.quant_linear_tilings`), so it restates the layouts it reads: int8 ``codes``
(N, K); int4 ``codes`` (N, K/2), element ``2i`` in the high nibble, uint8 ``zeros`` in 1/16 steps; fp6 ``codes``
(N, 3K/4), a nibble plane then a (sign, e2) plane per row, bits as :mod:`ds_plugin.quant.frozen.fp6` places them.

Decoding is sized to the ALU budget of a memory-bound GEMV (on an H100, ~6 instructions per fp6 weight at 2.2x over
bf16): codes are read as 32-bit words and become 16-bit float patterns two per 32-bit operation, exactly.

* int4: ``(word >> s) & 0x000F000F | 0x43004300`` is two bf16 values ``128 + q`` (fp16: ``0x5800``, the nibble 3
  bits higher).
* fp6: a code's nibble and its (sign, e2) bits shift into the fp16 pattern ``s 0 0 e2 e1 e0 m1 m0 0 ...``, whose
  value is the e3m2 value times 2^-12 (biases 15 and 3; e3m2 subnormals land on fp16 subnormals, which fp16 never
  flushes). For bf16 activations the tile goes on through fp32 (a full-rate unpack and a pack per pair, where a
  direct fp16 -> bf16 cast is one slower conversion per value: F2F in the SASS).
* int8: a cast.

The scale (``Config.post_scale``) is applied either per element before the dot, ``(raw - offset) * scale`` in fp32
rounded once (the reference's W, bit for bit), or, when a K-tile lies in one group, to the tile's product: the
decoded tile feeds the dot as it is (int4: ``q - zero / 16`` first, exact in 16 bits) and the fp32 ``[BM, BN]``
partial is multiplied by the scale. The backward scales per element (its scale varies along its reduction). FMA
contraction is asked for explicitly (Triton 3.9 warns when unset); it can only fuse accumulator updates.

M <= 16 runs 16-row tiles over wide N, with optional split-K (fp32 atomics); larger M runs tensor-core tiles in
grouped order for L2 reuse. :func:`forward_configs` / :func:`backward_configs` list a few tilings per shape class
(on a GPU :mod:`ds_plugin.quant.frozen.linear_op` times them once per shape); the interpreter runs one small config.
Kernels and their helpers are jitted on first use per mode, so a test can flip ``TRITON_INTERPRET`` in one process.

Every launch is built by :func:`forward_launch` / :func:`backward_launch` as a :class:`Launch` (the kernel's runtime
arguments, constexprs and options): :meth:`Launch.run` issues it and counts it (:func:`launch_counts`, after the
launch returned), and :meth:`Launch.specialisation` gives the signature Triton compiles it to, which is what
``ds-plugin bench kernel-resources`` builds for sm_90 without a GPU: one description of a launch, not two.
"""

from __future__ import annotations

import collections
import dataclasses
import types
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from ds_plugin.kernels.quant_linear_tilings import (
    Config,
    backward_configs,
    fit,
    forward_configs,
    interpreter_enabled,
    interpreter_problem,
)

__all__ = ["KERNEL_FORMATS", "Config", "Launch", "backward_configs", "backward_launch", "forward_configs"]
__all__ += ["forward_launch", "interpreter_enabled", "interpreter_problem", "launch_counts", "linear_backward"]
__all__ += ["linear_forward", "supports"]

KERNEL_FORMATS = ("int8", "int4", "fp6")
_FMT_ID = {"int8": 0, "int4": 1, "fp6": 2}
_INT8, _INT4, _FP6 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
_SIGN_BITS = tl.constexpr(0x80008000 - (1 << 32))  # as an int32, so the mask keeps the word's type


def supports(fmt: str, dtype: torch.dtype, k: int, group_size: int) -> bool:
    """Whether the kernels take a weight of this format, width K and group size for ``dtype`` activations.

    Args:
        fmt, dtype, k, group_size: the weight's format, the activations' dtype (bf16 or fp16 run here), K, group.
    """
    if fmt not in KERNEL_FORMATS or dtype not in (torch.bfloat16, torch.float16) or k % group_size:
        return False
    # Codes are read as whole 32-bit words: 8 int4 codes, 16 fp6 codes.
    return {"int8": True, "int4": k % 8 == 0, "fp6": k % 16 == 0}[fmt]


# ---------------------------------------------------------------------------------------------------------- kernels


def _shift(x, n: tl.constexpr):
    return x << n if n >= 0 else x >> (-n)  # arithmetic right shift: callers mask the sign-extended bits off


def _int4_pair(words, s: tl.constexpr, FP16: tl.constexpr):
    # The nibbles at bits s and 16 + s as 16-bit float patterns of 128 + q, the word's low then high half.
    if FP16:
        o = (_shift(words, 3 - s) & 0x00780078) | 0x58005800
    else:
        o = (_shift(words, -s) & 0x000F000F) | 0x43004300
    return o.to(tl.int16), (o >> 16).to(tl.int16)


def _fp6_pair(nib, top, T: tl.constexpr, P: tl.constexpr):
    # Codes 2T and 2T + 1 of a nibble word (P = 4u + T its pair index in the chunk) as fp16 patterns.
    o = (_shift(nib, 8 - 4 * T) & 0x0F000F00) | (_shift(top, 12 - P) & 0x10001000) | (_shift(top, 7 - P) & _SIGN_BITS)
    return o.to(tl.int16), (o >> 16).to(tl.int16)


def _raw_tile(w_ptr, rows, stride_wn, k0, K, hi_off, FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DT):
    """W[rows, k0:k0+BK] decoded but not scaled, in the activation dtype DT (zeros past K)."""
    base = rows[:, None] * stride_wn
    # One branch per format and no early return: Triton compiles the code after a constexpr-if's return too.
    if FMT == _INT8:
        rk = k0 + tl.arange(0, BK)
        # Through fp32: exact, what an int -> bf16 cast lowers to anyway, and the interpreter casts int -> bf16 wrongly.
        raw = tl.load(w_ptr + base + rk[None, :], mask=(rk < K)[None, :], other=0).to(tl.float32).to(DT)
    elif FMT == _INT4:
        kw = k0 // 8 + tl.arange(0, BK // 8)
        words = tl.load(w_ptr + base + kw[None, :], mask=(kw * 8 < K)[None, :], other=0)
        # Word byte j holds codes 2j (high nibble) and 2j + 1; code 4h + 2a + b of a word sits in 16-bit half h at
        # shift 8a + 4(1 - b). Joining h first, then a, then b lays the codes out in order.
        l0, h0 = _int4_pair(words, 4, DT == tl.float16)
        l1, h1 = _int4_pair(words, 0, DT == tl.float16)
        l2, h2 = _int4_pair(words, 12, DT == tl.float16)
        l3, h3 = _int4_pair(words, 8, DT == tl.float16)
        bits = tl.join(tl.join(tl.join(l0, h0), tl.join(l2, h2)), tl.join(tl.join(l1, h1), tl.join(l3, h3)))
        raw = tl.reshape(bits, [BN, BK]).to(DT, bitcast=True)
    else:
        kw = k0 // 8 + tl.arange(0, BK // 8)
        words = tl.load(w_ptr + base + kw[None, :], mask=(kw * 8 < K)[None, :], other=0)
        kt = k0 // 16 + tl.arange(0, BK // 16)
        top = tl.load(w_ptr + base + hi_off + kt[None, :], mask=(kt * 16 < K)[None, :], other=0)
        n0, n1 = tl.split(tl.reshape(words, [BN, BK // 16, 2]))
        # Code 8u + 2t + h of a chunk: nibble word u, pair t, half h. Join u first, then t's high bit, t's low bit, h.
        a0, b0 = _fp6_pair(n0, top, 0, 0)
        a1, b1 = _fp6_pair(n0, top, 1, 1)
        a2, b2 = _fp6_pair(n0, top, 2, 2)
        a3, b3 = _fp6_pair(n0, top, 3, 3)
        c0, d0 = _fp6_pair(n1, top, 0, 4)
        c1, d1 = _fp6_pair(n1, top, 1, 5)
        c2, d2 = _fp6_pair(n1, top, 2, 6)
        c3, d3 = _fp6_pair(n1, top, 3, 7)
        lo = tl.join(tl.join(tl.join(a0, c0), tl.join(a2, c2)), tl.join(tl.join(a1, c1), tl.join(a3, c3)))
        hi = tl.join(tl.join(tl.join(b0, d0), tl.join(b2, d2)), tl.join(tl.join(b1, d1), tl.join(b3, d3)))
        raw = tl.reshape(tl.join(lo, hi), [BN, BK]).to(tl.float16, bitcast=True)
        if DT == tl.bfloat16:
            # fp16 -> fp32 -> bf16 (exact both ways): a full-rate unpack and one pack per two values, where the
            # direct cast is one conversion per value on the slower conversion unit (measured in SASS: F2F.BF16.F16).
            raw = raw.to(tl.float32).to(DT)
    return raw


def _bf16_bits(bits):
    # bf16 scales travel as int16 bit patterns: a shift makes them fp32 exactly, compiled or interpreted.
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


def _group_params(
    s_ptr, z_ptr, rows, stride_sn, stride_zn, k0, K, FMT: tl.constexpr, G: tl.constexpr, BK: tl.constexpr
):
    """Scale and offset (int4: 128 + zero/16) of W[rows, k0:k0+BK], as [BN, 1] (tile in one group) or [BN, BK]."""
    if G % BK == 0:
        s_off = rows * stride_sn + k0 // G
        z_off = rows * stride_zn + k0 // G
        s = _bf16_bits(tl.load(s_ptr + s_off))[:, None]
        if FMT == _INT4:
            z = (128.0 + tl.load(z_ptr + z_off).to(tl.float32) * 0.0625)[:, None]
        else:
            z = s  # unread for this format
    else:
        rk = k0 + tl.arange(0, BK)
        g = tl.where(rk < K, rk, 0) // G
        s = _bf16_bits(tl.load(s_ptr + rows[:, None] * stride_sn + g[None, :]))
        if FMT == _INT4:
            z = 128.0 + tl.load(z_ptr + rows[:, None] * stride_zn + g[None, :]).to(tl.float32) * 0.0625
        else:
            z = s  # unread for this format
    return s, z


def _dequant(raw, s, z, FMT: tl.constexpr, DT):
    # (raw - offset) * scale in fp32: the subtraction is exact and the product the reference's one rounding.
    r = raw.to(tl.float32)
    if FMT == _INT4:
        r = r - z
    elif FMT == _FP6:
        r = r * 4096.0  # exact (the e3m2 value), before the scale: scale * 4096 could overflow
    return (r * s).to(DT)


def _mma(a, b, acc, WIDEN: tl.constexpr):
    # Triton 3.9's interpreter multiplies bf16 dot operands as their raw uint16 bits; widening them to fp32 there
    # (exact products, the same fp32 sums) keeps the interpreted kernels honest. Compiled kernels never widen.
    if WIDEN:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


def _tile_ids(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    # GROUP_M consecutive tile rows sweep the tile columns together, so their W tiles are reused from L2.
    # (a + b - 1) // b, not tl.cdiv (and tl.full, not tl.zeros): the interpreter cannot call triton.language's jitted
    # helpers when triton was imported without TRITON_INTERPRET (ours are jitted per mode; the library's are not).
    num_m = (M + BM - 1) // BM
    num_n = (N + BN - 1) // BN
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


def _fwd_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, hi_off,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_ym,
    FMT: tl.constexpr, G: tl.constexpr, POST_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, WIDEN: tl.constexpr,
):  # fmt: skip
    DT = x_ptr.dtype.element_ty
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, N, BM, BN, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    m_ok = rm < M
    n_ok = rn < N
    # Row indices in int64: M * N (or N * K bytes) can pass 2^31 in training. Rows past N read row 0 instead of
    # being masked, so W loads stay unmasked along N; those columns are not stored.
    rm = rm.to(tl.int64)
    rows = tl.where(n_ok, rn, 0).to(tl.int64)
    tiles = (K + BK - 1) // BK
    per = (tiles + SPLIT_K - 1) // SPLIT_K
    first = tl.program_id(1) * per
    acc = tl.full([BM, BN], 0.0, tl.float32)
    for t in range(first, tl.minimum(first + per, tiles)):
        k0 = t * BK
        rk = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & (rk < K)[None, :], other=0.0)
        raw = _raw_tile(w_ptr, rows, stride_wn, k0, K, hi_off, FMT, BN, BK, DT)
        s, z = _group_params(s_ptr, z_ptr, rows, stride_sn, stride_zn, k0, K, FMT, G, BK)
        if POST_SCALE:
            if FMT == _INT4:
                # q - zero / 16 is exact in bf16 and fp16 (at most 8 significant bits), so the zero point comes off
                # the tile in the activation dtype (packed, two per instruction) and only the scale is left.
                if WIDEN:  # the interpreter does bf16 arithmetic on the raw bits; the same exact values via fp32
                    raw = ((raw.to(tl.float32) - 128.0) - (z - 128.0)).to(DT)
                else:
                    raw = (raw - 128.0) - (z - 128.0).to(DT)
            part = _mma(x, tl.trans(raw), tl.full([BM, BN], 0.0, tl.float32), WIDEN)
            if FMT == _FP6:
                part = part * 4096.0  # fp6 tiles hold e3m2 / 2^12; applied apart from the scale, which may be huge
            acc += part * tl.trans(s)
        else:
            acc = _mma(x, tl.trans(_dequant(raw, s, z, FMT, DT)), acc, WIDEN)
    y_off = rm[:, None] * stride_ym + rn[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K > 1:
        tl.atomic_add(y_ptr + y_off, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _bwd_kernel(
    dy_ptr, w_ptr, s_ptr, z_ptr, dx_ptr, M, N, K, hi_off,
    stride_dym, stride_wn, stride_sn, stride_zn, stride_dxm,
    FMT: tl.constexpr, G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    WIDEN: tl.constexpr,
):  # fmt: skip
    DT = dy_ptr.dtype.element_ty
    pid_m, pid_k = _tile_ids(tl.program_id(0), M, K, BM, BK, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    k0 = pid_k * BK
    rk = k0 + tl.arange(0, BK)
    m_ok = rm < M
    rm = rm.to(tl.int64)  # M * N can pass 2^31
    acc = tl.full([BM, BK], 0.0, tl.float32)
    for n0 in range(0, N, BN):
        rn = n0 + tl.arange(0, BN)
        n_ok = rn < N
        rows = tl.where(n_ok, rn, 0).to(tl.int64)  # dy is zero past N, so row 0's weights add nothing
        dy = tl.load(dy_ptr + rm[:, None] * stride_dym + rn[None, :], mask=m_ok[:, None] & n_ok[None, :], other=0.0)
        raw = _raw_tile(w_ptr, rows, stride_wn, k0, K, hi_off, FMT, BN, BK, DT)
        s, z = _group_params(s_ptr, z_ptr, rows, stride_sn, stride_zn, k0, K, FMT, G, BK)
        acc = _mma(dy, _dequant(raw, s, z, FMT, DT), acc, WIDEN)
    mask = m_ok[:, None] & (rk < K)[None, :]
    tl.store(dx_ptr + rm[:, None] * stride_dxm + rk[None, :], acc.to(dx_ptr.dtype.element_ty), mask=mask)


_HELPERS = (_shift, _int4_pair, _fp6_pair, _raw_tile, _bf16_bits, _group_params, _dequant, _mma, _tile_ids)
_jitted: dict[tuple[str, bool], Any] = {}


def _jit(fn: Callable[..., None]) -> Any:
    """``fn`` jitted for the current mode, calling helpers jitted for the same mode (triton.jit decides between
    compiled and interpreted when it wraps, and an interpreted kernel cannot call a compiled helper)."""
    interpret = interpreter_enabled()
    if interpret and (problem := interpreter_problem()):
        raise RuntimeError(problem)  # else the interpreter fails deep inside its loop handling
    key = (fn.__name__, interpret)
    if key not in _jitted:
        namespace = dict(fn.__globals__)
        for helper in _HELPERS:
            namespace[helper.__name__] = triton.jit(_rebound(helper, namespace))
        # M is not specialised: Triton would compile M == 1 apart from every other M, for no gain here.
        _jitted[key] = triton.jit(_rebound(fn, namespace), do_not_specialize=["M"])
    return _jitted[key]


def _rebound(fn: Callable[..., Any], namespace: dict[str, Any]) -> Callable[..., Any]:
    """``fn`` with ``namespace`` as its globals, its annotations kept: ``tl.constexpr`` parameters are known to
    Triton by their annotation, and ``types.FunctionType`` copies none (a launch would pass BM as an i32 and fail
    to compile: "arange's arguments must be of type tl.constexpr")."""
    rebound = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    rebound.__annotations__ = dict(fn.__annotations__)
    rebound.__kwdefaults__ = fn.__kwdefaults__
    rebound.__module__, rebound.__qualname__ = fn.__module__, fn.__qualname__
    return rebound


# ------------------------------------------------------------------------------------------------------ host side


def _widen(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and interpreter_enabled()


def _words(codes: Tensor) -> Tensor:
    """The codes as int32 words, in place when their layout allows (FSDP2's gathered views may not be aligned)."""
    try:
        return codes.view(torch.int32)
    except RuntimeError:
        return codes.clone(memory_format=torch.contiguous_format).view(torch.int32)


def _operands(fmt: str, codes: Tensor, scales: Tensor, zeros: Tensor | None, k: int) -> tuple[Tensor, ...]:
    w = codes.view(torch.int8) if fmt == "int8" else _words(codes)
    s = scales.view(torch.int16)
    z = zeros if fmt == "int4" else s  # an unread placeholder otherwise
    hi_off = k // 8 if fmt == "fp6" else 0  # fp6: the top plane starts after K / 8 nibble words
    return w, s, z, hi_off


_launched: collections.Counter[tuple[str, str]] = collections.Counter()


def launch_counts() -> dict[tuple[str, str], int]:
    """Launches of these kernels that returned, per (pass, format): ``("fwd", "fp6")``, ``("bwd", "int4")``, ...

    Counted in :meth:`Launch.run` after Triton's launch call returned (so a kernel that failed to compile or launch
    is not counted), interpreted launches (``TRITON_INTERPRET=1``) and the op's autotuning launches included.
    """
    return dict(_launched)


@dataclasses.dataclass(frozen=True, eq=False)
class Launch:
    """One launch of a kernel, as the host code issues it.

    Args:
        kind: "fwd" or "bwd".
        fmt: the weight format.
        grid: the launch grid.
        args: the kernel's runtime arguments, in its parameter order (tensors, then sizes and strides).
        constexprs: its ``tl.constexpr`` parameters by name.
        options: Triton's launch options (``num_warps``, ``num_stages``, ``enable_fp_fusion``).
        out: the tensor the kernel writes (the forward's fp32 buffer under split-K).
    """

    kind: str
    fmt: str
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    constexprs: dict[str, Any]
    options: dict[str, Any]
    out: Tensor

    def kernel(self) -> Any:
        """The kernel, jitted for the current mode."""
        return _jit(_fwd_kernel if self.kind == "fwd" else _bwd_kernel)

    def run(self) -> None:
        """Launch it; counted in :func:`launch_counts` once Triton's launch call returned."""
        self.kernel()[self.grid](*self.args, **self.constexprs, **self.options)
        _launched[(self.kind, self.fmt)] += 1

    def specialisation(self, arch: int = 90) -> tuple[dict[str, str], dict[Any, Any], dict[Any, Any], Any]:
        """``(signature, constexprs, attrs, options)``: what Triton compiles this launch to for ``sm_<arch>``.

        Triton's own binder reads the arguments (types from the tensors' dtypes and the ints' ranges, 16-divisibility
        of pointers and ints, constexprs by annotation), as at a real launch; no device is needed, so meta tensors
        stand in for real ones (their pointers read as 16-byte aligned, as torch's allocations are). The binder is
        Triton's private one (``create_function_from_signature`` and ``JITFunction._pack_args``, which
        ``JITFunction.run`` calls; the same in Triton 3.6 and 3.9): reading it is what keeps this exact.

        Args:
            arch: the compute capability, e.g. 90 for H100/H200.
        """
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature

        kernel = self.kernel()
        if not hasattr(kernel, "params"):
            raise RuntimeError(
                "Launch.specialisation compiles, which Triton's interpreter never does: unset TRITON_INTERPRET"
            )
        backend = make_backend(GPUTarget("cuda", arch, 32))
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        kwargs = {**self.constexprs, **self.options, "debug": kernel.debug or triton.knobs.runtime.debug}
        for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):  # as JITFunction.run adds them, where known
            if hasattr(triton.knobs.compilation, name):
                kwargs[name] = getattr(triton.knobs.compilation, name)
        bound, specialization, options = binder(*self.args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
        return signature, constexprs, attrs, options


def forward_launch(
    x2: Tensor,
    fmt: str,
    codes: Tensor,
    scales: Tensor,
    zeros: Tensor | None,
    group_size: int,
    bias: Tensor | None,
    config: Config,
    y: Tensor,
) -> Launch:
    """The forward's launch for ``y = x2 @ dequant(W).T (+ bias)`` with tiling ``config`` (already fitted).

    Args:
        x2: ``(M, K)`` activations, unit stride along K.
        fmt, codes, scales, zeros, group_size, bias: as for :func:`linear_forward`.
        config: the tiling.
        y: the ``(M, N)`` output in x's dtype; under split-K the kernel writes a zeroed fp32 buffer instead.
    """
    m, k = x2.shape
    n = codes.shape[0]
    w, s, z, hi_off = _operands(fmt, codes, scales, zeros, k)
    out = y if config.split_k == 1 else torch.zeros((m, n), dtype=torch.float32, device=x2.device)
    b = s if bias is None else bias.contiguous()  # an unread placeholder without a bias
    args = (
        x2, w, s, z, b, out, m, n, k, hi_off, x2.stride(0), w.stride(0), s.stride(0), z.stride(0), out.stride(0),
    )  # fmt: skip
    constexprs = dict(
        FMT=_FMT_ID[fmt], G=group_size, POST_SCALE=config.post_scale, HAS_BIAS=bias is not None,
        SPLIT_K=config.split_k, BM=config.bm, BN=config.bn, BK=config.bk, GROUP_M=config.group_m,
        WIDEN=_widen(x2.dtype),
    )  # fmt: skip
    grid = (triton.cdiv(m, config.bm) * triton.cdiv(n, config.bn), config.split_k)
    return Launch("fwd", fmt, grid, args, constexprs, _options(config), out)


def backward_launch(
    dy: Tensor,
    fmt: str,
    codes: Tensor,
    scales: Tensor,
    zeros: Tensor | None,
    group_size: int,
    config: Config,
    dx: Tensor,
) -> Launch:
    """The backward's launch for ``dx = dy @ dequant(W)`` with tiling ``config``.

    Args:
        dy: ``(M, N)`` output gradient, unit stride along N.
        fmt, codes, scales, zeros, group_size: as for :func:`linear_forward`.
        config: the tiling.
        dx: the ``(M, K)`` input gradient it writes, in dy's dtype.
    """
    m, n = dy.shape
    k = dx.shape[1]
    w, s, z, hi_off = _operands(fmt, codes, scales, zeros, k)
    args = (dy, w, s, z, dx, m, n, k, hi_off, dy.stride(0), w.stride(0), s.stride(0), z.stride(0), dx.stride(0))
    constexprs = dict(
        FMT=_FMT_ID[fmt], G=group_size, BM=config.bm, BN=config.bn, BK=config.bk, GROUP_M=config.group_m,
        WIDEN=_widen(dy.dtype),
    )  # fmt: skip
    grid = (triton.cdiv(m, config.bm) * triton.cdiv(k, config.bk),)
    return Launch("bwd", fmt, grid, args, constexprs, _options(config), dx)


def _options(config: Config) -> dict[str, Any]:
    # FMA contraction asked for explicitly (Triton 3.9 warns when unset); it can only fuse accumulator updates.
    return {"num_warps": config.num_warps, "num_stages": config.num_stages, "enable_fp_fusion": True}


def linear_forward(
    x: Tensor,
    fmt: str,
    codes: Tensor,
    scales: Tensor,
    zeros: Tensor | None,
    group_size: int,
    bias: Tensor | None = None,
    config: Config | None = None,
) -> Tensor:
    """``x @ dequant(W).T + bias`` for a weight stored as ``fmt`` components, in ``x``'s dtype.

    Args:
        x: ``(..., K)`` bf16 or fp16, on a CUDA device (or any device under ``TRITON_INTERPRET=1``).
        fmt: "int8", "int4" or "fp6" (see :func:`supports`).
        codes, scales, zeros: the weight's components (``zeros`` for int4 only, else None); any row strides.
        group_size: elements per scale.
        bias: optional ``(N,)`` bias of any float dtype.
        config: the tiling (from :func:`forward_configs`; adjusted to the weight's group); None: the first there.
    """
    k, n = x.shape[-1], codes.shape[0]
    x2 = x.reshape(-1, k)
    if x2.shape[0] and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.view(*x.shape[:-1], n)
    if config is None:
        config = forward_configs(m, group_size, k)[0]
    config = fit(config, group_size, k) or dataclasses.replace(config, post_scale=False, split_k=1)
    launch = forward_launch(x2, fmt, codes, scales, zeros, group_size, bias, config, y)
    launch.run()
    if config.split_k > 1:
        # The atomics summed the splits in fp32; bias and the one rounding to x's dtype come after.
        y.copy_(launch.out if bias is None else launch.out + bias.float())
    return y.view(*x.shape[:-1], n)


def linear_backward(
    grad_out: Tensor,
    fmt: str,
    codes: Tensor,
    scales: Tensor,
    zeros: Tensor | None,
    group_size: int,
    k: int,
    config: Config | None = None,
) -> Tensor:
    """``grad_out @ dequant(W)``: the input gradient of :func:`linear_forward`, in ``grad_out``'s dtype.

    Args:
        grad_out: ``(..., N)`` bf16 or fp16.
        fmt, codes, scales, zeros, group_size, config: as for :func:`linear_forward`.
        k: the weight's K (the gradient's last dim).
    """
    n = grad_out.shape[-1]
    dy = grad_out.reshape(-1, n)
    if dy.shape[0] and dy.stride(-1) != 1:
        dy = dy.contiguous()
    m = dy.shape[0]
    dx = torch.empty((m, k), dtype=grad_out.dtype, device=grad_out.device)
    if m == 0 or k == 0:
        return dx.view(*grad_out.shape[:-1], k)
    if n == 0:
        return dx.zero_().view(*grad_out.shape[:-1], k)
    backward_launch(dy, fmt, codes, scales, zeros, group_size, config or backward_configs(m, group_size)[0], dx).run()
    return dx.view(*grad_out.shape[:-1], k)
