"""DeepSpeed's `deepspeed.ops` optimizers, imported by name: `from ds_plugin.deepspeed.ops.adam import FusedAdam`."""
