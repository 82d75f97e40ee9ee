"""FSDP2 by plan: `fully_shard` every module matched by `parallel.fsdp_plan.apply_modules`, then the root.

On a one-rank FSDP mesh there is nothing to shard: the plan is still matched (so a bad pattern fails the same way
everywhere), but the modules stay plain, as torchtitan does, and a bf16 `param_dtype` runs under autocast instead of
FSDP's parameter cast. This removes FSDP's copy-in/copy-out and hook cost from single-device runs. CPU offload still
needs FSDP, so it is applied whenever `cpu_offload` is on.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard

from glm45v_fsdp.config import FsdpPlanConfig
from glm45v_fsdp.errors import ConfigError
from glm45v_fsdp.module_patterns import PlanMatch, match_modules

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# parallel.fsdp_plan.unit_mib when the config leaves it null, per device type. cpu (gloo): measured, see
# docs/performance.md#how-the-unit-size-is-chosen. npu / cuda: one unit per planned module, as torchtitan and
# MindSpeed's FSDP2 shard (collectives overlap compute there); not yet measured on hardware.
UNIT_MIB_DEFAULT = {"cpu": 32.0, "cuda": 0.0, "npu": 0.0}


def unit_mib(plan: FsdpPlanConfig, device_type: str) -> float:
    """The unit size in MiB that runs: the plan's, or the device's default when the plan leaves it null."""
    return plan.unit_mib if plan.unit_mib is not None else UNIT_MIB_DEFAULT.get(device_type, 0.0)


# Glm4vMoeVisionModel / Glm4vMoeModel return the per-image embeddings as torch.split views, and GroupedExperts its
# grouped GEMM output as a view (model/moe.py, _ContiguousGrad); FSDP2 warns about any view output because an in-place
# op on it would skip its hook. Nothing modifies them, so those warnings are noise.
warnings.filterwarnings(
    "ignore", message=r"FSDP2-wrapped module \(FSDP(Glm4vMoe(Vision)?Model|GroupedExperts)\) returned a view tensor"
)


@dataclass(frozen=True)
class FsdpApplied:
    """What apply_fsdp matched and, in one line, what it sharded and how (None: nothing was sharded)."""

    matches: list[PlanMatch]
    sharding: str | None


def apply_fsdp(
    model: nn.Module,
    plan: FsdpPlanConfig,
    mesh: DeviceMesh,
    pin_memory: bool,
    required_units: tuple[str, ...] = (),
    expert_units: list[str] = (),
    expert_mesh: DeviceMesh | None = None,
    own_units: tuple[str, ...] = (),
) -> FsdpApplied:
    """Shard the planned modules innermost first (so nested patterns work), then the root.

    `expert_units`: modules whose parameters expert parallelism already sharded on dim 0 over the ep mesh; each is
    a unit of its own over `expert_mesh` (efsdp, or (dp_replicate, efsdp) for HSDP), sharded on dim 1, so a rank
    holds a plain box of its own experts (no strided shards). They are sharded first: they sit inside the layers.
    When `expert_mesh` has one rank (ep = dp: each expert lives on one rank) there is nothing to shard or reduce, so
    stacks already stored in `param_dtype` stay plain DTensors on the ep mesh, left out of every unit, as a one-rank
    FSDP mesh leaves the whole model: FSDP's hooks and copies there cost time only. Stacks that need a cast stay
    units: FSDP frees each layer's cast copy after its forward, where autograd would keep every layer's to backward.

    `required_units` are modules the training forward calls outside their parent's forward, so each must be an
    FSDP unit of its own or its parameters would not be gathered when it runs; the plan must select them.
    `own_units` are modules a script calls itself before the model's forward (a forward pre-hook that embeds the
    tokens and runs the vision tower): each is a unit of its own whatever its size, so the call gathers it, and its
    gradients are reduce-scattered after its own backward (in the root's unit they would come after the root's).
    Returns each pattern's matches and the log's line on what was sharded. The root keeps its parameters unsharded
    after forward: backward starts with it at once, so resharding would only cost an extra all-gather.
    """
    matches = match_modules(model, plan.apply_modules, "parallel.fsdp_plan.apply_modules")
    selected_names = {name for match in matches for name in match.names}
    present = dict(model.named_modules())
    missing = [unit for unit in required_units if unit in present and unit not in selected_names]
    if missing:
        raise ConfigError(
            f"Config key 'parallel.fsdp_plan.apply_modules' = {plan.apply_modules} does not select {missing}. The "
            f"training forward runs {', '.join(required_units)} outside its parent module's forward, so each must be "
            f"an FSDP unit of its own: add {missing} to parallel.fsdp_plan.apply_modules."
        )
    if mesh.size() == 1 and not plan.cpu_offload:
        return FsdpApplied(matches, None)
    size = unit_mib(plan, mesh.device_type)
    alone = set(required_units) | set(expert_units) | set(own_units)
    groups = unit_groups(model, matches, alone, size, required=set(required_units) - set(own_units))
    groups = [g for g in groups if g[0] not in expert_units]
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[plan.param_dtype], reduce_dtype=DTYPES[plan.reduce_dtype])
    offload = CPUOffloadPolicy(pin_memory=pin_memory) if plan.cpu_offload else OffloadPolicy()
    planned = len(selected_names - set(expert_units))
    in_units = sum(len(group) for group in groups)
    default = "" if plan.unit_mib is not None else f", the {mesh.device_type} default"
    if size > 0 and not groups:
        unit_text = f"all {planned} planned module(s) below unit_mib {size:g}{default}, so none is a unit of its own"
    elif size > 0:
        unit_text = (
            f"{in_units} of the {planned} planned module(s) in {len(groups)} unit(s) (unit_mib {size:g}{default}), "
            f"{planned - in_units} below the unit size left to the enclosing unit"
        )
    else:
        unit_text = f"one unit per planned module ({in_units})"
    expert_params = [param for name in expert_units for param in present[name].parameters()]
    plain_experts = bool(expert_units) and expert_stacks_stay_plain(
        expert_mesh.size(), plan.cpu_offload, all(param.dtype == DTYPES[plan.param_dtype] for param in expert_params)
    )
    if not expert_units:
        experts = ""
    elif plain_experts:
        experts = f", {len(expert_units)} expert stack(s) left plain (efsdp has one rank: nothing to shard or reduce)"
    else:
        experts = f", {len(expert_units)} expert stack(s) over {expert_mesh.size()} rank(s)"
    offloaded = ", parameters offloaded to the host" if plan.cpu_offload else ""
    hsdp = f" (HSDP: {mesh.size(0)} replica(s) x {mesh.size(1)} shard(s))" if mesh.ndim > 1 else ""
    sharding = (
        f"fully_shard over {mesh.size()} rank(s){hsdp}: {unit_text}{experts}, then the root (everything else)"
        f"{offloaded}; "
        f"compute {plan.param_dtype}, reduce {plan.reduce_dtype}"
    )
    units = [] if plain_experts else [([name], expert_mesh, lambda param: Shard(1)) for name in expert_units]
    plain = set(expert_params) if plain_experts else None
    units += [(group, mesh, None) for group in sorted(groups, key=lambda g: -g[0].count("."))]  # innermost first
    for names, unit_mesh, placement in units:
        fully_shard(
            present[names[0]] if len(names) == 1 else [present[name] for name in names],
            mesh=unit_mesh,
            mp_policy=policy,
            offload_policy=offload,
            reshard_after_forward=plan.reshard_after_forward,
            shard_placement_fn=placement,
            ignored_params=plain,
        )
    fully_shard(
        model, mesh=mesh, mp_policy=policy, offload_policy=offload, reshard_after_forward=False, ignored_params=plain
    )
    if plan.prefetch > 0:
        set_prefetch(model, matches, groups, plan.prefetch)
        sharding += f"; prefetch {plan.prefetch} unit(s) ahead in forward and backward along each pattern"
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Plain SUM over the FSDP mesh (no AVG, no PREMUL_SUM, which gloo lacks): the trainer's loss scale
            # holds the whole normalisation, so it stays right when CP ranks join the mesh.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return FsdpApplied(matches, sharding)


def expert_stacks_stay_plain(expert_mesh_ranks: int, cpu_offload: bool, stored_in_param_dtype: bool) -> bool:
    """Whether expert stacks stay out of FSDP (see `apply_fsdp`): their mesh has one rank, nothing is offloaded, and
    no cast is needed. The memory model (memory/estimate.py) applies the same rule."""
    return expert_mesh_ranks == 1 and not cpu_offload and stored_in_param_dtype


def unit_groups(
    model: nn.Module, matches: list[PlanMatch], alone: set[str], unit_mib: float, required: set[str] = frozenset()
) -> list[list[str]]:
    """The FSDP2 units of a plan: each pattern's matched modules in model order, consecutive ones merged until a
    unit holds at least `unit_mib` MiB of parameters (0: every module alone). A run of modules that cannot fill a
    unit (a pattern's remainder, or all of a small model) is no unit: it stays with the enclosing unit (the root at
    the latest, gathered once per step), so every collective moves at least `unit_mib` or all that is left.
    Modules in `alone` (required units, expert stacks) are units of their own whatever their size, except a
    `required` one (a module the step runs outside its parent's forward) below the unit size that no remaining unit
    encloses: the root, gathered at the step's entry, holds it then. Modules nested in one another are never
    merged; a module matched by several patterns is taken once, by the first."""

    @functools.cache
    def mib(name: str) -> float:
        return sum(p.numel() * p.element_size() for p in model.get_submodule(name).parameters()) / 2**20

    groups: list[list[str]] = []
    seen: set[str] = set()
    for match in matches:
        current: list[str] = []
        for name in match.names:
            if name in seen:
                continue
            seen.add(name)
            if name in alone or unit_mib == 0:
                groups += [current, [name]] if current else [[name]]
                current = []
                continue
            if any(name.startswith(f"{other}.") or other.startswith(f"{name}.") for other in current):
                groups.append(current)
                current = []
            current.append(name)
            if sum(mib(member) for member in current) >= unit_mib:
                groups.append(current)
                current = []
        if current:
            groups.append(current)
    kept = [group for group in groups if group[0] in alone or sum(mib(name) for name in group) >= unit_mib]
    enclosing = {name for group in kept for name in group if name not in required}

    def needed(group: list[str]) -> bool:
        name = group[0]
        if name not in required or mib(name) >= unit_mib:
            return True
        return any(name.startswith(f"{other}.") for other in enclosing)

    return [group for group in kept if needed(group)]


def set_prefetch(model: nn.Module, matches: list[PlanMatch], groups: list[list[str]], depth: int) -> None:
    """Explicit FSDP2 prefetch along each pattern's units in model order: a unit's forward gathers the next `depth`
    units of its pattern, its backward the previous `depth` (the order backward runs them)."""
    unit_of = {group[0]: model.get_submodule(group[0]) for group in groups}
    for match in matches:
        units = [unit_of[name] for name in match.names if name in unit_of]
        for index, unit in enumerate(units):
            ahead = units[index + 1 : index + 1 + depth]
            behind = units[max(0, index - depth) : index][::-1]
            if ahead:
                unit.set_modules_to_forward_prefetch(ahead)
            if behind:
                unit.set_modules_to_backward_prefetch(behind)


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def compute_precision(model: nn.Module, plan: FsdpPlanConfig, device_type: str) -> contextlib.AbstractContextManager:
    """The context forward runs in: FSDP casts parameters itself; an unsharded model in bf16 uses autocast."""
    if is_sharded(model) or plan.param_dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=DTYPES[plan.param_dtype])
