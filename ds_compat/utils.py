"""The most used pieces of `deepspeed.utils`: RepeatingLoader, logger, log_dist."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist

from glm45v_fsdp.log import get_logger

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
    rank = dist.get_rank() if dist.is_initialized() else 0
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")
