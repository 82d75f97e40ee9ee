"""`deepspeed.checkpoint.utils.clone_tensors_for_torch_save`, FSDP2-aware."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """Copies of every tensor in `item` (nested lists, tuples and dicts) on `device`, free of views into larger
    storages, as DeepSpeed's. A sharded (DTensor) parameter becomes its full tensor: a collective, so every rank must
    call this on the same structure, as accelerate's `get_state_dict` does."""
    if isinstance(item, DTensor):
        return item.full_tensor().detach().clone().to(device)
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(value, device) for value in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(value, device) for value in item)
    if isinstance(item, dict):
        return type(item)((key, clone_tensors_for_torch_save(value, device)) for key, value in item.items())
    return item
