"""The optimizer and LR scheduler a ds_config asks for, as torch classes with checked arguments.

DeepSpeed's `Adam` / `AdamW` run its FusedAdam (DeepSpeedCPUAdam under offload); the update rule is torch's Adam
(`adam_w_mode: false`) or AdamW, so the spec names the torch class. Other names resolve to `torch.optim` classes,
as in DeepSpeed. Schedulers: DeepSpeed's five as pure functions (ds_compat.schedules), or a
`torch.optim.lr_scheduler` class, replayed on a one-parameter optimizer.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ds_compat import schedules
from ds_compat._common import MAPPED, TAKEN, Report, as_bool, as_float, as_int, as_section, key_error, unknown_key_error
from glm45v_fsdp.config import TrainingConfig
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.optim import OptimizerRecipe, make_optimizer, recipe_from_training

ONE_BIT = ("onebitadam", "onebitlamb", "zerooneadam")
KERNEL_ONLY = ("lamb", "lion", "muadam", "muadamw", "musgd", "muon")
ADAM_PARAMS = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "bias_correction",
    "amsgrad",
    "adam_w_mode",
    "torch_adam",
    "fp32_optimizer_states",
    "set_grad_none",
    "foreach",
)
UNUSABLE_OPTIMIZERS = {
    "Optimizer": "is the abstract base class",
    "LBFGS": "needs a closure in step(), which the training loop does not pass",
    "SparseAdam": "needs sparse gradients",
}
UNUSABLE_SCHEDULERS = {
    "LRScheduler": "is the abstract base class",
    "LambdaLR": "needs a Python function, which JSON cannot hold",
    "MultiplicativeLR": "needs a Python function, which JSON cannot hold",
    "SequentialLR": "needs scheduler objects, which JSON cannot hold",
    "ChainedScheduler": "needs scheduler objects, which JSON cannot hold",
    "ReduceLROnPlateau": "needs a validation metric in step(), which the training loop does not pass",
}


@dataclass
class OptimizerSpec:
    """A torch.optim class and its arguments (lr always among them)."""

    type: str
    kwargs: dict[str, Any]
    # optimizer.type as the DeepSpeed config writes it; None when the optimizer comes from our training config.
    ds_type: str | None = None
    # Adam family: decoupled weight decay (AdamW) or L2 (Adam); None for other optimizers.
    adam_w_mode: bool | None = None

    @property
    def lr(self) -> float:
        return self.kwargs["lr"]

    def build(self, params: Iterable, fused: bool = False) -> torch.optim.Optimizer:
        """The optimizer over `params` (tensors or param groups), built as the trainer builds its own
        (glm45v_fsdp.optim.make_optimizer: fused where asked and the class has it, else foreach)."""
        return make_optimizer(self.type, list(params), self.kwargs, fused)

    def describe(self) -> str:
        return f"torch.optim.{self.type}({', '.join(f'{k}={v!r}' for k, v in self.kwargs.items())})"


@dataclass
class SchedulerSpec:
    """A DeepSpeed (or torch) LR schedule; `lr_at(step)` is the lr after `step` optimizer steps (0: before any)."""

    type: str
    params: dict[str, Any]
    base_lr: float
    lr_fn: Callable[[int], float] = field(repr=False, compare=False)
    # Adam betas the schedule sets after `step` steps (OneCycle's momentum cycling), else None.
    momentum_fn: Callable[[int], tuple[float, float]] | None = field(default=None, repr=False, compare=False)

    def lr_at(self, step: int) -> float:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self.lr_fn(step)

    def momentum_at(self, step: int) -> tuple[float, float] | None:
        return None if self.momentum_fn is None else self.momentum_fn(step)

    def recipe(self, optimizer: OptimizerSpec) -> OptimizerRecipe:
        """The core's optimizer recipe: `optimizer`'s class and arguments, this schedule's lr (and betas)."""
        return OptimizerRecipe(
            optimizer.type,
            dict(optimizer.kwargs),
            self.lr_at,
            f"{self.type} (ds_config)",
            betas_after=self.momentum_at if self.momentum_fn is not None else None,
        )


