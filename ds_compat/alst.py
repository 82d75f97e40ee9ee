"""What the engine takes from DeepSpeed's ALST `mpu` (`UlyssesSPAttentionHF.register_with_transformers`, which
accelerate's and the HF Trainer's `parallelism_config` call before `deepspeed.initialize(mpu=...)`).

The mpu says how many ranks split a sequence; the engine runs that as `sequence_parallel_size` (the Ulysses plan on
GLM-4.5V), so the ds_config may leave the key out or give the same size. Megatron-style mpus (tensor / pipeline
model parallelism) stay refused, and Ring from the extension section does not combine with the ALST adapter (it
slices the targets contiguously, Ring needs the zigzag layout).

Gradients: DeepSpeed 0.19.8 sums them over the sequence-parallel group at ZeRO 0-2 and averages them at ZeRO-3;
transformers' `deepspeed_sp_compute_loss` scales its loss by the group size at ZeRO-3 for deepspeed < 0.20.2 to make
up for it. The engine reduces the same way under the ALST mpu (`sequence_average`), so that loss trains as on
DeepSpeed.
"""

from __future__ import annotations

from typing import Any

from ds_compat.runtime.sequence_parallel import parallel_state_sp
from glm45v_fsdp.errors import UserError


def alst_sequence_parallel_size(mpu: Any) -> int:
    """The sequence-parallel size of DeepSpeed's ALST mpu, which the translation takes as `sequence_parallel_size`
    (ds_compat.config.translate's `alst_sequence_parallel`, checked there against the ds_config's own)."""
    if mpu is not parallel_state_sp:
        raise UserError(
            f"initialize(mpu={getattr(mpu, '__name__', type(mpu).__name__)}): the FSDP2 backend takes only "
            "DeepSpeed's sequence-parallel mpu (the one UlyssesSPAttentionHF.register_with_transformers returns); "
            "Megatron-style model parallelism is not supported: the engine shards every parameter over the "
            "data-parallel ranks itself. Remove mpu, or run on DeepSpeed."
        )
    if not parallel_state_sp.is_initialized():
        raise UserError(
            "initialize(mpu=parallel_state_sp) before its groups exist: call "
            "UlyssesSPAttentionHF.register_with_transformers(...) (or initialize_sequence_parallel) first."
        )
    return parallel_state_sp.get_sequence_parallel_world_size()


def sequence_average(zero_stage: int) -> int:
    """What the engine divides the gradients by over the sequence-parallel group under the ALST mpu (DeepSpeed
    0.19.8: 1 at ZeRO 0-2, the group size at ZeRO-3)."""
    return parallel_state_sp.get_sequence_parallel_world_size() if zero_stage == 3 else 1
