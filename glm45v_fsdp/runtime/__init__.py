"""Runtime layer: device selection (npu / cuda / cpu), launcher environments and the process group, the device
meshes, seeding and deterministic mode, and the per-step peak-memory meter.

See docs/runtime.md for which launcher variable maps to which field and what is unverified on NPU hardware.
"""

from glm45v_fsdp.errors import launcher_rank
from glm45v_fsdp.runtime.device import DeviceLayer, select_device
from glm45v_fsdp.runtime.dist import (
    DistEnv,
    detect_dist_env,
    expand_slurm_nodelist,
    gather_objects,
    init_distributed,
    rank_and_world,
    shutdown,
)
from glm45v_fsdp.runtime.memory_meter import MemoryMeter
from glm45v_fsdp.runtime.mesh import ParallelDims, ParallelMeshes, build_parallel_dims
from glm45v_fsdp.runtime.seed import set_deterministic, set_seed

__all__ = [
    "DeviceLayer",
    "DistEnv",
    "MemoryMeter",
    "ParallelDims",
    "ParallelMeshes",
    "build_parallel_dims",
    "detect_dist_env",
    "expand_slurm_nodelist",
    "gather_objects",
    "init_distributed",
    "launcher_rank",
    "rank_and_world",
    "select_device",
    "set_deterministic",
    "set_seed",
    "shutdown",
]
