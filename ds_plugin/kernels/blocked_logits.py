"""A language model's output layer on CPU, computed a block of vocabulary columns at a time.

On CPU one matmul of the hidden states (tokens x hidden) by the output layer's weight (vocabulary x hidden), writing
all tokens x vocabulary logits at once, runs well under the core's rate when the vocabulary is wide and its width
odd. One thread of a 2-core AMD EPYC (AVX-512), 512 tokens x 256 into GPT-2's 50,257 words: 256-287 ms in fp32 as
one matmul, 151-180 ms as 25 matmuls of 2,048 columns, each into a small contiguous buffer copied into place (bf16:
89-106 ms against 68-75 ms); the weight's gradient in blocks of rows 153 against 171 ms (bf16 69 against 77). The
input's gradient gains nothing from blocks and stays one matmul. For the whole forward and backward of a 16M GPT-2
that is 0.72 -> 0.64 s per step in fp32.

Every logit is still one dot product over the whole hidden dimension, and with this machine's kernels the blocks
gave `F.linear`'s numbers bit for bit in every shape tried with blocks of 256 or 2,048 columns, fp32 and bf16
(fp32 blocks of 16 columns did not). Whether blocks win depends on the shape, dtype and BLAS build (bf16 into
32,000 columns ran 10% slower in blocks): the first call of each (dtype, hidden, vocabulary, threads) shape runs
both ways on up to 512 of its rows and keeps blocks only when they gave the same bits and were at least 5% faster;
the weight's gradient is decided the same way at its first backward. So a result never depends on the choice,
only the time does; the choice is logged at DEBUG level.

`use_blocked_logits(model)` gives every Hugging Face model inside `model` whose output layer is a plain
`nn.Linear` at least `MIN_COLUMNS` wide this layer's forward; off CPU, under autocast, under `torch.compile` or on
tensor subclasses (DTensor) it is `F.linear` itself. The ZeRO engine does that unless the config's `blocked_logits`
is false.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["BLOCK_COLUMNS", "MIN_COLUMNS", "BlockedLogitsLinear", "blocked_linear", "use_blocked_logits"]

#: Columns per block: 2,048 x a few hundred hidden fp32 is a weight slice of about a MiB, and 1,024-8,192 measured
#: alike.
BLOCK_COLUMNS = 2048
#: Narrower layers are left alone: a handful of blocks gains nothing worth a first-call measurement.
MIN_COLUMNS = 4 * BLOCK_COLUMNS
#: Fewer rows than this (generating a token at a time) take one matmul: blocks pay off on a batch's logits.
_MIN_ROWS = 64
_SAMPLE_ROWS = 512
_GAIN = 0.95

# (pass, dtype, hidden, columns, bias, threads) -> blocks are faster; filled by the first call of each shape.
_FASTER_IN_BLOCKS: dict[tuple[Any, ...], bool] = {}


def _logits_in_blocks(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows, columns = x.shape[0], weight.shape[0]
    out = x.new_empty(rows, columns)
    # Each block into a contiguous scratch, then copied: `torch.mm(out=...)` straight into the strided column slice
    # was the slow path again (fp32, 512 x 256 -> 50,257: 230-271 ms against 166-194 ms this way).
    scratch = x.new_empty(rows * min(BLOCK_COLUMNS, columns))
    for start in range(0, columns, BLOCK_COLUMNS):
        width = min(BLOCK_COLUMNS, columns - start)
        part = scratch[: rows * width].view(rows, width)
        block = weight[start : start + width].t()
        if bias is None:
            torch.mm(x, block, out=part)
        else:
            torch.addmm(bias[start : start + width], x, block, out=part)
        out[:, start : start + width].copy_(part)
    return out


def _weight_grad_in_blocks(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    columns = grad.shape[1]
    out = x.new_empty(columns, x.shape[1])
    for start in range(0, columns, BLOCK_COLUMNS):
        end = start + BLOCK_COLUMNS
        torch.mm(grad[:, start:end].t(), x, out=out[start:end])
    return out


def _faster_in_blocks(key: tuple[Any, ...], whole: Any, blocks: Any) -> bool:
    """Whether `blocks()` gives exactly `whole()`'s tensor and beats it by `_GAIN`; measured once per key.

    Alternating, best of three each. Requiring the same bits means the choice, which depends on timing, can never
    change a result: a run computes what `F.linear` computes, whichever way it took.
    """
    known = _FASTER_IN_BLOCKS.get(key)
    if known is None:
        best = {whole: float("inf"), blocks: float("inf")}
        results = {}
        for _ in range(3):
            for way in (whole, blocks):
                start = time.perf_counter()
                results[way] = way()
                best[way] = min(best[way], time.perf_counter() - start)
        same = torch.equal(results[whole], results[blocks])
        known = _FASTER_IN_BLOCKS[key] = same and best[blocks] < _GAIN * best[whole]
        logger.debug(
            "blocked_logits %s: %s (one matmul %.1f ms, blocks %.1f ms, same bits %s)",
            key,
            "blocks" if known else "one matmul",
            best[whole] * 1e3,
            best[blocks] * 1e3,
            same,
        )
    return known


def _shape_key(step: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[Any, ...]:
    return (step, x.dtype, weight.shape[1], weight.shape[0], bias is not None, torch.get_num_threads())


class _BlockedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        sample = flat[:_SAMPLE_ROWS]
        use_blocks = flat.shape[0] >= _MIN_ROWS and _faster_in_blocks(
            _shape_key("forward", flat, weight, bias),
            lambda: F.linear(sample, weight, bias),
            lambda: _logits_in_blocks(sample, weight, bias),
        )
        out = _logits_in_blocks(flat, weight, bias) if use_blocks else F.linear(flat, weight, bias)
        ctx.save_for_backward(flat, weight)
        ctx.input_shape = x.shape
        ctx.has_bias = bias is not None
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        flat, weight = ctx.saved_tensors
        grad = grad_out.reshape(-1, weight.shape[0])
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad @ weight).view(ctx.input_shape)
        if ctx.needs_input_grad[1]:
            sample_grad, sample_x = grad[:_SAMPLE_ROWS], flat[:_SAMPLE_ROWS]
            use_blocks = grad.shape[0] >= _MIN_ROWS and _faster_in_blocks(
                _shape_key("weight_grad", flat, weight, None),
                lambda: sample_grad.t() @ sample_x,
                lambda: _weight_grad_in_blocks(sample_grad, sample_x),
            )
            grad_weight = _weight_grad_in_blocks(grad, flat) if use_blocks else grad.t() @ flat
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_x, grad_weight, grad_bias


def _plain(t: torch.Tensor | None) -> bool:
    return t is None or type(t) in (torch.Tensor, nn.Parameter)


def blocked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, with the logits and the weight's gradient in column blocks where that is faster.

    Args:
        x: ... x hidden inputs.
        weight: columns x hidden.
        bias: columns, or None.
    """
    if (
        x.device.type != "cpu"
        or x.dtype != weight.dtype
        or not (_plain(x) and _plain(weight) and _plain(bias))
        or torch.is_autocast_enabled("cpu")
        or torch.compiler.is_compiling()
    ):
        return F.linear(x, weight, bias)
    return _BlockedLinear.apply(x, weight, bias)


class BlockedLogitsLinear(nn.Linear):
    """An `nn.Linear` whose forward is `blocked_linear`: same parameters, state dict and numbers."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return blocked_linear(input, self.weight, self.bias)


def use_blocked_logits(model: nn.Module) -> int:
    """Give the output layer of every Hugging Face model in `model` `BlockedLogitsLinear`'s forward.

    Only a layer that is exactly `nn.Linear` (not a LoRA, FP8 or quantized layer) with at least `MIN_COLUMNS`
    outputs is switched, in place: its class changes, its parameters and their names do not. Returns how many
    layers were switched.

    Args:
        model: any module; Hugging Face models are found among its submodules (a peft wrapper's included).
    """
    switched = 0
    for module in model.modules():
        getter = getattr(module, "get_output_embeddings", None)
        if getter is None:
            continue
        try:
            head = getter()
        except Exception:  # a model without an output layer may raise instead of returning None
            continue
        if type(head) is nn.Linear and head.out_features >= MIN_COLUMNS:
            head.__class__ = BlockedLogitsLinear
            switched += 1
    return switched
