"""DeepSpeed's module surface under ds-fsdp against the real DeepSpeed (issue 33), the same calls on both:
`deepspeed.runtime.lr_schedules` (ds_compat/lr_schedules.py: every schedule of tests/test_ds_config.py's corpus plus
per-group lists, 1000 steps each, learning rates and Adam betas equal to 1e-12 at every step, resumption from a
state dict, the errors, the tuning arguments and constants) and `deepspeed.accelerator`'s module functions."""

from __future__ import annotations

import argparse
import math
import os

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
from deepspeed.runtime import lr_schedules as ds_lr  # noqa: E402
from test_ds_config import SCHEDULES  # noqa: E402

from ds_compat import lr_schedules as ours  # noqa: E402

STEPS = 1000
GROUPS = (0.01, 0.02)  # two parameter groups with their own lr
PER_GROUP = [
    ("WarmupLR", {"warmup_min_lr": [1e-5, 2e-5], "warmup_max_lr": [1e-3, 3e-3], "warmup_num_steps": 300}),
    ("WarmupDecayLR", {"total_num_steps": 800, "warmup_max_lr": [1e-3, 2e-3], "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 700, "warmup_num_steps": 50, "warmup_min_ratio": 0.1}),
    ("WarmupLR", {"warmup_num_steps": 1, "warmup_type": "linear"}),  # raised to 2, as DeepSpeed does
    ("WarmupLR", {"warmup_num_steps": 40, "warmup_type": "cubic"}),  # unknown type: log, with a warning
    ("OneCycle", {"cycle_min_lr": [1e-4, 2e-4], "cycle_max_lr": [1e-2, 2e-2], "cycle_first_step_size": 300,
                  "decay_step_size": 50, "decay_lr_rate": 0.2, "decay_mom_rate": 0.01, "cycle_min_mom": [0.8, 0.85]}),
    ("LRRangeTest", {"lr_range_test_min_lr": [1e-4, 1e-3], "lr_range_test_step_size": 30,
                     "lr_range_test_staircase": True}),
]  # fmt: skip
CASES = SCHEDULES + PER_GROUP


def optimizer() -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in GROUPS]
    return torch.optim.AdamW(groups)


def state(opt: torch.optim.Optimizer) -> list[tuple]:
    return [(group["lr"], tuple(group["betas"])) for group in opt.param_groups]


def close(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)


@pytest.mark.parametrize("name, params", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_every_schedule_equals_deepspeeds_for_1000_steps(name, params):
    (theirs_opt, mine_opt) = optimizer(), optimizer()
    theirs, mine = getattr(ds_lr, name)(theirs_opt, **params), getattr(ours, name)(mine_opt, **params)
    assert close(state(mine_opt), state(theirs_opt))  # what construction writes
    assert close(mine.get_lr(), theirs.get_lr())
    resumed = None
    for step in range(STEPS):
        theirs.step()
        mine.step()
        assert close(mine.get_last_lr(), theirs.get_last_lr()), (step, mine.get_last_lr(), theirs.get_last_lr())
        assert close(state(mine_opt), state(theirs_opt)), step
        if resumed is not None:
            resumed.step()
            assert close(resumed.get_last_lr(), theirs.get_last_lr()), step
        if step == STEPS // 2:  # resume: a fresh scheduler from the state dict carries on identically
            assert mine.state_dict() == theirs.state_dict() == {"last_batch_iteration": step}
            resumed = getattr(ours, name)(optimizer(), **params, last_batch_iteration=step)
            resumed.load_state_dict(mine.state_dict())
    theirs.step(STEPS + 200)  # an explicit iteration
    mine.step(STEPS + 200)
    assert close(state(mine_opt), state(theirs_opt))


def raised(call) -> type[BaseException] | None:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the class is what is compared
        return type(error)
    return None


@pytest.mark.parametrize(
    "name, args, kwargs",
    [
        ("WarmupLR", (), {"warmup_num_steps": 0}),
        ("WarmupLR", (), {"warmup_num_steps": 2.5}),
        ("WarmupLR", (), {"warmup_max_lr": [1e-3, 1e-3, 1e-3]}),
        ("WarmupDecayLR", (100,), {"warmup_min_lr": [0.0]}),
        ("WarmupCosineLR", (100,), {"warmup_num_steps": 0}),
        ("LRRangeTest", (), {"lr_range_test_step_size": 0}),
        ("LRRangeTest", (), {"lr_range_test_min_lr": [1e-3]}),
        ("OneCycle", (1e-3, 1e-2), {"cycle_first_step_size": 0}),
        ("OneCycle", (1e-3, 1e-2), {"cycle_second_step_size": -1}),
        ("OneCycle", (1e-3, [1e-2]), {}),
        ("OneCycle", (1e-3, 1e-2), {"cycle_min_mom": [0.8, 0.8, 0.8]}),
    ],
)
def test_bad_arguments_raise_deepspeeds_error_class(name, args, kwargs):
    theirs = raised(lambda: getattr(ds_lr, name)(optimizer(), *args, **kwargs))
    mine = raised(lambda: getattr(ours, name)(optimizer(), *args, **kwargs))
    assert theirs is not None and mine is theirs, (theirs, mine)


def test_optimizer_checks_and_get_last_lr_before_a_step():
    for module in (ds_lr, ours):
        with pytest.raises(TypeError, match="not a subclass of torch.optim.Optimizer"):
            module.WarmupLR(object())
        wrapper = argparse.Namespace(optimizer=optimizer())  # an engine-like object holding the optimizer
        assert module.WarmupLR(wrapper).optimizer is wrapper.optimizer
        one_cycle = module.OneCycle(optimizer(), 1e-3, 1e-2)
        with pytest.raises(AssertionError, match="need to call step"):
            one_cycle.get_last_lr()
        sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        assert module.OneCycle(sgd, 1e-3, 1e-2).cycle_momentum is False  # no betas: momentum cycling turns off


def test_tuning_arguments_and_constants_are_deepspeeds():
    argv = ["--lr_schedule", "OneCycle", "--cycle_min_lr", "0.001", "--cycle_momentum", "--warmup_num_steps", "7"]
    for args in ([], argv):
        theirs = ds_lr.add_tuning_arguments(argparse.ArgumentParser()).parse_args(args)
        mine = ours.add_tuning_arguments(argparse.ArgumentParser()).parse_args(args)
        assert vars(mine) == vars(theirs)
    constants = {name for name in dir(ds_lr) if name.isupper()}
    assert constants <= set(dir(ours)), constants - set(dir(ours))
    assert all(getattr(ours, name) == getattr(ds_lr, name) for name in constants)


def test_accelerator_functions_answer_as_deepspeeds():
    """`deepspeed.accelerator`'s module functions, on this CPU (DS_ACCELERATOR=cpu for both)."""
    import deepspeed.accelerator as theirs

    from ds_compat import accelerator as mine

    assert (
        mine.SUPPORTED_ACCELERATOR_LIST
        == __import__("deepspeed.accelerator.real_accelerator", fromlist=["x"]).SUPPORTED_ACCELERATOR_LIST
    )
    assert mine.is_current_accelerator_supported() is theirs.is_current_accelerator_supported() is True
    assert mine.get_accelerator().device_name() == theirs.get_accelerator().device_name() == "cpu"
    for module in (theirs, mine):
        with pytest.raises(AssertionError, match="is not subclass of DeepSpeedAccelerator"):
            module.set_accelerator(object())
    current = mine.get_accelerator()
    replacement = mine.DeepSpeedAccelerator(current.layer)
    mine.set_accelerator(replacement)
    try:
        assert mine.get_accelerator() is replacement
    finally:
        mine.set_accelerator(current)
