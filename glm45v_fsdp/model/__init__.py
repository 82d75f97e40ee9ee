"""The GLM-4.5V model layer: HF config (presets or a local directory), meta-device build, deterministic
materialization (FSDP2-aware), freezing, parameter accounting and the summed causal-LM loss."""

from glm45v_fsdp.model.builder import (
    apply_freeze,
    build_meta_model,
    count_parameters,
    describe_model,
    load_hf_config,
)
from glm45v_fsdp.model.init import materialize
from glm45v_fsdp.model.loss import (
    REQUIRED_FSDP_UNITS,
    Glm4vMoeForTraining,
    causal_lm_loss_sum,
    forward_hidden,
    model_loss_sum,
)
from glm45v_fsdp.model.presets import GLM45V_CONFIG, TINY_CONFIG

__all__ = [
    "REQUIRED_FSDP_UNITS",
    "GLM45V_CONFIG",
    "Glm4vMoeForTraining",
    "TINY_CONFIG",
    "apply_freeze",
    "build_meta_model",
    "causal_lm_loss_sum",
    "count_parameters",
    "describe_model",
    "forward_hidden",
    "load_hf_config",
    "materialize",
    "model_loss_sum",
]
