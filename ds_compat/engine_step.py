"""The engine's step and optimizer glue: the optimizer (from the ds_config, a client object re-pointed at the sharded
parameters, or a client callable) and the lr scheduler built at initialize, then DeepSpeed's micro steps, accumulation
boundary and counters around the trainer's step (glm45v_fsdp.step.OptimizerStep): EngineSteps, a mixin of
DeepSpeedEngine."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ds_compat.alst import sequence_average
from ds_compat.step_watch import watched
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.model.router_health import router_monitor
from glm45v_fsdp.optim import build_scheduler
from glm45v_fsdp.step import OptimizerStep, StepOutcome


def param_groups(model_parameters: Any) -> list[dict[str, Any]]:
    """model_parameters (tensors or param-group dicts) as a list of groups with list 'params'."""
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [{**group, "params": list(group["params"])} for group in items]
    return [{"params": items}]


def _remap_groups(groups: list[dict[str, Any]], old_names: dict[int, str], new_params: dict[str, nn.Parameter]):
    """Param groups over the model's parameters before sharding, re-pointed at the sharded ones (by name)."""
    remapped = []
    for index, group in enumerate(groups):
        params = []
        for param in group["params"]:
            name = old_names.get(id(param))
            if name is None:
                if any(param is p for p in new_params.values()):
                    params.append(param)
                    continue
                raise UserError(
                    f"Parameter group {index} holds a tensor of shape {tuple(param.shape)} that is not a parameter of "
                    "the model passed to initialize(). The FSDP2 engine shards the model's parameters and can only "
                    "optimize those: pass model.parameters() (or groups of them) as model_parameters / optimizer."
                )
            params.append(new_params[name])
        remapped.append({**group, "params": params})
    return remapped


