"""Forward to the last hidden state and the summed causal-LM loss (normalization is the trainer's job)."""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule

from glm45v_fsdp.data.vocab import IGNORE_INDEX
from glm45v_fsdp.errors import UserError

# Collated batch keys passed to Glm4vMoeModel.forward when present; bookkeeping keys are ignored.
_MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "pixel_values", "image_grid_thw", "mm_token_type_ids")
_CHECKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _check_fsdp_root(model: nn.Module) -> None:
    """The loss calls `model.model` and `model.lm_head`, never the root's forward, so the root FSDP unit's
    all-gather never runs: every parameter must belong to a nested FSDP unit."""
    if model in _CHECKED or not isinstance(model, FSDPModule):
        return
    units = [name + "." for name, module in model.named_modules() if name and isinstance(module, FSDPModule)]
    left = [name for name, _ in model.named_parameters() if not any(name.startswith(unit) for unit in units)]
    if left:
        raise UserError(
            f"Config key 'parallel.fsdp_plan.apply_modules' leaves {len(left)} parameter(s) in the root FSDP unit "
            f"(e.g. {left[:3]}), but the loss calls model.model and model.lm_head directly, so the root unit never "
            f"gathers them. Add 'model' and 'lm_head' to parallel.fsdp_plan.apply_modules."
        )
    _CHECKED.add(model)


def forward_hidden(model: nn.Module, batch: dict) -> torch.Tensor:
    """Run `model.model` (vision tower + language model) on a collated batch -> last hidden state [B, S, H].

    position_ids may be [3, B, S] (mRoPE) or [4, B, S] (packed: row 0 holds the per-sequence text positions).
    """
    _check_fsdp_root(model)
    inputs = {key: batch[key] for key in _MODEL_INPUTS if batch.get(key) is not None}
    return model.model(**inputs, use_cache=False).last_hidden_state


def causal_lm_loss_sum(
    hidden: torch.Tensor, lm_head: nn.Linear, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of fp32 token cross-entropy, number of supervised tokens), position t predicting labels[:, t+1].

    Same shift and ignore_index as transformers' ForCausalLMLoss; the last position of each row predicts nothing.
    """
    logits = lm_head(hidden).float()
    shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].to(logits.device)
    loss_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), shift_labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss_sum, (shift_labels != IGNORE_INDEX).sum()


def model_loss_sum(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """forward_hidden + causal_lm_loss_sum with the model's lm_head."""
    return causal_lm_loss_sum(forward_hidden(model, batch), model.lm_head, batch["labels"])
