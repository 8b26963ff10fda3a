"""FP8 formats, scaled quantization for the three training recipes, and the scaled-matmul dispatch.

Every recipe is one rule: cut a 2-D tensor into ``block = (rows, cols)`` tiles and give each tile one fp32 scale,
``scale = amax(tile) / fp8_max``; ``q = clamp(x / scale)`` cast to fp8, and ``x ≈ q * scale``.

========== ====================================== =========================================
recipe     activations (M, K)                     weights (N, K)
========== ====================================== =========================================
tensorwise one scale: block (M, K)                one scale: block (N, K)
rowwise    one per row: block (1, K), scale (M,1) one per output row: block (1, K), (N, 1)
blockwise  1×128 tiles along K: scale (M, K/128)  128×128 blocks: scale (N/128, K/128)
========== ====================================== =========================================

Blockwise is DeepSeek-V3's recipe (E4M3 everywhere, amax computed online for every tile, no delayed scaling).
The scale is a *dequantization* scale, the convention ``torch._scaled_mm`` takes. A tile of zeros gets scale 1 so it
quantizes to exact zeros without a 0/0.

:func:`scaled_mm` multiplies two :class:`ScaledFp8` operands with ``torch._scaled_mm`` where the hardware runs that
scaling (CUDA sm89+ for tensorwise/rowwise, sm90+ for blockwise) and otherwise with an exact emulation: dequantize
to fp32 and multiply in fp32.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ds_plugin.quant import KernelLaunchError, strict_kernels

__all__ = [
    "FP8_FORMATS",
    "RECIPES",
    "ScaledFp8",
    "amax_to_scale",
    "dequantize",
    "fp8_dtype",
    "fp8_max",
    "quantize_activation",
    "quantize_blocks",
    "quantize_weight",
    "scaled_mm",
    "scaled_mm_emulated",
]

logger = logging.getLogger(__name__)

FP8_FORMATS: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "blockwise")

# DeepSeek-V3's tile edge: 1×128 activation tiles, 128×128 weight blocks.
BLOCK = 128
# torchao's floor on amax: keeps scale a normal fp32 number when a tile holds only denormal-sized values.
_AMAX_EPS = 1e-12


def fp8_dtype(fmt: str | torch.dtype) -> torch.dtype:
    """The torch dtype for an fp8 format name.

    Args:
        fmt: ``"e4m3"`` (``torch.float8_e4m3fn``, max 448) or ``"e5m2"`` (``torch.float8_e5m2``, max 57344), or
            one of those dtypes.
    """
    if isinstance(fmt, torch.dtype):
        if fmt not in FP8_FORMATS.values():
            raise ValueError(f"{fmt} is not a supported fp8 dtype; use torch.float8_e4m3fn or torch.float8_e5m2")
        return fmt
    try:
        return FP8_FORMATS[fmt.lower()]
    except KeyError:
        raise ValueError(f"unknown fp8 format {fmt!r}; use 'e4m3' or 'e5m2'") from None


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 dtype (448 for E4M3, 57344 for E5M2).

    Args:
        dtype: an fp8 dtype.
    """
    return float(torch.finfo(dtype).max)


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dequantization scale ``amax / fp8_max`` in fp32, 1 where ``amax == 0``.

    Args:
        amax: per-tile absolute maxima.
        dtype: the fp8 dtype the tiles are cast to.
    """
    amax = amax.float()
    scale = amax.clamp(min=_AMAX_EPS) / fp8_max(dtype)
    return torch.where(amax == 0, torch.ones_like(scale), scale)


@dataclass(frozen=True)
class ScaledFp8:
    """An fp8 matrix with one fp32 scale per ``block``-shaped tile: ``x ≈ data * scale`` tile by tile.

    Args:
        data: the fp8 values, shape (R, C).
        scale: fp32 dequantization scales, shape (ceil(R / block[0]), ceil(C / block[1])).
        block: tile shape (rows, cols); a block as large as the matrix is tensorwise scaling.
    """

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def t(self) -> ScaledFp8:
        """The transpose (a view): data, scales and tile shape all transpose together."""
        return ScaledFp8(self.data.t(), self.scale.t(), (self.block[1], self.block[0]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data * scale`` as a ``dtype`` tensor (computed in fp32)."""
        return dequantize(self, dtype)


