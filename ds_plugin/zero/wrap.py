"""Which submodules become their own FSDP2 unit: the model's repeated blocks.

Sharding each transformer block separately is what makes stage 3 pay off: only one block's weights are
gathered at a time, and the next block's all-gather overlaps the current block's compute. The blocks are
found the way the Hugging Face integrations find them (the model's `_no_split_modules` class names),
else as the repeated children of an `nn.ModuleList`; `block_types` overrides both.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from torch import nn

from ds_plugin.zero.mesh import ZeroSetupError

__all__ = ["BlockTypes", "find_blocks"]

logger = logging.getLogger(__name__)

BlockTypes = Iterable[type[nn.Module] | str]


def _matches(module: nn.Module, types: tuple[type, ...], names: frozenset[str]) -> bool:
    return isinstance(module, types) or type(module).__name__ in names


def _outermost(model: nn.Module, chosen: set[int]) -> list[nn.Module]:
    """The chosen modules in forward (registration) order, dropping any nested inside another chosen one."""
    out: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or module is model:
            continue
        if id(module) in chosen:
            out.append(module)
            inside.update(id(m) for m in module.modules())
    return out


def _by_type(model: nn.Module, block_types: BlockTypes) -> list[nn.Module]:
    wanted = list(block_types)
    types = tuple(t for t in wanted if isinstance(t, type))
    names = frozenset(t for t in wanted if isinstance(t, str))
    bad = [t for t in wanted if not isinstance(t, type | str)]
    if bad:
        raise ZeroSetupError(
            f"block_types: {bad[0]!r} is neither a module class nor a class name; pass classes or names"
        )
    chosen = {id(m) for m in model.modules() if m is not model and _matches(m, types, names)}
    return _outermost(model, chosen)


def _repeated_children(model: nn.Module) -> list[nn.Module]:
    # A ModuleList whose children share one class is a stack of layers (transformer blocks, ResNet stages).
    chosen: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            kinds = {type(child) for child in module}
            if len(kinds) == 1:
                chosen.update(id(child) for child in module)
    return _outermost(model, chosen)


def find_blocks(model: nn.Module, block_types: BlockTypes | None = None) -> list[nn.Module]:
    """The submodules to shard as separate FSDP2 units, outermost first, in forward order.

    Args:
        model: the model (the root itself is never returned; it is sharded last, on its own).
        block_types: module classes or class names to wrap. None picks them automatically: the
            `_no_split_modules` of the model or of any transformers model inside it, else the repeated children
            of each `nn.ModuleList`.

    Raises:
        ZeroSetupError: `block_types` was given but no submodule matches it.
    """
    if block_types is not None:
        wanted = [block_types] if isinstance(block_types, str | type) else list(block_types)
        blocks = _by_type(model, wanted)
        if not blocks:
            present = sorted({type(m).__name__ for m in model.modules() if m is not model})
            shown = ", ".join(present[:8]) + (", ..." if len(present) > 8 else "")
            asked = ", ".join(t if isinstance(t, str) else t.__name__ for t in wanted)
            raise ZeroSetupError(
                f"block_types: no submodule is a {asked}; use one of the model's module classes ({shown})"
            )
        return blocks
    # Read from every submodule, not only the root: a wrapper (a LightningModule, a peft model, a user's module
    # around a transformers model) holds the model that declares them.
    no_split = sorted({name for m in model.modules() for name in (getattr(m, "_no_split_modules", None) or ())})
    if no_split:
        blocks = _by_type(model, list(no_split))
        if blocks:
            return blocks
        logger.debug("_no_split_modules %s matched nothing; falling back to repeated ModuleList children", no_split)
    blocks = _repeated_children(model)
    if not blocks:
        logger.info("no repeated blocks found in %s: the whole model is one ZeRO unit", type(model).__name__)
    return blocks
