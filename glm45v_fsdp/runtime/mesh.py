"""Parallel sizes (`ParallelDims`) and every device mesh a run uses (`ParallelMeshes`).

`ParallelDims` is arithmetic only (preflight and the estimator use it without a process group). `ParallelMeshes`
builds every mesh from it once, over the default process group, and hands out named views: no code outside
runtime/ indexes a mesh by a string.

Dense world mesh: dp_replicate x dp_shard x cp_ring x cp_ulysses, size-1 dims included (nothing special-cases a
1-D mesh). Ulysses is innermost, so an all-to-all group is a block of adjacent ranks and the ring runs across
blocks. Views of it:
  dp       dp_replicate x dp_shard, flattened: the ranks that see different data (data loading, loss reduction)
  fsdp     dp_shard x cp_ring x cp_ulysses, flattened: the ranks dense parameters are sharded over
  cp       cp_ring x cp_ulysses, flattened: the ranks that split one sequence
  dp_replicate, cp_ring, cp_ulysses: the world mesh's own dims
Sparse (expert) view: the fsdp ranks unflattened into efsdp x ep, ep innermost (an EP group is a block of adjacent
ranks), dp_replicate in front: experts are split ep ways and each expert's parameters sharded efsdp ways.
`dense_shard` / `expert_shard` are what `fully_shard` takes: the 1-D shard mesh, or (dp_replicate, shard) for HSDP.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from glm45v_fsdp.config import ParallelConfig, validate_layout

WORLD_DIMS = ("dp_replicate", "dp_shard", "cp_ring", "cp_ulysses")
EXPERT_DIMS = ("dp_replicate", "efsdp", "ep")


@dataclass(frozen=True)
class ParallelDims:
    """world = dp_replicate x dp_shard x cp_ring x cp_ulysses; experts: dp_shard x cp = efsdp x ep."""

    world_size: int
    dp_replicate: int
    dp_shard: int
    cp_ring: int
    cp_ulysses: int
    ep: int

    def __post_init__(self) -> None:
        if self.dp_replicate * self.dp_shard * self.cp != self.world_size or self.fsdp_size % self.ep:
            raise ValueError(f"inconsistent parallel sizes: {self}")

    @property
    def cp(self) -> int:
        """Ranks that split one sequence."""
        return self.cp_ring * self.cp_ulysses

    @property
    def dp(self) -> int:
        """Ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_size(self) -> int:
        """Ranks FSDP shards dense parameters over."""
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """Ranks each expert's parameters are sharded over once experts are split ep ways."""
        return self.fsdp_size // self.ep

    @property
    def hsdp_enabled(self) -> bool:
        """Parameters are replicated over dp_replicate groups (and sharded inside each)."""
        return self.dp_replicate > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def cp_ring_enabled(self) -> bool:
        return self.cp_ring > 1

    @property
    def cp_ulysses_enabled(self) -> bool:
        return self.cp_ulysses > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1


def build_parallel_dims(parallel_cfg: ParallelConfig, world_size: int) -> ParallelDims:
    """Derive dp_shard = world / (dp_replicate x cp) after `config.validate_layout` (an error naming the key)."""
    validate_layout(parallel_cfg, world_size)
    cp = parallel_cfg.ulysses_parallel_size * parallel_cfg.ring_attention_size
    return ParallelDims(
        world_size=world_size,
        dp_replicate=parallel_cfg.data_parallel_replicate_size,
        dp_shard=world_size // (parallel_cfg.data_parallel_replicate_size * cp),
        cp_ring=parallel_cfg.ring_attention_size,
        cp_ulysses=parallel_cfg.ulysses_parallel_size,
        ep=parallel_cfg.expert_parallel_size,
    )


class ParallelMeshes:
    """Every mesh of a run, built once (collectively: every rank constructs it in the same order)."""

    def __init__(self, dims: ParallelDims, device_type: str) -> None:
        self.dims = dims
        self.world = init_device_mesh(
            device_type, (dims.dp_replicate, dims.dp_shard, dims.cp_ring, dims.cp_ulysses), mesh_dim_names=WORLD_DIMS
        )
        self.dp = self.world["dp_replicate", "dp_shard"]._flatten("dp")
        self.fsdp = self.world["dp_shard", "cp_ring", "cp_ulysses"]._flatten("fsdp")
        self.cp = self.world["cp_ring", "cp_ulysses"]._flatten("cp")
        self.dp_replicate = self.world["dp_replicate"]
        self.cp_ring = self.world["cp_ring"]
        self.cp_ulysses = self.world["cp_ulysses"]
        replicated_fsdp = DeviceMesh._concatenate([self.dp_replicate, self.fsdp])
        self.expert = replicated_fsdp._unflatten("fsdp", (dims.efsdp, dims.ep), EXPERT_DIMS[1:])
        self.efsdp = self.expert["efsdp"]
        self.ep = self.expert["ep"]
        self.dense_shard = replicated_fsdp if dims.hsdp_enabled else self.fsdp
        self.expert_shard = self.expert["dp_replicate", "efsdp"] if dims.hsdp_enabled else self.efsdp
