"""The optimizer and its learning-rate schedule, built the same for every door (trainer, ds_compat engine); the step
itself is glm45v_fsdp/step.py.

An `OptimizerRecipe` says which `torch.optim` class the trainer builds and how the lr (and Adam betas) move with the
optimizer steps. Our own `training.*` keys give AdamW with a linear warmup and a constant / linear / cosine decay to
`min_lr` (`recipe_from_training`); a DeepSpeed config gives its optimizer and schedule through ds_compat.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from glm45v_fsdp.config import TrainingConfig
from glm45v_fsdp.errors import UserError


@dataclass(frozen=True)
class OptimizerRecipe:
    """`optimizer`: a torch.optim class name; `kwargs`: its arguments (lr among them); `lr_after(k)`: the lr after k
    optimizer steps (k = 0 before the first); `betas_after(k)`: Adam betas after k steps, or None to leave them."""

    optimizer: str
    kwargs: dict[str, Any]
    lr_after: Callable[[int], float]
    schedule: str
    betas_after: Callable[[int], tuple[float, float] | None] | None = None

    def describe(self) -> str:
        args = ", ".join(f"{key}={value!r}" for key, value in self.kwargs.items())
        return f"torch.optim.{self.optimizer}({args}), schedule {self.schedule}"


def lr_at(step: int, training: TrainingConfig) -> float:
    """Learning rate of optimizer step `step` (1-based): linear warmup from 0, then the decay down to min_lr."""
    total = training.train_iters
    warmup = math.floor(training.lr_warmup_ratio * total + 0.5)  # half up: ratio 0.1 of 5 steps is 1 step
    if warmup and step <= warmup:
        return training.lr * step / warmup
    if training.lr_scheduler == "constant" or total <= warmup:
        return training.lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if training.lr_scheduler == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return training.min_lr + (training.lr - training.min_lr) * factor


def recipe_from_training(training: TrainingConfig) -> OptimizerRecipe:
    """AdamW with our schedule: the lr after k steps is the lr of step k + 1."""
    kwargs = {
        "lr": training.lr,
        "betas": (training.adam_beta1, training.adam_beta2),
        "eps": training.adam_eps,
        "weight_decay": training.weight_decay,
    }
    schedule = f"{training.lr_scheduler} (warmup ratio {training.lr_warmup_ratio:g}, min_lr {training.min_lr:g})"
    return OptimizerRecipe("AdamW", kwargs, lambda k: lr_at(k + 1, training), schedule)


def parameter_groups(model: nn.Module, weight_decay: float | None) -> list[dict]:
    """Decay matrices and embeddings; never biases or norm weights (1-D tensors), as HF Trainer and Megatron do.
    Without a weight decay (an optimizer that has none) all trainable parameters form one group."""
    params = [p for p in model.parameters() if p.requires_grad]
    if weight_decay is None:
        return [{"params": params}] if params else []
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def build_optimizer(model: nn.Module, recipe: OptimizerRecipe, fused: bool) -> torch.optim.Optimizer:
    """The recipe's optimizer over the trainable parameters (make_optimizer)."""
    groups = parameter_groups(model, recipe.kwargs.get("weight_decay"))
    if not groups:
        raise UserError(
            "The model has no trainable parameters: model.freeze covers every module. "
            "Remove some patterns from model.freeze."
        )
    return make_optimizer(recipe.optimizer, groups, recipe.kwargs, fused)


def make_optimizer(name: str, groups: list, kwargs: dict[str, Any], fused: bool) -> torch.optim.Optimizer:
    """`torch.optim.<name>(groups, **kwargs)`; `fused` uses the device's fused kernel where the class has one (one
    launch per step; on CPU 5x faster than foreach for AdamW on plain tensors, which the step hands it: see
    parallel/local_shards.py), else the foreach implementation where it exists. Explicit kwargs win."""
    cls = getattr(torch.optim, name)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = dict(kwargs)
    if fused and "fused" in accepted and "foreach" not in kwargs:
        kwargs.setdefault("fused", True)
    elif "foreach" in accepted and "fused" not in kwargs:
        kwargs.setdefault("foreach", True)
    return cls(groups, **kwargs)


class RecipeSchedule:
    """Sets every group's lr (and Adam betas, when the recipe moves them and the optimizer has betas) to the recipe's
    value after each optimizer step. Its state is the number of steps taken; `step()` is called only for steps the
    optimizer really took. It also answers DeepSpeed's scheduler API (`get_lr()`, `last_batch_iteration`,
    `step(last_batch_iteration)`), which the ds_compat engine hands to scripts."""

    def __init__(self, optimizer: torch.optim.Optimizer, recipe: OptimizerRecipe) -> None:
        self.optimizer = optimizer
        self.recipe = recipe
        self.steps = 0
        self._apply()

    def _apply(self) -> None:
        lr = self.recipe.lr_after(self.steps)
        betas = self.recipe.betas_after(self.steps) if self.recipe.betas_after is not None else None
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            if betas is not None and "betas" in group:
                group["betas"] = tuple(betas)

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's name for the index of the last step taken (-1 before the first)."""
        return self.steps - 1

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.steps = self.steps + 1 if last_batch_iteration is None else last_batch_iteration + 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    get_lr = get_last_lr

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.steps = int(state["steps"])
        self._apply()

    def __repr__(self) -> str:
        return f"RecipeSchedule({self.recipe.schedule}, steps={self.steps})"


def build_scheduler(optimizer: torch.optim.Optimizer, recipe: OptimizerRecipe) -> RecipeSchedule:
    return RecipeSchedule(optimizer, recipe)