def _tile_view(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, int, int]:
    # Zero-pad ragged edges so the matrix views as (n_row_tiles, rows, n_col_tiles, cols); zeros change no amax.
    rows, cols = x.shape
    br, bc = block
    nr, nc = math.ceil(rows / br), math.ceil(cols / bc)
    pad_r, pad_c = nr * br - rows, nc * bc - cols
    if pad_r or pad_c:
        x = F.pad(x, (0, pad_c, 0, pad_r))
    return x.reshape(nr, br, nc, bc), nr, nc


def quantize_blocks(
    x: torch.Tensor,
    block: tuple[int, int],
    dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    amax: torch.Tensor | None = None,
) -> ScaledFp8:
    """Quantize a 2-D tensor with one amax-derived fp32 scale per ``block`` tile.

    Args:
        x: a 2-D tensor in any floating dtype (the arithmetic is fp32).
        block: tile shape (rows, cols); ragged edge tiles are allowed and scaled on their own elements.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        amax: per-tile absolute maxima to use instead of ``x``'s own, shape (row tiles, col tiles); a shard of a
            tensorwise-scaled weight passes the amax all-reduced over every shard.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_blocks expects a 2-D tensor, got shape {tuple(x.shape)}")
    dtype = fp8_dtype(dtype)
    rows, cols = x.shape
    block = (max(1, min(block[0], rows)), max(1, min(block[1], cols)))
    tiles, nr, nc = _tile_view(x.float(), block)
    # vector_norm(inf) is max |x| in one pass, without the temporary that abs().amax() allocates.
    if amax is None:
        amax = torch.linalg.vector_norm(tiles, float("inf"), dim=(1, 3))
    scale = amax_to_scale(amax.reshape(nr, nc), dtype)
    limit = fp8_max(dtype)
    # Division (not a multiply by the reciprocal) so the values match a plain reference bit for bit; the clamp
    # catches a round-up past fp8_max, which would otherwise become nan (E4M3) or inf (E5M2).
    q = (tiles / scale[:, None, :, None]).clamp_(-limit, limit).to(dtype)
    q = q.reshape(nr * block[0], nc * block[1])
    if q.shape != x.shape:
        q = q[:rows, :cols].contiguous()
    return ScaledFp8(q, scale, block)


def dequantize(q: ScaledFp8, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Expand the tile scales and multiply: ``data * scale`` in fp32, cast to ``dtype``.

    Args:
        q: the quantized matrix.
        dtype: output dtype.
    """
    rows, cols = q.data.shape
    tiles, nr, nc = _tile_view(q.data.float(), q.block)
    x = tiles.mul_(q.scale.float()[:, None, :, None]).reshape(nr * q.block[0], nc * q.block[1])
    return x[:rows, :cols].to(dtype)


