"""AdamW and the learning-rate schedules (constant / linear / cosine with linear warmup and a floor)."""

from __future__ import annotations

import math

import torch
from torch import nn

from glm45v_fsdp.config import TrainingConfig
from glm45v_fsdp.errors import UserError


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings; never biases or norm weights (1-D tensors), as HF Trainer and Megatron do."""
    decay, no_decay = [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def build_optimizer(model: nn.Module, training: TrainingConfig, fused: bool) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; `fused` uses the device's fused kernel (one launch per step)."""
    groups = parameter_groups(model, training.weight_decay)
    if not groups:
        raise UserError(
            "The model has no trainable parameters: model.freeze covers every module. "
            "Remove some patterns from model.freeze."
        )
    return torch.optim.AdamW(
        groups,
        lr=training.lr,
        betas=(training.adam_beta1, training.adam_beta2),
        eps=training.adam_eps,
        fused=fused or None,
        foreach=None if fused else True,
    )


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


def build_scheduler(optimizer: torch.optim.Optimizer, training: TrainingConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR whose k-th value (k = 0 before the first step) is lr_at(k + 1) / lr."""
    base = training.lr

    def factor(index: int) -> float:
        return lr_at(index + 1, training) / base if base else 0.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
