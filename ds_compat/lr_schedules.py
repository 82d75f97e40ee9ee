"""`deepspeed.runtime.lr_schedules`: DeepSpeed's scheduler classes, key constants and tuning arguments.

Each class computes its learning rates with the formulas of `ds_compat.schedules` (the ones the ds_config
translator runs), per parameter group: `last_batch_iteration` is DeepSpeed's counter (-1 before the first
`step()`), the formulas' `step` is that plus one. Construction sets the optimizer's lr as DeepSpeed does (the start
value when `last_batch_iteration` is -1), `step()` advances and writes the groups' lr (and OneCycle's Adam betas),
`get_lr()` computes for the current counter, `get_last_lr()` is what the last write set, and `state_dict()` holds
the counter. Bad arguments raise DeepSpeed's errors (ValueError; TypeError for an optimizer that is not a torch one).
"""

from __future__ import annotations

import argparse
import logging

import torch
from torch.optim import Optimizer

from ds_compat import schedules
from ds_compat.schedules import VALID_LR_SCHEDULES

logger = logging.getLogger("ds_compat")

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR = VALID_LR_SCHEDULES
LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"
EDGE_VALUE, MID_VALUE = "edge_value", "mid_value"
CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR, CYCLE_MAX_LR, DECAY_LR_RATE = "cycle_min_lr", "cycle_max_lr", "decay_lr_rate"
CYCLE_MIN_MOM, CYCLE_MAX_MOM, DECAY_MOM_RATE = "cycle_min_mom", "cycle_max_mom", "decay_mom_rate"
WARMUP_MIN_LR, WARMUP_MAX_LR = "warmup_min_lr", "warmup_max_lr"
WARMUP_NUM_STEPS, WARMUP_TYPE = "warmup_num_steps", "warmup_type"
WARMUP_LOG_RATE, WARMUP_LINEAR_RATE = "log", "linear"
WARMUP_MIN_RATIO, COS_MIN_RATIO = "warmup_min_ratio", "cos_min_ratio"
TOTAL_NUM_STEPS = "total_num_steps"

__all__ = [
    "LRRangeTest",
    "OneCycle",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "VALID_LR_SCHEDULES",
    "add_tuning_arguments",
    "parse_arguments",
    "get_torch_optimizer",
    "update_lr",
]


def add_tuning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's "Convergence Tuning" command-line group, with its names and defaults."""
    group = parser.add_argument_group("Convergence Tuning", "Convergence tuning configurations")
    group.add_argument("--lr_schedule", type=str, default=None, help="LR schedule for training.")
    for name, kind, default in (
        ("lr_range_test_min_lr", float, 0.001),
        ("lr_range_test_step_rate", float, 1.0),
        ("lr_range_test_step_size", int, 1000),
    ):
        group.add_argument(f"--{name}", type=kind, default=default)
    group.add_argument("--lr_range_test_staircase", default=False, action="store_true")
    for name, kind, default in (
        ("cycle_first_step_size", int, 1000),
        ("cycle_first_stair_count", int, -1),
        ("cycle_second_step_size", int, -1),
        ("cycle_second_stair_count", int, -1),
        ("decay_step_size", int, 1000),
        ("cycle_min_lr", float, 0.01),
        ("cycle_max_lr", float, 0.1),
        ("decay_lr_rate", float, 0.0),
    ):
        group.add_argument(f"--{name}", type=kind, default=default)
    group.add_argument("--cycle_momentum", default=False, action="store_true")
    for name, kind, default in (
        ("cycle_min_mom", float, 0.8),
        ("cycle_max_mom", float, 0.9),
        ("decay_mom_rate", float, 0.0),
        ("warmup_min_lr", float, 0),
        ("warmup_max_lr", float, 0.001),
        ("warmup_num_steps", int, 1000),
        ("warmup_type", str, WARMUP_LOG_RATE),
        ("warmup_min_ratio", float, 0.01),
        ("cos_min_ratio", float, 0.01),
    ):
        group.add_argument(f"--{name}", type=kind, default=default)
    return parser


def parse_arguments() -> tuple[argparse.Namespace, list[str]]:
    return add_tuning_arguments(argparse.ArgumentParser()).parse_known_args()


def get_torch_optimizer(optimizer: object) -> Optimizer:
    """`optimizer`, or the torch optimizer it wraps (an engine's `.optimizer`)."""
    if isinstance(optimizer, Optimizer):
        return optimizer
    if isinstance(getattr(optimizer, "optimizer", None), Optimizer):
        return optimizer.optimizer
    raise TypeError(f"{type(optimizer).__name__} is not a subclass of torch.optim.Optimizer")