# --------------------------------------------------------------------------------------------------------------
# Optimizer
# --------------------------------------------------------------------------------------------------------------


def optimizer_from_training(training: TrainingConfig) -> OptimizerSpec:
    """The trainer's own AdamW (what a ds_config without an optimizer section gets)."""
    return OptimizerSpec("AdamW", recipe_from_training(training).kwargs, adam_w_mode=True)


def optimizer_spec(section: Any, training: TrainingConfig, report: Report) -> OptimizerSpec:
    """The `optimizer` section as a spec; without one (or without a type) the training config's AdamW."""
    if section is None:
        return optimizer_from_training(training)
    section = as_section("optimizer", section)
    for key in section:
        if key == "legacy_fusion":
            report.ignore("optimizer.legacy_fusion")
        elif key not in ("type", "params"):
            report.unknown(f"optimizer.{key}")
    name = section.get("type")
    if name is None:
        report.ignore("optimizer")
        report.note(
            "optimizer has no 'type': DeepSpeed then uses the optimizer the script passes; the trainer uses the "
            "training config's AdamW.",
            door="trainer",
        )
        return optimizer_from_training(training)
    if not isinstance(name, str):
        raise key_error("optimizer.type", name, "is not a name", 'Write an optimizer name such as "AdamW".')
    params = as_section("optimizer.params", section.get("params"))
    if "max_grad_norm" in params:
        raise key_error(
            "optimizer.params.max_grad_norm",
            params["max_grad_norm"],
            "is rejected by DeepSpeed",
            "Remove it and set the top-level 'gradient_clipping' instead.",
        )
    lower = name.lower()
    if lower in ("adam", "adamw"):
        spec = _adam_spec(lower, name, params, report)
    else:
        spec = _torch_optimizer_spec(name, lower, params, report)
    report.override("training.lr", spec.lr, source="optimizer.params.lr")
    report.mapped("optimizer.type", f"torch.optim.{spec.type}")
    report.answer_params("optimizer", params, MAPPED, f"torch.optim.{spec.type}")
    return spec


def _adam_spec(lower: str, name: str, params: dict, report: Report) -> OptimizerSpec:
    for key, value in params.items():
        if key not in ADAM_PARAMS:
            raise unknown_key_error(
                f"optimizer.params.{key}", value, ADAM_PARAMS, f"DeepSpeed's {name} (FusedAdam) takes no such argument"
            )
    path = "optimizer.params."
    torch_adam = as_bool(path + "torch_adam", params.get("torch_adam", False))
    adam_w_mode = lower == "adamw" or as_bool(path + "adam_w_mode", params.get("adam_w_mode", True))
    betas = params.get("betas", (0.9, 0.999))
    if not isinstance(betas, (list, tuple)) or len(betas) != 2:
        raise key_error(path + "betas", betas, "is not a pair", "Write two numbers, e.g. [0.9, 0.999].")
    beta1, beta2 = (as_float(path + "betas", beta, minimum=0.0) for beta in betas)
    if beta1 >= 1 or beta2 >= 1:
        raise key_error(path + "betas", betas, "has a beta >= 1", "Write betas in [0, 1).")
    kwargs: dict[str, Any] = {
        "lr": as_float(path + "lr", params.get("lr", 1e-3), minimum=0.0),
        "betas": (beta1, beta2),
        "eps": as_float(path + "eps", params.get("eps", 1e-8), positive=True),
        "weight_decay": as_float(path + "weight_decay", params.get("weight_decay", 0.0), minimum=0.0),
    }
    if not as_bool(path + "bias_correction", params.get("bias_correction", True)):
        raise key_error(
            path + "bias_correction",
            False,
            "cannot be honoured: torch's Adam and AdamW always correct the moment bias",
            "Remove the key (or set it to true).",
        )
    if as_bool(path + "amsgrad", params.get("amsgrad", False)):
        if not torch_adam:
            raise key_error(
                path + "amsgrad", True, "is rejected by DeepSpeed's FusedAdam", "Set torch_adam: true or remove it."
            )
        kwargs["amsgrad"] = True
    if "foreach" in params and not torch_adam:
        raise key_error(
            path + "foreach", params["foreach"], "is rejected by DeepSpeed's FusedAdam", "Use it only with torch_adam."
        )
    for key in ("torch_adam", "fp32_optimizer_states", "set_grad_none", "foreach"):
        if key in params:
            report.ignore(path + key)
    if lower == "adamw" and "adam_w_mode" in params:
        report.ignore(path + "adam_w_mode")
    report.override("training.adam_beta1", beta1, source=f"{path}betas")
    report.override("training.adam_beta2", beta2, source=f"{path}betas")
    report.override("training.adam_eps", kwargs["eps"], source=f"{path}eps")
    report.override("training.weight_decay", kwargs["weight_decay"], source=f"{path}weight_decay")
    if not adam_w_mode and kwargs["weight_decay"] > 0:
        report.note(
            "optimizer Adam with adam_w_mode false applies L2 weight decay (torch.optim.Adam), not AdamW's decoupled "
            "decay: the trainer builds torch.optim.Adam from the ds_config (Translation.optimizer).",
            door="trainer",
        )
    if kwargs["weight_decay"] > 0:
        report.note(
            "weight decay: DeepSpeed decays every parameter the script passes it; the trainer exempts biases and norm "
            "weights (1-D tensors), as the HF Trainer does.",
            door="trainer",
        )
    return OptimizerSpec("AdamW" if adam_w_mode else "Adam", kwargs, ds_type=name, adam_w_mode=adam_w_mode)


