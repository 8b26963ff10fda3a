"""`FusedAdam` and `DeepSpeedCPUAdam` as DeepSpeed scripts construct them, built as torch's own Adam/AdamW.

DeepSpeed's two classes are kernels for one update (AdamW, or Adam with the L2 penalty when `adam_w_mode` /
`adamw_mode` is False) with DeepSpeed's defaults (lr 1e-3, weight_decay 0). Here each returns the torch optimizer
with those values; `initialize` rebuilds it on the fp32 masters with torch's fused kernel where there is one, offloaded
or not. DeepSpeed's kernel switches (`set_grad_none`, `fp32_optimizer_states`) change nothing: gradients are dropped to
None and optimizer states are fp32 anyway.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


def _adam(
    params: Any, lr: float, bias_correction: bool, betas: tuple[float, float], eps: float, weight_decay: float,
    amsgrad: bool, adam_w: bool,
) -> torch.optim.Optimizer:  # fmt: skip
    if not bias_correction:
        raise ValueError("bias_correction=False: torch's Adam always corrects the bias; drop the argument")
    cls = torch.optim.AdamW if adam_w else torch.optim.Adam
    return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)


# DeepSpeed's class names, called as scripts call them (a function each: `initialize` rebuilds torch's own class).
def FusedAdam(
    params: Any,
    lr: float = 1e-3,
    bias_correction: bool = True,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    adam_w_mode: bool = True,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    set_grad_none: bool = True,
) -> torch.optim.Optimizer:
    """DeepSpeed's GPU Adam: torch's `AdamW` (or `Adam` with `adam_w_mode=False`) with DeepSpeed's defaults."""
    return _adam(params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adam_w_mode)


def DeepSpeedCPUAdam(
    model_params: Any,
    lr: float = 1e-3,
    bias_correction: bool = True,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    adamw_mode: bool = True,
    fp32_optimizer_states: bool = True,
) -> torch.optim.Optimizer:
    """DeepSpeed's CPU Adam (for offloaded optimizer state): the same torch optimizer as `FusedAdam`."""
    return _adam(model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adamw_mode)
