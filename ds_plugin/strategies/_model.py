"""What the adapters need to know about a framework's model: the transformers models inside a LightningModule (for
exports).
"""

from __future__ import annotations

import sys

from torch import nn

__all__ = ["hf_models"]


def hf_models(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, model) of the outermost transformers models inside `module`; empty if transformers is not imported.

    Args:
        module: e.g. a LightningModule holding a `PreTrainedModel` (or a peft model around one).
    """
    if "transformers" not in sys.modules:
        return []
    from transformers import PreTrainedModel

    found: list[tuple[str, nn.Module]] = []
    for name, m in module.named_modules():
        if isinstance(m, PreTrainedModel) and not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, m))
    return found
