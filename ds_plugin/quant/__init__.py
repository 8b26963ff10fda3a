"""Quantized formats: blockwise symmetric INT8/INT4 (qwZ weight all-gather, qgZ gradient reduction).

Layers, bottom up: :mod:`~ds_plugin.quant.format` (constants and reference maths; imports only torch), the two
backends :mod:`~ds_plugin.quant.fused` (torch, eager or compiled) and :mod:`ds_plugin.kernels.quant_triton`
(Triton), :mod:`~ds_plugin.quant.dispatch` (picks one; the ZeRO++ row steps) and :mod:`~ds_plugin.quant.blockwise`
(the flat API, re-exported here).

The re-exports load :mod:`~ds_plugin.quant.blockwise` on first use rather than on import, so that importing the
bottom module (as the Triton kernels do) does not pull the dispatch layer in above it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ds_plugin.quant.blockwise import (
        DEFAULT_BLOCK_SIZE,
        QuantizedBlocks,
        dequantize_blockwise,
        dequantize_int4_blockwise,
        dequantize_int8_blockwise,
        pack_int4,
        quantize_blockwise,
        quantize_int4_blockwise,
        quantize_int8_blockwise,
        quantized_nbytes,
        unpack_int4,
    )

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "QuantizedBlocks",
    "dequantize_blockwise",
    "dequantize_int4_blockwise",
    "dequantize_int8_blockwise",
    "pack_int4",
    "quantize_blockwise",
    "quantize_int4_blockwise",
    "quantize_int8_blockwise",
    "quantized_nbytes",
    "unpack_int4",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("ds_plugin.quant.blockwise"), name)
    raise AttributeError(f"module 'ds_plugin.quant' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
