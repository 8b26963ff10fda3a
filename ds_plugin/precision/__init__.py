"""Precision: DeepSpeed's dynamic loss scaling for FP16, and FP8 training (tensorwise, rowwise, blockwise) with an
optional FP8 weight all-gather under ZeRO-3."""

from ds_plugin.precision.fp8 import (
    RECIPES,
    ScaledFp8,
    dequantize,
    fp8_dtype,
    quantize_activation,
    quantize_blocks,
    quantize_weight,
    scaled_mm,
)
from ds_plugin.precision.fp8_all_gather import Fp8AllGatherStats, enable_fp8_all_gather, fp8_all_gather_stats
from ds_plugin.precision.fp8_linear import Fp8Linear, convert_to_fp8_training
from ds_plugin.precision.loss_scaler import DynamicLossScaler, LossScaleAtMinimumError, found_overflow

__all__ = [
    "RECIPES",
    "DynamicLossScaler",
    "Fp8AllGatherStats",
    "Fp8Linear",
    "LossScaleAtMinimumError",
    "ScaledFp8",
    "convert_to_fp8_training",
    "dequantize",
    "enable_fp8_all_gather",
    "found_overflow",
    "fp8_all_gather_stats",
    "fp8_dtype",
    "quantize_activation",
    "quantize_blocks",
    "quantize_weight",
    "scaled_mm",
]
