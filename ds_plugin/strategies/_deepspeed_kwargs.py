"""Lightning's `DeepSpeedStrategy(...)` keyword arguments, read as DeepSpeed config keys, so a Trainer or Fabric that
built Lightning's DeepSpeed strategy from keywords switches by the class name alone:

    DeepSpeedStrategy(stage=3, offload_optimizer=True, allgather_bucket_size=5e8)   # Lightning's
    ZeroStrategy(stage=3, offload_optimizer=True, allgather_bucket_size=5e8)        # the same run here

Each keyword becomes the DeepSpeed key Lightning writes it to (`stage` -> `zero_optimization.stage`,
`offload_optimizer` -> `zero_optimization.offload_optimizer.device`, `loss_scale` -> `fp16.loss_scale`, ...), merged
over the strategy's config like any other override, so the config's own rules (acted on, or reported ignored with
the reason) apply to it. The few that are Lightning's alone are said to have no effect, with the reason.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

__all__ = ["translate"]

logger = logging.getLogger(__name__)

_ZERO = ("stage", "sub_group_size", "contiguous_gradients", "overlap_comm", "allgather_partitions", "reduce_scatter",
         "allgather_bucket_size", "reduce_bucket_size")  # fmt: skip
_FP16 = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")
_CHECKPOINTING = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                  "synchronize_checkpoint_boundary")  # fmt: skip
_NVME = ("nvme_path", "params_buffer_count", "params_buffer_size", "max_in_cpu", "optimizer_buffer_count", "block_size",
         "queue_depth", "single_submit", "overlap_events", "thread_count")  # fmt: skip
_LIGHTNING_ONLY = {
    "logging_batch_size_per_gpu": "the micro batch comes from the dataloader (or the config's "
    "train_micro_batch_size_per_gpu)",
    "logging_level": "ds_plugin logs through Python's logging",
    "remote_device": "the model is built where the script builds it and sharded at setup (for sharded initialisation "
    "build it on the meta device or use ds_plugin.load_pretrained)",
    "load_full_weights": "ckpt_path loads ds_plugin's checkpoint directories; load a whole-weights file into the "
    "model before fit",
}
NAMES = frozenset(
    {
        *_ZERO,
        *_FP16,
        *_CHECKPOINTING,
        *_NVME,
        *_LIGHTNING_ONLY,
        "zero_optimization",
        "offload_optimizer",
        "offload_parameters",
        "offload_optimizer_device",
        "offload_params_device",
        "pin_memory",
        "zero_allow_untested_optimizer",
    }
)
"""Every keyword of Lightning's DeepSpeedStrategy this reads (the others are Lightning's strategy arguments)."""


def translate(kwargs: Mapping[str, Any], owner: str) -> dict[str, Any]:
    """The DeepSpeed overrides for Lightning's DeepSpeedStrategy keywords in `kwargs`; the other keywords pass as is.

    Args:
        kwargs: the strategy constructor's keywords.
        owner: the strategy's class name, for what is said.
    """
    out = {k: v for k, v in kwargs.items() if k not in NAMES or (k == "zero_optimization" and isinstance(v, Mapping))}
    zero: dict[str, Any] = dict(out.get("zero_optimization", {}))
    if kwargs.get("zero_optimization") is False:
        zero["stage"] = 0
    zero.update({k: kwargs[k] for k in _ZERO if k in kwargs})
    # Lightning writes its own default (False) into each offload block it makes; DeepSpeed's is True.
    pin = {"pin_memory": kwargs.get("pin_memory", False)}
    if kwargs.get("offload_optimizer"):
        zero["offload_optimizer"] = {"device": kwargs.get("offload_optimizer_device", "cpu"), **pin}
    if kwargs.get("offload_parameters"):
        zero["offload_param"] = {"device": kwargs.get("offload_params_device", "cpu"), **pin}
    if zero:
        out["zero_optimization"] = zero
    if any(k in kwargs for k in _FP16):
        out["fp16"] = {**out.get("fp16", {}), **{k: kwargs[k] for k in _FP16 if k in kwargs}}
    if any(k in kwargs for k in _CHECKPOINTING):
        out["activation_checkpointing"] = {k: kwargs[k] for k in _CHECKPOINTING if k in kwargs}
    if "zero_allow_untested_optimizer" in kwargs:
        out["zero_allow_untested_optimizer"] = kwargs["zero_allow_untested_optimizer"]
    for key in kwargs:
        if key in _LIGHTNING_ONLY:
            logger.info("%s: %s has no effect here (%s)", owner, key, _LIGHTNING_ONLY[key])
        elif key in _NVME:
            logger.info("%s: %s has no effect here (NVMe offload is not supported)", owner, key)
    return out
