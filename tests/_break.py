"""Test-only sabotage switches, to prove the training tests can fail (never imported by the library).

With ``DS_PLUGIN_TEST_NOOP_STEP=1`` in the environment, :func:`install` makes the ``step`` of every
``torch.optim.Optimizer`` built afterwards a no-op: the weights and the optimizer state never change. A training
test that still passes under it cannot tell a run that learns from one that does not.

The switch reaches every process of a test because they all inherit the environment and call :func:`install`
before building an optimizer: ``tests/conftest.py`` (the pytest process), the `run_ranks` workers of the tests
that train, and ``tests/strategies/scripts/_tiny_lightning.run`` (every Lightning script and the ranks
Lightning's launcher re-runs it as).
"""

from __future__ import annotations

import functools
import os
import types
from typing import Any

__all__ = ["NOOP_STEP", "install"]

NOOP_STEP = "DS_PLUGIN_TEST_NOOP_STEP"


def install() -> bool:
    """Apply the switches the environment asks for; return whether the no-op step is on. Idempotent."""
    if os.environ.get(NOOP_STEP) != "1":
        return False
    import torch

    init = torch.optim.Optimizer.__init__
    if getattr(init, "_ds_plugin_noop_step", False):
        return True

    @functools.wraps(init)
    def __init__(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        # On the instance, so every subclass is caught whatever its own `step`; a bound method, because
        # LRScheduler re-wraps `optimizer.step` through its `__func__`.
        self.step = types.MethodType(_noop_step, self)

    __init__._ds_plugin_noop_step = True  # type: ignore[attr-defined]
    torch.optim.Optimizer.__init__ = __init__
    return True


def _noop_step(self: Any, closure: Any = None) -> Any:
    # Lightning runs `training_step` and backward inside the closure it hands to `step`: run it, update nothing.
    if closure is None:
        return None
    import torch

    with torch.enable_grad():
        return closure()
