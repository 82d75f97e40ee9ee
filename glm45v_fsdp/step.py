"""The end of a training step, one object for both doors (the Trainer and the ds_compat DeepSpeed engine).

`OptimizerStep` owns what happens between the last backward of an accumulation and the next step's first forward:
  - before each backward: HSDP all-reduces the replicas' gradients only at the accumulation boundary (every micro
    batch is reduce-scattered, so gradients stay sharded);
  - post-backward hooks (registered by plans that must touch the gradients before they are used, e.g. expert
    parallelism's replica reduction), run once per step;
  - the global gradient norm (with the trainer's loss and token count summed over the data-parallel ranks in the
    same all-reduce when both span the job), unscale (fp16), clipping to `clip` (0: off) and the optimizer step, on
    the local shards of FSDP2's DTensors (glm45v_fsdp/parallel/local_shards.py: the same figures without DTensor's
    per-op dispatch), unless the loss or the norm is non-finite; then the schedule;
  - a non-finite step is skipped and handed to `on_skip` (the door's policy: count, warn, or stop);
  - the MoE router monitor's step end (model/router_health.py): with features.router.bias_update_rate, the step's
    expert load summed over all ranks and each router's e_score_correction_bias updated from it (not after a skipped
    step);
  - the fp16 loss scaler's update, and zeroing the gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from glm45v_fsdp.loss_scale import LossScaler
from glm45v_fsdp.model.router_health import RouterMonitor
from glm45v_fsdp.parallel.local_shards import grad_norm, optimizer_step, scale_grads_


@dataclass(frozen=True)
class StepOutcome:
    grad_norm: float  # global, before clipping, unscaled
    stepped: bool
    loss_scale: float  # the fp16 scale this step's gradients carried (1.0 without fp16)


SkipHandler = Callable[[float | None, StepOutcome], None]


@dataclass(frozen=True)
class DpSums:
    """Scalars of the step to sum over the data-parallel ranks (`values`, float64, summed in place; `group` None: one
    data-parallel rank, nothing to sum)."""

    values: torch.Tensor
    group: Any = None


@dataclass(eq=False)  # identity, not field-wise equality
class OptimizerStep:
    """`parameters`: the trainable ones, in the order the norm sums them; `hsdp_root`: the FSDP root module of an HSDP
    model (None otherwise); `on_skip(loss, outcome)` is called for a skipped step; `router`: the model's router
    monitor (None without MoE layers)."""

    parameters: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: Any = None
    clip: float = 0.0
    scaler: LossScaler | None = None
    hsdp_root: FSDPModule | None = None
    on_skip: SkipHandler | None = None
    router: RouterMonitor | None = None
    post_backward_hooks: list[Callable[[], None]] = field(default_factory=list, init=False)

    @property
    def loss_scale(self) -> float:
        """What the loss is multiplied by before backward (fp16 loss scaling; 1.0 otherwise)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def before_backward(self, last_of_step: bool) -> None:
        """HSDP: reduce-scatter every micro batch, all-reduce across the replicas only with the step's last one."""
        if self.hsdp_root is not None:
            self.hsdp_root.set_requires_all_reduce(last_of_step)

    def finish(
        self, loss: float | None = None, scheduler_kwargs: dict | None = None, dp_sums: DpSums | None = None
    ) -> StepOutcome:
        """Norm, then unscale / clip / step / schedule, or skip; then the scaler's update and zero the gradients.
        `loss`: the step's loss, if known (a non-finite one skips the step); `dp_sums`: the step's loss (first) and
        other scalars, summed over the data-parallel ranks in the norm's all-reduce, the sum then being `loss`."""
        for hook in self.post_backward_hooks:
            hook()
        loss_scale = self.loss_scale
        assert loss is None or dp_sums is None, "the loss is either given or summed from dp_sums"
        riders, group = (dp_sums.values, dp_sums.group) if dp_sums is not None else (None, None)
        norm = grad_norm(self.parameters, riders, group) / loss_scale
        if dp_sums is not None:
            loss = float(dp_sums.values[0])
        stepped = (loss is None or math.isfinite(loss)) and math.isfinite(norm)
        outcome = StepOutcome(norm, stepped, loss_scale)
        if stepped:
            if loss_scale != 1.0:
                scale_grads_(self.parameters, 1.0 / loss_scale)
            clip_coefficient = self.clip / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s rule
            if self.clip > 0 and clip_coefficient < 1.0:
                scale_grads_(self.parameters, clip_coefficient)
            optimizer_step(self.optimizer)
            if self.scheduler is not None:
                self.scheduler.step(**(scheduler_kwargs or {}))
        elif self.on_skip is not None:
            self.on_skip(loss, outcome)
        if self.router is not None:
            self.router.end_step(stepped)
        if self.scaler is not None:
            self.scaler.update(overflow=not stepped)
        self.optimizer.zero_grad(set_to_none=True)
        return outcome
