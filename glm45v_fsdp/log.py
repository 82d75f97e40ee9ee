"""Logging: rank 0 speaks at INFO, the other ranks only warn."""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "glm45v_fsdp"


def setup_logging(rank: int) -> logging.Logger:
    logger = logging.getLogger(LOGGER_NAME)
    logger.handlers.clear()
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"[%(asctime)s rank{rank}] %(message)s", datefmt="%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False
    return logger


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)
