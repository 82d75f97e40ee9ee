"""DataLoader over a GlobalBatchSampler; worker processes are spawned, never forked from an initialised device."""

from __future__ import annotations

import functools

from torch.utils.data import DataLoader, Dataset

from glm45v_fsdp.data.collate import collate
from glm45v_fsdp.data.sampler import GlobalBatchSampler


def build_dataloader(
    dataset: Dataset, sampler: GlobalBatchSampler, pad_token_id: int, packing: bool, num_workers: int
) -> DataLoader:
    """Micro batches of `sampler` collated by `collate`; num_workers > 0 uses persistent spawned workers."""
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=functools.partial(collate, pad_token_id=pad_token_id, packing=packing),
        num_workers=num_workers,
        multiprocessing_context="spawn" if num_workers > 0 else None,
        persistent_workers=num_workers > 0,
        pin_memory=False,
    )
