"""`deepspeed.checkpointing` for models that call it: activation checkpointing with torch.utils.checkpoint.

`checkpoint(function, *args)` recomputes `function` in backward (non-reentrant, so it composes with FSDP2); the
RNG state is restored for the recomputation, so dropout draws the same masks. `configure` accepts DeepSpeed's
arguments: partition_activations (tensor-parallel splitting) and cpu_checkpointing have no effect here, nor do the
buffer options; they change memory, never the numerics.
"""

from __future__ import annotations

from typing import Any

import torch.utils.checkpoint

_configured = False


def configure(mpu_: Any = None, deepspeed_config: Any = None, **_: Any) -> None:
    global _configured
    _configured = True


def is_configured() -> bool:
    return _configured


def reset() -> None:
    """DeepSpeed frees its checkpointing buffers here; there are none."""


def checkpoint(function: Any, *args: Any) -> Any:
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


def non_reentrant_checkpoint(function: Any, *args: Any) -> Any:
    return checkpoint(function, *args)


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """No model parallelism: seeds the device generators like torch.manual_seed."""
    torch.manual_seed(seed)
