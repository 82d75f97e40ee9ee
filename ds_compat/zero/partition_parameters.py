"""`deepspeed.zero.Init` and `deepspeed.zero.GatheredParameters` on this backend.

Inside `Init`, a parameter is partitioned as soon as the module that owns it is attached to its parent (for the root
and loose parameters: when the context exits), i.e. after that module's `__init__` ran its default initialisation,
as DeepSpeed partitions at the end of each module's construction. Partitioning broadcasts rank 0's value (DeepSpeed
does too, so every rank agrees), keeps this rank's rows of dim 0 (`torch.chunk` over the world, FSDP2's own layout)
and leaves an empty tensor in the parameter with DeepSpeed's `ds_shape` / `ds_numel` / `ds_id` attributes. So a
model larger than one rank can be built: a rank holds its shards plus, for a moment, the module being constructed.

`GatheredParameters(params, modifier_rank)` all-gathers full values into the parameters for the block and, on exit,
broadcasts the modifier rank's values and partitions them again: how the HF integration loads `from_pretrained`
weights and initialises under ZeRO-3. `deepspeed.initialize` then builds the FSDP2 model on the meta device from the
shapes and fills each local shard from the partitions (one full parameter at a time).

Every tensor answers DeepSpeed's `ds_status` (a `ZeroParamStatus`) for its state here, what code that gathers only
what is not yet gathered reads (TRL's `maybe_gather_lm_head_ctx`): see `param_status`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.modules import module as module_hooks

from ds_compat.accelerator import get_accelerator
from glm45v_fsdp.errors import UserError

_ids = itertools.count()
_orig_torch_arange = torch.arange  # transformers' prevent_arange_dtype_change swaps the two names below


def zero_wrapper_for_fp_tensor_constructor(fn: Any, target_fp_dtype: torch.dtype, target_device: Any = None) -> Any:
    """DeepSpeed wraps tensor constructors to cast them inside Init; this backend keeps constructors as they are
    (precision is the engine's mixed-precision policy), so the wrapper is the identity."""
    return fn


def is_partitioned(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_shape") and hasattr(param, "_zero_rows")


class ZeroParamStatus(Enum):
    """DeepSpeed's `param.ds_status` values, with its members and numbers. INFLIGHT (a gather under way) is never
    answered here: gathers finish before the call that starts them returns."""

    AVAILABLE = 1  # the full value is in the tensor, ready for use
    NOT_AVAILABLE = 2  # partitioned: this rank holds a part
    INFLIGHT = 3  # being gathered


def param_status(tensor: torch.Tensor) -> ZeroParamStatus:
    """DeepSpeed's `ds_status` of a tensor on this backend. NOT_AVAILABLE: an FSDP2 shard (a DTensor, which plain
    tensor code cannot use; `full_tensor()` is its value), a zero.Init partition outside GatheredParameters (an empty
    tensor beside `ds_numel`), an FSDP2 unsharded parameter whose storage its unit freed at reshard. AVAILABLE: any
    tensor that holds its full value, such as the unsharded parameters FSDP2 puts in the modules of a unit for its
    forward and backward, a zero.Init parameter inside GatheredParameters, a parameter that is not partitioned."""
    if isinstance(tensor, DTensor):
        return ZeroParamStatus.NOT_AVAILABLE
    if is_partitioned(tensor) and tensor.numel() != tensor.ds_numel:
        return ZeroParamStatus.NOT_AVAILABLE
    if tensor.numel() and tensor.layout == torch.strided and tensor.untyped_storage().nbytes() == 0:
        return ZeroParamStatus.NOT_AVAILABLE
    return ZeroParamStatus.AVAILABLE


def _get_ds_status(tensor: torch.Tensor) -> Any:
    """`tensor.ds_status`: a value assigned to it (DeepSpeed's own zero code sets its parameters', should it run in
    the same process), else `param_status(tensor)`."""
    return tensor.__dict__["ds_status"] if "ds_status" in tensor.__dict__ else param_status(tensor)


def _set_ds_status(tensor: torch.Tensor, status: Any) -> None:
    tensor.__dict__["ds_status"] = status


torch.Tensor.ds_status = property(_get_ds_status, _set_ds_status, doc=param_status.__doc__)


def _row_range(rows: int, world: int, rank: int) -> tuple[int, int]:
    chunk = -(-rows // world)
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


def _world() -> tuple[int, int]:
    return dist.get_world_size(), dist.get_rank()


def _keep_rows(param: nn.Parameter, src: int) -> None:
    """Rank `src`'s full value (in `param.data` on every rank): this rank's rows kept, an empty tensor left behind."""
    world, rank = _world()
    full = param.data
    if world > 1:
        dist.broadcast(full, src=src)
    if full.dim() == 0:
        param._zero_rows = full.detach().clone()
    else:
        start, stop = _row_range(full.shape[0], world, rank)
        param._zero_rows = full[start:stop].detach().clone()
    param.data = torch.empty(0, dtype=full.dtype, device=full.device)


def partition(param: nn.Parameter) -> None:
    """Partition a full parameter (rank 0's value), with DeepSpeed's ds_id / ds_shape / ds_numel."""
    if not hasattr(param, "ds_id"):
        param.ds_id = next(_ids)
    param.ds_shape, param.ds_numel = param.shape, param.numel()
    _keep_rows(param, src=0)


def gather_full(param: nn.Parameter) -> torch.Tensor:
    """The parameter's full value from every rank's rows (a collective)."""
    rows, shape = param._zero_rows, param.ds_shape
    world, _ = _world()
    if rows.dim() == 0 or world == 1:
        return rows.clone()
    chunk = -(-shape[0] // world)
    padded = rows.new_zeros((chunk, *shape[1:]))
    padded[: rows.shape[0]] = rows
    gathered = rows.new_empty((chunk * world, *shape[1:]))
    dist.all_gather_single(gathered, padded)
    return gathered[: shape[0]]


def _check_not_sharded(params: list[nn.Parameter]) -> None:
    if any(isinstance(p, DTensor) for p in params):
        raise UserError(
            "deepspeed.zero.GatheredParameters was given the engine's parameters after deepspeed.initialize: this "
            "backend shards them with FSDP2 (DTensor), where a full value is `param.full_tensor()` and a change is "
            "`engine.module.load_state_dict(...)`. Use GatheredParameters before initialize (zero.Init models), or "
            "those calls."
        )


class GatheredParameters:
    """Full values in the given zero.Init-partitioned parameters for the block; with `modifier_rank`, that rank's
    changes are what every rank keeps. Parameters that are not partitioned are left alone, as DeepSpeed."""

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: Any = None, enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        params = [] if params is None else list(params)
        _check_not_sharded(params)
        self.params = [p for p in params if is_partitioned(p)] if enabled else []
        self.modifier_rank = modifier_rank

    def __enter__(self) -> GatheredParameters:
        for param in self.params:
            param.data = gather_full(param)
        return self

    def __exit__(self, *exc: Any) -> None:
        for param in self.params:
            if self.modifier_rank is None:  # nobody changed it: every rank's rows are still right
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
            else:
                _keep_rows(param, src=self.modifier_rank)


class Init:
    """`deepspeed.zero.Init`: partition parameters while the model is constructed (see the module docstring), or,
    with `module=`, an existing module's parameters now."""

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: Any = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        **_: Any,
    ) -> None:
        if data_parallel_group is not None or mpu is not None:
            raise UserError(
                "deepspeed.zero.Init(data_parallel_group=... / mpu=...) partitions over a sub-group; this backend "
                "partitions over every rank (the engine's data-parallel world). Remove the argument."
            )
        self.enabled = enabled
        self._pending: dict[int, nn.Parameter] = {}
        self._handles: list[Any] = []
        if enabled:
            from ds_compat import comm

            comm.init_distributed()
        if enabled and module is not None:
            for param in module.parameters():
                if not is_partitioned(param):
                    partition(param)

    def _on_parameter(self, module: nn.Module, name: str, param: Any) -> None:
        if isinstance(param, nn.Parameter) and not is_partitioned(param):
            self._pending[id(param)] = param

    def _on_module(self, parent: nn.Module, name: str, child: Any) -> None:
        if isinstance(child, nn.Module):
            self._flush(child.parameters())

    def _flush(self, params: Iterable[nn.Parameter]) -> None:
        for param in params:
            if self._pending.pop(id(param), None) is not None:
                partition(param)

    def __enter__(self) -> Init:
        if self.enabled:
            self._handles = [
                module_hooks.register_module_parameter_registration_hook(self._on_parameter),
                module_hooks.register_module_module_registration_hook(self._on_module),
            ]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if exc[0] is None:
            self._flush(list(self._pending.values()))
        self._pending.clear()


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed needs to be told of a parameter used by a module that does not own it; FSDP2 gathers by unit, so
    there is nothing to do."""


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """See register_external_parameter."""


__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "gather_full",
    "get_accelerator",
    "is_partitioned",
    "param_status",
    "register_external_parameter",
    "unregister_external_parameter",
]
