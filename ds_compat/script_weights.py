"""The weights of the model a script passes to `deepspeed.initialize`, handed to the weights plans as getters (one
full tensor at a time): the tensors the model holds (held by reference, rank 0's), its zero.Init partitions (each
gathered when copied) and a PEFT model's adapters. The GLM-4.5V door and the generic path both take them here; the
plans call the getters at the side of the build."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ds_compat.zero.partition_parameters import gather_full, is_partitioned
from glm45v_fsdp.checkpoint.layout import model_tensors
from glm45v_fsdp.lora.peft_model import PeftAdapters
from glm45v_fsdp.plans import GivenWeights


def take_zero_init_partitions(model: nn.Module) -> dict[str, Callable[[], torch.Tensor]]:
    """Swap each zero.Init-partitioned parameter (an empty tensor plus its rows) for a meta parameter of its full
    shape, so the plans see the real shapes; -> {name: its full tensor, gathered from the rows on demand}."""
    replacement: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and is_partitioned(param):
                meta = torch.empty(param.ds_shape, dtype=param.dtype, device="meta")
                new = replacement.setdefault(id(param), nn.Parameter(meta, requires_grad=param.requires_grad))
                new._zero_source = param
                module._parameters[name] = new
    return {
        name: functools.partial(gather_full, param._zero_source)
        for name, param in model.named_parameters(remove_duplicate=False)
        if hasattr(param, "_zero_source")
    }


def module_partitions(model: nn.Module) -> GivenWeights | None:
    """Any other module's zero.Init partitions (the module meta in their place), for the module weights plan; None
    when it has none: the module holds all its values."""
    pending = take_zero_init_partitions(model)
    if not pending:
        return None
    shapes = {name: tuple(model.get_parameter(name).shape) for name in pending}
    return GivenWeights(shapes, pending, f"the module's {len(pending)} zero.Init parameter(s)")


def take_weights(
    model: nn.Module, device: torch.device, broadcast: bool, adapters: PeftAdapters | None = None
) -> GivenWeights:
    """The script's weights, held by reference (no copy), and the model moved to the meta device in fp32 (FSDP2's
    master weights; requires_grad kept). Parameters whose values the module does not hold (zero.Init partitions)
    are gathered each when the weights plan copies it. `broadcast`: each tensor is rank 0's (as DeepSpeed broadcasts
    the model at initialize), so every rank starts from the same weights. `adapters`: a PEFT model's adapters, each
    in our layout under our name."""
    pending = take_zero_init_partitions(model)
    tensors, _ = model_tensors(model)
    shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
    held = {name: tensor.detach() for name, tensor in tensors.items() if name not in pending}
    source = "the model passed to deepspeed.initialize" + (
        f" ({len(pending)} zero.Init partition(s) gathered one at a time)" if pending else ""
    )
    model.to(device="meta", dtype=torch.float32)

    def rank0(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.to(device)
        if broadcast:
            dist.broadcast(tensor, src=0)
        return tensor

    getters = {name: functools.partial(rank0, tensor) for name, tensor in held.items()}
    if adapters is not None:
        for name, param in adapters.parameters.items():
            shape = param.ds_shape if is_partitioned(param) else param.shape
            shapes[name] = tuple(adapters.our_value(name, torch.empty(shape, device="meta")).shape)
            getters[name] = functools.partial(_adapter_value, adapters, name, param, rank0)
        source += f" with its {adapters.describe()}"
    return GivenWeights(shapes, {**getters, **pending}, source)


def _adapter_value(adapters: PeftAdapters, name: str, param: nn.Parameter, rank0: Callable) -> torch.Tensor:
    full = gather_full(param) if is_partitioned(param) else param.detach()
    return rank0(adapters.our_value(name, full))
