"""`deepspeed.utils.groups` on FSDP2: DeepSpeed's process-group queries, answered from the engine's device meshes.

The engine API runs data parallelism only (ZeRO stages as FSDP2 layouts; no tensor, pipeline, sequence or expert
parallelism: ds_compat/engine.py refuses them), so the answers are DeepSpeed's for a job without an mpu: the
data-parallel group is the engine's data-parallel mesh (every rank; the whole world before `deepspeed.initialize`),
the sequence-parallel size is 1 with no sequence-parallel group (KeyError, as DeepSpeed), the model-parallel size is
1, and asking for a tensor-parallel or expert-parallel group is DeepSpeed's AssertionError ("... is not
initialized"). Megatron's `mpu` and `initialize(ep_size, mpu)` are not taken: the layout comes from the ds_config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

import torch.distributed as dist

from ds_compat._common import DeepSpeedAssertion

if TYPE_CHECKING:
    from glm45v_fsdp.runtime.mesh import ParallelMeshes

_meshes: ParallelMeshes | None = None
_TRAINER = (
    "GLM-4.5V trains with expert and Ulysses / Ring context parallelism through `python -m glm45v_fsdp.train "
    "--deepspeed ds_config.json`"
)


def use_meshes(meshes: ParallelMeshes | None) -> None:
    """The engine's meshes answer from now on (None: back to the world group)."""
    global _meshes
    _meshes = meshes


def _require_dist() -> None:
    if not dist.is_initialized():
        raise DeepSpeedAssertion("dist is not initialized: call deepspeed.init_distributed() or deepspeed.initialize.")


def _not_initialized(group: str) -> NoReturn:
    raise DeepSpeedAssertion(
        f"{group} group is not initialized: the engine API of the FSDP2 backend runs data parallelism only. {_TRAINER}."
    )


def initialize(ep_size: int = 1, mpu: Any = None) -> None:
    """DeepSpeed's deprecated group set-up: nothing to create here unless it asks for what the engine cannot run."""
    if ep_size != 1 or mpu is not None:
        raise ValueError(
            f"deepspeed.utils.groups.initialize(ep_size={ep_size}, mpu={mpu!r}): the FSDP2 backend takes its layout "
            f"from the ds_config, not from an mpu, and its engine API runs no expert parallelism. {_TRAINER}."
        )


# Data parallel: the ranks that see different data.


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


# Sequence parallel: none in the engine API; sequence x data parallel is then data parallel.


def _get_sequence_parallel_world_size() -> int:
    _require_dist()
    return 1


def _get_sequence_parallel_rank() -> int:
    return 0


def _get_sequence_parallel_group() -> NoReturn:
    raise KeyError(f"No sequence parallel group found: the engine API runs no sequence parallelism. {_TRAINER}.")


def _get_sequence_data_parallel_group() -> dist.ProcessGroup:
    return _get_data_parallel_group()


def _get_sequence_data_parallel_world_size() -> int:
    return _get_data_parallel_world_size()


def _get_sequence_data_parallel_rank() -> int:
    return _get_data_parallel_rank()


# Tensor / model parallel: none.


def _get_model_parallel_world_size() -> int:
    return 1


def _get_expert_model_parallel_world_size() -> int:
    return 1


def get_tensor_model_parallel_group() -> NoReturn:
    _not_initialized("intra_layer_model parallel")


def get_model_parallel_group() -> NoReturn:
    _not_initialized("model parallel")


def get_data_parallel_group() -> NoReturn:
    """AutoTP's data-parallel group (the one beside its tensor-parallel groups): never created here."""
    _not_initialized("data parallel")


def get_tensor_model_parallel_world_size() -> int:
    return dist.get_world_size(group=get_tensor_model_parallel_group())


def get_tensor_model_parallel_rank() -> int:
    return dist.get_rank(group=get_tensor_model_parallel_group())


def get_model_parallel_world_size() -> int:
    return get_tensor_model_parallel_world_size()


def get_model_parallel_rank() -> int:
    return get_tensor_model_parallel_rank()


# Expert parallel: no groups (DeepSpeed names them "ep_size_N").


def _get_expert_parallel_group_dict() -> dict[str, dist.ProcessGroup]:
    return {}


def _get_expert_data_parallel_group_dict() -> dict[str, dist.ProcessGroup]:
    return {}


def _get_max_expert_size() -> int | None:
    return None


def _get_max_expert_size_name() -> str:
    return f"ep_size_{_get_max_expert_size()}"


def _get_expert_parallel_group(group_name: str) -> NoReturn:
    _not_initialized("expert parallel")


def _get_expert_data_parallel_group(group_name: str) -> NoReturn:
    _not_initialized("expert data parallel")


def _get_max_expert_parallel_group() -> NoReturn:
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _get_expert_parallel_group_ranks(group_name: str) -> NoReturn:
    return _get_expert_parallel_group(group_name)


def _get_expert_data_parallel_group_ranks(group_name: str) -> NoReturn:
    return _get_expert_data_parallel_group(group_name)


def _get_expert_parallel_world_size(group_name: str) -> int:
    return dist.get_world_size(group=_get_expert_parallel_group(group_name))


def _get_expert_parallel_rank(group_name: str) -> int:
    return dist.get_rank(group=_get_expert_parallel_group(group_name))


def _get_expert_parallel_src_rank(group_name: str) -> int:
    return dist.get_global_rank(_get_expert_parallel_group(group_name), 0)


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return dist.get_world_size(group=_get_expert_data_parallel_group(group_name))


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return dist.get_rank(group=_get_expert_data_parallel_group(group_name))


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    return dist.get_global_rank(_get_expert_data_parallel_group(group_name), 0)
