"""`deepspeed.ops.adagrad.DeepSpeedCPUAdagrad` on torch.optim.Adagrad (L2 weight decay, no lr decay, as DeepSpeed)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
    ) -> None:
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)


__all__ = ["DeepSpeedCPUAdagrad"]
