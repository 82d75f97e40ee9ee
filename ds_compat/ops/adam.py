"""`deepspeed.ops.adam`: DeepSpeedCPUAdam and FusedAdam on torch.optim.Adam (decoupled weight decay = AdamW)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from glm45v_fsdp.errors import UserError


def _check_bias_correction(name: str, bias_correction: bool) -> None:
    if not bias_correction:
        raise UserError(
            f"{name}(bias_correction=False) is not supported by the FSDP2 backend: its Adam always corrects the "
            "moment bias, as torch.optim.Adam does. Remove bias_correction=False (DeepSpeed's default is True)."
        )


class DeepSpeedCPUAdam(torch.optim.Adam):
    """DeepSpeed's host Adam: AdamW when `adamw_mode` (the default), else Adam with L2 weight decay."""

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        _check_bias_correction(type(self).__name__, bias_correction)
        super().__init__(
            model_params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            decoupled_weight_decay=adamw_mode,
        )
        self.defaults["adamw_mode"] = adamw_mode  # so the engine's rebuild on sharded parameters keeps it


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's device Adam: AdamW when `adam_w_mode` (the default), else Adam with L2 weight decay."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        _check_bias_correction(type(self).__name__, bias_correction)
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            decoupled_weight_decay=adam_w_mode,
        )
        self.defaults["adam_w_mode"] = adam_w_mode


__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