def _torch_optimizer_spec(name: str, lower: str, params: dict, report: Report) -> OptimizerSpec:
    if lower in ONE_BIT:
        raise key_error(
            "optimizer.type",
            name,
            "cannot be honoured: 1-bit / 0-1 optimizers compress gradient communication inside DeepSpeed's engine "
            "(and DeepSpeed 0.19 no longer ships them)",
            "Use Adam, AdamW or a torch.optim optimizer.",
        )
    if lower == "muon":
        raise key_error(
            "optimizer.type",
            name,
            "cannot be honoured: DeepSpeed's Muon orthogonalises the update of each whole 2-D hidden weight and steps "
            "every other parameter with AdamW (its engine tags the parameters, use_muon); torch.optim.Muon takes 2-D "
            "parameters only and this backend's optimizer steps FSDP2 shards, not whole matrices",
            "Use Adam or AdamW (or another torch.optim optimizer that steps any parameter).",
        )
    if lower in KERNEL_ONLY:
        raise key_error(
            "optimizer.type",
            name,
            "cannot be honoured: it is one of DeepSpeed's own optimizer kernels (or the mup package), which the FSDP2 "
            "backend does not have",
            "Use Adam, AdamW or a torch.optim optimizer.",
        )
    class_name = "Adagrad" if lower == "adagrad" else name
    if class_name in UNUSABLE_OPTIMIZERS:
        raise key_error("optimizer.type", name, f"cannot be used: {UNUSABLE_OPTIMIZERS[class_name]}", "Choose another.")
    cls = getattr(torch.optim, class_name, None)
    if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)):
        names = ["Adam", "AdamW", *(n for n in dir(torch.optim) if n[:1].isupper() and n not in UNUSABLE_OPTIMIZERS)]
        close = [n for n in names if n.lower() == lower] or difflib.get_close_matches(name, names, n=1)
        hint = f"Did you mean '{close[0]}'? " if close else ""
        raise key_error(
            "optimizer.type",
            name,
            "is neither a DeepSpeed optimizer nor a torch.optim class (names are case-sensitive)",
            f"{hint}Use Adam, AdamW or a torch.optim class name.",
        )
    signature = inspect.signature(cls.__init__).parameters
    arguments = [key for key in signature if key not in ("self", "params")]
    kwargs: dict[str, Any] = {}
    for key, value in params.items():
        if key not in arguments:
            raise unknown_key_error(
                f"optimizer.params.{key}", value, arguments, f"torch.optim.{class_name} has no such argument"
            )
        kwargs[key] = tuple(value) if isinstance(value, list) else value
    kwargs.setdefault("lr", signature["lr"].default)
    as_float("optimizer.params.lr", kwargs["lr"], minimum=0.0)
    report.note(
        f"optimizer {name}: the trainer builds torch.optim.{class_name} from the ds_config (Translation.optimizer); "
        "the training.adam_* keys do not apply.",
        door="trainer",
    )
    return OptimizerSpec(class_name, kwargs, ds_type=name)


