"""`ZeroAcceleratedOptimizer`: what `accelerator.prepare(optimizer)` returns when a `ZeroEngine` trains the model.

Accelerate's `AcceleratedOptimizer.step()` calls the wrapped optimizer's `step()` at accumulation boundaries. Here
the boundary step is the engine's instead (fp16 overflow check and unscale, clipping by the config's
`gradient_clipping`, the optimizer step, zero_grad, the step counters), so `optimizer.step()` in an unchanged script
trains exactly as `engine.step()` does. Everything else (param groups, state dict, LR schedulers built on it) is
Accelerate's wrapper around the optimizer the engine built on the fp32 master shards.
"""

from __future__ import annotations

from typing import Any

from accelerate.optimizer import AcceleratedOptimizer

from ds_plugin.zero.engine import ZeroEngine

__all__ = ["ZeroAcceleratedOptimizer"]


class ZeroAcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper whose boundary step is the engine's.

    Args:
        engine: the engine whose `optimizer` this wraps.
    """

    def __init__(self, engine: ZeroEngine) -> None:
        if engine.optimizer is None:
            raise ValueError("ZeroAcceleratedOptimizer: the engine has no optimizer; prepare the model with one")
        # No device placement: the engine built the optimizer on the master shards, where its state will live.
        super().__init__(engine.optimizer, device_placement=False, scaler=None)
        self.engine = engine

    def step(self, closure: Any = None) -> Any:
        """At an accumulation boundary, run the engine's step; between boundaries, nothing (as Accelerate).

        Args:
            closure: re-evaluates the loss; called once before the step (the engine steps without one).
        """
        if not self.gradient_state.sync_gradients:
            return None
        result = closure() if closure is not None else None
        # The micro-steps before the boundary were counted in `Accelerator.backward`; this one ends the step.
        self.engine.set_gradient_accumulation_boundary(True)
        self._is_overflow = not self.engine.step()
        return result

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Drop the gradients at a boundary (the engine's step already did; a script calling it again is harmless).

        Args:
            set_to_none: accepted for compatibility; gradients are always set to None.
        """
        if self.gradient_state.sync_gradients:
            self.engine.zero_grad()