def update_lr(param_groups: list[dict], lrs: list[float]) -> list[float]:
    """Write each group's lr (in place for a tensor lr); returns what the groups hold."""
    for group, lr in zip(param_groups, lrs):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr.squeeze() if torch.is_tensor(lr) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in param_groups]


def _per_group(optimizer: Optimizer, value: object, name: str) -> list:
    """A value for every param group: a list or tuple of one per group, or one value for all. A tensor (a group's
    tensor lr, which the schedule then updates in place) is read as its number now, not kept as an alias."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"expected {len(optimizer.param_groups)} value for {name}, got {len(value)}")
        return [item.item() if isinstance(item, torch.Tensor) else item for item in value]
    return [value.item() if isinstance(value, torch.Tensor) else value] * len(optimizer.param_groups)


def _positive_int(value: object, name: str) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value}")


def _warmup_type(value: str) -> str:
    if value not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        logger.warning("Using unknown warmup_type: %s. The increasing function is set to default (log)", value)
        return WARMUP_LOG_RATE
    return value


def _warn_unstarted(step: int) -> None:
    if step < 1:  # the warm-up schedules' warning before the first step()
        logger.warning("Attempting to get learning rate from scheduler before it has started")


class _Schedule:
    """What the five classes share: the optimizer, DeepSpeed's counter, step / get_last_lr / state."""

    def __init__(self, optimizer: object, last_batch_iteration: int) -> None:
        self.optimizer = get_torch_optimizer(optimizer)
        self.last_batch_iteration = last_batch_iteration

    def _lrs(self, step: int) -> list[float]:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        return self._lrs(self.last_batch_iteration + 1)

    def get_last_lr(self) -> list[float]:
        assert getattr(self, "_last_lr", None) is not None, "need to call step() first"
        return self._last_lr

    def _advance(self, iteration: int | None) -> None:
        self.last_batch_iteration = self.last_batch_iteration + 1 if iteration is None else iteration
        self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]


