"""Recompute (activation checkpointing) by plan: the matched modules keep only their inputs during forward and run
again in backward.

The plan patches each matched module's `forward` in place (no wrapper module), so parameter names, checkpoints and
the FSDP plan's patterns are unchanged; FSDP2 then wraps the same module and gathers its parameters before the
recomputation runs in backward. Granularity:
  - full: nothing inside the module is kept;
  - selective: the outputs of matrix multiplies, grouped expert GEMMs, attention kernels and the router's top-k are
    kept, the cheap element-wise work (norms, activations, rotary) is recomputed.
The router is deterministic (sigmoid scores + top-k, no sampling), so the recomputed forward routes every token to the
same experts; the selective policy keeps the top-k result itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from glm45v_fsdp.config import RecomputeConfig
from glm45v_fsdp.parallel.plan import PlanMatch, match_modules

_ATEN = torch.ops.aten
SAVED_IN_SELECTIVE = {
    _ATEN.mm.default,
    _ATEN.addmm.default,
    _ATEN.bmm.default,
    _ATEN._grouped_mm.default,
    _ATEN._scaled_dot_product_flash_attention_for_cpu.default,
    _ATEN._scaled_dot_product_efficient_attention.default,
    _ATEN._scaled_dot_product_flash_attention.default,
    _ATEN._scaled_dot_product_cudnn_attention.default,
    _ATEN.topk.default,
}


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_IN_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_selective_policy)


def _recomputed_forward(forward: Callable, cfg: RecomputeConfig, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    if cfg.use_reentrant:  # the reentrant variant takes positional tensors only: keyword arguments ride in a closure
        return checkpoint(lambda *inputs: forward(*inputs, **kwargs), *args, use_reentrant=True)
    if cfg.granularity == "selective":
        return checkpoint(forward, *args, use_reentrant=False, context_fn=_selective_contexts, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_recompute(model: nn.Module, cfg: RecomputeConfig) -> list[PlanMatch]:
    """The recompute plan on the meta model (before FSDP): patch the forward of every matched module."""
    matches = match_modules(model, cfg.apply_modules, "features.recompute.apply_modules")
    for name in sorted({name for match in matches for name in match.names}):
        module = model.get_submodule(name)
        module.forward = functools.partial(_recomputed_forward, module.forward, cfg)
    return matches
