"""DeepSpeed keys that are accepted but have no effect on FSDP2, each with the reason shown to the user."""

FSDP_BUCKETS = "FSDP2 groups communication per wrapped block, not by byte-sized buckets"
DS_RUNTIME_ONLY = "a DeepSpeed-engine feature with no counterpart here"
FETCH_BY_ALL_GATHER = "FSDP2 fetches each block's weights with one all-gather"
GRANULARITY = "blocks to wrap are chosen from the model's structure"
CONTIGUOUS_GRADIENTS = "FSDP2 reduce-scatters each block's gradients from one flat buffer already"
SUB_GROUPS = (
    "each rank's optimizer step runs over its whole shard at once (torch's fused/foreach kernels); DeepSpeed's "
    "sub-groups bound the step's working memory, mostly under NVMe offload, which is not built here"
)
FP8_NO_LOSS_SCALE = (
    "DeepSpeed reads no fp8 block; here FP8 scales come from each tensor's own values (the recipe), with no "
    "dynamic loss scale"
)

# DeepSpeed's ZeRO model takes each `stage3_*` key under a plain field name too (the `stage3_*` spelling is the
# pydantic alias); both spellings are listed wherever the key is ignored.

ZERO_IGNORED = {
    "reduce_scatter": "gradients are always reduce-scattered by FSDP2",
    "use_multi_rank_bucket_allreduce": FSDP_BUCKETS,
    "allgather_partitions": "FSDP2 always all-gathers shards",
    "compute_grad_norm": "the global norm is computed when gradient_clipping > 0",
    "load_from_fp32_weights": "checkpoints always hold the fp32 master weights",
    "elastic_checkpoint": "checkpoints reshard to any world size anyway",
    "stage3_model_persistence_threshold": "FSDP2 shards every parameter",
    "model_persistence_threshold": "FSDP2 shards every parameter",
    "stage3_module_granularity_threshold": GRANULARITY,
    "module_granularity_threshold": GRANULARITY,
    "stage3_use_all_reduce_for_fetch_params": FETCH_BY_ALL_GATHER,
    "use_all_reduce_for_fetch_params": FETCH_BY_ALL_GATHER,
    "stage3_allgather_sequential": FETCH_BY_ALL_GATHER,
    "allgather_sequential": FETCH_BY_ALL_GATHER,
    "ignore_unused_parameters": "FSDP2 handles unused parameters",
    "legacy_stage1": DS_RUNTIME_ONLY,
    "round_robin_gradients": DS_RUNTIME_ONLY,
    "parameter_alignment": DS_RUNTIME_ONLY,
    "memory_efficient_linear": DS_RUNTIME_ONLY,
    "pipeline_loading_checkpoint": DS_RUNTIME_ONLY,
    "override_module_apply": DS_RUNTIME_ONLY,
    "log_trace_cache_warnings": DS_RUNTIME_ONLY,
    "enable_sanity_checks": DS_RUNTIME_ONLY,
    "save_muon_momentum_buffer_in_memory": DS_RUNTIME_ONLY,
    "leaf_module": GRANULARITY,
    "zenflow": DS_RUNTIME_ONLY,
    "mics_shard_size": DS_RUNTIME_ONLY,
    "mics_hierarchical_params_gather": DS_RUNTIME_ONLY,
    "zeropp_loco_param": DS_RUNTIME_ONLY,
}

TOP_LEVEL_IGNORED = {
    "steps_per_print": "progress is reported by the framework's logger",
    "wall_clock_breakdown": DS_RUNTIME_ONLY,
    "memory_breakdown": "use `ds-plugin bench zero-memory`",
    "dump_state": DS_RUNTIME_ONLY,
    "prescale_gradients": "gradients are averaged once, by the reduce-scatter",
    "gradient_predivide_factor": "gradients are averaged once, by the reduce-scatter",
    "gradient_allreduce_op": "gradients are always averaged",
    "zero_allow_untested_optimizer": "every torch.optim optimizer is allowed",
    "zero_force_ds_cpu_optimizer": "the optimizer step runs torch's own kernels",
    "disable_allgather": DS_RUNTIME_ONLY,
    "sparse_gradients": DS_RUNTIME_ONLY,
    "amp": "use fp16 or bf16 instead of apex AMP",
    "torch_autocast": "use fp16 or bf16; precision plugins set autocast",
    "activation_checkpointing": (
        "the engine does not read it (nor does DeepSpeed's): a script's `deepspeed.checkpointing.configure(None, "
        "deepspeed_config=...)` does (ds_plugin.deepspeed.checkpointing); or use your framework's activation "
        "checkpointing"
    ),
    "flops_profiler": DS_RUNTIME_ONLY,
    "tensorboard": "logging belongs to the framework",
    "wandb": "logging belongs to the framework",
    "csv_monitor": "logging belongs to the framework",
    "comet": "logging belongs to the framework",
    "monitor_config": "logging belongs to the framework",
    "comms_config": "not a DeepSpeed key (DeepSpeed skips it; its collective logging is `comms_logger`)",
    "hybrid_engine": "generation runs the model as is (DeepSpeed-Chat inference engine not needed)",
    "aio": "NVMe offload is not supported",
    "checkpoint": "checkpoints are torch.distributed.checkpoint directories",
    "elasticity": DS_RUNTIME_ONLY,
    "pipeline": "pipeline parallelism is not part of ds_plugin",
    "progressive_layer_drop": DS_RUNTIME_ONLY,
    "curriculum_learning": DS_RUNTIME_ONLY,
    "data_efficiency": DS_RUNTIME_ONLY,
    "compression_training": DS_RUNTIME_ONLY,
    "eigenvalue": DS_RUNTIME_ONLY,
    "quantize_training": DS_RUNTIME_ONLY,
    "autotuning": DS_RUNTIME_ONLY,
    "nebula": DS_RUNTIME_ONLY,
    "compile": "call torch.compile on the model yourself",
    "weight_quantization": "weights are never stored quantized here (quantized initialization is not built)",
    "tensor_parallel": "tensor parallelism is not part of ds_plugin",
    "sequence_parallel_size": "sequence parallelism is not part of ds_plugin",
    "sequence_parallel": "sequence parallelism is not part of ds_plugin (this block is switched off)",
    "seq_parallel_communication_data_type": "sequence parallelism is not part of ds_plugin",
    "timers": DS_RUNTIME_ONLY,
    "dataloader_drop_last": "data loading belongs to the framework",
    "disable_python_gc": DS_RUNTIME_ONLY,
    "use_data_before_expert_parallelism": "expert parallelism is not part of ds_plugin",
    "log_level": "use Python logging",
    "memory_efficient_linear": DS_RUNTIME_ONLY,
    "zero_optimization_stage": DS_RUNTIME_ONLY,
    "sparse_attention": "DeepSpeed removed Sparse Attention (0.19.8 refuses this block); no sparse kernels here",
    "graph_harvesting": "DeepSpeed removed graph harvesting (0.19.8 refuses this key)",
    "expert_parallel": "expert parallelism is not part of ds_plugin",
    "managed_gradient_accumulation": (
        "the engine steps at the accumulation boundary (set_gradient_accumulation_boundary moves it)"
    ),
    "vocabulary_size": "DeepSpeed only warns when it is not a multiple of 8; nothing here reads it",
    "datastates_ckpt": "checkpoints are torch.distributed.checkpoint directories",
}
