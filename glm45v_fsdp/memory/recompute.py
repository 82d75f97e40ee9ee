"""Recompute (activation checkpointing) by plan: the matched modules keep only their inputs during forward and run
again in backward.

The plan patches each matched module's `forward` in place (no wrapper module), so parameter names, checkpoints and
the FSDP plan's patterns are unchanged; FSDP2 then wraps the same module and gathers its parameters before the
recomputation runs in backward. Granularity:
  - full: each module's inputs are kept and, with `keep_attention` (the default), the outputs of its attention
    kernels (output and log-sum-exp: O(tokens) bytes); everything else runs again in backward. The attention kernel
    is the one op whose forward grows with tokens^2 while its outputs grow with tokens, so keeping them costs a few
    MiB per layer and spares backward the most expensive recomputation (at 8192 tokens on the tiny model: +21% time
    per step when attention is recomputed, ~0% when it is kept; peak memory -73% vs -69%; docs/memory.md);
  - selective: the outputs of matrix multiplies, grouped expert GEMMs, attention kernels, the router's top-k and
    context parallelism's all-to-alls and ring are kept, the cheap element-wise work (norms, activations, rotary) is
    recomputed. Full recompute runs the all-to-alls again in backward (they are part of the forward it replays);
    the ring is an attention op, so full recompute keeps it with keep_attention and replays it without.
The router is deterministic (sigmoid scores + top-k, no sampling), so the recomputed forward routes every token to the
same experts; the selective policy keeps the top-k result itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from glm45v_fsdp.config import RecomputeConfig
from glm45v_fsdp.log import get_logger
from glm45v_fsdp.module_patterns import PlanMatch, match_modules
from glm45v_fsdp.parallel.ring import RING_ATTENTION_OP

_ATEN = torch.ops.aten


def _existing_ops(names: list[tuple[str, str]]) -> set[Any]:
    """The overloads among `(namespace, op)` that this build registers (backend and kernel packages add their own)."""
    ops = set()
    for namespace, name in names:
        try:
            ops.add(getattr(getattr(torch.ops, namespace), name).default)
        except (AttributeError, RuntimeError):
            continue
    return ops


# Attention kernels below autograd, as a selective-checkpoint policy sees them: sdpa's CPU / CUDA / out-of-tree
# (NPU: privateuse1) back ends, flash-attn's custom ops when that package is installed and loaded, and Ring
# attention's op (the whole ring: keeping its outputs keeps backward from running the forward ring again).
ATTENTION_OPS = {RING_ATTENTION_OP} | _existing_ops(
    [
        ("aten", "_scaled_dot_product_flash_attention_for_cpu"),
        ("aten", "_scaled_dot_product_efficient_attention"),
        ("aten", "_scaled_dot_product_flash_attention"),
        ("aten", "_scaled_dot_product_cudnn_attention"),
        ("aten", "_scaled_dot_product_fused_attention_overrideable"),
        ("flash_attn", "_flash_attn_forward"),
        ("flash_attn", "_flash_attn_varlen_forward"),
    ]
)
# Context parallelism's exchanges (functional collectives): kept by selective recompute, so backward does not run
# them again.
COLLECTIVE_OPS = _existing_ops(
    [
        ("_c10d_functional", "all_to_all_single"),
        ("_c10d_functional", "all_gather_into_tensor"),
        ("_c10d_functional", "reduce_scatter_tensor"),
    ]
)
# FSDP2 units nested inside a checkpointed module (the expert stacks under expert parallelism, inside each decoder
# layer) mark their hooks with record_function, and the recomputation runs one marker more than the forward did
# (FSDP's root_pre_forward fires again). Selective checkpointing counts every op's calls and rejects a recomputation
# with more; the markers carry no data, so they join the ops torch's selective checkpoint already ignores (detach).
torch.utils.checkpoint.SAC_IGNORED_OPS.update(
    getattr(getattr(torch.ops.profiler, name), overload)
    for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit")
    for overload in getattr(torch.ops.profiler, name).overloads()
)
SAVED_IN_SELECTIVE = (
    ATTENTION_OPS
    | COLLECTIVE_OPS
    | {
        _ATEN.mm.default,
        _ATEN.addmm.default,
        _ATEN.bmm.default,
        _ATEN._grouped_mm.default,
        _ATEN.topk.default,
    }
)


def _policy(saved: set[Any]) -> Callable[..., CheckpointPolicy]:
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


_SELECTIVE_POLICY = _policy(SAVED_IN_SELECTIVE)
_KEEP_ATTENTION_POLICY = _policy(ATTENTION_OPS)


def _selective_contexts():
    return create_selective_checkpoint_contexts(_SELECTIVE_POLICY)


def _keep_attention_contexts():
    return create_selective_checkpoint_contexts(_KEEP_ATTENTION_POLICY)


def kept_inside(cfg: RecomputeConfig) -> str:
    """What a recomputed module keeps besides its inputs, in words (the plan's log line)."""
    if cfg.use_reentrant:
        return "nothing (reentrant checkpoint)"
    if cfg.granularity == "selective":
        return "matmul, grouped-GEMM, attention, router top-k and all-to-all outputs (selective)"
    return "attention kernel outputs (full, keep_attention)" if cfg.keep_attention else "nothing (full)"


def _recomputed_forward(forward: Callable, cfg: RecomputeConfig, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    if cfg.use_reentrant:  # the reentrant variant takes positional tensors only: keyword arguments ride in a closure
        return checkpoint(lambda *inputs: forward(*inputs, **kwargs), *args, use_reentrant=True)
    if cfg.granularity == "selective":
        return checkpoint(forward, *args, use_reentrant=False, context_fn=_selective_contexts, **kwargs)
    if cfg.keep_attention:
        return checkpoint(forward, *args, use_reentrant=False, context_fn=_keep_attention_contexts, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_recompute(model: nn.Module, cfg: RecomputeConfig) -> list[PlanMatch]:
    """The recompute plan on the meta model (before FSDP): patch the forward of every matched module."""
    matches = match_modules(model, cfg.apply_modules, "features.recompute.apply_modules")
    for name in sorted({name for match in matches for name in match.names}):
        module = model.get_submodule(name)
        module.forward = functools.partial(_recomputed_forward, module.forward, cfg)
    get_logger().info("recompute keeps each module's inputs and %s", kept_inside(cfg))
    return matches
