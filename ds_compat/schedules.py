"""DeepSpeed's learning-rate schedules as pure functions of the optimizer step.

`step` counts the optimizer steps taken (0 before the first one); the value is the learning rate the next optimizer
step uses, i.e. what DeepSpeed's scheduler has set after `step` calls of `scheduler.step()` (DeepSpeed steps it once
per applied optimizer step). DeepSpeed's own counter is `last_batch_iteration = step - 1`. Warmup lengths below 2
are raised to 2, as DeepSpeed does.
"""

from __future__ import annotations

import math

DS_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
# `deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES` (accelerate checks a scheduler's class name against it)
VALID_LR_SCHEDULES = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
WARMUP_TYPES = ("log", "linear")

# Parameters of each DeepSpeed scheduler with their defaults (None: the optimizer's lr for WarmupLR's warmup_max_lr,
# the first half's for OneCycle's second half; required for the keys in REQUIRED).
DEFAULTS: dict[str, dict[str, object]] = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupDecayLR": {
        "total_num_steps": None,
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 0.001,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
    },
    "WarmupCosineLR": {
        "total_num_steps": None,
        "warmup_min_ratio": 0.0,
        "warmup_num_steps": 1000,
        "cos_min_ratio": 0.0001,
        "warmup_type": "log",
    },
    "OneCycle": {
        "cycle_min_lr": None,
        "cycle_max_lr": None,
        "decay_lr_rate": 0.0,
        "cycle_first_step_size": 2000,
        "cycle_second_step_size": None,
        "cycle_first_stair_count": 0,
        "cycle_second_stair_count": None,
        "decay_step_size": 0,
        "cycle_momentum": True,
        "cycle_min_mom": 0.8,
        "cycle_max_mom": 0.9,
        "decay_mom_rate": 0.0,
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": 0.001,
        "lr_range_test_step_size": 2000,
        "lr_range_test_step_rate": 1.0,
        "lr_range_test_staircase": False,
    },
}
REQUIRED: dict[str, tuple[str, ...]] = {
    "WarmupDecayLR": ("total_num_steps",),
    "WarmupCosineLR": ("total_num_steps",),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr"),
}

# The beta2 DeepSpeed's OneCycle writes into Adam's betas together with the cycled momentum (beta1).
ONE_CYCLE_BETA2 = 0.99


def _warmup_progress(iteration: int, warmup: int, warmup_type: str) -> float:
    """Share of the warmup done at DeepSpeed iteration `iteration` < `warmup`: log(i+1)/log(W) or i/W."""
    if warmup_type == "linear":
        return iteration / warmup
    return math.log(iteration + 1) / math.log(warmup)


def warmup_lr(
    step: int, *, warmup_min_lr: float, warmup_max_lr: float, warmup_num_steps: int, warmup_type: str
) -> float:
    """WarmupLR: min -> max over the warmup (log or linear), then max."""
    iteration, warmup = step - 1, max(2, warmup_num_steps)
    if iteration < 0:
        return warmup_min_lr
    share = _warmup_progress(iteration, warmup, warmup_type) if iteration < warmup else 1.0
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * share


def warmup_decay_lr(
    step: int,
    *,
    total_num_steps: int,
    warmup_min_lr: float,
    warmup_max_lr: float,
    warmup_num_steps: int,
    warmup_type: str,
) -> float:
    """WarmupDecayLR: WarmupLR's warmup, then linear decay of the share to 0 at total_num_steps."""
    iteration, warmup = step - 1, max(2, warmup_num_steps)
    if iteration < 0:
        return warmup_min_lr
    if iteration < warmup:
        share = _warmup_progress(iteration, warmup, warmup_type)
    else:
        share = max(0.0, (total_num_steps - iteration) / max(1.0, total_num_steps - warmup))
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * share


