"""Runtime layer: device selection (npu / cuda / cpu), launcher environments and the process group, the device
mesh, seeding and deterministic mode, and the per-step peak-memory meter.

See docs/runtime.md for which launcher variable maps to which field and what is unverified on NPU hardware.
"""

from glm45v_fsdp.runtime.device import DeviceLayer, select_device
from glm45v_fsdp.runtime.dist import (
    DistEnv,
    detect_dist_env,
    expand_slurm_nodelist,
    init_distributed,
    launcher_rank,
    shutdown,
)
from glm45v_fsdp.runtime.memory import MemoryMeter
from glm45v_fsdp.runtime.mesh import ParallelDims, build_device_mesh, build_parallel_dims, flattened_mesh, fsdp_mesh
from glm45v_fsdp.runtime.seed import set_deterministic, set_seed

__all__ = [
    "DeviceLayer",
    "DistEnv",
    "MemoryMeter",
    "ParallelDims",
    "build_device_mesh",
    "build_parallel_dims",
    "detect_dist_env",
    "expand_slurm_nodelist",
    "flattened_mesh",
    "fsdp_mesh",
    "init_distributed",
    "launcher_rank",
    "select_device",
    "set_deterministic",
    "set_seed",
    "shutdown",
]
