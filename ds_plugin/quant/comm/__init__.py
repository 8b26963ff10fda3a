"""The blockwise INT8 / INT4 format of ZeRO++'s quantized collectives (qwZ weight all-gather, qgZ gradients).

Layers, bottom up: :mod:`~ds_plugin.quant.comm.format` (constants and reference maths; imports only torch, and is
the only module the Triton kernels import), the two backends :mod:`~ds_plugin.quant.comm.fused` (torch, eager or
compiled) and :mod:`ds_plugin.kernels.quant_triton` (Triton), and :mod:`~ds_plugin.quant.comm.dispatch` (picks one
per bucket; the row steps :mod:`ds_plugin.zero.zeropp` calls). This package imports nothing on its own, so loading
the format (as the kernels do) does not pull the dispatch in above it.
"""
