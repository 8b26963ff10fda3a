"""DeepSpeed's Python API on ds_plugin: `import ds_plugin.deepspeed as deepspeed` and a DeepSpeed script runs.

    import ds_plugin.deepspeed as deepspeed
    parser = deepspeed.add_config_arguments(parser)
    engine, optimizer, trainloader, lr_scheduler = deepspeed.initialize(
        args=args, model=net, model_parameters=net.parameters(), training_data=trainset)
    for x, y in trainloader:
        loss = criterion(engine(x.to(engine.local_rank)), y)
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint("ckpt")

`initialize` reads the config (`config`, `config_params`, or `args.deepspeed_config`) before anything starts, joins
the process group the launcher describes (`init_distributed`), and sets the model up with ds_plugin's one setup
path: the JSON's `optimizer` block is built unless one is passed in code, and its `scheduler` block unless one is
passed. `zero.Init`, `zero.GatheredParameters`, `checkpointing` (activation checkpointing), `comm`,
`accelerator.get_accelerator` and `ops.adam` (`FusedAdam`, `DeepSpeedCPUAdam`) are in their modules; `ds-plugin
launch` (`launcher.py`) starts the ranks. The names load on first use, so the `ds-plugin` command can reach the
launcher without torch. What is not covered, and why, is in the README ("DeepSpeed scripts").
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "DeepSpeedEngine",
    "accelerator",
    "add_config_arguments",
    "checkpointing",
    "comm",
    "init_distributed",
    "initialize",
    "launcher",
    "ops",
    "zero",
]

__version__ = "0.19.8"
"""The DeepSpeed release whose API and numbers this follows (for scripts that print or compare `__version__`)."""

_WHERE = {
    "initialize": "ds_plugin.deepspeed.api",
    "add_config_arguments": "ds_plugin.deepspeed.api",
    "init_distributed": "ds_plugin.deepspeed.comm",
    "DeepSpeedEngine": "ds_plugin.deepspeed.engine",
}
_MODULES = ("comm", "zero", "checkpointing", "launcher", "engine", "api", "accelerator", "ops")


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    if name in _MODULES:
        return importlib.import_module(f"ds_plugin.deepspeed.{name}")
    raise AttributeError(f"module 'ds_plugin.deepspeed' has no attribute {name!r}")
