"""Generation under ZeRO-3 at inference speed: gather the sharded model once, generate, reshard.

Under ZeRO-3 every FSDP2 unit is all-gathered before its forward and freed after it, so `model.generate` gathers
the whole model again for every token it produces: a 100-token answer moves the model across the network 100
times (DeepSpeed-Chat's Hybrid Engine and trl's "gather once" exist for this). `gathered_for_generation(model)`
gathers each unit once on entry and keeps it gathered for every forward inside the block (FSDP2's pre-forward
finds it unsharded and gathers nothing; its post-forward keeps it), then reshards on exit, so training continues
exactly as before. A frozen base stored as INT8/INT4/NF4/FP6 is gathered as its codes and dequantized layer by layer
as each Linear runs, as in training.

Memory: while inside, every rank holds the whole model's parameters in the form they are gathered in (bf16 for a
bf16 model, codes for a quantized frozen base), as ZeRO-2 does; outside, ZeRO-3's shards only. At ZeRO-0/1/2
(parameters already whole on every rank, or gathered once per forward and kept) the block changes nothing.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["gathered_for_generation", "held_gathered"]

_HELD: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def held_gathered(unit: nn.Module) -> bool:
    """Whether ``unit`` is inside a `gathered_for_generation` block, which keeps it gathered across forwards."""
    return unit in _HELD


def _param_groups(unit: FSDPModule) -> list[Any]:
    # The unit's FSDP2 parameter groups: one list in recent torch releases, one optional group in earlier ones.
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    for group in groups:
        if not hasattr(group, "post_forward_mesh_info"):
            raise RuntimeError(
                f"gathered_for_generation: this torch {torch.__version__}'s FSDP2 keeps no post_forward_mesh_info; "
                "generate outside the block (each forward then gathers its units)"
            )
    return list(groups)


@contextlib.contextmanager
def gathered_for_generation(model: nn.Module) -> Iterator[nn.Module]:
    """Gather every ZeRO-3 unit of ``model`` once, keep the units gathered inside the block, reshard on exit.

    Use it around ``model.generate(...)`` (or any number of forward passes without backward) on every rank at
    once, each rank with its own prompts; gradients are off inside. Works on any model the engine, the Lightning
    strategy or Accelerate prepared (an FSDP2-sharded module), and on an unsharded one (then it does nothing).

    Args:
        model: the prepared model (or the module holding it).

    Yields:
        ``model``.
    """
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    saved: list[tuple[Any, Any]] = []
    states: list[tuple[Any, Any]] = []
    try:
        if units:
            # FSDP2 finds its root on the first forward through it; a peft model's `generate` calls the inner
            # model's, which never enters the root, so before any forward its children would each claim to be root
            # and the next forward through the real root fails. The outermost unit is the root: settle that now.
            units[0]._get_fsdp_state()._lazy_init()
        for unit in units:
            state = unit._get_fsdp_state()
            if hasattr(state, "_auto_reshard_after_forward"):
                states.append((state, state._auto_reshard_after_forward))
                state._auto_reshard_after_forward = False
            for group in _param_groups(unit):
                saved.append((group, group.post_forward_mesh_info))
                group.post_forward_mesh_info = None  # FSDP2's post-forward then keeps the unit gathered
        _HELD.update(units)
        for unit in units:
            unit.unshard()  # one all-gather per unit (a no-op for a unit already gathered)
        with torch.no_grad():
            yield model
    finally:
        for unit in units:
            _HELD.discard(unit)
        for group, info in saved:
            group.post_forward_mesh_info = info
        for state, auto in states:
            state._auto_reshard_after_forward = auto
        for unit in units:
            unit.reshard()
