"""Quantized formats: blockwise symmetric INT8/INT4 (qwZ weight all-gather, qgZ gradient reduction)."""

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