def _quantize_operand(t: torch.Tensor, recipe: str, dtype: torch.dtype, blockwise: tuple[int, int]) -> ScaledFp8:
    """One scale for the whole matrix, one per row, or one per `blockwise` tile (always E4M3)."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown fp8 recipe {recipe!r}; use one of {', '.join(RECIPES)}")
    rows, cols = t.shape
    if recipe == "tensorwise":
        return quantize_blocks(t, (rows, cols), dtype)
    if recipe == "rowwise":
        return quantize_blocks(t, (1, cols), dtype)
    return quantize_blocks(t, blockwise, torch.float8_e4m3fn)


def quantize_activation(x: torch.Tensor, recipe: str, dtype: torch.dtype = torch.float8_e4m3fn) -> ScaledFp8:
    """Quantize an (M, K) activation for a GEMM that contracts K.

    Args:
        x: the (M, K) matrix.
        recipe: ``"tensorwise"`` (one scale), ``"rowwise"`` (scale (M, 1)) or ``"blockwise"`` (1×128 tiles along
            K, scale (M, ceil(K/128)); always E4M3).
        dtype: fp8 dtype for tensorwise/rowwise.
    """
    return _quantize_operand(x, recipe, dtype, (1, BLOCK))


def quantize_weight(w: torch.Tensor, recipe: str, dtype: torch.dtype = torch.float8_e4m3fn) -> ScaledFp8:
    """Quantize an (N, K) weight (``nn.Linear`` layout) for the forward GEMM ``x @ w.T``.

    Args:
        w: the (N, K) weight.
        recipe: ``"tensorwise"`` (one scale), ``"rowwise"`` (one per output row, scale (N, 1)) or
            ``"blockwise"`` (128×128 blocks, scale (ceil(N/128), ceil(K/128)); always E4M3).
        dtype: fp8 dtype for tensorwise/rowwise.
    """
    return _quantize_operand(w, recipe, dtype, (BLOCK, BLOCK))


def scaled_mm_emulated(a: ScaledFp8, b: ScaledFp8, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``a @ b`` by dequantizing both operands to fp32 and multiplying in fp32 (any tile shapes).

    fp32 accumulation over the whole K is at least as accurate as DeepSeek-V3's promotion of partial sums to fp32
    every 128 elements, so this is the numerical reference the hardware kernels approximate.

    Args:
        a: (M, K) operand.
        b: (K, N) operand.
        out_dtype: dtype of the result.
    """
    return torch.mm(a.dequantize(), b.dequantize()).to(out_dtype)


def _kinds(q: ScaledFp8, lhs: bool) -> set[str]:
    # Every _scaled_mm scaling a tile shape matches: at K == 128 a rowwise tile is also a 1×128 tile, and the
    # pairing decides which one the kernel gets.
    rows, cols = q.data.shape
    block = q.block
    kinds = set()
    if q.scale.numel() == 1 and block == (rows, cols):
        kinds.add("tensor")
    # Rowwise: one scale per row of the lhs / per column of the rhs, i.e. along the non-contracted dim.
    if block == ((1, cols) if lhs else (rows, 1)):
        kinds.add("row")
    # Tiles of 128 along the contracted dim: (1, 128) for the lhs (M, K), (128, 1) for the rhs (K, N).
    if block == ((1, BLOCK) if lhs else (BLOCK, 1)):
        kinds.add("1x128")
    if block == (BLOCK, BLOCK):
        kinds.add("128x128")
    return kinds


# The pairings _scaled_mm implements, in order of preference.
_PAIRINGS = (("tensor", "tensor"), ("row", "row"), ("1x128", "128x128"), ("1x128", "1x128"), ("128x128", "1x128"))


def _pick_kinds(a: ScaledFp8, b: ScaledFp8) -> tuple[str, str] | None:
    ka, kb = _kinds(a, lhs=True), _kinds(b, lhs=False)
    return next(((x, y) for x, y in _PAIRINGS if x in ka and y in kb), None)


def _hardware_scales(a: ScaledFp8, b: ScaledFp8, kinds: tuple[str, str]) -> tuple[torch.Tensor, torch.Tensor]:
    # _scaled_mm's layouts (torch's ScaledBlas.cpp): tensorwise scalars; rowwise (M,1) and (1,N) contiguous;
    # a 1×128 lhs scale is (M, K/128) stored K-outer (stride (1, M)); a 128×128 lhs scale is row-major. The rhs is
    # checked through b.t(), so its scale must be the transpose of the layout the lhs rule asks for.
    def lhs_layout(scale: torch.Tensor, kind: str) -> torch.Tensor:
        if kind == "tensor":
            return scale.reshape(()).contiguous()
        if kind == "1x128":
            return scale.t().contiguous().t()
        return scale.contiguous()

    sa = lhs_layout(a.scale.float(), kinds[0])
    sb = lhs_layout(b.scale.float().t(), kinds[1])
    return sa, (sb if kinds[1] == "tensor" else sb.t())


