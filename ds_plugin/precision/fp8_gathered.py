"""The weight an FP8 all-gather delivers: :class:`Fp8GatheredWeight` and :func:`gathered_fp8`.

Both sides of the FP8 weight all-gather need this type: :mod:`ds_plugin.precision.fp8_all_gather` builds it after
the gather, and :class:`~ds_plugin.precision.fp8_linear.Fp8Linear` reads its codes in the forward and backward
GEMMs. It lives below both, so the import graph runs one way: ``fp8`` <- ``fp8_gathered`` <- ``fp8_linear`` <-
``fp8_all_gather``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from ds_plugin.precision.fp8 import BLOCK, ScaledFp8

__all__ = ["Fp8GatheredWeight", "gathered_fp8", "weight_block"]

aten = torch.ops.aten


def weight_block(recipe: str, rows: int, cols: int) -> tuple[int, int]:
    """The tile shape ``quantize_weight`` uses for a ``(rows, cols)`` weight under ``recipe``.

    A gathered weight built from these tiles is the :class:`~ds_plugin.precision.fp8.ScaledFp8` the layer would
    have made from the bf16 weight.

    Args:
        recipe: ``"tensorwise"``, ``"rowwise"`` or ``"blockwise"``.
        rows: the weight's rows (N).
        cols: the weight's columns (K).
    """
    return {"tensorwise": (rows, cols), "rowwise": (1, cols), "blockwise": (BLOCK, BLOCK)}[recipe]


class Fp8GatheredWeight(torch.Tensor):
    """The unsharded weight after an FP8 all-gather: E4M3 codes and fp32 scales of the ``recipe``'s tiles.

    It reports the shape and mixed-precision dtype of the weight it stands for. ``Fp8Linear`` reads the codes
    through :func:`gathered_fp8`; any other op sees the dequantized weight.

    Args:
        data: the gathered fp8 codes, (N, K).
        scale: fp32 dequantization scales of the recipe's tiles.
        recipe: ``"tensorwise"``, ``"rowwise"`` or ``"blockwise"``.
        dtype: the dtype the weight would have had (FSDP2's ``param_dtype``).
    """

    _data: torch.Tensor
    _scale: torch.Tensor
    recipe: str

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, recipe: str, dtype: torch.dtype) -> Fp8GatheredWeight:
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=dtype, device=data.device)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, recipe: str, dtype: torch.dtype) -> None:
        self._data, self._scale, self.recipe = data, scale, recipe

    __torch_function__ = torch._C._disabled_torch_function_impl

    def scaled_fp8(self) -> ScaledFp8:
        """The codes and scales as the :class:`ScaledFp8` ``quantize_weight`` would have returned."""
        return ScaledFp8(self._data, self._scale, weight_block(self.recipe, *self._data.shape))

    def dequantize(self) -> torch.Tensor:
        """``codes * scale`` in this tensor's dtype."""
        return self.scaled_fp8().dequantize(self.dtype)

    def __repr__(self) -> str:
        return f"Fp8GatheredWeight(shape={tuple(self.shape)}, recipe={self.recipe}, dtype={self.dtype})"

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_data", "_scale"], (self.recipe, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: Any, outer_size: Any, outer_stride: Any) -> Fp8GatheredWeight:
        return Fp8GatheredWeight(inner["_data"], inner["_scale"], *meta)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket
        first = args[0] if args else None
        # FSDP2 turns the gathered tensor into its unsharded parameter with as_strided (same shape) and
        # nn.Parameter (detach): both must keep the codes, not a dequantized copy.
        if isinstance(first, cls) and packet in (aten.detach, aten.alias, aten.as_strided, aten.view):
            if packet in (aten.detach, aten.alias) or tuple(args[1]) == tuple(first.shape):
                return cls(first._data, first._scale, first.recipe, first.dtype)
        args, kwargs = tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs))
        return func(*args, **kwargs)


def gathered_fp8(weight: torch.Tensor) -> ScaledFp8 | None:
    """The fp8 codes of a weight that arrived through the FP8 all-gather, else None.

    Args:
        weight: a layer's weight as its forward sees it.
    """
    return weight.scaled_fp8() if isinstance(weight, Fp8GatheredWeight) else None
