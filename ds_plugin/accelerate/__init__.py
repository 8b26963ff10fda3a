"""DeepSpeed ZeRO 0-3, ZeRO++ and mixed precision for Hugging Face Accelerate, on ds_plugin's FSDP2 engine.

In code:

    from ds_plugin.accelerate import Accelerator, ZeroPlugin
    accelerator = Accelerator(zero_plugin=ZeroPlugin("zero3"), mixed_precision="bf16")

Unchanged scripts (plain Accelerate, the HF Trainer, trl):

    accelerate launch --config_file cfg.yaml -m ds_plugin.accelerate --ds-config zeropp.json train.py [args]

Importing this package imports Accelerate (not Lightning); `install()` is what the launch path calls to make every
`accelerate.Accelerator` a ds_plugin one.
"""

from __future__ import annotations

from ds_plugin.accelerate.accelerator import Accelerator
from ds_plugin.accelerate.bootstrap import install
from ds_plugin.accelerate.dummy import DummyOptim, DummyScheduler
from ds_plugin.accelerate.plugin import CONFIG_ENV, ZeroPlugin

__all__ = ["CONFIG_ENV", "Accelerator", "DummyOptim", "DummyScheduler", "ZeroPlugin", "install"]