# --------------------------------------------------------------------------------------------------------------
# Scheduler
# --------------------------------------------------------------------------------------------------------------

_DS_FUNCTIONS: dict[str, Callable[..., float]] = {
    "WarmupLR": schedules.warmup_lr,
    "WarmupDecayLR": schedules.warmup_decay_lr,
    "WarmupCosineLR": schedules.warmup_cosine_lr,
    "OneCycle": schedules.one_cycle_lr,
    "LRRangeTest": schedules.lr_range_test_lr,
}
_INT_PARAMS = ("cycle_first_stair_count", "cycle_second_stair_count")
_BOOL_PARAMS = ("cycle_momentum", "lr_range_test_staircase")


def scheduler_spec(section: Any, optimizer: OptimizerSpec, report: Report) -> SchedulerSpec | None:
    """The `scheduler` section as a spec, or None without one (DeepSpeed then keeps the optimizer's lr)."""
    if section is None:
        return None
    section = as_section("scheduler", section)
    for key in section:
        if key not in ("type", "params"):
            report.unknown(f"scheduler.{key}")
    name = section.get("type")
    if name is None:
        report.ignore("scheduler")
        return None
    if not isinstance(name, str):
        raise key_error("scheduler.type", name, "is not a name", 'Write a scheduler name such as "WarmupLR".')
    if "params" not in section or section["params"] is None:
        raise key_error(
            "scheduler.params", None, "is missing; DeepSpeed needs it to build the scheduler", 'Add "params": {}.'
        )
    params = as_section("scheduler.params", section["params"])
    if "last_batch_iteration" in params:
        if params["last_batch_iteration"] != -1:
            raise key_error(
                "scheduler.params.last_batch_iteration",
                params["last_batch_iteration"],
                "cannot be honoured: the schedule's position is restored from the checkpoint",
                "Remove the key (or set it to -1).",
            )
        report.ignore("scheduler.params.last_batch_iteration")
        params = {k: v for k, v in params.items() if k != "last_batch_iteration"}
    spec = (
        _deepspeed_schedule(name, params, optimizer, report)
        if name in schedules.DS_SCHEDULERS
        else _torch_schedule(name, params, optimizer)
    )
    how = "DeepSpeed's schedule, step for step" if name in schedules.DS_SCHEDULERS else "replayed as DeepSpeed steps it"
    report.take("scheduler.type", f"{name}: {how} (Translation.scheduler)")
    report.answer_params("scheduler", params, TAKEN, name)
    return spec


