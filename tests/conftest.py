"""Shared fixtures."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from test_train import PARITY, read_metrics, train


@pytest.fixture(scope="session")
def parity_off(tmp_path_factory) -> Callable[[int], list[dict]]:
    """The metrics of the plain PARITY run (every memory switch off) on `nproc` ranks, trained once per session:
    the chunk-loss, recompute and offload parity tests all compare against it."""
    cache: dict[int, list[dict]] = {}

    def records(nproc: int) -> list[dict]:
        if nproc not in cache:
            out = tmp_path_factory.mktemp(f"parity_off_{nproc}")
            result = train(out, PARITY, nproc=nproc)
            assert result.returncode == 0, result.stderr[-3000:]
            cache[nproc] = read_metrics(out)
        return cache[nproc]

    return records
