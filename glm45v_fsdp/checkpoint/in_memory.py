"""Weights held in memory as full tensors (the model a DeepSpeed-API script built: `from_pretrained`, a random init,
or zero.Init partitions gathered one parameter at a time) copied into a materialised, sharded model's local shards.

The counterpart of `checkpoint.hf.load_hf_weights` for tensors instead of files: every parameter and persistent
buffer must be given, with its shape, or nothing is copied (no silent initial values).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from glm45v_fsdp.checkpoint.hf import local_box
from glm45v_fsdp.checkpoint.layout import compare_keys, describe_diff, model_tensors
from glm45v_fsdp.errors import UserError

# name -> the full tensor (called once per name, in the model's order: a gather may be a collective)
FullTensors = Mapping[str, Callable[[], torch.Tensor]]


@torch.no_grad()
def load_full_tensors(model: nn.Module, shapes: Mapping[str, tuple[int, ...]], tensors: FullTensors) -> int:
    """Copy each full tensor's slice into this rank's shard of the materialised `model`; returns the bytes copied.

    `shapes` are the given tensors' full shapes, checked against the model before anything is copied."""
    targets, _ = model_tensors(model)
    assert not any(t.is_meta for t in targets.values()), "load_full_tensors needs a materialised model"
    diff = compare_keys({name: tuple(t.shape) for name, t in targets.items()}, shapes)
    if not diff.ok:
        raise UserError(
            f"The model's weights do not fit the model the plans built: {describe_diff(diff)} Nothing was copied. "
            "Pass the model as transformers built it (from_pretrained or the config's constructor), unchanged."
        )
    copied = 0
    for name, target in targets.items():
        full = tensors[name]()
        copied += _copy_slice(target, full)
    return copied


@torch.no_grad()
def load_some_tensors(model: nn.Module, tensors: Mapping[str, torch.Tensor], key: str) -> int:
    """Copy these full tensors (a subset of the model's: LoRA adapters) into this rank's shards; `key` names the
    config key they came from in the error. Shapes are checked before anything is copied."""
    targets, _ = model_tensors(model)
    wrong = [
        f"{name} {tuple(tensor.shape)} (the model's: {tuple(targets[name].shape) if name in targets else 'none'})"
        for name, tensor in tensors.items()
        if name not in targets or tuple(targets[name].shape) != tuple(tensor.shape)
    ]
    if wrong:
        raise UserError(
            f"Config key '{key}': {len(wrong)} tensor(s) do not fit the model: {'; '.join(wrong[:3])}. Nothing was "
            f"copied. Give tensors of the model's shapes (the adapter's rank must be model.lora.rank)."
        )
    return sum(_copy_slice(targets[name], tensor) for name, tensor in tensors.items())


def _copy_slice(target: torch.Tensor, full: torch.Tensor) -> int:
    box = local_box(target)
    if box is None:  # e.g. strided shards: let DTensor take this rank's part of the full tensor (no communication)
        value = full.to(device=target.device, dtype=target.dtype)
        target.copy_(distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None))
        return target.to_local().nbytes
    offset, size = box
    local = target.to_local() if isinstance(target, DTensor) else target
    piece = full[tuple(slice(o, o + s) for o, s in zip(offset, size))]
    local.copy_(piece.to(device=local.device, dtype=local.dtype))
    return piece.nbytes
