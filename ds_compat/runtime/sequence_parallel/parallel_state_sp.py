"""`deepspeed.runtime.sequence_parallel.parallel_state_sp`: DeepSpeed's sequence-parallel "mpu" (the object
`UlyssesSPAttentionHF.register_with_transformers` returns and `deepspeed.initialize(mpu=...)` takes).

The groups are DeepSpeed's: sequence-parallel groups of `size` consecutive ranks, one sequence x data-parallel group
of every rank. They are the engine's context-parallel groups too (the CP mesh dimension is the innermost one, so its
groups are the same consecutive ranks), which is what lets the engine take this mpu: it reads the size from it and
builds its own meshes over the same ranks.
"""

from __future__ import annotations

import torch.distributed as dist

from glm45v_fsdp.errors import UserError

_SEQUENCE_PARALLEL_GROUP: dist.ProcessGroup | None = None
_SEQUENCE_DATA_PARALLEL_GROUP: dist.ProcessGroup | None = None


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Build the groups (every rank calls this, as in DeepSpeed); the sizes are checked as DeepSpeed checks them."""
    global _SEQUENCE_PARALLEL_GROUP, _SEQUENCE_DATA_PARALLEL_GROUP
    assert dist.is_initialized()
    world = dist.get_world_size()
    if sequence_parallel_size <= 1:
        raise ValueError(f"sequence_parallel_size must be greater than 1, got {sequence_parallel_size}")
    if world % sequence_parallel_size != 0:
        raise UserError(
            f"sequence_parallel_size {sequence_parallel_size} does not divide the world size {world}: every rank "
            "must belong to one sequence-parallel group. Use a divisor of the number of ranks."
        )
    assert _SEQUENCE_PARALLEL_GROUP is None, "sequence parallel group is already initialized"
    rank = dist.get_rank()
    for start in range(0, world, sequence_parallel_size):
        ranks = list(range(start, start + sequence_parallel_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            _SEQUENCE_PARALLEL_GROUP = group
    _SEQUENCE_DATA_PARALLEL_GROUP = dist.new_group(list(range(world)))


def is_initialized() -> bool:
    return _SEQUENCE_PARALLEL_GROUP is not None


def get_sequence_parallel_group() -> dist.ProcessGroup:
    assert _SEQUENCE_PARALLEL_GROUP is not None, "sequence parallel group is not initialized"
    return _SEQUENCE_PARALLEL_GROUP


def get_sequence_data_parallel_group() -> dist.ProcessGroup:
    assert _SEQUENCE_DATA_PARALLEL_GROUP is not None, "sequence data parallel group is not initialized"
    return _SEQUENCE_DATA_PARALLEL_GROUP


def get_sequence_parallel_world_size() -> int:
    return dist.get_world_size(group=get_sequence_parallel_group())


def get_sequence_data_parallel_world_size() -> int:
    return dist.get_world_size(group=get_sequence_data_parallel_group())


def get_sequence_parallel_rank() -> int:
    return dist.get_rank(group=get_sequence_parallel_group())


def get_sequence_data_parallel_rank() -> int:
    return dist.get_rank(group=get_sequence_data_parallel_group())


# DeepSpeed's aliases: to Megatron-style code the sequence-parallel group is the model-parallel one.
get_model_parallel_rank = get_sequence_parallel_rank
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_group = get_sequence_parallel_group
