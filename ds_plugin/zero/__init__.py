"""The ZeRO engine on FSDP2: the plan, setup, stages 0-3 and ZeRO++ collectives."""

from ds_plugin.zero.apply import apply_zero, is_zero_applied, mixed_precision_policy
from ds_plugin.zero.engine import ZeroEngine
from ds_plugin.zero.init import init_sharded, materialize_, meta_init
from ds_plugin.zero.mesh import ZeroSetupError, data_parallel_mesh
from ds_plugin.zero.optimizer import clip_grad_norm_
from ds_plugin.zero.plan import FrameworkSettings, ZeroPlan, resolve_plan
from ds_plugin.zero.setup import initialize, setup_zero
from ds_plugin.zero.wrap import find_blocks

__all__ = [
    "FrameworkSettings",
    "ZeroEngine",
    "ZeroPlan",
    "ZeroSetupError",
    "apply_zero",
    "clip_grad_norm_",
    "data_parallel_mesh",
    "find_blocks",
    "init_sharded",
    "initialize",
    "is_zero_applied",
    "materialize_",
    "meta_init",
    "mixed_precision_policy",
    "resolve_plan",
    "setup_zero",
]
