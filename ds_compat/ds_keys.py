"""What DeepSpeed 0.19 accepts in a ds_config, sorted by what the FSDP2 backend does with it.

DeepSpeed reads the top level as a plain dict (unknown keys are ignored), but its pydantic sections forbid keys
they do not define: those sections and their keys (field names and aliases) are listed in `STRICT_SECTIONS`.
`tests/test_ds_config.py` checks these tables against the installed DeepSpeed's models.
"""

from __future__ import annotations

_REMOVED = "removed from DeepSpeed (issue deepspeedai/DeepSpeed#8489), which rejects the key"

# Top-level keys DeepSpeed 0.19 rejects outright, with what replaced them.
REMOVED_TOP_LEVEL: dict[str, str] = {
    "nebula": f"Nebula checkpointing was {_REMOVED}",
    "compression_training": f"the compression library (quantization / pruning training) was {_REMOVED}",
    "amp": f"NVIDIA Apex AMP was {_REMOVED}; use 'bf16'",
    "quantize_training": f"Mixture-of-Quantization was {_REMOVED}",
    "sparse_gradients": f"sparse embedding-gradient compression was {_REMOVED}",
    "eigenvalue": f"eigenvalue-based MoQ was {_REMOVED}",
    "sparse_attention": f"Sparse Attention was {_REMOVED}",
    "elasticity": f"elastic training was {_REMOVED}; set the batch keys directly",
    "graph_harvesting": f"graph harvesting was {_REMOVED}",
    "curriculum_learning": f"top-level curriculum learning was {_REMOVED}",
    "progressive_layer_drop": f"Progressive Layer Drop was {_REMOVED}",
}
REMOVED_ZERO: dict[str, str] = {
    "mics_shard_size": f"MiCS sharding was {_REMOVED}",
    "mics_hierarchical_params_gather": f"MiCS sharding was {_REMOVED}",
    "zeropp_loco_param": f"LoCo-ZeRO++ was {_REMOVED}",
}

# zero_optimization: alias -> field name (DeepSpeed accepts either spelling, not both).
ZERO_ALIASES: dict[str, str] = {
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_model_persistence_threshold": "model_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save": "gather_16bit_weights_on_model_save",
    "stage3_module_granularity_threshold": "module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params": "use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential": "allgather_sequential",
}
# zero_optimization bucket sizes (elements) and DeepSpeed 0.19's defaults: they set the FSDP2 unit size
# (parallel.fsdp_plan.unit_mib): reduce / all-gather buckets at stages 0-2, the prefetch bucket at stage 3.
BUCKET_KEYS: dict[str, float] = {
    "reduce_bucket_size": 5e8,
    "allgather_bucket_size": 5e8,
    "stage3_prefetch_bucket_size": 5e7,
    "prefetch_bucket_size": 5e7,
}
# zero_optimization keys that tune DeepSpeed's own buckets, streams, partitioning and checkpoint gathering.
ZERO_NO_EFFECT: frozenset[str] = frozenset(
    {
        "contiguous_gradients",
        "reduce_scatter",
        "use_multi_rank_bucket_allreduce",
        "allgather_partitions",
        "overlap_comm",
        "compute_grad_norm",
        "load_from_fp32_weights",
        "elastic_checkpoint",
        "sub_group_size",
        "cpu_offload_use_pin_memory",
        "stage3_gather_fp16_weights_on_model_save",
        "ignore_unused_parameters",
        "legacy_stage1",
        "round_robin_gradients",
        "parameter_alignment",
        "memory_efficient_linear",
        "pipeline_loading_checkpoint",
        "override_module_apply",
        "log_trace_cache_warnings",
        "enable_sanity_checks",
        "save_muon_momentum_buffer_in_memory",
        "leaf_module",
        *(alias for alias in ZERO_ALIASES if alias not in BUCKET_KEYS),
        *(name for name in ZERO_ALIASES.values() if name not in BUCKET_KEYS),
    }
)
# zero_optimization keys read by the translation; with ZERO_NO_EFFECT and the cannot-honour ones below, all of
# DeepSpeedZeroConfig.
ZERO_MAPPED: frozenset[str] = frozenset(
    {"stage", "offload_param", "offload_optimizer", "cpu_offload", "cpu_offload_param"}
)
# zero_optimization keys refused when they enable their feature (true, or a section given), with the reason.
ZERO_UNSUPPORTED: dict[str, str] = {
    "zero_quantized_weights": "ZeRO++ quantized weight communication changes the numerics",
    "zero_quantized_gradients": "ZeRO++ quantized gradient communication changes the numerics",
    "zero_quantized_nontrainable_weights": "ZeRO++ quantized frozen weights change the numerics",
    "zenflow": "ZenFlow's stale-gradient CPU optimizer changes the updates",
}
# zero_optimization.zero_hpz_partition_size: ZeRO++'s secondary parameter partition; its default (1: none) is taken.
HPZ_KEY = "zero_hpz_partition_size"

