"""`deepspeed.ops.lion`: DeepSpeedCPULion and FusedLion, the Lion update (Chen et al. 2023) in plain PyTorch.

Per parameter: update = sign(beta1 * m + (1 - beta1) * g); p <- p * (1 - lr * weight_decay) - lr * update;
m <- beta2 * m + (1 - beta2) * g — DeepSpeed's rule. Elementwise, so it runs on FSDP2's sharded parameters as is.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class Lion(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        if lr < 0.0 or not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"Lion: lr must be >= 0 and betas in [0, 1); got lr={lr}, betas={betas}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["exp_avg"] = torch.zeros_like(param)
                exp_avg, grad = state["exp_avg"], param.grad
                param.mul_(1.0 - group["lr"] * group["weight_decay"])
                param.add_(torch.sign(exp_avg * beta1 + grad * (1.0 - beta1)), alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(grad, alpha=1.0 - beta2)
        return loss


class DeepSpeedCPULion(Lion):
    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        fp32_optimizer_states: bool = True,
    ) -> None:
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)


class FusedLion(Lion):
    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)


__all__ = ["DeepSpeedCPULion", "FusedLion", "Lion"]
