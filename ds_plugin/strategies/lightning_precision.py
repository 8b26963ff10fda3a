"""`ZeroPrecision`: Lightning's precision strings mapped onto the config's fp16/bf16 blocks.

DeepSpeed's mixed precision is not autocast: the whole forward and backward run in the compute dtype while
the fp32 master weights stay sharded, and FP16 adds DeepSpeed's dynamic loss scaling. So here
"16-mixed"/"16-true" both mean the `fp16` block, "bf16-mixed"/"bf16-true" the `bf16` block and "32-true"
neither; "-true" does not store the weights in half precision (the masters are always fp32, as in
DeepSpeed). The plugin hands backward and the optimizer step to the strategy's `ZeroEngine`, which scales
the fp16 loss, checks overflow, unscales, clips by the config's `gradient_clipping` and steps.

Lightning builds its own plugin from `Trainer(precision=...)`; `ZeroStrategy` and `ZeroFabricStrategy`
convert the standard ones with `to_zero_precision` and reject the rest with one line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import WarningCache
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

__all__ = ["SUPPORTED_PRECISION", "ZeroPrecision", "to_zero_precision"]

SUPPORTED_PRECISION = {
    "32-true": "fp32",
    "16-mixed": "fp16",
    "16-true": "fp16",
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
}
_STANDARD_PLUGINS = {"Precision", "MixedPrecision", "HalfPrecision"}

_warnings = WarningCache()


def _unsupported(owner: str, precision: Any, plugin: str = "") -> ValueError:
    supported = ", ".join(repr(p) for p in SUPPORTED_PRECISION)
    return ValueError(
        f"{owner} does not support precision={precision!r}{plugin}; use one of {supported} "
        "(FP8: plugins=ds_plugin.strategies.Fp8Precision())"
    )


class ZeroPrecision(Precision):
    """Precision for `ZeroStrategy` / `ZeroFabricStrategy`: sets the compute dtype of the ZeRO engine.

    Args:
        precision: "32-true", "16-mixed", "bf16-mixed", "16-true" or "bf16-true".
    """

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in SUPPORTED_PRECISION:
            raise _unsupported(type(self).__name__, precision)
        self.precision = precision
        self.engine: Any = None  # the strategy's ZeroEngine, once set up (clipping by value goes through it)

    @property
    def compute_dtype(self) -> str:
        """The config's dtype name for this precision: "fp32", "fp16" or "bf16"."""
        return SUPPORTED_PRECISION[self.precision]

    def config_overrides(self) -> dict[str, Any]:
        """Config sections this plugin sets beyond the compute dtype (FP8 adds its block)."""
        return {}

    def check_clipping(self, trainer: pl.Trainer) -> None:
        """Warn that a custom `configure_gradient_clipping` does not clip by norm here.

        Args:
            trainer: the Trainer being set up.
        """
        if is_overridden("configure_gradient_clipping", trainer.lightning_module, pl.LightningModule):
            _warnings.warn(
                "configure_gradient_clipping is overridden: its norm clipping is the engine's (the config's "
                "gradient_clipping, inside the step); clipping by value is applied as asked"
            )

    @override
    def backward(  # type: ignore[override]
        self, tensor: Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        if is_overridden("backward", model):
            _warnings.warn(
                "LightningModule.backward is overridden but ignored: the ZeRO engine runs backward (loss scaling, "
                "gradient synchronisation)"
            )
        model.trainer.strategy.engine.backward(
            tensor, retain_graph=bool(kwargs.get("retain_graph")), scale_wrt_gas=False
        )

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        # The engine steps the optimizer itself (unscale, overflow check, clip, step, zero_grad), so the closure
        # runs first here instead of inside `optimizer.step(closure)`.
        closure_result = closure()
        engine = model.trainer.strategy.engine
        # Lightning steps only at an accumulation boundary; say so even when training_step returned None and no
        # backward told the engine, so clipping (inside _after_closure) sees the step's gradients as complete.
        engine.set_gradient_accumulation_boundary(True)
        self._after_closure(model, optimizer)
        engine.step()
        return closure_result

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip by value through the engine; by norm, nothing here: the engine clips by the global norm inside its
        step (`Trainer(gradient_clip_val)` with the "norm" algorithm sets the config's `gradient_clipping`)."""
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE and clip_val:
            if self.engine is None:
                raise RuntimeError("ZeroPrecision.clip_gradients: no engine yet; the strategy sets it up in fit()")
            self.engine.clip_grad_value_(float(clip_val))


def to_zero_precision(plugin: Any, owner: str) -> ZeroPrecision:
    """The `ZeroPrecision` for a precision plugin Lightning or Fabric built from `precision=...`.

    Args:
        plugin: a `ZeroPrecision` (kept), or Lightning's/Fabric's standard 32/16/bf16 plugin (converted).
        owner: the strategy's name, for the error message.

    Raises:
        ValueError: any other plugin ("64-true", "transformer-engine", bitsandbytes, ...), in one line.
    """
    if isinstance(plugin, ZeroPrecision):
        return plugin
    precision = getattr(plugin, "precision", None)
    standard = isinstance(plugin, FabricPrecision) and type(plugin).__name__ in _STANDARD_PLUGINS
    if standard and precision in SUPPORTED_PRECISION:
        return ZeroPrecision(precision)
    raise _unsupported(owner, precision, f" (the {type(plugin).__name__} plugin)" if not standard else "")