OFFLOAD_PARAM_KEYS = frozenset({"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"})
OFFLOAD_OPTIMIZER_KEYS = frozenset(
    {
        "device",
        "nvme_path",
        "buffer_count",
        "pin_memory",
        "pipeline_read",
        "pipeline_write",
        "fast_init",
        "ratio",
        "super_offload",
        "cpuadam_cores_perc",
    }
)
# The fp16 section's loss-scaling keys (mapped onto training.loss_scale), then all its keys.
FP16_SCALING_KEYS = (
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
)
FP16_KEYS = frozenset({"enabled", "auto_cast", *FP16_SCALING_KEYS, "fp16_master_weights_and_grads"})
BF16_KEYS = frozenset(
    {
        "enabled",
        "immediate_grad_update",
        "check_grad_overflow",
        "bf16_master_weights_and_grads",
        "bf16_optimizer_states",
    }
)
_MONITOR_PATH_KEYS = frozenset({"enabled", "output_path", "job_name"})

# Sections whose DeepSpeed model forbids undefined keys (nested offload sections are checked on their own).
STRICT_SECTIONS: dict[str, frozenset[str]] = {
    "zero_optimization": ZERO_MAPPED
    | frozenset(BUCKET_KEYS)
    | ZERO_NO_EFFECT
    | frozenset(ZERO_UNSUPPORTED)
    | {HPZ_KEY},
    "fp16": FP16_KEYS,
    "bf16": BF16_KEYS,
    "bfloat16": BF16_KEYS,
    "tensorboard": _MONITOR_PATH_KEYS,
    "csv_monitor": _MONITOR_PATH_KEYS,
    "wandb": frozenset({"enabled", "group", "team", "project"}),
    "comet": frozenset(
        {
            "enabled",
            "samples_log_interval",
            "project",
            "workspace",
            "api_key",
            "experiment_name",
            "experiment_key",
            "online",
            "mode",
        }
    ),
    "comms_logger": frozenset({"enabled", "prof_all", "prof_ops", "verbose", "debug"}),
    "hybrid_engine": frozenset(
        {
            "enabled",
            "max_out_tokens",
            "inference_tp_size",
            "release_inference_cache",
            "pin_parameters",
            "tp_gather_partition_size",
            "enable_cuda_graph",
        }
    ),
    "compile": frozenset(
        {
            "deepcompile",
            "autoep_non_moe",
            "free_activation",
            "free_activation_threshold",
            "offload_activation",
            "offload_activation_pin_memory",
            "offload_opt_states",
            "double_buffer",
            "symmetric_memory",
            "debug_log",
            "offload_parameters",
            "sync_before_reduce",
            "sync_after_reduce",
            "sync_before_allgather",
            "sync_after_allgather",
            "keep_int_input_tensors",
            "keep_all_input_tensors",
            "passes",
        }
    ),
    "tensor_parallel": frozenset(
        {
            "autotp_size",
            "dtype",
            "tp_overlap_comm",
            "vocab_parallel_lm_head",
            "vocab_parallel_ce_backend",
            "tensor_parallel",
            "tp",
            "preset_model",
            "partition_config",
            "injection_policy_tuple",
            "keep_module_on_host",
            "replace_with_kernel_inject",
            "kernel_inject",
        }
    ),
}

