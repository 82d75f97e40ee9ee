"""DataLoader over a batch sampler (training: GlobalBatchSampler); worker processes are spawned, never forked from an
initialised device."""

from __future__ import annotations

import functools
from collections.abc import Iterable

from torch.utils.data import DataLoader, Dataset

from glm45v_fsdp.data.collate import collate


def build_dataloader(
    dataset: Dataset, sampler: Iterable[list[int]], pad_token_id: int, packing: bool, num_workers: int
) -> DataLoader:
    """Micro batches of `sampler` (a GlobalBatchSampler, or a list of sample index lists) collated by `collate`;
    num_workers > 0 uses persistent spawned workers."""
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=functools.partial(collate, pad_token_id=pad_token_id, packing=packing),
        num_workers=num_workers,
        multiprocessing_context="spawn" if num_workers > 0 else None,
        persistent_workers=num_workers > 0,
        pin_memory=False,
    )
