"""Seeding and deterministic mode.

Call `set_deterministic` before `init_distributed` and before the first matmul: HCCL reads HCCL_DETERMINISTIC when
its communicators are created and cuBLAS reads CUBLAS_WORKSPACE_CONFIG when its handle is created.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from glm45v_fsdp.runtime.device import DeviceLayer

# cuBLAS needs a fixed workspace configuration for reproducible results (":16:8" also works, slower, less memory).
_CUBLAS_WORKSPACE_CONFIG = ":4096:8"


def set_seed(seed: int, device: DeviceLayer) -> None:
    """Seed Python's `random`, NumPy's global generator, torch's CPU generator and every device generator.

    The same seed on every rank: FSDP2 shards parameters that each rank initialised identically.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    device.manual_seed_all(seed)


def set_deterministic(enabled: bool, device: DeviceLayer) -> None:
    """Make kernels and collectives reproducible run to run (training.deterministic), or restore torch defaults.

    Choices: `torch.use_deterministic_algorithms(True)` with warn_only=False, so an op without a deterministic
    kernel raises (naming the op) instead of silently breaking reproducibility; cuDNN deterministic and no autotuning;
    CUBLAS_WORKSPACE_CONFIG (cuda) and HCCL_DETERMINISTIC=true (npu: deterministic reductions in HCCL) are exported
    unless the user already set them. Turning it off restores torch's flags; exported variables stay.
    """
    torch.use_deterministic_algorithms(enabled, warn_only=False)
    torch.backends.cudnn.deterministic = enabled
    if enabled:
        torch.backends.cudnn.benchmark = False
        if device.type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", _CUBLAS_WORKSPACE_CONFIG)
        elif device.type == "npu":
            os.environ.setdefault("HCCL_DETERMINISTIC", "true")
