"""FSDP2 by plan: `fully_shard` every module matched by `parallel.fsdp_plan.apply_modules`, then the root."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from glm45v_fsdp.config import FsdpPlanConfig
from glm45v_fsdp.parallel.plan import PlanMatch, match_modules

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def apply_fsdp(model: nn.Module, plan: FsdpPlanConfig, mesh: DeviceMesh, pin_memory: bool) -> list[PlanMatch]:
    """Shard the planned modules innermost first (so nested patterns work), then the root.

    Returns each pattern's matches for the log. The root keeps its parameters unsharded after forward: backward
    starts with it at once, so resharding would only cost an extra all-gather.
    """
    matches = match_modules(model, plan.apply_modules, "parallel.fsdp_plan.apply_modules")
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
