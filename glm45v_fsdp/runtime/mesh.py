"""Parallel sizes and the device mesh built from them.

The world mesh always has the three named dims ("dp_replicate", "dp_shard", "cp"), size-1 dims included, so code
never has to special-case a 1-D mesh. Two flattened submeshes hang off it: "dp" (dp_replicate x dp_shard: ranks that
see different data; data loading and loss reduction) and "dp_shard_cp" (the ranks FSDP shards parameters over).
Get them with `flattened_mesh`: slicing a flattened name from the root mesh (`mesh["dp"]`) works but is deprecated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from glm45v_fsdp.config import ParallelConfig, validate_layout

MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "cp")
_FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp")}


@dataclass(frozen=True)
class ParallelDims:
    """world = dp_replicate x dp_shard x cp, with cp = ulysses x ring; experts shard over dp_shard x cp / ep."""

    world_size: int
    dp_replicate: int
    dp_shard: int
    ulysses: int
    ring: int
    ep: int

    def __post_init__(self) -> None:
        if self.dp_replicate * self.dp_shard * self.cp != self.world_size or self.fsdp_size % self.ep:
            raise ValueError(f"inconsistent parallel sizes: {self}")

    @property
    def cp(self) -> int:
        return self.ulysses * self.ring

    @property
    def dp(self) -> int:
        """Ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_size(self) -> int:
        """Ranks FSDP shards parameters over."""
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """Ranks each expert's parameters are sharded over once experts are split ep ways."""
        return self.fsdp_size // self.ep


def build_parallel_dims(parallel_cfg: ParallelConfig, world_size: int) -> ParallelDims:
    """Derive dp_shard = world / (dp_replicate x cp) after `config.validate_layout` (UserError naming the key)."""
    validate_layout(parallel_cfg, world_size)
    cp = parallel_cfg.ulysses_parallel_size * parallel_cfg.ring_attention_size
    return ParallelDims(
        world_size=world_size,
        dp_replicate=parallel_cfg.data_parallel_replicate_size,
        dp_shard=world_size // (parallel_cfg.data_parallel_replicate_size * cp),
        ulysses=parallel_cfg.ulysses_parallel_size,
        ring=parallel_cfg.ring_attention_size,
        ep=parallel_cfg.expert_parallel_size,
    )


def flattened_mesh(mesh: DeviceMesh, name: Literal["dp", "dp_shard_cp"]) -> DeviceMesh:
    """The 1-D flattened submesh `name` of the world mesh (created once, then looked up)."""
    return mesh[_FLATTENED[name]]._flatten(name)


def build_device_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The world mesh over the default process group, with the "dp" and "dp_shard_cp" submeshes created."""
    mesh = init_device_mesh(device_type, (dims.dp_replicate, dims.dp_shard, dims.cp), mesh_dim_names=MESH_DIM_NAMES)
    for name in _FLATTENED:
        flattened_mesh(mesh, name)
    return mesh


def fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """What `fully_shard` takes: 1-D "dp_shard_cp", or 2-D ("dp_replicate", "dp_shard_cp") for HSDP."""
    shard = flattened_mesh(mesh, "dp_shard_cp")
    if dims.dp_replicate == 1:
        return shard
    return DeviceMesh._concatenate([mesh["dp_replicate"], shard])
