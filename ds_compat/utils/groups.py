"""`deepspeed.utils.groups` on FSDP2: DeepSpeed's process-group queries, answered from the engine's device meshes.

The engine API runs data parallelism only (ZeRO stages as FSDP2 layouts; no tensor, pipeline, sequence or expert
parallelism: ds_compat/engine.py refuses them), so the answers are DeepSpeed's for a job without an mpu: the
data-parallel group is the engine's data-parallel mesh (every rank; the whole world before `deepspeed.initialize`),
the sequence-parallel size is 1 and there is no sequence-parallel group (KeyError, as DeepSpeed), model-parallel
sizes are 1, and no expert-parallel group exists. Megatron's `mpu` and `initialize(ep_size, mpu)` are not taken:
the layout comes from the ds_config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from glm45v_fsdp.runtime.mesh import ParallelMeshes

_meshes: ParallelMeshes | None = None


def use_meshes(meshes: ParallelMeshes | None) -> None:
    """The engine's meshes answer from now on (None: back to the world group)."""
    global _meshes
    _meshes = meshes


def _require_dist() -> None:
    if not dist.is_initialized():
        raise RuntimeError("dist is not initialized: call deepspeed.init_distributed() (or deepspeed.initialize).")


def initialize(ep_size: int = 1, mpu: Any = None) -> None:
    """DeepSpeed's deprecated group set-up: nothing to create here unless it asks for what the engine cannot run."""
    if ep_size != 1 or mpu is not None:
        raise ValueError(
            f"deepspeed.utils.groups.initialize(ep_size={ep_size}, mpu={mpu!r}): the FSDP2 backend takes its layout "
            "from the ds_config, not from an mpu, and its engine API runs no expert parallelism. GLM-4.5V trains its "
            "experts with expert parallelism through `python -m glm45v_fsdp.train --deepspeed ds_config.json`."
        )


def _get_data_parallel_group() -> dist.ProcessGroup:
    _require_dist()
    return dist.group.WORLD if _meshes is None else _meshes.dp.get_group()


def _get_data_parallel_world_size() -> int:
    return dist.get_world_size(group=_get_data_parallel_group())


def _get_data_parallel_rank() -> int:
    return dist.get_rank(group=_get_data_parallel_group())


def _get_data_parallel_group_ranks() -> list[int]:
    return dist.get_process_group_ranks(_get_data_parallel_group())


def _get_broadcast_src_rank() -> int:
    """The global rank of data-parallel rank 0, where DeepSpeed broadcasts from."""
    return dist.get_global_rank(_get_sequence_data_parallel_group(), 0)


def _get_sequence_parallel_world_size() -> int:
    _require_dist()
    return 1


def _get_sequence_parallel_rank() -> int:
    return 0


def _get_sequence_parallel_group() -> dist.ProcessGroup:
    raise KeyError(
        "No sequence parallel group found: the engine API runs no sequence parallelism. Long sequences train with "
        "Ulysses / Ring context parallelism through `python -m glm45v_fsdp.train --deepspeed ds_config.json`."
    )


def _get_sequence_data_parallel_group() -> dist.ProcessGroup:
    return _get_data_parallel_group()


def _get_sequence_data_parallel_world_size() -> int:
    return _get_data_parallel_world_size()


def _get_sequence_data_parallel_rank() -> int:
    return _get_data_parallel_rank()


def _get_model_parallel_world_size() -> int:
    return 1


def get_tensor_model_parallel_world_size() -> int:
    return 1


def get_tensor_model_parallel_rank() -> int:
    return 0


def _get_expert_model_parallel_world_size() -> int:
    return 1


def _get_expert_parallel_group_dict() -> dict[str, dist.ProcessGroup]:
    return {}


def _get_expert_data_parallel_group_dict() -> dict[str, dist.ProcessGroup]:
    return {}


def _get_expert_parallel_group(group_name: str) -> dist.ProcessGroup:
    raise KeyError(
        f"expert parallel group '{group_name}' not found: the engine API runs no expert parallelism (see "
        "deepspeed.utils.groups.initialize)."
    )


_get_expert_data_parallel_group = _get_expert_parallel_group
