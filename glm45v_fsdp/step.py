"""The end of a training step, one object for both doors (the Trainer and the ds_compat DeepSpeed engine).

`OptimizerStep` owns what happens between the last backward of an accumulation and the next step's first forward:
  - before each backward: HSDP all-reduces the replicas' gradients only at the accumulation boundary (every micro
    batch is reduce-scattered, so gradients stay sharded);
  - post-backward hooks (registered by plans that must touch the gradients before they are used, e.g. expert
    parallelism's replica reduction), run once per step;
  - the global gradient norm, per mesh: parameters sharded on different meshes (dense and expert) cannot share one
    foreach norm, so each mesh's norm is reduced over its own mesh and the squares are summed; one mesh gives the
    figure a single foreach norm gives;
  - unless the loss or the norm is non-finite: unscale (fp16), clip to `clip` (0: off), optimizer step, schedule;
  - a non-finite step is skipped and handed to `on_skip` (the door's policy: count, warn, or stop);
  - the fp16 loss scaler's update, and zeroing the gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from glm45v_fsdp.loss_scale import LossScaler


@dataclass(frozen=True)
class StepOutcome:
    grad_norm: float  # global, before clipping, unscaled
    stepped: bool
    loss_scale: float  # the fp16 scale this step's gradients carried (1.0 without fp16)


SkipHandler = Callable[[float | None, StepOutcome], None]


def _by_mesh(parameters: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Parameters with a gradient, grouped by the mesh their gradient lives on (plain tensors form one group)."""
    groups: dict[Any, list[nn.Parameter]] = {}
    for param in parameters:
        if param.grad is not None:
            mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            groups.setdefault(mesh, []).append(param)
    return list(groups.values())


def _mesh_norm(parameters: list[nn.Parameter]) -> torch.Tensor:
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters], norm_type=2.0, foreach=True)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def global_grad_norm(parameters: list[nn.Parameter]) -> float:
    """L2 norm of all gradients, every mesh's part reduced over its own mesh."""
    norms = [_mesh_norm(group) for group in _by_mesh(parameters)]
    if len(norms) == 1:
        return float(norms[0])
    return math.sqrt(sum(float(norm) ** 2 for norm in norms))


class OptimizerStep:
    def __init__(
        self,
        parameters: list[nn.Parameter],
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        clip: float = 0.0,
        scaler: LossScaler | None = None,
        hsdp_root: FSDPModule | None = None,
        on_skip: SkipHandler | None = None,
    ) -> None:
        """`parameters`: the trainable ones, in the order the norm sums them; `hsdp_root`: the FSDP root module of
        an HSDP model (None otherwise); `on_skip(loss, outcome)` is called for a skipped step."""
        self.parameters = parameters
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.clip = clip
        self.scaler = scaler
        self.hsdp_root = hsdp_root
        self.on_skip = on_skip
        self.post_backward_hooks: list[Callable[[], None]] = []

    @property
    def loss_scale(self) -> float:
        """What the loss is multiplied by before backward (fp16 loss scaling; 1.0 otherwise)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def before_backward(self, last_of_step: bool) -> None:
        """HSDP: reduce-scatter every micro batch, all-reduce across the replicas only with the step's last one."""
        if self.hsdp_root is not None:
            self.hsdp_root.set_requires_all_reduce(last_of_step)

    def finish(self, loss: float | None = None, scheduler_kwargs: dict | None = None) -> StepOutcome:
        """Norm, then unscale / clip / step / schedule, or skip; then the scaler's update and zero the gradients.
        `loss`: the step's loss, if known (a non-finite one skips the step)."""
        for hook in self.post_backward_hooks:
            hook()
        loss_scale = self.loss_scale
        grad_norm = global_grad_norm(self.parameters) / loss_scale
        stepped = (loss is None or math.isfinite(loss)) and math.isfinite(grad_norm)
        outcome = StepOutcome(grad_norm, stepped, loss_scale)
        if stepped:
            groups = _by_mesh(self.parameters)
            if loss_scale != 1.0:
                torch._foreach_mul_([p.grad for group in groups for p in group], 1.0 / loss_scale)
            if self.clip > 0:
                for group in groups:
                    norm = torch.tensor(grad_norm, device=group[0].device)
                    torch.nn.utils.clip_grads_with_norm_(group, self.clip, norm, foreach=True)
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step(**(scheduler_kwargs or {}))
        elif self.on_skip is not None:
            self.on_skip(loss, outcome)
        if self.scaler is not None:
            self.scaler.update(overflow=not stepped)
        self.optimizer.zero_grad(set_to_none=True)
        return outcome
