"""`deepspeed.runtime.zero.config`: the zero_optimization section as DeepSpeed's DeepSpeedZeroConfig reads it.

Field names, aliases (the `stage3_` spellings), defaults, bounds and the checks across fields are DeepSpeed 0.19's,
so a script reading `ds_config.zero_config.offload_param.device` or `.prefetch_bucket_size` sees the same value and a
bad section fails with the same error class (pydantic's ValidationError). Which keys change anything under FSDP2,
and how, is ds_compat/ds_keys.py's table and the translator's mapping (docs/ds_compat.md); the keys this model
accepts are checked against that table by tests/test_ds_runtime_modules.py.
"""

from __future__ import annotations

import sys
from enum import Enum
from typing import Any

from pydantic import Field, field_validator, model_validator

from ds_compat.runtime.config_utils import DeepSpeedConfigModel, logger
from ds_compat.zero.offload_config import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
)

ZERO_OPTIMIZATION = "zero_optimization"
# The MoE blocks DeepSpeed keeps whole under ZeRO-3 unless leaf_module.classes says otherwise.
DEFAULT_LEAF_MODULE_CLASSES = [
    f"transformers.models.{name}.modeling_{name}.{block}"
    for name, block in (
        ("mixtral", "MixtralSparseMoeBlock"),
        ("qwen2_moe", "Qwen2MoeSparseMoeBlock"),
        ("qwen3_moe", "Qwen3MoeSparseMoeBlock"),
    )
]


class ZeroStageEnum(int, Enum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3  # an alias of `weights`


class DeepSpeedZeroLeafModuleConfig(DeepSpeedConfigModel):
    """`zero_optimization.leaf_module`: module classes, names or name suffixes ZeRO-3 keeps whole (ds_compat.utils
    set_z3_leaf_modules flags them the same way). A single string stands for a one-element list."""

    classes: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    names: list[str] = Field(default_factory=list)
    name_suffixes: list[str] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _strings_are_lists(cls, values: Any) -> Any:
        if values is None:
            return {}
        if not isinstance(values, dict):
            raise TypeError(
                f"zero_optimization.leaf_module must be a section (classes / names / name_suffixes), got {values!r}"
            )
        return {key: [value] if isinstance(value, str) else value for key, value in values.items()}


def _offload_to_cpu(section: type) -> Any:
    return lambda enabled: section(device=OffloadDeviceEnum.cpu) if enabled else None


class DeepSpeedZeroConfig(DeepSpeedConfigModel):
    stage: ZeroStageEnum = 0
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = Field(500_000_000, gt=0)
    use_multi_rank_bucket_allreduce: bool = True
    allgather_partitions: bool = True
    allgather_bucket_size: int = Field(500_000_000, ge=0)
    overlap_comm: bool | None = None  # None: on for stage 3 only
    compute_grad_norm: bool = True
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    offload_param: DeepSpeedZeroOffloadParamConfig | None = None
    offload_optimizer: DeepSpeedZeroOffloadOptimizerConfig | None = None
    zenflow: dict | None = None  # the translator refuses ZenFlow; kept as given
    sub_group_size: int = Field(1_000_000_000, ge=0)
    cpu_offload_param: bool | None = None  # deprecated: offload_param
    cpu_offload_use_pin_memory: bool | None = None  # deprecated, no effect
    cpu_offload: bool | None = None  # deprecated: offload_optimizer
    prefetch_bucket_size: int = Field(50_000_000, ge=0, alias="stage3_prefetch_bucket_size")
    param_persistence_threshold: int = Field(100_000, ge=0, alias="stage3_param_persistence_threshold")
    model_persistence_threshold: int = Field(sys.maxsize, ge=0, alias="stage3_model_persistence_threshold")
    max_live_parameters: int = Field(1_000_000_000, ge=0, alias="stage3_max_live_parameters")
    max_reuse_distance: int = Field(1_000_000_000, ge=0, alias="stage3_max_reuse_distance")
    gather_16bit_weights_on_model_save: bool = Field(False, alias="stage3_gather_16bit_weights_on_model_save")
    module_granularity_threshold: int = Field(0, alias="stage3_module_granularity_threshold")
    use_all_reduce_for_fetch_params: bool = Field(False, alias="stage3_use_all_reduce_for_fetch_params")
    allgather_sequential: bool = Field(False, alias="stage3_allgather_sequential")
    stage3_gather_fp16_weights_on_model_save: bool = False  # deprecated: gather_16bit_weights_on_model_save
    ignore_unused_parameters: bool = True
    legacy_stage1: bool = False
    round_robin_gradients: bool = False
    parameter_alignment: bool = False
    zero_hpz_partition_size: int = Field(1, ge=0)
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    memory_efficient_linear: bool = True
    pipeline_loading_checkpoint: bool = False
    override_module_apply: bool = True
    log_trace_cache_warnings: bool = False
    enable_sanity_checks: bool = False
    save_muon_momentum_buffer_in_memory: bool = False
    leaf_module: DeepSpeedZeroLeafModuleConfig = Field(default_factory=DeepSpeedZeroLeafModuleConfig)

    DEPRECATED = {
        "cpu_offload_param": ("offload_param", _offload_to_cpu(DeepSpeedZeroOffloadParamConfig)),
        "cpu_offload_use_pin_memory": (None, lambda value: value),
        "cpu_offload": ("offload_optimizer", _offload_to_cpu(DeepSpeedZeroOffloadOptimizerConfig)),
        "stage3_gather_fp16_weights_on_model_save": ("gather_16bit_weights_on_model_save", lambda value: value),
    }

    @field_validator("zenflow", mode="before")
    @classmethod
    def _zenflow_section(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"zero_optimization.zenflow must be a section (a JSON object), got {value!r}")
        return value

    @model_validator(mode="after")
    def _checks_across_fields(self) -> DeepSpeedZeroConfig:
        if self.overlap_comm is None:
            self.__dict__["overlap_comm"] = self.stage == ZeroStageEnum.weights
        if not self.compute_grad_norm and self.stage not in (ZeroStageEnum.optimizer_states, ZeroStageEnum.gradients):
            raise ValueError(f"compute_grad_norm false needs ZeRO stage 1 or 2, not stage {self.stage}")
        if self.offload_optimizer is not None and self.offload_optimizer.ratio < 1.0 and self.stage != 3:
            raise ValueError(
                f"offload_optimizer.ratio < 1 (a partial offload) needs ZeRO stage 3, not stage {self.stage}"
            )
        if self.stage == ZeroStageEnum.weights and self.elastic_checkpoint:
            logger.warning("elastic_checkpoint has no effect at ZeRO stage 3 (use universal checkpoints).")
        return self


def read_zero_config_deprecated(param_dict: dict) -> dict:
    """`"zero_optimization": true|false`, the oldest format: stage 1 or 0, the bucket from `allgather_size`."""
    stage = 1 if param_dict[ZERO_OPTIMIZATION] else 0
    section: dict[str, Any] = {"stage": stage}
    if stage > 0:
        section["allgather_bucket_size"] = param_dict.get("allgather_size", 5e8)
    logger.warning('DeepSpeedConfig: a boolean zero_optimization is deprecated; write {"stage": N} instead.')
    return section


def get_zero_config(param_dict: dict) -> DeepSpeedZeroConfig:
    section = param_dict.get(ZERO_OPTIMIZATION, {})
    if isinstance(section, bool):
        section = read_zero_config_deprecated(param_dict)
    return DeepSpeedZeroConfig(**section)
