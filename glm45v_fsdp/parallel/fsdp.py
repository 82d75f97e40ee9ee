"""FSDP2 by plan: `fully_shard` every module matched by `parallel.fsdp_plan.apply_modules`, then the root.

On a one-rank FSDP mesh there is nothing to shard: the plan is still matched (so a bad pattern fails the same way
everywhere), but the modules stay plain, as torchtitan does, and a bf16 `param_dtype` runs under autocast instead of
FSDP's parameter cast. This removes FSDP's copy-in/copy-out and hook cost from single-device runs. CPU offload still
needs FSDP, so it is applied whenever `cpu_offload` is on.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from glm45v_fsdp.config import FsdpPlanConfig
from glm45v_fsdp.parallel.plan import PlanMatch, match_modules

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

# Glm4vMoeModel returns the vision tower's per-image embeddings as torch.split views; FSDP2 warns about any view
# output because an in-place op on it would skip its hook. Nothing modifies them, so that one warning is noise.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPGlm4vMoeModel\) returned a view tensor")


def apply_fsdp(model: nn.Module, plan: FsdpPlanConfig, mesh: DeviceMesh, pin_memory: bool) -> list[PlanMatch]:
    """Shard the planned modules innermost first (so nested patterns work), then the root.

    Returns each pattern's matches for the log. The root keeps its parameters unsharded after forward: backward
    starts with it at once, so resharding would only cost an extra all-gather.
    """
    matches = match_modules(model, plan.apply_modules, "parallel.fsdp_plan.apply_modules")
    if mesh.size() == 1 and not plan.cpu_offload:
        return matches
    modules = dict(model.named_modules())
    selected = sorted({name for match in matches for name in match.names}, key=lambda n: -n.count("."))
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[plan.param_dtype], reduce_dtype=DTYPES[plan.reduce_dtype])
    offload = CPUOffloadPolicy(pin_memory=pin_memory) if plan.cpu_offload else OffloadPolicy()
    for name in selected:
        fully_shard(
            modules[name],
            mesh=mesh,
            mp_policy=policy,
            offload_policy=offload,
            reshard_after_forward=plan.reshard_after_forward,
        )
    fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload, reshard_after_forward=False)
    return matches


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def compute_precision(model: nn.Module, plan: FsdpPlanConfig, device_type: str) -> contextlib.AbstractContextManager:
    """The context forward runs in: FSDP casts parameters itself; an unsharded model in bf16 uses autocast."""
    if is_sharded(model) or plan.param_dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=DTYPES[plan.param_dtype])
