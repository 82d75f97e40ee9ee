"""Global-batch samplers: step k trains on the same samples whatever the dp x micro batch x accumulation split."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class StepSampler(Sampler[list[int]]):
    """Yields this dp rank's micro batches (lists of sample indices) in training order, forever, from a subclass's
    `step_indices` (the G = micro_batch_size * gradient_accumulation_steps * dp_size indices of a step).

    A step's G indices are cut into consecutive chunks of micro_batch_size; chunk c goes to rank
    c // accumulation as its micro batch c % accumulation (rank-major). Iteration starts at start_step.
    """

    def __init__(
        self,
        micro_batch_size: int,
        gradient_accumulation_steps: int,
        dp_rank: int,
        dp_size: int,
        start_step: int = 0,
    ):
        if micro_batch_size < 1 or gradient_accumulation_steps < 1 or start_step < 0:
            raise ValueError(
                f"micro_batch_size={micro_batch_size}, gradient_accumulation_steps={gradient_accumulation_steps} "
                f"must be >= 1 and start_step={start_step} >= 0"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is not in [0, dp_size={dp_size})")
        self.micro_batch_size = micro_batch_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.start_step = start_step
        self.global_batch_size = micro_batch_size * gradient_accumulation_steps * dp_size

    def step_indices(self, step: int) -> list[int]:
        """The G sample indices of `step`, over all ranks and micro batches."""
        raise NotImplementedError

    def micro_batches(self, step: int) -> list[list[int]]:
        """This rank's gradient_accumulation_steps micro batches of `step`."""
        per_rank = self.micro_batch_size * self.gradient_accumulation_steps
        mine = self.step_indices(step)[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        return [mine[i : i + self.micro_batch_size] for i in range(0, per_rank, self.micro_batch_size)]

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start_step
        while True:
            yield from self.micro_batches(step)
            step += 1


class GlobalBatchSampler(StepSampler):
    """One data set's index stream: the concatenation of epoch orders (a permutation seeded with seed + epoch when
    shuffling). Step k takes stream items [k*G, (k+1)*G), so a data set smaller than G still works."""

    def __init__(
        self,
        dataset_size: int,
        micro_batch_size: int,
        gradient_accumulation_steps: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool,
        start_step: int = 0,
    ):
        if dataset_size < 1:
            raise ValueError(f"dataset_size={dataset_size} must be >= 1")
        super().__init__(micro_batch_size, gradient_accumulation_steps, dp_rank, dp_size, start_step)
        self.dataset_size = dataset_size
        self.seed = seed
        self.shuffle = shuffle
        self._orders: dict[int, list[int]] = {}

    def epoch_of_step(self, step: int) -> int:
        """Epoch of the first sample of `step`."""
        return step * self.global_batch_size // self.dataset_size

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            self._orders = {e: order for e, order in self._orders.items() if e > epoch - 2}
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                self._orders[epoch] = torch.randperm(self.dataset_size, generator=generator).tolist()
            else:
                self._orders[epoch] = list(range(self.dataset_size))
        return self._orders[epoch]

    def step_indices(self, step: int) -> list[int]:
        start = step * self.global_batch_size
        return [
            self._order(p // self.dataset_size)[p % self.dataset_size]
            for p in range(start, start + self.global_batch_size)
        ]
