"""ds_plugin: DeepSpeed's training features on torch.distributed's FSDP2, for Lightning and Accelerate."""

__version__ = "0.1.0"