def _hardware_ok(a: ScaledFp8, b: ScaledFp8, kinds: tuple[str, str] | None) -> bool:
    dev = a.data.device
    if kinds is None or dev.type != "cuda" or b.data.device != dev:
        return False
    blockwise = kinds[0] not in ("tensor", "row")
    # fp8 tensor cores: sm89 (Ada) and sm90 (Hopper) for tensorwise/rowwise; cuBLAS blockwise scaling is sm90+.
    if torch.cuda.get_device_capability(dev) < ((9, 0) if blockwise else (8, 9)):
        return False
    # cuBLAS has no e5m2 × e5m2 kernel.
    if a.data.dtype == torch.float8_e5m2 and b.data.dtype == torch.float8_e5m2:
        return False
    # _scaled_mm needs K and N multiples of 16; blockwise is only taken on whole 128-tiles (a ragged token count
    # in the wgrad GEMM is K there), anything else is emulated.
    m, k = a.data.shape
    n = b.data.shape[1]
    if blockwise:
        return m % BLOCK == 0 and k % BLOCK == 0 and n % BLOCK == 0
    return k % 16 == 0 and n % 16 == 0


# (device index, kinds, dtypes, out dtype) combinations whose kernel raised once: emulate them from then on.
_UNSUPPORTED: set[tuple] = set()


def scaled_mm(a: ScaledFp8, b: ScaledFp8, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``a @ b`` with ``torch._scaled_mm`` where the hardware supports the scaling, else :func:`scaled_mm_emulated`.

    Args:
        a: (M, K) operand, tiles along K (or one scale / one per row).
        b: (K, N) operand, e.g. ``quantize_weight(w, recipe).t()``.
        out_dtype: dtype of the result.
    """
    kinds = _pick_kinds(a, b)
    if kinds is None or not _hardware_ok(a, b, kinds):
        return scaled_mm_emulated(a, b, out_dtype)
    # CUTLASS's rowwise kernel only writes bf16 (cuBLAS fp32 output needs sm90 + cuBLAS 12.9), so rowwise asks
    # for bf16 and upcasts: the precision of a bf16-rounded fp32 accumulator.
    kernel_dtype = torch.bfloat16 if kinds[0] == "row" else out_dtype
    key = (a.data.device.index, kinds, a.data.dtype, b.data.dtype, kernel_dtype)
    if key in _UNSUPPORTED and not strict_kernels():
        return scaled_mm_emulated(a, b, out_dtype)
    sa, sb = _hardware_scales(a, b, kinds)
    mat_a = a.data.contiguous()
    mat_b = b.data if b.data.t().is_contiguous() else b.data.t().contiguous().t()
    try:
        out = torch._scaled_mm(mat_a, mat_b, scale_a=sa, scale_b=sb, out_dtype=kernel_dtype)
    except RuntimeError as err:
        if strict_kernels():  # DS_PLUGIN_STRICT_KERNELS=1: a GPU check must not time the emulation as FP8
            cause = str(err).splitlines()[0] if str(err) else ""
            raise KernelLaunchError(
                f"torch._scaled_mm failed for {kinds[0]} x {kinds[1]} scaling: RuntimeError: {cause} "
                "(DS_PLUGIN_STRICT_KERNELS=1; unset it to fall back to the fp32 emulation)"
            ) from err
        # Builds differ in which scalings cuBLAS/CUTLASS were compiled with (blockwise needs CUDA 12.9+):
        # remember the failure and keep training on the emulation instead of crashing.
        _UNSUPPORTED.add(key)
        logger.warning("torch._scaled_mm cannot run %s x %s scaling here (%s); using the fp32 emulation", *kinds, err)
        return scaled_mm_emulated(a, b, out_dtype)
    return out.to(out_dtype)