def _deepspeed_schedule(name: str, params: dict, optimizer: OptimizerSpec, report: Report) -> SchedulerSpec:
    defaults = schedules.DEFAULTS[name]
    for key, value in params.items():
        if key not in defaults:
            raise unknown_key_error(
                f"scheduler.params.{key}", value, defaults, f"DeepSpeed's {name} takes no such argument"
            )
    for key in schedules.REQUIRED.get(name, ()):
        if params.get(key) is None:
            raise key_error(
                f"scheduler.params.{key}", None, f"is missing; DeepSpeed's {name} requires it", "Add the value."
            )
    values = {**defaults, **params}
    for key, value in values.items():
        path = f"scheduler.params.{key}"
        if value is None:
            continue
        if key == "warmup_type":
            if value not in schedules.WARMUP_TYPES:
                report.note(f"{path} = {value!r} is unknown: DeepSpeed falls back to 'log' warmup, and so does this.")
                values[key] = "log"
        elif key in ("warmup_num_steps", "lr_range_test_step_size"):
            values[key] = as_int(path, value, minimum=1)
        elif key in _INT_PARAMS:
            values[key] = as_int(path, value, minimum=0)
        elif key in _BOOL_PARAMS:
            values[key] = as_bool(path, value)
        else:  # numbers keep their JSON type, as DeepSpeed computes with them
            as_float(path, value, minimum=0.0, positive=key == "cycle_first_step_size")
    if name == "WarmupLR" and values["warmup_max_lr"] is None:
        values["warmup_max_lr"] = optimizer.lr
    function = _DS_FUNCTIONS[name]
    if name == "WarmupCosineLR":
        lr_fn = functools.partial(function, base_lr=optimizer.lr, **values)
    else:
        lr_fn = functools.partial(function, **values)
    momentum_fn = None
    if name == "OneCycle" and values["cycle_momentum"]:
        if "betas" in inspect.signature(getattr(torch.optim, optimizer.type)).parameters:
            momentum_fn = functools.partial(schedules.one_cycle_momentum, **values)
            report.note(
                "OneCycle cycles beta1 between cycle_max_mom and cycle_min_mom and sets beta2 to 0.99, as DeepSpeed "
                "does: the trainer must apply SchedulerSpec.momentum_at(step) to the optimizer's betas.",
                door="trainer",
            )
        else:
            report.note(
                f"OneCycle momentum cycling is off: {optimizer.type} has no betas (DeepSpeed turns it off too)."
            )
    return SchedulerSpec(name, values, optimizer.lr, lr_fn, momentum_fn)


class _TorchReplay:
    """The lr (and betas) a torch scheduler sets, step by step, on a one-parameter optimizer; cached."""

    def __init__(self, cls: type, params: dict, optimizer: OptimizerSpec) -> None:
        self._optimizer = optimizer.build([torch.zeros(1, requires_grad=True)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._scheduler = cls(self._optimizer, **params)
        self._history = [self._read()]

    def _read(self) -> tuple[float, tuple[float, float] | None]:
        group = self._optimizer.param_groups[0]
        return float(group["lr"]), (tuple(group["betas"]) if "betas" in group else None)

    def at(self, step: int) -> tuple[float, tuple[float, float] | None]:
        while len(self._history) <= step:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._scheduler.step()
            self._history.append(self._read())
        return self._history[step]


def _torch_schedule(name: str, params: dict, optimizer: OptimizerSpec) -> SchedulerSpec:
    if name in UNUSABLE_SCHEDULERS:
        raise key_error("scheduler.type", name, f"cannot be used: it {UNUSABLE_SCHEDULERS[name]}", "Choose another.")
    cls = getattr(torch.optim.lr_scheduler, name, None)
    if not (inspect.isclass(cls) and issubclass(cls, torch.optim.lr_scheduler.LRScheduler)):
        names = [*schedules.DS_SCHEDULERS, *(n for n in dir(torch.optim.lr_scheduler) if n.endswith("LR"))]
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"Did you mean '{close[0]}'? " if close else ""
        raise key_error(
            "scheduler.type",
            name,
            "is neither a DeepSpeed scheduler nor a torch.optim.lr_scheduler class",
            f"{hint}Use one of {', '.join(schedules.DS_SCHEDULERS)} or a torch scheduler name.",
        )
    try:
        replay = _TorchReplay(cls, params, optimizer)
    except (TypeError, ValueError, KeyError) as error:
        raise UserError(
            f"DeepSpeed config key 'scheduler.params' = {params!r} does not build torch.optim.lr_scheduler.{name}: "
            f"{error}. Fix the parameters to match that class."
        ) from None
    cycles_momentum = name in ("OneCycleLR", "CyclicLR") and params.get("cycle_momentum", True)
    momentum_fn = (lambda step: replay.at(step)[1]) if cycles_momentum and replay.at(0)[1] else None
    return SchedulerSpec(name, dict(params), optimizer.lr, lambda step: replay.at(step)[0], momentum_fn)