def warmup_cosine_lr(
    step: int,
    *,
    base_lr: float,
    total_num_steps: int,
    warmup_min_ratio: float,
    warmup_num_steps: int,
    cos_min_ratio: float,
    warmup_type: str,
) -> float:
    """WarmupCosineLR: the optimizer's lr times a ratio, warmup_min_ratio -> 1, then cosine down to cos_min_ratio.

    Before the first step DeepSpeed sets the lr to 0.
    """
    iteration, warmup = step - 1, max(2, warmup_num_steps)
    if iteration < 0:
        return 0.0
    if iteration < warmup:
        ratio = warmup_min_ratio + _warmup_progress(iteration, warmup, warmup_type) * (1.0 - warmup_min_ratio)
    else:
        progress = min(1.0, (iteration - warmup + 1) / max(1, total_num_steps - warmup))
        ratio = max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)
    return base_lr * ratio


def lr_range_test_lr(
    step: int,
    *,
    lr_range_test_min_lr: float,
    lr_range_test_step_size: int,
    lr_range_test_step_rate: float,
    lr_range_test_staircase: bool,
) -> float:
    """LRRangeTest: min_lr * (1 + rate * step / step_size), the interval floored with the staircase."""
    interval = step / lr_range_test_step_size
    if lr_range_test_staircase:
        interval = math.floor(interval)
    return lr_range_test_min_lr * (1 + lr_range_test_step_rate * interval)


def _one_cycle_scale(step: int, first: float, second: float, first_stairs: int, second_stairs: int) -> float:
    """Position in the cycle as a 0..1 height: up over the first half, down over the second, optionally in stairs."""
    total = first + second
    up_share = first / total
    position = 1.0 + step / total - math.floor(1 + step / total)
    if position <= up_share:
        scale, stairs = position / up_share, first_stairs
    else:
        scale, stairs = (position - 1) / (up_share - 1), second_stairs
    if stairs > 0:
        in_cycle = step % total
        if in_cycle <= first:
            stair = in_cycle * stairs / first
        else:
            stair = (total - in_cycle) * stairs / second
        scale = math.floor(stair) / stairs
    return scale


def _one_cycle_shape(params: dict) -> tuple[float, float, int, int]:
    first = float(params["cycle_first_step_size"])
    second = first if params["cycle_second_step_size"] is None else float(params["cycle_second_step_size"])
    first_stairs = params["cycle_first_stair_count"]
    second_stairs = first_stairs if params["cycle_second_stair_count"] is None else params["cycle_second_stair_count"]
    return first, second, first_stairs, second_stairs


def one_cycle_lr(step: int, **params: object) -> float:
    """OneCycle: min -> max -> min over one cycle, then min / (1 + decay_lr_rate * steps_after / decay_step_size)."""
    first, second, first_stairs, second_stairs = _one_cycle_shape(params)
    low, high = params["cycle_min_lr"], params["cycle_max_lr"]
    if step - 1 < first + second:
        return low + (high - low) * _one_cycle_scale(step, first, second, first_stairs, second_stairs)
    if params["decay_step_size"] == 0 or params["decay_lr_rate"] == 0:
        return low
    return low / (1 + params["decay_lr_rate"] * ((step - first - second) / params["decay_step_size"]))


def one_cycle_momentum(step: int, **params: object) -> tuple[float, float]:
    """OneCycle's Adam betas: beta1 cycles max -> min -> max (starting at cycle_min_mom), beta2 is fixed at 0.99."""
    first, second, first_stairs, second_stairs = _one_cycle_shape(params)
    low, high = params["cycle_min_mom"], params["cycle_max_mom"]
    if step == 0:
        beta1 = low
    elif step - 1 < first + second:
        beta1 = high - (high - low) * _one_cycle_scale(step, first, second, first_stairs, second_stairs)
    elif params["decay_step_size"] == 0 or params["decay_mom_rate"] == 0:
        beta1 = high
    else:
        beta1 = high * (1 + params["decay_mom_rate"] * ((step - first - second) / params["decay_step_size"]))
    return (beta1, ONE_CYCLE_BETA2)
