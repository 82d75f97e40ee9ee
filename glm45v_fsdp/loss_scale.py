"""fp16 loss scaling, with DeepSpeed's rules (deepspeed/runtime/fp16/loss_scaler.py), so a ds_config's fp16 section
behaves the same here.

Dynamic: start at 2**initial_scale_power; a step whose gradients overflow is skipped and, once `hysteresis`
overflows have used up the delay, halves the scale (never below `min_scale`; an overflow at the floor stops the run,
as DeepSpeed raises); after `window` steps without an overflow the scale doubles (and the hysteresis refills).
`consecutive_hysteresis` refills the hysteresis after every good step. Static: a fixed scale, overflows are skipped.
"""

from __future__ import annotations

from glm45v_fsdp.config import LossScaleConfig
from glm45v_fsdp.errors import TrainingStopped

SCALE_FACTOR = 2.0


class LossScaler:
    """`stop_at_min_scale=False` keeps skipping steps at the floor instead of stopping (DeepSpeed's
    raise_error_at_min_scale=False)."""

    def __init__(self, cfg: LossScaleConfig, stop_at_min_scale: bool = True) -> None:
        self.dynamic = cfg.static_scale == 0
        self.scale = float(2**cfg.initial_scale_power) if self.dynamic else float(cfg.static_scale)
        self.window = cfg.window
        self.min_scale = float(cfg.min_scale)
        self.hysteresis = cfg.hysteresis
        self.consecutive_hysteresis = cfg.consecutive_hysteresis
        self.hysteresis_left = cfg.hysteresis
        self.stop_at_min_scale = stop_at_min_scale
        self.iteration = 0
        self.last_overflow = -1

    def describe(self) -> str:
        if not self.dynamic:
            return f"static loss scale {self.scale:g}"
        return (
            f"dynamic loss scale from {self.scale:g} (x2 after {self.window} good steps, /2 after {self.hysteresis} "
            f"overflow(s), floor {self.min_scale:g})"
        )

    def update(self, overflow: bool) -> None:
        """After each step: `overflow` says whether its gradients were non-finite (the step was skipped)."""
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                if self.scale == self.min_scale and self.stop_at_min_scale:
                    raise TrainingStopped(
                        f"Training stopped: the gradients overflow at the minimum fp16 loss scale {self.min_scale:g} "
                        "(training.loss_scale.min_scale), as DeepSpeed stops. Lower training.lr, check the data, or "
                        "train in bf16 (parallel.fsdp_plan.param_dtype=bf16)."
                    )
                self.scale = max(self.scale / SCALE_FACTOR, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            stable = self.iteration - self.last_overflow - 1
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                self.scale *= SCALE_FACTOR
        self.iteration += 1

    def state_dict(self) -> dict[str, float | int]:
        return {
            "scale": self.scale,
            "iteration": self.iteration,
            "last_overflow": self.last_overflow,
            "hysteresis_left": self.hysteresis_left,
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.iteration = int(state["iteration"])
        self.last_overflow = int(state["last_overflow"])
        self.hysteresis_left = int(state["hysteresis_left"])
