"""Learning-rate schedules and AdamW parameter groups."""

import math

import pytest
import torch

from glm45v_fsdp.config import TrainingConfig
from glm45v_fsdp.optim import build_optimizer, build_scheduler, lr_at, recipe_from_training


def config(**kwargs) -> TrainingConfig:
    base = dict(train_iters=100, lr=1.0, min_lr=0.1, lr_warmup_ratio=0.1)
    base.update(kwargs)
    return TrainingConfig(**base)


def test_warmup_then_cosine_to_min_lr():
    c = config(lr_scheduler="cosine")
    assert lr_at(1, c) == pytest.approx(0.1)
    assert lr_at(10, c) == pytest.approx(1.0)
    assert lr_at(55, c) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(100, c) == pytest.approx(0.1)


def test_linear_and_constant():
    assert lr_at(55, config(lr_scheduler="linear")) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(80, config(lr_scheduler="constant")) == pytest.approx(1.0)
    assert lr_at(5, config(lr_scheduler="constant")) == pytest.approx(0.5)


def test_scheduler_follows_lr_at_and_groups_skip_decay_on_vectors():
    c = config(lr_scheduler="cosine", weight_decay=0.1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer = build_optimizer(model, recipe_from_training(c), fused=False)
    decay, no_decay = optimizer.param_groups
    assert [p.ndim for p in decay["params"]] == [2] and decay["weight_decay"] == 0.1
    assert all(p.ndim == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    scheduler = build_scheduler(optimizer, recipe_from_training(c))
    seen = []
    for _ in range(100):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([lr_at(k, c) for k in range(1, 101)])


def test_recipe_schedule_sets_lr_and_betas_and_resumes_from_its_step_count():
    from glm45v_fsdp.optim import OptimizerRecipe

    recipe = OptimizerRecipe("SGD", {"lr": 0.5, "momentum": 0.9}, lambda k: 0.5 / (k + 1), "test", betas_after=None)
    model = torch.nn.Linear(3, 2)
    optimizer = build_optimizer(model, recipe, fused=False)
    assert len(optimizer.param_groups) == 1 and "weight_decay" in optimizer.param_groups[0]  # SGD's own default
    scheduler = build_scheduler(optimizer, recipe)
    assert scheduler.get_last_lr() == [0.5]
    for _ in range(3):
        scheduler.step()
    assert scheduler.get_last_lr() == [0.5 / 4]
    fresh = build_scheduler(build_optimizer(model, recipe, fused=False), recipe)
    fresh.load_state_dict(scheduler.state_dict())
    assert fresh.get_last_lr() == [0.5 / 4] and fresh.steps == 3

    adam = OptimizerRecipe(
        "Adam", {"lr": 1.0, "betas": (0.9, 0.99)}, lambda k: 1.0, "test", betas_after=lambda k: (0.8 + 0.01 * k, 0.99)
    )
    optimizer = build_optimizer(model, adam, fused=False)
    scheduler = build_scheduler(optimizer, adam)
    scheduler.step()
    assert optimizer.param_groups[0]["betas"] == pytest.approx((0.81, 0.99))
