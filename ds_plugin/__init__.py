"""ds_plugin: DeepSpeed's ZeRO, ZeRO++ and mixed precision on torch.distributed's FSDP2.

Public verbs: `load_config` (a preset name, a DeepSpeed JSON/YAML path, or a dict), `initialize` (model +
config -> ZeRO engine), `init_distributed` (DeepSpeed's: the process group, a 10-minute collective
timeout), `apply_zero`, `quantize_frozen_` (frozen Linear weights stored as INT8 / INT4 / NF4),
`save_adapter` (a peft adapter trained at any ZeRO stage, saved whole), `load_pretrained` (a Hugging Face
safetensors checkpoint streamed into a ZeRO model, each rank reading only its rows), `gathered_for_generation` (a
ZeRO-3 model gathered once for `generate`, resharded after), and the config types. Importing the
package also makes the Lightning strategy names (zero0..zero3, zero3_offload, zeropp) available: at once when
Lightning is already imported, else the moment it is.
"""

from __future__ import annotations

import importlib

from ds_plugin.config import ConfigError, TrainingConfig, from_deepspeed
from ds_plugin.presets import PRESETS, get_preset, load_config
from ds_plugin.strategies.registry import register_when_lightning_loads

__version__ = "0.1.0"

__all__ = ["PRESETS", "ConfigError", "TrainingConfig", "from_deepspeed", "get_preset", "load_config"]


# Lightning finds strategy names only in its registry: make "zeropp" & co. resolvable (see strategies/registry.py).
register_when_lightning_loads()


def __getattr__(name: str):
    # The engine imports torch.distributed; keep `import ds_plugin` cheap for config-only users (the CLI).
    if name == "initialize":
        from ds_plugin.zero.setup import initialize

        return initialize
    if name == "ZeroEngine":
        from ds_plugin.zero.engine import ZeroEngine

        return ZeroEngine
    if name == "apply_zero":
        from ds_plugin.zero.apply import apply_zero

        return apply_zero
    if name == "init_distributed":
        from ds_plugin.runtime.faults import init_distributed

        return init_distributed
    if name == "save_adapter":
        from ds_plugin.peft_adapters import save_adapter

        return save_adapter
    if name == "load_pretrained":
        from ds_plugin.checkpoint.hf_stream import load_pretrained

        return load_pretrained
    if name == "gathered_for_generation":
        from ds_plugin.zero.generation import gathered_for_generation

        return gathered_for_generation
    if name == "quantize_frozen_":
        from ds_plugin.quant.frozen.quantize import quantize_frozen_

        return quantize_frozen_
    if name == "strategies":  # `ds_plugin.strategies.ZeroStrategy(...)` after a bare `import ds_plugin`
        return importlib.import_module("ds_plugin.strategies")
    raise AttributeError(f"module 'ds_plugin' has no attribute {name!r}")