class LRRangeTest(_Schedule):
    def __init__(
        self,
        optimizer: Optimizer,
        lr_range_test_min_lr: float = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = _per_group(self.optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        _positive_int(lr_range_test_step_size, "lr_range_test_step_size")
        self.step_size, self.step_rate, self.staircase = (
            lr_range_test_step_size,
            lr_range_test_step_rate,
            lr_range_test_staircase,
        )
        if last_batch_iteration == -1:
            self._last_lr = update_lr(self.optimizer.param_groups, self.min_lr)

    def _lrs(self, step: int) -> list[float]:
        return [
            schedules.lr_range_test_lr(
                step,
                lr_range_test_min_lr=low,
                lr_range_test_step_size=self.step_size,
                lr_range_test_step_rate=self.step_rate,
                lr_range_test_staircase=self.staircase,
            )
            for low in self.min_lr
        ]

    def step(self, batch_iteration: int | None = None) -> None:
        self._advance(batch_iteration)


class OneCycle(_Schedule):
    def __init__(
        self,
        optimizer: Optimizer,
        cycle_min_lr: float,
        cycle_max_lr: float,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        if first <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {first}")
        if second < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got {second}")
        self.first_step_size, self.second_step_size, self.total_size = first, second, first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        second_stairs = cycle_second_stair_count
        self.second_stair_count = cycle_first_stair_count if second_stairs is None else second_stairs
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(self.optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(self.optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        if last_batch_iteration == -1:
            update_lr(self.optimizer.param_groups, self.min_lrs)
        self.cycle_momentum = cycle_momentum
        self.decay_mom_rate = decay_mom_rate
        if cycle_momentum and "betas" not in self.optimizer.defaults:
            logger.warning(
                "cycle_momentum is disabled because optimizer %s does not support momentum, no betas attribute in "
                "defaults",
                type(self.optimizer).__name__,
            )
            self.cycle_momentum = False
        if self.cycle_momentum:
            beta2 = schedules.ONE_CYCLE_BETA2
            self.min_moms = [(m, beta2) for m in _per_group(self.optimizer, cycle_min_mom, "cycle_min_mom")]
            self.max_moms = [(m, beta2) for m in _per_group(self.optimizer, cycle_max_mom, "cycle_max_mom")]
            if last_batch_iteration == -1:
                for betas, group in zip(self.min_moms, self.optimizer.param_groups):
                    group["betas"] = betas

    def _params(self, group: int) -> dict:
        return {
            "cycle_first_step_size": self.first_step_size,
            "cycle_second_step_size": self.second_step_size,
            "cycle_first_stair_count": self.first_stair_count,
            "cycle_second_stair_count": self.second_stair_count,
            "decay_step_size": self.decay_step_size,
            "cycle_min_lr": self.min_lrs[group],
            "cycle_max_lr": self.max_lrs[group],
            "decay_lr_rate": self.decay_lr_rate,
            "cycle_min_mom": self.min_moms[group][0] if self.cycle_momentum else None,
            "cycle_max_mom": self.max_moms[group][0] if self.cycle_momentum else None,
            "decay_mom_rate": self.decay_mom_rate,
        }

    def _lrs(self, step: int) -> list[float]:
        return [schedules.one_cycle_lr(step, **self._params(g)) for g in range(len(self.min_lrs))]

    def get_mom(self) -> list[tuple[float, float]] | None:
        if not self.cycle_momentum:
            return None
        step = self.last_batch_iteration + 1
        if step == 0:  # the cycle's start, as the cycle formula gives it (construction set the minimum)
            return list(self.max_moms)
        return [schedules.one_cycle_momentum(step, **self._params(g)) for g in range(len(self.min_lrs))]

    def step(self, batch_iteration: int | None = None) -> None:
        self._advance(batch_iteration)
        if self.cycle_momentum:
            for group, betas in zip(self.optimizer.param_groups, self.get_mom()):
                group["betas"] = betas


class WarmupLR(_Schedule):
    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        _positive_int(warmup_num_steps, "warmup_num_steps")
        super().__init__(optimizer, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in self.optimizer.param_groups]
        self.min_lrs = _per_group(self.optimizer, warmup_min_lr, "min_lr")
        self.max_lrs = _per_group(self.optimizer, warmup_max_lr, "max_lr")
        self.delta_lrs = [high - low for high, low in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _warmup_type(warmup_type)
        if last_batch_iteration == -1:
            self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())

    def _lrs(self, step: int) -> list[float]:
        _warn_unstarted(step)
        return [self._warmup(step, low, high) for low, high in zip(self.min_lrs, self.max_lrs)]

    def _warmup(self, step: int, low: float, high: float) -> float:
        return schedules.warmup_lr(
            step,
            warmup_min_lr=low,
            warmup_max_lr=high,
            warmup_num_steps=self.warmup_num_steps,
            warmup_type=self.warmup_type,
        )

    def step(self, last_batch_iteration: int | None = None) -> None:
        self._advance(last_batch_iteration)


class WarmupDecayLR(WarmupLR):
    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning("total_num_steps %s is less than warmup_num_steps %s", total_num_steps, warmup_num_steps)

    def _warmup(self, step: int, low: float, high: float) -> float:
        return schedules.warmup_decay_lr(
            step,
            total_num_steps=self.total_num_steps,
            warmup_min_lr=low,
            warmup_max_lr=high,
            warmup_num_steps=self.warmup_num_steps,
            warmup_type=self.warmup_type,
        )


class WarmupCosineLR(_Schedule):
    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        _positive_int(warmup_num_steps, "warmup_num_steps")
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps, self.cos_min_ratio = total_num_steps, cos_min_ratio
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_type = _warmup_type(warmup_type)
        self.warmup_num_steps = max(2, warmup_num_steps)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning("total_num_steps %s is less than warmup_num_steps %s", total_num_steps, warmup_num_steps)
        self.org_lrs = [g["lr"].clone() if torch.is_tensor(g["lr"]) else g["lr"] for g in self.optimizer.param_groups]
        if last_batch_iteration == -1:
            self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())

    def get_lr_ratio(self) -> float:
        return self._ratio(self.last_batch_iteration + 1)

    def _ratio(self, step: int) -> float:
        _warn_unstarted(step)
        return schedules.warmup_cosine_lr(
            step,
            base_lr=1.0,
            total_num_steps=self.total_num_steps,
            warmup_min_ratio=self.warmup_min_ratio,
            warmup_num_steps=self.warmup_num_steps,
            cos_min_ratio=self.cos_min_ratio,
            warmup_type=self.warmup_type,
        )

    def _lrs(self, step: int) -> list[float]:
        ratio = self._ratio(step)
        return [lr * ratio for lr in self.org_lrs]

    def step(self, last_batch_iteration: int | None = None) -> None:
        self._advance(last_batch_iteration)