def _mark_stepped_by_scheduler(optimizer: torch.optim.Optimizer) -> None:
    """What torch's LRScheduler does to the optimizer it is built on, for a scheduler moved onto `optimizer`."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step = optimizer.step

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True
        return step(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    optimizer.step = wrapper


class EngineSteps:
    """initialize's optimizer and scheduler, and backward / step / zero_grad with DeepSpeed's bookkeeping."""

    def _configure_step(
        self,
        client_optimizer: Any,
        client_scheduler: Any,
        given_groups: list[dict[str, Any]] | None,
        old_names: dict[int, str],
    ) -> None:
        """The optimizer, the lr scheduler and the trainer's step object, when initialize has an optimizer (the
        client's, or the ds_config's)."""
        self.optimizer: torch.optim.Optimizer | None = None
        self.basic_optimizer = None
        self.lr_scheduler: Any = None
        self.step_runner: OptimizerStep | None = None  # the trainer's step object; built with the optimizer
        if client_optimizer is None and self.translation.optimizer.ds_type is None:
            return
        new_params = dict(self.module.named_parameters(remove_duplicate=False))
        self._configure_optimizer(client_optimizer, given_groups, old_names, new_params)
        self._configure_lr_scheduler(client_scheduler)
        self.step_runner = OptimizerStep(
            [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad],
            self.optimizer,
            self.lr_scheduler,
            clip=self.gradient_clipping(),
            scaler=self.loss_scaler,
            hsdp_root=self.core if isinstance(self.core, FSDPModule) and self.dims.hsdp_enabled else None,
            on_skip=self._skip_step,
            router=router_monitor(self.core),  # MoE bias balancing after each step (features.router)
        )

    def _configure_optimizer(
        self,
        client_optimizer: Any,
        given_groups: list[dict[str, Any]] | None,
        old_names: dict[int, str],
        new_params: dict[str, nn.Parameter],
    ) -> None:
        """`given_groups`: model_parameters as param groups over the model's parameters before sharding."""
        if given_groups is None:
            groups = [{"params": list(self.module.parameters())}]
        else:
            groups = _remap_groups(given_groups, old_names, new_params)
        if client_optimizer is None:
            optimizer = self.translation.optimizer.build(groups, fused=self.device_layer.has_fused_adamw())
            self.log.info("ds_compat: optimizer from the ds_config: %s", self.translation.optimizer.describe())
        elif isinstance(client_optimizer, torch.optim.Optimizer):
            optimizer = self._repoint_optimizer(client_optimizer, old_names, new_params)
        elif callable(client_optimizer):
            optimizer = client_optimizer(groups)
            self.log.info("ds_compat: optimizer from the client callable: %s", type(optimizer).__name__)
        else:
            raise UserError(
                f"initialize(optimizer=...) must be a torch.optim.Optimizer or a callable taking the parameters, got "
                f"{type(client_optimizer).__name__}."
            )
        optimizer.param_groups[:] = [group for group in optimizer.param_groups if len(group["params"]) != 0]
        seen: set[int] = set()
        for group in optimizer.param_groups:
            for param in group["params"]:
                assert id(param) not in seen, "Duplicate parameters found in optimizer param groups"
                seen.add(id(param))
        self.optimizer = self.basic_optimizer = optimizer

    def _repoint_optimizer(
        self, client: torch.optim.Optimizer, old_names: dict[int, str], new_params: dict[str, nn.Parameter]
    ) -> torch.optim.Optimizer:
        """fully_shard replaced the parameters the client optimizer holds: its param groups are re-pointed at the
        sharded ones (mapped by name) in place, so the object stays the client's, as in DeepSpeed, and a scheduler
        or anything else built on it before initialize() drives the live optimizer."""
        if any(client.state.values()):
            self.log.warning(
                "ds_compat: the client optimizer already holds state (it has stepped); it restarts without it on the "
                "sharded parameters"
            )
        groups = _remap_groups([dict(group) for group in client.param_groups], old_names, new_params)
        for group, remapped in zip(client.param_groups, groups):
            group["params"] = remapped["params"]
        client.state.clear()
        self.log.info(
            "ds_compat: the client optimizer %s now holds the sharded parameters (same object, same param-group "
            "hyperparameters)",
            type(client).__name__,
        )
        return client

    def _configure_lr_scheduler(self, client_scheduler: Any) -> None:
        if client_scheduler is not None:
            if isinstance(client_scheduler, Callable) and not hasattr(client_scheduler, "step"):
                self.lr_scheduler = client_scheduler(self.optimizer)
                self.log.info("ds_compat: lr scheduler from the client callable")
            else:
                self.lr_scheduler = client_scheduler
                if getattr(client_scheduler, "optimizer", self.optimizer) is not self.optimizer:
                    client_scheduler.optimizer = self.optimizer
                    _mark_stepped_by_scheduler(self.optimizer)
                    self.log.info("ds_compat: the client lr scheduler now drives the engine's optimizer")
        elif self.translation.scheduler is not None:
            spec = self.translation.scheduler
            self.lr_scheduler = build_scheduler(self.optimizer, spec.recipe(self.translation.optimizer))

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._is_gradient_accumulation_boundary is not None:
            return self._is_gradient_accumulation_boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._is_gradient_accumulation_boundary = is_boundary

    @watched
    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """loss / gradient_accumulation_steps (returned, as DeepSpeed), backpropagated divided by the data-parallel
        size too: the FSDP2 core sums gradients over ranks, DeepSpeed averages them (under DeepSpeed's ALST mpu at
        ZeRO-3 also over the sequence-parallel group, as DeepSpeed 0.19.8: ds_compat/alst.py)."""
        assert self.optimizer is not None, "must provide optimizer during init in order to use backward"
        assert isinstance(loss, torch.Tensor) and loss.numel() == 1, (
            "loss must be a scalar tensor. If you need to pass output gradients, backward() of output tensors"
        )
        scaled = loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss
        self.step_runner.before_backward(last_of_step=self.is_gradient_accumulation_boundary())
        divisor = self.dp_world_size * (sequence_average(self.translation.zero_stage) if self.alst else 1)
        (scaled * (self.step_runner.loss_scale / divisor)).backward(retain_graph=retain_graph)
        return scaled

    def zero_grad(self) -> None:
        for param in self.module.parameters():
            param.grad = None

    @watched
    def step(self, lr_kwargs: dict | None = None) -> None:
        """At the accumulation boundary: the trainer's step (clip at gradient_clipping, skip on a non-finite norm,
        optimizer step, lr scheduler step with `lr_kwargs`, zero the gradients), then count the step. Every call
        counts a micro step."""
        assert self.optimizer is not None, "must provide optimizer during init in order to use step"
        self._step_applied = False
        if self.is_gradient_accumulation_boundary():
            outcome = self.step_runner.finish(scheduler_kwargs=lr_kwargs)
            self._global_grad_norm, self._step_applied = outcome.grad_norm, outcome.stepped
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
            if self.global_steps % self.translation.steps_per_print == 0:  # DeepSpeed's _report_progress
                self.log.info(
                    "step=%d, skipped=%d, lr=%s, mom=%s",
                    self.global_steps,
                    self.skipped_steps,
                    self.get_lr(),
                    self.get_mom(),
                )
        self.micro_steps += 1

    def _skip_step(self, loss: float | None, outcome: StepOutcome) -> None:
        """DeepSpeed skips a step with a non-finite gradient norm, without limit, and says so."""
        self.skipped_steps += 1
        self.log.warning(
            "ds_compat: skipping step %d: the gradient norm is %s%s (skipped steps: %d)",
            self.global_steps + 1,
            outcome.grad_norm,
            "" if self.loss_scaler is None else f" at fp16 loss scale {outcome.loss_scale:g}",
            self.skipped_steps,
        )
