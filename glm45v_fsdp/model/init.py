"""Deterministic materialization of a meta-device (optionally FSDP2-sharded) model.

Every parameter and persistent buffer gets a value that is a pure function of (seed, FQN), following the rules of
transformers' `Glm4vMoePreTrainedModel._init_weights`, so any world size starts from the same weights. A normal
tensor is defined block-wise along dim 0: block k (about 2**20 elements, whole rows; its size depends only on the
shape) is drawn on CPU from a generator seeded with CRC32(`{seed}/{fqn}/{k}`). A rank draws only the blocks its shard
overlaps, so the 106B model costs each of N ranks ~1/N of the full draw. Non-persistent buffers (rotary `inv_freq`)
are recomputed from the module's config.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.glm4v_moe.modeling_glm4v_moe import Glm4vMoeTextExperts, Glm4vMoeTextTopkRouter

from glm45v_fsdp.adapters import is_adapter
from glm45v_fsdp.model.moe import GroupedExperts, MoERouter

_LINEAR_LIKE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_BLOCK_NUMEL = 1 << 20


def _generator(seed: int, key: str) -> torch.Generator:
    # The CPU generator (mt19937) keeps only the low 32 bits of a seed, so hash seed and key together.
    generator = torch.Generator(device="cpu")
    generator.manual_seed(zlib.crc32(f"{seed}/{key}".encode()))
    return generator


def _is_norm(module: nn.Module) -> bool:
    name = type(module).__name__
    return isinstance(module, nn.LayerNorm) or "LayerNorm" in name or "RMSNorm" in name


def _init_rule(module: nn.Module, name: str, fqn: str) -> str:
    """'normal', 'zeros' or 'ones', as transformers' _init_weights would initialize `module.<name>`."""
    if isinstance(module, (*_LINEAR_LIKE, nn.Embedding)) and name == "weight":
        return "normal"
    if isinstance(module, _LINEAR_LIKE) and name == "bias":
        return "zeros"
    if _is_norm(module):
        return {"weight": "ones", "bias": "zeros"}[name]
    if isinstance(module, (Glm4vMoeTextTopkRouter, MoERouter)):
        return {"weight": "normal", "e_score_correction_bias": "zeros"}[name]
    if isinstance(module, (Glm4vMoeTextExperts, GroupedExperts)) and name in ("gate_up_proj", "down_proj"):
        return "normal"
    if is_adapter(name):  # PEFT's default: A kaiming-uniform (a = sqrt(5): bound 1/sqrt(fan_in)), B zeros
        return "lora_uniform" if name.endswith("lora_A") else "zeros"
    raise RuntimeError(f"materialize: no init rule for '{fqn}' ({type(module).__name__}.{name}); add one.")


def _normal_rows(
    shape: torch.Size, std: float, seed: int, fqn: str, start: int, stop: int, uniform: bool = False
) -> torch.Tensor:
    """Rows [start, stop) (dim 0) of the block-wise N(0, std) tensor of this shape and FQN (`uniform`: U(-std, std))."""
    rows_per_block = max(1, _BLOCK_NUMEL // max(1, math.prod(shape[1:])))
    pieces = []
    for block in range(start // rows_per_block, -(-stop // rows_per_block)):
        low, high = block * rows_per_block, min((block + 1) * rows_per_block, shape[0])
        values, generator = torch.empty((high - low, *shape[1:])), _generator(seed, f"{fqn}/{block}")
        values = (
            values.uniform_(-std, std, generator=generator)
            if uniform
            else values.normal_(0.0, std, generator=generator)
        )
        pieces.append(values[max(start, low) - low : min(stop, high) - low])
    return torch.cat(pieces) if pieces else torch.empty((0, *shape[1:]))


def _value(
    module: nn.Module, name: str, fqn: str, shape: torch.Size, box: tuple, std: float, seed: int
) -> torch.Tensor:
    """The slice `box` = (local shape, global offset) of the parameter's full initial value."""
    local_shape, offset = box
    rule = _init_rule(module, name, fqn)
    if rule not in ("normal", "lora_uniform"):
        return (torch.ones if rule == "ones" else torch.zeros)(local_shape)
    if rule == "lora_uniform":
        std = 1.0 / math.sqrt(shape[-1])  # the bound
    value = _normal_rows(shape, std, seed, fqn, offset[0], offset[0] + local_shape[0], uniform=rule == "lora_uniform")
    for dim in range(1, len(shape)):
        value = value.narrow(dim, offset[dim], local_shape[dim])
    if isinstance(module, nn.Embedding) and module.padding_idx is not None:
        row = module.padding_idx - offset[0]
        if 0 <= row < local_shape[0]:
            value[row] = 0.0
    return value


def _fill(module: nn.Module, name: str, fqn: str, target: torch.Tensor, std: float, seed: int) -> None:
    shape = target.shape
    if not isinstance(target, DTensor):
        target.copy_(_value(module, name, fqn, shape, (tuple(shape), (0,) * len(shape)), std, seed))
    elif all(type(p) in (Shard, Replicate) for p in target.placements):  # the local shard is one box
        box = compute_local_shape_and_global_offset(shape, target.device_mesh, target.placements)
        target.to_local().copy_(_value(module, name, fqn, shape, box, std, seed))
    else:  # e.g. strided shards: draw the full tensor and let DTensor slice it locally (no communication)
        full = _value(module, name, fqn, shape, (tuple(shape), (0,) * len(shape)), std, seed).to(target.dtype)
        target.copy_(distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None))


def _reset_rotary(module: nn.Module) -> None:
    """Recompute `inv_freq`/`original_inv_freq` the way transformers' _init_weights does."""
    rope_fns = {
        "axial": getattr(module, "compute_axial_rope_parameters", None),
        "default": getattr(module, "compute_default_rope_parameters", None),
        **ROPE_INIT_FUNCTIONS,
    }
    inv_freq, _ = rope_fns[module.rope_type](module.config, module.inv_freq.device)
    module.inv_freq.copy_(inv_freq)
    module.original_inv_freq.copy_(inv_freq)


def _std_for(model: nn.Module, fqn: str) -> float:
    config = model.config
    sub = config.vision_config if fqn.startswith("model.visual.") else config.text_config
    return sub.initializer_range


@torch.no_grad()
def allocate(model: nn.Module, device: torch.device) -> None:
    """Allocate a meta model on `device` (values undefined) and recompute the non-persistent rotary buffers; for
    weights that are copied in whole afterwards (`checkpoint.in_memory`)."""
    model.to_empty(device=device)
    for module_name, module in model.named_modules():
        if _is_rotary(module):
            _reset_rotary(module)
            continue
        unknown = module._non_persistent_buffers_set & set(module._buffers)
        if unknown:
            raise RuntimeError(
                f"materialize: no rule to recompute non-persistent buffers {sorted(unknown)} of '{module_name}'."
            )


def _is_rotary(module: nn.Module) -> bool:
    return "RotaryEmbedding" in type(module).__name__ and hasattr(module, "original_inv_freq")


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate a meta model on `device` and fill it deterministically from (seed, FQN); FSDP2-sharded or not."""
    allocate(model, device)
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if _is_rotary(module):
            continue
        tensors = list(module.named_parameters(recurse=False)) + [
            (name, buffer)
            for name, buffer in module.named_buffers(recurse=False)
            if name not in module._non_persistent_buffers_set
        ]
        for name, tensor in tensors:
            if id(tensor) in seen:  # tied weights: the first FQN decides
                continue
            seen.add(id(tensor))
            _fill(module, name, prefix + name, tensor, _std_for(model, prefix + name), seed)
