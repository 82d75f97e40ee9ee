"""`deepspeed.utils.groups` on FSDP2: DeepSpeed's process-group queries, answered from the engine's device meshes.

The engine API runs data parallelism (ZeRO stages as FSDP2 layouts) on any module, and on GLM-4.5V also context
parallelism (`sequence_parallel_size`, Ring from the extension section) and expert parallelism
(`expert_parallel.autoep_size`); no tensor or pipeline parallelism. The answers are DeepSpeed's for that layout: the
data-parallel group is the engine's data-parallel mesh (the whole world before `deepspeed.initialize`); the
sequence-parallel group is the engine's context-parallel mesh (Ulysses x Ring; before `deepspeed.initialize`, the
groups of DeepSpeed's ALST mpu when `register_with_transformers` made them), absent at size 1 (KeyError, as
DeepSpeed); sequence x data parallel is every rank; the expert-parallel groups are named as DeepSpeed names them
(`ep_size_N`: the EP mesh, with the expert-data-parallel mesh beside it), none without EP; the model-parallel size is
1, and asking for a group that does not exist is DeepSpeed's AssertionError ("... is not initialized"). Megatron's
`mpu` and `initialize(ep_size, mpu)` are not taken: the layout comes from the ds_config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

import torch.distributed as dist

from ds_compat._common import DeepSpeedAssertion
from ds_compat.runtime.sequence_parallel import parallel_state_sp

if TYPE_CHECKING:
    from glm45v_fsdp.runtime.mesh import ParallelMeshes

_meshes: ParallelMeshes | None = None
_LAYOUT = (
    "GLM-4.5V trains with expert and Ulysses / Ring context parallelism through the engine API or `python -m "
    "glm45v_fsdp.train --deepspeed ds_config.json` (expert_parallel.autoep_size, sequence_parallel_size)"
)


def use_meshes(meshes: ParallelMeshes | None) -> None:
    """The engine's meshes answer from now on (None: back to the world group)."""
    global _meshes
    _meshes = meshes


def _require_dist() -> None:
    if not dist.is_initialized():
        raise DeepSpeedAssertion("dist is not initialized: call deepspeed.init_distributed() or deepspeed.initialize.")


def _not_initialized(group: str) -> NoReturn:
    raise DeepSpeedAssertion(f"{group} group is not initialized: this engine's layout has none. {_LAYOUT}.")


def initialize(ep_size: int = 1, mpu: Any = None) -> None:
    """DeepSpeed's deprecated group set-up: nothing to create here unless it asks for what the engine cannot run."""
    if ep_size != 1 or mpu is not None:
        raise ValueError(
            f"deepspeed.utils.groups.initialize(ep_size={ep_size}, mpu={mpu!r}): the FSDP2 backend takes its layout "
            f"from the ds_config, not from an mpu or this call. {_LAYOUT}."
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


# Sequence parallel: the engine's context-parallel mesh; sequence x data parallel: every rank.


def _context_parallel_size() -> int:
    if _meshes is None:  # before deepspeed.initialize: the ALST mpu's groups, if register_with_transformers made them
        return parallel_state_sp.get_sequence_parallel_world_size() if parallel_state_sp.is_initialized() else 1
    return _meshes.dims.cp


def _get_sequence_parallel_world_size() -> int:
    _require_dist()
    return _context_parallel_size()


def _get_sequence_parallel_rank() -> int:
    return 0 if _context_parallel_size() == 1 else dist.get_rank(group=_get_sequence_parallel_group())


def _get_sequence_parallel_group() -> dist.ProcessGroup:
    if _context_parallel_size() == 1:
        raise KeyError(f"No sequence parallel group found: this engine splits no sequence. {_LAYOUT}.")
    return parallel_state_sp.get_sequence_parallel_group() if _meshes is None else _meshes.cp.get_group()


def _get_sequence_data_parallel_group() -> dist.ProcessGroup:
    if _context_parallel_size() > 1:
        return dist.group.WORLD
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


# Expert parallel: the engine's EP mesh and the expert-data-parallel mesh beside it, named as DeepSpeed names them
# ("ep_size_N"); none without EP.


def _expert_size() -> int:
    return 1 if _meshes is None else _meshes.dims.ep


def _get_expert_parallel_group_dict() -> dict[str, dist.ProcessGroup]:
    size = _expert_size()
    return {} if size == 1 else {f"ep_size_{size}": _meshes.ep.get_group()}


def _get_expert_data_parallel_group_dict() -> dict[str, dist.ProcessGroup]:
    size = _expert_size()
    return {} if size == 1 else {f"ep_size_{size}": _meshes.expert_shard.get_group()}


def _get_max_expert_size() -> int | None:
    size = _expert_size()
    return None if size == 1 else size


def _get_max_expert_size_name() -> str:
    return f"ep_size_{_get_max_expert_size()}"


def _get_expert_parallel_group(group_name: str) -> dist.ProcessGroup:
    group = _get_expert_parallel_group_dict().get(group_name)
    if group is None:
        _not_initialized(f"expert parallel {group_name}")
    return group


def _get_expert_data_parallel_group(group_name: str) -> dist.ProcessGroup:
    group = _get_expert_data_parallel_group_dict().get(group_name)
    if group is None:
        _not_initialized(f"expert data parallel {group_name}")
    return group


def _get_max_expert_parallel_group() -> dist.ProcessGroup:
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _get_expert_parallel_group_ranks(group_name: str) -> list[int]:
    return dist.get_process_group_ranks(_get_expert_parallel_group(group_name))


def _get_expert_data_parallel_group_ranks(group_name: str) -> list[int]:
    return dist.get_process_group_ranks(_get_expert_data_parallel_group(group_name))


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


def _get_expert_parallel_ranks(
    world_size: int,
    tensor_parallel_size_: int,
    expert_parallel_size_: int,
    pipeline_parallel_size_: int = 1,
    use_data_before_expert_parallel_: bool = False,
) -> tuple[list[list[int]], list[list[int]]]:
    """DeepSpeed's expert-parallel and expert-data-parallel rank lists for `world_size` ranks laid out as pipeline
    stages (blocks of ranks) x data parallel x tensor parallel (adjacent ranks): arithmetic only, no process group.

    Each stage's data-parallel ranks of one tensor-parallel slot split into expert-parallel groups of
    `expert_parallel_size_` consecutive members (E + D), or members `dp / ep` apart when `use_data_before_expert_
    parallel_` (D + E); the members at the same place in those groups form an expert-data-parallel group. The
    engine's own EP layout is the E + D case without tensor or pipeline parallelism: blocks of adjacent ranks.
    """
    tp, pp, ep = tensor_parallel_size_, pipeline_parallel_size_, expert_parallel_size_
    if world_size % (tp * pp):
        raise DeepSpeedAssertion(f"{world_size} is not divisible by {tp * pp}")
    dp = world_size // (tp * pp)
    if dp % ep:
        raise DeepSpeedAssertion(f"{dp} is not divisible by {ep}")
    stage = world_size // pp
    expert_groups: list[list[int]] = []
    expert_data_groups: list[list[int]] = []
    for first in range(0, world_size, stage):
        for slot in range(tp):
            data = list(range(first + slot, first + stage, tp))
            if use_data_before_expert_parallel_:
                apart = dp // ep
                data = [data[index] for start in range(apart) for index in range(start, dp, apart)]
            chunks = [data[start : start + ep] for start in range(0, dp, ep)]
            expert_groups.extend(chunks)
            expert_data_groups.extend([list(members) for members in zip(*chunks)])
    return expert_groups, expert_data_groups
