"""`deepspeed.comm` for the FSDP2 backend: the same functions, straight onto torch.distributed.

Scripts written against DeepSpeed call `deepspeed.comm.get_rank()`, `all_reduce(t, op=ReduceOp.SUM)` and friends;
with `import ds_compat as deepspeed` these land here. As in DeepSpeed, every query asserts that the process group
exists (`init_distributed` first), `ReduceOp` is DeepSpeed's enum (torch's `ReduceOp` values are accepted too), and
`get_local_rank` reads the launcher's LOCAL_RANK (or Open MPI's) variable.
"""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from glm45v_fsdp.errors import install_user_error_hook
from glm45v_fsdp.log import get_logger
from glm45v_fsdp.runtime import DeviceLayer, detect_dist_env, select_device
from glm45v_fsdp.runtime import init_distributed as runtime_init_distributed

_NOT_INITIALIZED = "DeepSpeed backend not set, please initialize it using init_process_group()"
DEFAULT_TIMEOUT_MINUTES = 30


class ReduceOp(Enum):
    """DeepSpeed's reduce operations (deepspeed.comm.ReduceOp)."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    AVG = 7
    UNUSED = 8


def _torch_op(op: Any) -> Any:
    if not isinstance(op, ReduceOp):
        return op  # already a torch.distributed.ReduceOp
    if op is ReduceOp.UNUSED:
        raise ValueError("ReduceOp.UNUSED is not a reduction")
    return getattr(dist.ReduceOp, op.name)


def _check() -> None:
    assert dist.is_available() and dist.is_initialized(), _NOT_INITIALIZED


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Create the default process group from the launcher's environment, as `deepspeed.init_distributed`.

    The environment is read by glm45v_fsdp.runtime.detect_dist_env (torchrun / deepspeed launcher variables, else
    Slurm, else Open MPI, else one process). `dist_backend` defaults to the device's backend (hccl / nccl / gloo);
    `dist_init_required=False` only checks that a group exists, as DeepSpeed does. An existing group is kept.
    `auto_mpi_discovery`, `verbose` and `config` have no further effect; `distributed_port` is the MASTER_PORT
    used when the environment has none (Slurm / Open MPI, several processes).
    """
    install_user_error_hook("ds_compat")  # a UserError the script does not catch: one paragraph, exit 2
    if dist_init_required is None:
        dist_init_required = not dist.is_initialized()
    if dist_init_required is False:
        assert dist.is_initialized(), (
            "Distributed backend is not initialized. Please set dist_init_required to True or initialize before "
            "calling deepspeed.initialize()"
        )
        return
    if dist.is_initialized():
        return
    timeout = timeout or timedelta(minutes=DEFAULT_TIMEOUT_MINUTES)
    if init_method is not None and init_method != "env://":
        dist.init_process_group(
            backend=dist_backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
        )
        return
    env = dict(os.environ)
    if "RANK" not in env and "WORLD_SIZE" not in env and ("SLURM_PROCID" in env or "OMPI_COMM_WORLD_RANK" in env):
        env.setdefault("MASTER_PORT", str(distributed_port))
    device = device_layer()
    if dist_backend is not None and dist_backend != device.backend:
        device = dataclasses.replace(device, backend=dist_backend)
    minutes = max(1, int(timeout.total_seconds() // 60))
    dist_env = detect_dist_env(env)
    network = runtime_init_distributed(dist_env, device, timeout_minutes=minutes)
    if dist_env.rank == 0:
        get_logger().info("ds_compat: %s", network)


def device_layer() -> DeviceLayer:
    """The device family: DS_ACCELERATOR when it names one (DeepSpeed reads it too), else npu > cuda > cpu."""
    requested = os.environ.get("DS_ACCELERATOR", "auto")
    return select_device(requested if requested in ("cpu", "cuda", "npu") else "auto")


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def destroy_process_group(group: Any = None) -> None:
    dist.destroy_process_group(group)


def new_group(ranks: list[int]) -> Any:
    _check()
    return dist.new_group(ranks)


def get_world_group() -> Any:
    _check()
    return dist.group.WORLD


def get_world_size(group: Any = None) -> int:
    _check()
    return dist.get_world_size(group)


def get_rank(group: Any = None) -> int:
    _check()
    return dist.get_rank(group)


def get_local_rank() -> int:
    _check()
    return int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    _check()
    if group is None:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    _check()
    return dist.get_process_group_ranks(group or dist.group.WORLD)


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None, **_: Any) -> Any:
    _check()
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def monitored_barrier(group: Any = None, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> Any:
    _check()
    return dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False, **_: Any):
    _check()
    return dist.all_reduce(tensor, op=_torch_op(op), group=group, async_op=async_op)


def inference_all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, **_: Any):
    return all_reduce(tensor, op=op, group=group)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False, **_):
    _check()
    return dist.reduce(tensor, dst, op=_torch_op(op), group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False, **_: Any):
    _check()
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def broadcast_object_list(object_list: list, src: int, group: Any = None, device: Any = None, **_: Any):
    _check()
    return dist.broadcast_object_list(object_list, src=src, group=group, device=device)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False, **_):
    _check()
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_object(object_list: list, obj: Any, group: Any = None, **_: Any):
    _check()
    return dist.all_gather_object(object_list, obj, group=group)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group: Any = None, async_op=False, **_):
    _check()
    return dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


allgather_fn = all_gather_into_tensor


def reduce_scatter(output, input_list, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False, **_):
    _check()
    return dist.reduce_scatter(output, input_list, op=_torch_op(op), group=group, async_op=async_op)


def reduce_scatter_tensor(output, tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False, **_):
    _check()
    return dist.reduce_scatter_tensor(output, tensor, op=_torch_op(op), group=group, async_op=async_op)


def all_to_all_single(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False, **_):
    _check()
    return dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=group, async_op=async_op)


def all_to_all(output_tensor_list, input_tensor_list, group: Any = None, async_op: bool = False, **_: Any):
    _check()
    return dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


def gather(tensor, gather_list=None, dst: int = 0, group: Any = None, async_op: bool = False, **_: Any):
    _check()
    return dist.gather(tensor, gather_list, dst, group=group, async_op=async_op)


def scatter(tensor, scatter_list=None, src: int = 0, group: Any = None, async_op: bool = False, **_: Any):
    _check()
    return dist.scatter(tensor, scatter_list, src, group=group, async_op=async_op)


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, **_: Any):
    _check()
    return dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, **_: Any):
    _check()
    return dist.recv(tensor, src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, **_: Any):
    _check()
    return dist.isend(tensor, dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, **_: Any):
    _check()
    return dist.irecv(tensor, src, group=group, tag=tag)
