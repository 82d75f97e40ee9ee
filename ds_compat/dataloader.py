"""DeepSpeed's training data loader (`deepspeed.initialize(training_data=...)`, `engine.deepspeed_io`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler, IterableDataset


class DeepSpeedDataLoader:
    """DeepSpeed's training loader: a DistributedSampler over the data-parallel ranks (shuffled, seed 0, the same
    order every epoch unless the script calls `data_sampler.set_epoch`), micro-batch sized batches, the collate_fn.

    Batches are loaded in the main process (DeepSpeed forks two workers per rank; forking after the accelerator is
    initialised can deadlock), so the order is the same and only the loading overlaps less.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        dp_world_size: int,
        dp_rank: int,
        collate_fn: Callable | None,
        drop_last: bool,
        pin_memory: bool,
        data_sampler: Any = None,
    ) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.dataloader_drop_last = drop_last
        self.pin_memory = pin_memory
        self.post_process_func = None
        if isinstance(dataset, IterableDataset):
            self.data_sampler = None
            self.len = None
        else:
            self.data_sampler = data_sampler or DistributedSampler(dataset, num_replicas=dp_world_size, rank=dp_rank)
            count = len(self.data_sampler)
            self.len = count // batch_size if drop_last else math.ceil(count / batch_size)
        self.dataloader: DataLoader | None = None
        self._iterator = None

    def _create_dataloader(self) -> DataLoader:
        kwargs: dict[str, Any] = {"batch_size": self.batch_size, "pin_memory": self.pin_memory}
        if self.collate_fn is not None:
            kwargs["collate_fn"] = self.collate_fn
        if self.data_sampler is not None:
            kwargs.update(sampler=self.data_sampler, drop_last=self.dataloader_drop_last)
        self.dataloader = DataLoader(self.dataset, **kwargs)
        return self.dataloader

    def __iter__(self) -> DeepSpeedDataLoader:
        self._iterator = iter(self._create_dataloader())
        return self

    def __next__(self) -> Any:
        if self._iterator is None:
            iter(self)
        return next(self._iterator)

    def __len__(self) -> int:
        if self.len is None:
            raise TypeError("an IterableDataset has no length")
        return self.len