# Top-level keys that only tune DeepSpeed's own machinery (profilers, timers, its data loader, its checkpoint
# engine, its async I/O): accepted and listed as having no effect on the FSDP2 backend.
NO_EFFECT_TOP: frozenset[str] = frozenset(
    {
        "prescale_gradients",
        "gradient_predivide_factor",
        "disable_allgather",
        "dump_state",
        "disable_python_gc",
        "wall_clock_breakdown",
        "memory_breakdown",
        "flops_profiler",
        "comms_logger",
        "timers",
        "autotuning",
        "log_level",
        "vocabulary_size",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "seq_parallel_communication_data_type",
        "dataloader_drop_last",
        "aio",
        "datastates_ckpt",
    }
)

# Top-level keys the translation reads (the rest of what DeepSpeed knows is in the tables above).
MAPPED_TOP: frozenset[str] = frozenset(
    {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "managed_gradient_accumulation",
        "optimizer",
        "scheduler",
        "gradient_clipping",
        "gradient_allreduce_op",
        "zero_optimization",
        "fp16",
        "bf16",
        "bfloat16",
        "torch_autocast",
        "communication_data_type",
        "data_types",
        "sequence_parallel_size",
        "data_parallel_size",
        "steps_per_print",
        "tensorboard",
        "csv_monitor",
        "wandb",
        "comet",
        "activation_checkpointing",
        "hybrid_engine",
        "pipeline",
        "data_efficiency",
        "tensor_parallel",
        "expert_parallel",
        "use_data_before_expert_parallelism",
        "weight_quantization",
        "checkpoint",
        "compile",
    }
)
# The ds_config section of this backend's own keys (ds_compat/extension.py); DeepSpeed ignores it.
EXTENSION_KEY = "glm45v_fsdp"
KNOWN_TOP: frozenset[str] = MAPPED_TOP | NO_EFFECT_TOP | frozenset(REMOVED_TOP_LEVEL) | {EXTENSION_KEY}

ACTIVATION_CHECKPOINTING_KEYS = frozenset(
    {
        "partition_activations",
        "number_checkpoints",
        "contiguous_memory_optimization",
        "cpu_checkpointing",
        "profile",
        "synchronize_checkpoint_boundary",
    }
)

# DeepSpeed 0.19's AutoEP section (deepspeed/module_inject/auto_ep_config.py, parse_autoep_config): every key it reads.
EXPERT_PARALLEL_KEYS: frozenset[str] = frozenset(
    {
        "enabled",
        "autoep_size",
        "expert_tensor_parallel_size",
        "validate_folding_routing",
        "async_split_plan",
        "preset_model",
        "moe_layer_pattern",
        "expert_pattern",
        "router_pattern",
        "use_grouped_mm",
        "disable_triton_grouped_mm",
        "route_norm",
        "route_scale",
        "score_apply",
        "combine_impl",
        "row_weighting_impl",
        "gate_up_impl",
        "comm_backend",
        "comm_num_sm",
        "comm_qp_margin",
        "comm_max_tokens_per_rank",
        "num_expert_groups",
        "num_limited_groups",
        "score_func",
        "top_k",
        "load_balance_coeff",
        "routed_scaling_factor",
        "expert_w1",
        "expert_w2",
        "expert_w3",
        "num_experts_attr",
        "top_k_attr",
        "has_shared_experts",
        "shared_experts_pattern",
        "shared_experts_gate_pattern",
        "expert_activation",
    }
)
# AutoEP's routing overrides and the defaults that leave the model's own routing alone.
EXPERT_PARALLEL_ROUTING: dict[str, object] = {
    "route_norm": None,
    "route_scale": 1.0,
    "score_apply": "auto",
    "score_func": "auto",
    "top_k": "auto",
    "routed_scaling_factor": "auto",
    "num_expert_groups": None,
    "num_limited_groups": None,
}
