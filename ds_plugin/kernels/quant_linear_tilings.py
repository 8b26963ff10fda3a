"""The tilings the fused quantized-weight GEMMs of :mod:`ds_plugin.kernels.quant_linear_triton` are launched with.

:class:`Config` is one tiling; :func:`forward_configs` / :func:`backward_configs` list a few per shape class, best
guess first (on a GPU :mod:`ds_plugin.quant.frozen.linear_op` times them once per shape; ``ds-plugin bench
kernel-resources`` builds every one for sm_90); under Triton's interpreter one small tiling runs.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os

import triton

__all__ = ["Config", "backward_configs", "fit", "forward_configs", "interpreter_enabled", "interpreter_problem"]


@dataclasses.dataclass(frozen=True)
class Config:
    """One tiling of a kernel.

    Args:
        bm, bn, bk: tile rows of x (dy), rows of W, columns of W (powers of 2 >= 16). Forward: bn output columns,
            bk the reduction step; backward: bn the reduction step, bk output columns.
        split_k: forward only: programs sharing one output tile's reduction (fp32 atomics when > 1).
        post_scale: forward only: scale the tile product rather than each weight (needs ``group % bk == 0``).
        group_m: tiles of M visited together, for L2 reuse of W.
        num_warps, num_stages: Triton's launch options.
    """

    bm: int
    bn: int
    bk: int
    split_k: int = 1
    post_scale: bool = True
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


def interpreter_enabled() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``), as triton itself reads it."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def interpreter_problem(triton_version: str | None = None, numpy_version: str | None = None) -> str | None:
    """Why Triton's interpreter cannot run the GEMM kernels with these Triton and NumPy releases, or None.

    Triton <= 3.6's interpreter takes a loop bound as ``int()`` of a shape-(1,) array, which NumPy >= 2.5 refuses
    (Triton 3.7 squeezes it first); the kernels loop over K (N in the backward) with runtime bounds. The installed
    releases unless given.
    """
    triton_version = triton_version or triton.__version__
    if numpy_version is None:
        try:
            numpy_version = importlib.metadata.version("numpy")
        except importlib.metadata.PackageNotFoundError:
            return "Triton's interpreter needs NumPy, which is not installed: pip install numpy"
    if _release(triton_version) < (3, 7) and _release(numpy_version) >= (2, 5):
        return (
            f"Triton {triton_version}'s interpreter cannot run the kernels' loops under NumPy {numpy_version}: "
            "use Triton >= 3.7 or NumPy < 2.5"
        )
    return None


# Candidates per shape class, best guess first; the op times them on a GPU. Few on purpose: each is a compile.
# fmt: off
_SMALL_M = (  # M <= 16: weight streaming; wide K steps, split-K for shapes with few programs
    Config(16, 64, 128, num_stages=4), Config(16, 32, 128, num_stages=4), Config(16, 128, 64, num_stages=4),
    Config(16, 64, 128, split_k=2, num_stages=4), Config(16, 32, 256, post_scale=False),
    Config(16, 64, 64, split_k=4, num_stages=5),
)
_MID_M = (  # 16 < M <= 128
    Config(64, 64, 64, num_stages=4), Config(32, 64, 128, num_stages=4),
    Config(64, 128, 64, num_warps=8), Config(128, 64, 64, num_warps=8),
)
# M > 128: tensor-core tiles; the decode is amortised over BM rows. No candidate spills registers on sm_90 beyond a
# few words (``ds-plugin bench kernel-resources``): a post-scaled 128 x 256 tile, with its two fp32
# accumulators, spilled ~1 KB per thread, so that tile scales per element.
_LARGE_M = (
    Config(128, 128, 64, num_warps=8), Config(128, 256, 64, post_scale=False, num_warps=8),
    Config(128, 128, 64, post_scale=False, num_warps=8), Config(64, 128, 64, num_stages=4),
)
# Backward: bn is the reduction step over N, bk the output columns. Replaced for spilling on sm_90: 128 x 256 output
# tiles, and 64 x 128 on 4 warps (int4, Triton 3.6).
_BACKWARD = (
    Config(128, 64, 128, num_warps=8), Config(128, 32, 128, num_warps=8, num_stages=4),
    Config(64, 64, 128, num_warps=8, num_stages=4), Config(128, 64, 128, num_warps=8, num_stages=4),
)
_BACKWARD_SMALL = (Config(16, 64, 64, num_stages=4), Config(16, 64, 128))
# fmt: on
_INTERPRETED = Config(16, 32, 32, group_m=2, num_warps=1, num_stages=1)  # numpy per program: small tiles


def fit(cfg: Config, group_size: int, k: int) -> Config | None:
    """``cfg`` adjusted to the weight: post-scaling needs K-tiles inside one group; None when it cannot run."""
    bk = cfg.bk
    if cfg.post_scale and group_size % bk:
        bk = group_size & -group_size  # the largest power of two dividing the group
        if bk < 16:
            return None
    if cfg.split_k > 1 and triton.cdiv(k, bk) < cfg.split_k:
        return None
    return dataclasses.replace(cfg, bk=bk)


def _candidates(pool: tuple[Config, ...], group_size: int, k: int) -> list[Config]:
    fitted = [c for c in (fit(c, group_size, k) for c in pool) if c is not None]
    fitted = list(dict.fromkeys(fitted))
    if not fitted:  # a group with no power-of-two factor >= 16: scale per element
        fitted = [dataclasses.replace(c, post_scale=False) for c in pool if c.split_k == 1][:1]
    return fitted


def forward_configs(m: int, group_size: int, k: int) -> list[Config]:
    """The forward's candidate tilings for ``m`` rows and this weight, best guess first (empty: none fits).

    Args:
        m, group_size, k: rows of x, the weight's group size and K.
    """
    if interpreter_enabled():
        return _candidates((_INTERPRETED,), group_size, k)
    return _candidates(_SMALL_M if m <= 16 else _MID_M if m <= 128 else _LARGE_M, group_size, k)


def backward_configs(m: int, group_size: int | None = None) -> list[Config]:
    """The backward's candidate tilings for ``m`` rows of dy, best guess first.

    Args:
        m: rows of dy.
        group_size: the weight's group size: an output tile wider than the largest power of two dividing it (at
            least 16) is narrowed to that, so each tile row lies in one group and loads one scale (and int4 offset)
            instead of one per element. The first H200 run, with 128-wide tiles for int4's groups of 64, measured
            int4's backward at 0.03-0.04x bf16's against 0.3-0.47x for fp6 and int8 (groups of 128).
    """
    pool = [_INTERPRETED] if interpreter_enabled() else list(_BACKWARD_SMALL if m <= 16 else _BACKWARD)
    narrow = (group_size or 0) & -(group_size or 0)
    if narrow >= 16:
        pool = [c if group_size % c.bk == 0 else dataclasses.replace(c, bk=narrow) for c in pool]
    return list(dict.fromkeys(pool))
