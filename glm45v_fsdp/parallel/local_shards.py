"""The end of a step on the local shards of FSDP2's DTensors: gradient norm, gradient scaling and the optimizer step.

FSDP2 hands the optimizer DTensor parameters and gradients. Every op on a DTensor goes through DTensor's dispatch
(sharding propagation, a Python call per op and tensor), which on a small model costs more than the arithmetic:
profiled at ZeRO-2 on transformers' tiny GLM-4.5V, 400 dispatches and ~9 ms per step for the optimizer's foreach
ops, the norm and the clipping. None of these needs DTensor's semantics:
  - an elementwise optimizer (Adam, AdamW, SGD, ...) updates each element from that element's gradient and state,
    so stepping the local tensors updates exactly what stepping the DTensors does (in place, in the same storage);
  - the global L2 norm is the square root of the sum of the ranks' local sums of squares, each summed over the mesh
    dimensions a tensor is sharded on (not the replicated ones), one all-reduce per group (one for all the groups
    that span the whole job);
  - scaling gradients by a number is elementwise.
Optimizer states stay DTensors between steps (DCP checkpoints, `get_optimizer_state_dict`): states the optimizer
creates during a local step are wrapped as DTensors over the same storage. Optimizers that are not elementwise
(Adafactor's row/column statistics, LBFGS, user subclasses) keep DTensor's path.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

# torch.optim classes whose update of an element reads only that element's gradient and state (and scalars).
ELEMENTWISE_OPTIMIZERS = tuple(
    getattr(torch.optim, name)
    for name in ("Adam", "AdamW", "SGD", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop", "ASGD")
)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's part of a DTensor (the same storage), or the tensor itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _reduction_key(grad: torch.Tensor) -> tuple[Any, tuple[int, ...]] | None:
    """(mesh, the mesh dimensions the gradient is sharded over), () for a plain tensor; None when a placement is
    neither a shard nor a replica (a pending partial sum), which only DTensor's own norm handles."""
    if not isinstance(grad, DTensor):
        return (None, ())
    dims = []
    for dim, placement in enumerate(grad.placements):
        if isinstance(placement, Shard):
            if grad.device_mesh.size(dim) > 1:
                dims.append(dim)
        elif not isinstance(placement, Replicate):
            return None
    return (grad.device_mesh, tuple(dims))


def _dtensor_norm_squared(grads: list[torch.Tensor]) -> float:
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2


def _spans_world(mesh: Any, dims: tuple[int, ...]) -> bool:
    """The reduction over `dims` is one group holding every rank of the job (the same group on every rank)."""
    return len(dims) == 1 and mesh.size(dims[0]) == dist.get_world_size()


def grad_norm(
    parameters: list[nn.Parameter], riders: torch.Tensor | None = None, riders_group: dist.ProcessGroup | None = None
) -> float:
    """Global L2 norm of the gradients of `parameters`: local sums of squares, reduced per (mesh, sharded dims).

    The sums of every (mesh, dims) whose reduction spans the whole job travel in one all-reduce (EP's expert stacks
    and FSDP's other parameters at ep = dp = world size: one collective per step instead of two); the others, each
    over its own groups. `riders` (float64, summed in place over `riders_group`, the trainer's loss and token count)
    ride in that all-reduce when their group spans the job too, else take one of their own; None group: no sum."""
    by_key: dict[Any, list[torch.Tensor]] = defaultdict(list)
    for param in parameters:
        if param.grad is not None:
            by_key[_reduction_key(param.grad)].append(param.grad)
    total = 0.0
    world_sums: list[torch.Tensor] = []
    world_group = None
    for key, grads in by_key.items():
        if key is None:
            total += _dtensor_norm_squared(grads)
            continue
        mesh, dims = key
        norms = torch._foreach_norm([local(grad) for grad in grads], 2.0)
        squares = torch.stack([norm.float() for norm in norms]).square().sum()
        if _spans_world(mesh, dims):
            world_sums.append(squares)
            if world_group is None:
                world_group = mesh.get_group(dims[0])
            continue
        for dim in dims:
            dist.all_reduce(squares, group=mesh.get_group(dim))
        total += float(squares)
    sum_riders = riders is not None and riders_group is not None
    riding = sum_riders and bool(world_sums) and dist.get_world_size(riders_group) == dist.get_world_size()
    if sum_riders and not riding:
        dist.all_reduce(riders, group=riders_group)
    if world_sums:
        summed = torch.stack(world_sums)
        if riding:  # in float64 with the riders; each sum rounded back to the fp32 it is on its own
            packed = torch.cat([summed.double(), riders])
            dist.all_reduce(packed, group=world_group)
            summed = packed[: len(world_sums)].float()
            riders.copy_(packed[len(world_sums) :])
        else:
            dist.all_reduce(summed, group=world_group)
        total += sum(summed.tolist())
    return math.sqrt(total)


def scale_grads_(parameters: list[nn.Parameter], factor: float) -> None:
    """Multiply every gradient by `factor`, on the local shards."""
    grads = [local(p.grad) for p in parameters if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor)


def _as_dtensor_like(value: Any, param: torch.Tensor, view: torch.Tensor) -> Any:
    """A state tensor of the local shard `view` as a DTensor laid out like `param` (no copy); anything else as is."""
    if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == view.shape:
        return DTensor.from_local(
            value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return value


def optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """`optimizer.step()` on the local shards when the optimizer is elementwise and holds DTensors, else as is.

    The param groups and the state are swapped for their local views for the duration of the step and restored
    after it; a state value the step created or replaced is kept as a DTensor over its local storage."""
    groups = optimizer.param_groups
    if type(optimizer) not in ELEMENTWISE_OPTIMIZERS or not any(
        isinstance(p, DTensor) for group in groups for p in group["params"]
    ):
        optimizer.step()
        return
    held_params = [group["params"] for group in groups]
    held_state = optimizer.state
    local_state: defaultdict[torch.Tensor, dict] = defaultdict(dict)
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for group in groups:
        views = []
        for param in group["params"]:
            view = local(param)
            if view is not param:
                view.grad = None if param.grad is None else local(param.grad)
            state = held_state.get(param)
            if state is not None:
                local_state[view] = {key: local(value) for key, value in state.items()}
            pairs.append((param, view))
            views.append(view)
        group["params"] = views
    optimizer.state = local_state
    try:
        optimizer.step()
    finally:
        for group, params in zip(groups, held_params):
            group["params"] = params
        optimizer.state = held_state
        for param, view in pairs:
            if view is not param:
                view.grad = None
            stepped = local_state.get(view)
            if stepped is None:
                continue
            before = held_state.get(param, {})
            held_state[param] = {
                key: before[key]
                if key in before and local(before[key]) is value
                else _as_dtensor_like(value, param, view)
                for key, value in stepped.items()
            }
