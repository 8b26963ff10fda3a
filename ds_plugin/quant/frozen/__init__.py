"""Frozen Linear weights stored as INT8, INT4, NF4 or FP6 codes (LoRA / QLoRA base weights), torchao's pattern.

Modules, bottom up: :mod:`~ds_plugin.quant.frozen.fp6` (e3m2 codes and their bit-plane packing),
:mod:`~ds_plugin.quant.frozen.codecs` (each format's quantize / dequantize maths and byte count; a new format starts
here), :mod:`~ds_plugin.quant.frozen.linear_op` (the ``ds_plugin::quantized_linear`` custom ops, Triton kernels or
the reference), :mod:`~ds_plugin.quant.frozen.tensor` (``QuantizedWeight``, the tensor subclass FSDP2 shards and
gathers as codes) and :mod:`~ds_plugin.quant.frozen.quantize` (the verb ``quantize_frozen_`` and the checkpoint
helpers). ``ds_plugin.quantize_frozen_`` is the public entry point.
"""
