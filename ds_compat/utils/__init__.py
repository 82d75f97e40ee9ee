"""The most used pieces of `deepspeed.utils`: RepeatingLoader, logger, log_dist, the ZeRO-3 leaf-module flags; its
`groups` and `numa` modules are ds_compat/utils/groups.py and numa.py. Nothing here imports torch at import time: the
launcher (ds-fsdp) reads numa's core lists without it."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ds_compat.alias import submodule_attributes
from glm45v_fsdp.log import get_logger

if TYPE_CHECKING:
    from torch import nn

logger = get_logger()


class RepeatingLoader:
    """Iterate over `loader` forever, restarting it when it is exhausted (deepspeed.utils.RepeatingLoader)."""

    def __init__(self, loader: Iterable) -> None:
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log `message` on the given ranks (all when None or containing -1), as deepspeed.utils.log_dist."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")


Z3_LEAF_ATTRIBUTE = "_z3_leaf"  # DeepSpeed's flag name; the engine keeps a flagged module's subtree in one FSDP2 unit


def _set_z3_leaf(
    model: nn.Module, classes: list[type] | list[str], flag: bool, raise_if_not_found: bool
) -> list[nn.Module]:
    wanted = [c.__name__ if isinstance(c, type) else str(c) for c in classes]
    matched = [module for module in model.modules() if type(module).__name__ in wanted]
    if not matched and raise_if_not_found:
        raise ValueError(f"No modules of type {wanted} found in model {type(model).__name__}")
    for module in matched:
        setattr(module, Z3_LEAF_ATTRIBUTE, flag)
    return matched


def set_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: list[type] | list[str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Flag modules of these classes as ZeRO-3 leaves (e.g. MoE blocks, whose experts run in a varying order): the
    engine's automatic FSDP2 units never split a leaf, so all its parameters are gathered together, as DeepSpeed."""
    return _set_z3_leaf(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: list[type] | list[str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    return _set_z3_leaf(model, leaf_module_classes, False, raise_if_not_found)


def z3_leaf_module(model: nn.Module) -> bool:
    return getattr(model, Z3_LEAF_ATTRIBUTE, False)


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if z3_leaf_module(module)]


__getattr__ = submodule_attributes("deepspeed.utils")  # groups, numa, zero_to_fp32 on first use
