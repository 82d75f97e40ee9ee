"""`deepspeed.runtime.precision_config`: the fp16 and bf16 sections as DeepSpeed 0.19 reads them (field names,
defaults, the legacy "bfloat16" key and the checks on the loss-scale values). What they do under FSDP2 is the
translator's mapping (ds_compat/sections.py map_precision): fp16 runs with glm45v_fsdp/loss_scale.py, whose rules
`deepspeed.runtime.fp16.loss_scaler` exposes under DeepSpeed's names.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import ValidationInfo, field_validator, model_validator

from ds_compat.runtime.config_utils import DeepSpeedConfigModel
from ds_compat.runtime.fp16.loss_scaler import (
    CONSECUTIVE_HYSTERESIS,
    DELAYED_SHIFT,
    INITIAL_LOSS_SCALE,
    MIN_LOSS_SCALE,
    SCALE_WINDOW,
)

BFLOAT16 = "bf16"
BFLOAT16_OLD = "bfloat16"  # the older spelling DeepSpeed still reads
FP16 = "fp16"


def _as_float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class DeepSpeedBF16Config(DeepSpeedConfigModel):
    enabled: bool = False
    immediate_grad_update: bool = False
    check_grad_overflow: bool = True
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False


class DeepSpeedFP16Config(DeepSpeedConfigModel):
    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = 0  # 0: dynamic loss scaling
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: int = 1
    fp16_master_weights_and_grads: bool = False

    @field_validator("loss_scale", mode="before")
    @classmethod
    def _scale_is_finite_and_not_negative(cls, value: Any) -> float:
        number = None if isinstance(value, bool) else _as_float(value)
        if number is None:  # DeepSpeed's words for what is wrong, then the fix
            problem = "must be a number"
        elif not math.isfinite(number):
            problem = "must be a finite number"
        elif number < 0:
            problem = "must be >= 0"
        else:
            return number
        raise ValueError(f"fp16.loss_scale = {value!r} {problem}: write 0 (dynamic scaling) or a fixed scale > 0")

    @field_validator("loss_scale_window", "min_loss_scale", mode="before")
    @classmethod
    def _count_is_a_whole_number(cls, value: Any, info: ValidationInfo) -> Any:
        whole = not isinstance(value, bool) and _as_float(value) is not None and math.isfinite(_as_float(value))
        if not whole:
            raise ValueError(f"fp16.{info.field_name} = {value!r}: write a whole number")
        return value

    @model_validator(mode="after")
    def _dynamic_scaling_needs_a_window_and_a_floor(self) -> DeepSpeedFP16Config:
        dynamic = self.enabled and self.loss_scale == 0
        for name in ("loss_scale_window", "min_loss_scale"):
            if dynamic and getattr(self, name) <= 0:
                raise ValueError(f"fp16.{name} = {getattr(self, name)}: dynamic loss scaling needs a value > 0")
        return self

    def initial_dynamic_scale(self) -> int:
        return 2**self.initial_scale_power

    def dynamic_loss_scale_args(self) -> dict[str, Any]:
        """The keyword arguments of DynamicLossScaler (CreateLossScaler's `dynamic_loss_args`)."""
        return {
            INITIAL_LOSS_SCALE: self.initial_dynamic_scale(),
            SCALE_WINDOW: self.loss_scale_window,
            DELAYED_SHIFT: self.hysteresis,
            CONSECUTIVE_HYSTERESIS: self.consecutive_hysteresis,
            MIN_LOSS_SCALE: self.min_loss_scale,
        }


def get_bfloat16_config(param_dict: dict) -> DeepSpeedBF16Config:
    section = param_dict.get(BFLOAT16)
    return DeepSpeedBF16Config(**(param_dict.get(BFLOAT16_OLD, {}) if section is None else section))


def get_float16_config(param_dict: dict) -> DeepSpeedFP16Config:
    return DeepSpeedFP16Config(**param_dict.get(FP16, {}))
