"""`deepspeed.runtime.fp16.loss_scaler`: DeepSpeed's loss-scaler classes on the engine's own scaler.

DynamicLossScaler's update rule (halve after `delayed_shift` overflows, double after `scale_window` good steps, the
hysteresis refill, the floor) is glm45v_fsdp/loss_scale.py's, the one the trainer and the ds_compat engine run;
these classes only give it DeepSpeed's constructor arguments and attribute names.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from ds_compat._common import DeepSpeedAssertion
from glm45v_fsdp.config import LossScaleConfig as _ScaleSettings
from glm45v_fsdp.errors import TrainingStopped
from glm45v_fsdp.log import get_logger
from glm45v_fsdp.loss_scale import SCALE_FACTOR
from glm45v_fsdp.loss_scale import LossScaler as _ScaleRules

logger = get_logger()

# The keys of `dynamic_loss_args` (DeepSpeedFP16Config.dynamic_loss_scale_args()).
INITIAL_LOSS_SCALE = "init_scale"
SCALE_WINDOW = "scale_window"
DELAYED_SHIFT = "delayed_shift"
CONSECUTIVE_HYSTERESIS = "consecutive_hysteresis"
MIN_LOSS_SCALE = "min_scale"


def _has_inf_or_nan(tensor: torch.Tensor) -> bool:
    return not bool(torch.isfinite(tensor.float()).all())


class LossScalerBase:
    def __init__(self, cur_scale: float) -> None:
        self.cur_scale = cur_scale
        self.dynamic = False

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_gradient(self, module: Any, grad_in: tuple, grad_out: tuple) -> tuple:
        return tuple(self.loss_scale * grad for grad in grad_in)

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            logger.log(logging.WARNING, "[deepspeed] OVERFLOW! Skipping step. Gradients are non-finite.")

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        self.scale_loss(loss).backward(retain_graph=retain_graph)


class LossScaler(LossScalerBase):
    """A static loss scale: never changes, never reports an overflow."""

    def __init__(self, scale: float = 1) -> None:
        super().__init__(scale)

    def has_overflow(self, params: Iterable[torch.nn.Parameter]) -> bool:
        return False


class _Rule:
    """A DeepSpeed scaler attribute that lives on the engine's scaler under its own name (read and written there)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, scaler: DynamicLossScaler | None, owner: type) -> Any:
        return self if scaler is None else getattr(scaler._rules, self.name)

    def __set__(self, scaler: DynamicLossScaler, value: Any) -> None:
        setattr(scaler._rules, self.name, value)


class DynamicLossScaler(LossScalerBase):
    """Dynamic loss scaling with DeepSpeed's arguments and attributes; an overflow at `min_scale` stops the run
    unless `raise_error_at_min_scale=False` (then the scale stays at the floor)."""

    cur_scale = _Rule("scale")
    cur_iter = _Rule("iteration")
    last_overflow_iter = _Rule("last_overflow")
    cur_hysteresis = _Rule("hysteresis_left")
    scale_window = _Rule("window")
    min_scale = _Rule("min_scale")
    delayed_shift = _Rule("hysteresis")
    consecutive_hysteresis = _Rule("consecutive_hysteresis")
    raise_error_at_min_scale = _Rule("stop_at_min_scale")

    def __init__(
        self,
        init_scale: float,
        scale_window: int,
        min_scale: float,
        delayed_shift: int,
        consecutive_hysteresis: bool,
        raise_error_at_min_scale: bool = True,
        dtype: torch.dtype = torch.half,
    ) -> None:
        settings = _ScaleSettings(
            window=scale_window,
            hysteresis=delayed_shift,
            consecutive_hysteresis=consecutive_hysteresis,
            min_scale=min_scale,
        )
        self._rules = _ScaleRules(settings, stop_at_min_scale=raise_error_at_min_scale)
        super().__init__(init_scale)
        self.scale_factor = SCALE_FACTOR
        self.dynamic = True
        self.dtype = dtype

    def has_overflow_serial(self, params: Iterable[torch.nn.Parameter]) -> bool:
        return any(p.grad is not None and _has_inf_or_nan(p.grad) for p in params)

    def update_scale(self, overflow: bool) -> None:
        before = self.cur_scale
        try:
            self._rules.update(overflow)
        except TrainingStopped:
            raise TrainingStopped(
                f"The gradients overflow at the minimum loss scale {self.min_scale:g}, which cannot go lower: "
                "stopping, as DeepSpeed does. Lower the learning rate, check the data, train in bf16, or build the "
                "scaler with raise_error_at_min_scale=False to keep skipping steps at the floor."
            ) from None
        if overflow:
            logger.info(f"[deepspeed] OVERFLOW! Skipping step. Loss scale {before:g} -> {self.cur_scale:g}")


def CreateLossScaler(  # noqa: N802 - DeepSpeed's name
    dtype: torch.dtype, static_loss_scale: float, dynamic_scaling: bool, dynamic_loss_args: dict | None
) -> LossScalerBase:
    """fp16 with dynamic scaling: a DynamicLossScaler from `dynamic_loss_args`; otherwise a static LossScaler (scale
    1 for fp32 and bf16, which need none)."""
    if dtype == torch.half and dynamic_scaling:
        if dynamic_loss_args is None:
            raise DeepSpeedAssertion(
                "Dynamic loss scaling parameters must be defined: CreateLossScaler got dynamic_loss_args=None. Pass "
                "DeepSpeedFP16Config.dynamic_loss_scale_args()."
            )
        return DynamicLossScaler(dtype=dtype, **dynamic_loss_args)
    return LossScaler(scale=static_loss_scale if dtype == torch.half else 1.0)
