"""FP8 training for ``nn.Linear``: :class:`Fp8Linear` and :func:`convert_to_fp8_training`.

The layer keeps its high-precision weight as the parameter, so optimizers, FSDP2 sharding and checkpoints see an
ordinary ``nn.Linear``; only the three GEMMs of each step run in fp8 (see :mod:`ds_plugin.precision.fp8` for the
recipes). Embeddings, the output head, norms and attention's softmax/bmm stay in bf16/fp32, as in DeepSeek-V3.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from ds_plugin.precision.fp8 import (
    BLOCK,
    RECIPES,
    ScaledFp8,
    fp8_dtype,
    quantize_activation,
    quantize_blocks,
    quantize_weight,
    scaled_mm,
)
from ds_plugin.precision.fp8_gathered import gathered_fp8

__all__ = ["Fp8Linear", "convert_to_fp8_training"]

logger = logging.getLogger(__name__)

# torchao's defaults: a single tensor-wide scale needs E5M2's range for gradients; finer scales keep E4M3's
# precision. DeepSeek-V3 (blockwise) uses E4M3 everywhere.
_DEFAULT_GRADIENT_FORMAT = {"tensorwise": "e5m2", "rowwise": "e4m3", "blockwise": "e4m3"}


def _quantize_grad_out(dy: torch.Tensor, recipe: str, dtype: torch.dtype, wgrad: bool) -> ScaledFp8:
    """Quantize grad_out (M, N) as the lhs of a backward GEMM.

    dgrad (``dy @ W``) contracts N: rowwise takes one scale per row of dy (the non-contracted M), blockwise 1×128
    tiles along N. wgrad (``dyᵀ @ x``) contracts M: rowwise takes one scale per column of dy (= per row of dyᵀ,
    the non-contracted N), blockwise 128×1 tiles along M, i.e. DeepSeek-V3's 1×128 tiles of dyᵀ.
    """
    rows, cols = dy.shape
    if recipe == "tensorwise":
        return quantize_blocks(dy, (rows, cols), dtype)
    if recipe == "rowwise":
        return quantize_blocks(dy, (rows, 1) if wgrad else (1, cols), dtype)
    return quantize_blocks(dy, (BLOCK, 1) if wgrad else (1, BLOCK), torch.float8_e4m3fn)


def _dgrad(dy: torch.Tensor, weight: torch.Tensor, recipe: str, grad_dtype: torch.dtype) -> torch.Tensor:
    """dx = dy·W for rowwise and blockwise; W quantized here unless it arrived as fp8 codes."""
    w_q = gathered_fp8(weight)
    if w_q is None:
        n = weight.shape[0]
        w_q = quantize_blocks(weight, (n, 1)) if recipe == "rowwise" else quantize_weight(weight, recipe)
    elif recipe == "rowwise":
        # W = diag(s)·Q with s along the summed N: move s onto dy's columns and give Q unit column scales.
        dy = dy.float() * w_q.scale.reshape(1, -1)
        n, k = w_q.data.shape
        w_q = ScaledFp8(w_q.data, torch.ones(1, k, device=dy.device), (n, 1))
    return scaled_mm(_quantize_grad_out(dy, recipe, grad_dtype, wgrad=False), w_q, torch.float32)


class _Fp8LinearFunction(torch.autograd.Function):
    """y = x·Wᵀ + b with all three GEMMs in fp8; bias, reductions and outputs in high precision.

    Scaling axis per GEMM: a scale may only vary along a dimension the GEMM does not sum over, or in 128-element
    chunks of the summed dimension (DeepSeek-V3, whose kernels promote the partial sum to fp32 at every chunk
    boundary, where the scale can change). So:

    ==========  =========================  ==================================  ===============================
    GEMM        tensorwise                 rowwise                             blockwise
    ==========  =========================  ==================================  ===============================
    y = x·Wᵀ    x, W one scale each        x per row (M), W per row (N)        x 1×128 along K, W 128×128
    dx = dy·W   dy, W one scale each       dy per row (M), W per column (K)    dy 1×128 along N, W 128×128
    dW = dyᵀ·x  dy, x one scale each       dy per column (N), x per col (K)    dy, x 128×1 along M (tokens)
    ==========  =========================  ==================================  ===============================

    128×128 weight blocks are square, so one quantization of W serves both the forward GEMM and dgrad's Wᵀ (a
    reason DeepSeek-V3 gives for them). Rowwise W and all wgrad operands need a quantization along the other axis.

    A weight that came through the FP8 all-gather (:mod:`ds_plugin.precision.fp8_all_gather`) already holds the
    codes ``quantize_weight`` would make; they are used as they are. Rowwise dgrad then folds W's row scales into
    dy (``dx = (dy·diag(s))·Q``), since the bf16 W a per-column quantization needs was never gathered.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        recipe: str,
        grad_dtype: torch.dtype,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            x_q = quantize_activation(x, recipe)
            w_q = gathered_fp8(weight) or quantize_weight(weight, recipe)
            y = scaled_mm(x_q, w_q.t(), torch.float32)
            if bias is not None:
                y = y + bias.float()
        ctx.recipe, ctx.grad_dtype, ctx.has_bias = recipe, grad_dtype, bias is not None
        ctx.x_dtype, ctx.bias_dtype = x.dtype, None if bias is None else bias.dtype
        if recipe == "tensorwise":
            # One scale fits every GEMM, so the fp8 copy of x serves wgrad: half the bytes of saving bf16 x.
            ctx.save_for_backward(x_q.data, x_q.scale, weight)
        else:
            # The weight is saved in high precision (not as fp8) because under ZeRO-3 it is the unsharded
            # parameter FSDP frees and re-gathers; an fp8 copy here would keep every layer's full weight alive.
            ctx.save_for_backward(x, weight)
        return y.to(out_dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        recipe, grad_dtype = ctx.recipe, ctx.grad_dtype
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        with torch.autocast(grad_out.device.type, enabled=False):
            dy = grad_out.reshape(-1, grad_out.shape[-1])
            if recipe == "tensorwise":
                x_data, x_scale, weight = ctx.saved_tensors
                x_q = ScaledFp8(x_data, x_scale, tuple(x_data.shape))
                dy_q = _quantize_grad_out(dy, recipe, grad_dtype, wgrad=False)
                if need_dx:
                    w_q = gathered_fp8(weight) or quantize_weight(weight, recipe)
                    grad_x = scaled_mm(dy_q, w_q, torch.float32)
                if need_dw:
                    grad_w = scaled_mm(dy_q.t(), x_q, torch.float32)
            else:
                x, weight = ctx.saved_tensors
                if need_dx:
                    grad_x = _dgrad(dy, weight, recipe, grad_dtype)
                if need_dw:
                    dyt_q = _quantize_grad_out(dy, recipe, grad_dtype, wgrad=True).t()
                    m = x.shape[0]
                    x_q = quantize_blocks(x, (m, 1) if recipe == "rowwise" else (BLOCK, 1))
                    grad_w = scaled_mm(dyt_q, x_q, torch.float32)
            if need_db and ctx.has_bias:
                grad_b = dy.float().sum(0).to(ctx.bias_dtype)
        if grad_x is not None:
            grad_x = grad_x.to(ctx.x_dtype)
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_x, grad_w, grad_b, None, None, None


class Fp8Linear(nn.Linear):
    """``nn.Linear`` whose forward and backward GEMMs run in fp8 with per-step (online) scales.

    The parameters stay high precision (fp32 master or bf16), so optimizers and FSDP2 treat the layer like any
    ``nn.Linear``. Under autocast the output has the autocast dtype, as ``nn.Linear``'s would; otherwise it has the
    input's dtype.

    Args:
        in_features: size of each input sample (K).
        out_features: size of each output sample (N).
        bias: whether to learn an additive bias (added in high precision, never quantized).
        device: device of the new parameters.
        dtype: dtype of the new parameters.
        recipe: ``"tensorwise"``, ``"rowwise"`` or ``"blockwise"`` (DeepSeek-V3).
        gradient_format: ``"e4m3"`` or ``"e5m2"`` for grad_out; None picks the recipe's default (e5m2 for
            tensorwise, e4m3 otherwise). Blockwise always uses E4M3.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        recipe: str = "tensorwise",
        gradient_format: str | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if recipe not in RECIPES:
            raise ValueError(f"unknown fp8 recipe {recipe!r}; use one of {', '.join(RECIPES)}")
        self.recipe = recipe
        self.gradient_format = gradient_format or _DEFAULT_GRADIENT_FORMAT[recipe]
        if recipe == "blockwise" and self.gradient_format != "e4m3":
            logger.debug("blockwise fp8 quantizes gradients to e4m3; gradient_format=%r ignored", gradient_format)
            self.gradient_format = "e4m3"
        self._grad_dtype = fp8_dtype(self.gradient_format)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, recipe: str = "tensorwise", gradient_format: str | None = None
    ) -> Fp8Linear:
        """An :class:`Fp8Linear` that shares ``linear``'s parameter objects (optimizer state stays valid).

        Args:
            linear: the layer to replace.
            recipe: fp8 recipe.
            gradient_format: grad_out format (see the class docstring).
        """
        # Built on the meta device so no memory is allocated for parameters that are replaced at once.
        with torch.device("meta"):
            new = cls(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                recipe=recipe,
                gradient_format=gradient_format,
            )
        new.weight = linear.weight
        if linear.bias is not None:
            new.bias = linear.bias
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            out_dtype = torch.get_autocast_dtype(device_type)
        else:
            out_dtype = x.dtype
        y = _Fp8LinearFunction.apply(
            x.reshape(-1, self.in_features), self.weight, self.bias, self.recipe, self._grad_dtype, out_dtype
        )
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}, gradient_format={self.gradient_format}"


class _Options(NamedTuple):
    recipe: str
    gradient_format: str | None
    skip_modules: tuple[str, ...]


def _resolve(config: Any) -> _Options:
    if isinstance(config, str):
        options = _Options(config, None, ())
    else:
        options = _Options(
            getattr(config, "recipe", "tensorwise"),
            getattr(config, "gradient_format", None),
            tuple(getattr(config, "skip_modules", None) or ()),
        )
    if options.recipe not in RECIPES:
        raise ValueError(f"unknown fp8 recipe {options.recipe!r}; use one of {', '.join(RECIPES)}")
    if options.gradient_format is not None:
        fp8_dtype(options.gradient_format)
    return options


def _output_head(model: nn.Module) -> nn.Module | None:
    get_head = getattr(model, "get_output_embeddings", None)
    if not callable(get_head):
        return None
    try:
        return get_head()
    except (NotImplementedError, AttributeError):
        return None


def _skip_reason(
    name: str,
    module: nn.Linear,
    skip_modules: tuple[str, ...],
    head: nn.Module | None,
    module_filter_fn: Callable[[str, nn.Module], bool] | None,
    align: int,
) -> str | None:
    if any(pattern in name for pattern in skip_modules):
        return "skip_modules"
    if module_filter_fn is not None:
        if not module_filter_fn(name, module):
            return "module_filter_fn"
    elif module is head or "lm_head" in name:
        return "output head"
    if module.in_features % align or module.out_features % align:
        return "alignment"
    return None


def _no_eligible_message(model: nn.Module, options: _Options, align: int, seen: int, unaligned: int) -> str:
    problem = f"no nn.Linear in {type(model).__name__} is eligible for FP8 {options.recipe} training"
    if seen == 0:
        return f"{problem}: it has none (only exact nn.Linear layers are converted); keep this model in bf16"
    fixes = []
    if unaligned:
        fixes.append(f"make in/out features multiples of {align}")
        if options.recipe == "blockwise":
            fixes.append("use recipe='tensorwise' (multiples of 16)")
    if seen > unaligned:
        fixes.append("pass module_filter_fn=(name, module) -> bool or narrow skip_modules to choose layers")
    return (
        f"{problem} ({seen} seen: {unaligned} with in/out features not multiples of {align}, {seen - unaligned} "
        f"excluded as output head, by skip_modules {list(options.skip_modules)} or module_filter_fn); "
        f"{', or '.join(fixes)}"
    )


def convert_to_fp8_training(
    model: nn.Module,
    config: Any = "tensorwise",
    *,
    module_filter_fn: Callable[[str, nn.Module], bool] | None = None,
) -> nn.Module:
    """Swap eligible ``nn.Linear`` layers for :class:`Fp8Linear` in place and return the model.

    A layer is converted when it is exactly an ``nn.Linear`` (subclasses such as LoRA layers or
    ``MultiheadAttention.out_proj``, which never calls its own forward, are left alone), its name matches no
    ``skip_modules`` substring, and its in/out features are multiples of 16 (tensorwise, rowwise: the fp8 GEMM's
    alignment) or of 128 (blockwise: whole 128×128 weight blocks and 1×128 tiles; unaligned layers are skipped, not
    padded, so parameter shapes never change). By default the output head (a name containing ``lm_head`` or
    ``model.get_output_embeddings()``) is excluded; a ``module_filter_fn`` replaces that rule. Embeddings and norms
    are not ``nn.Linear`` and stay as they are. Convert before ``fully_shard``.

    Args:
        model: the model to convert (a bare ``nn.Linear`` is returned as a new module).
        config: a recipe name (``"tensorwise"``, ``"rowwise"``, ``"blockwise"``) or an object with attributes
            ``recipe``, ``gradient_format`` (``"e4m3"``/``"e5m2"``/None), ``skip_modules`` (module-name
            substrings); ``all_gather`` is applied by ``apply_zero`` (stage 3), see
            :func:`ds_plugin.precision.fp8_all_gather.enable_fp8_all_gather`.
        module_filter_fn: ``(name, module) -> bool``; when given, decides instead of the output-head rule.

    Raises:
        ValueError: when no layer is eligible.
    """
    options = _resolve(config)
    align = BLOCK if options.recipe == "blockwise" else 16
    head = _output_head(model)
    converted: dict[int, Fp8Linear] = {}
    seen: set[int] = set()
    skipped_dims = 0
    # remove_duplicate=False: a Linear registered under two names must be replaced under both.
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if type(module) is not nn.Linear:
            continue
        if id(module) not in seen:
            seen.add(id(module))
            reason = _skip_reason(name, module, options.skip_modules, head, module_filter_fn, align)
            if reason is not None:
                skipped_dims += reason == "alignment"
                logger.debug("fp8: %s (%d -> %d) kept: %s", name, module.in_features, module.out_features, reason)
                continue
            converted[id(module)] = Fp8Linear.from_linear(module, options.recipe, options.gradient_format)
        new = converted.get(id(module))
        if new is None:
            continue
        if not name:
            return new
        parent_name, _, child_name = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child_name, new)
    if not converted:
        raise ValueError(_no_eligible_message(model, options, align, len(seen), skipped_dims))
    logger.info(
        "fp8 %s: converted %d of %d nn.Linear layers (%d skipped for alignment)",
        options.recipe,
        len(converted),
        len(seen),
        skipped_dims,
    )
    return model
