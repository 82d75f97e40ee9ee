"""The validation set: read from data.validation_path by the training data's own readers, or held out of the
training data by data.validation_split (a fraction, chosen with training.seed); and its eval batches, which
evaluation.py runs.

Eval batches: the validation set in order, in global eval batches of training.micro_batch_size samples per
data-parallel rank (no accumulation): global batch b gives DP rank r the samples [b*G + r*m, b*G + (r+1)*m) with
G = m x dp. Every rank runs the same number of forwards, since expert parallelism's all-to-alls, context parallelism's
collectives and FSDP's all-gathers need every rank of their group: where the last global batch leaves a rank fewer
samples its micro batch is shorter, and where it leaves a rank none, the rank runs a zero-weight placeholder (the set's
first sample with every label ignored: no CE, no tokens). Every validation sample thus counts exactly once, in every
layout. training.eval_iters > 0 takes the first that many global batches, the same ones at every eval.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from glm45v_fsdp.config import DataConfig, validation_format
from glm45v_fsdp.data.datasets import build_dataset
from glm45v_fsdp.data.loader import build_dataloader
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.vocab import IGNORE_INDEX

Batch = dict[str, torch.Tensor]


class DataSubset(Dataset):
    """The samples of `base` at `positions` (in that order), with the data-set methods the doors read."""

    def __init__(self, base: Dataset, positions: Sequence[int], role: str) -> None:
        self.base = base
        self.positions = list(positions)
        self.role = role  # "training" or "validation", for the log

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.base[self.positions[index]]

    def describe(self, index: int) -> str:
        return self.base.describe(self.positions[index])

    @property
    def skipped_records(self) -> int:
        return self.base.skipped_records

    def summary(self) -> str:
        return f"{self.role}: {len(self)} of the {len(self.base)} samples of the {self.base.summary()}"


def split_validation(dataset: Dataset, fraction: float, seed: int) -> tuple[DataSubset, DataSubset]:
    """(training, validation): ceil(fraction x size) samples drawn with `seed` are held out for validation, the rest
    train; each part keeps the data set's order. The same seed and data set give the same split in every process."""
    size = len(dataset)
    held_out = math.ceil(fraction * size)
    if held_out >= size:
        raise UserError(
            f"Config key 'data.validation_split' = {fraction} holds out {held_out} of the {size} training samples, "
            f"leaving none to train on. Choose a smaller fraction (at most {(size - 1) / size:.4g} here), or give a "
            f"validation file with data.validation_path."
        )
    order = torch.randperm(size, generator=torch.Generator().manual_seed(seed)).tolist()
    validation = sorted(order[:held_out])
    training = sorted(order[held_out:])
    return DataSubset(dataset, training, "training"), DataSubset(dataset, validation, "validation")


def read_validation_file(
    data_cfg: DataConfig, hf_config: object, tokenizer: object, image_processor: object
) -> Dataset:
    """data.validation_path, read and checked as data.data_path is (same reader, cutoff, image root, split and bad
    record policy; with data.mixture, in its sources' file format). The readers' messages name data.data_path, the
    key they read; here it is data.validation_path."""
    assert data_cfg.validation_path is not None
    validation_cfg = dataclasses.replace(
        data_cfg, dataset=validation_format(data_cfg), data_path=data_cfg.validation_path, mixture=None
    )
    try:
        return build_dataset(validation_cfg, hf_config, tokenizer, image_processor)
    except UserError as error:
        raise type(error)(str(error).replace("data.data_path", "data.validation_path")) from None


def eval_micro_batches(
    size: int, micro_batch_size: int, dp_rank: int, dp_size: int, eval_iters: int = 0
) -> list[list[int]]:
    """This DP rank's eval micro batches (sample indices of the validation set), one per global eval batch; an empty
    list where the last global batch leaves this rank no sample (it runs a placeholder). `eval_iters` > 0: at most
    that many global batches."""
    global_batch = micro_batch_size * dp_size
    batches = math.ceil(size / global_batch)
    if eval_iters:
        batches = min(batches, eval_iters)
    return [
        list(range(start, min(start + micro_batch_size, size)))
        for start in (b * global_batch + dp_rank * micro_batch_size for b in range(batches))
    ]


class EvalBatches:
    """This rank's eval micro batches over `dataset`, collated as the training's (packing, padding, workers)."""

    def __init__(
        self,
        dataset: Dataset,
        indices: list[list[int]],
        pad_token_id: int,
        packing: bool,
        num_workers: int,
    ) -> None:
        self.dataset = dataset
        self.placeholders = [not batch for batch in indices]
        # a placeholder loads the set's first sample; `__iter__` takes its weight away
        self.loader: DataLoader = build_dataloader(
            dataset, [batch or [0] for batch in indices], pad_token_id, packing=packing, num_workers=num_workers
        )

    def __len__(self) -> int:
        return len(self.placeholders)

    def __iter__(self) -> Iterator[Batch]:
        for placeholder, batch in zip(self.placeholders, self.loader, strict=True):
            yield zero_weight(batch) if placeholder else batch


def zero_weight(batch: Batch) -> Batch:
    """`batch` with nothing to count: every label ignored, no samples, tokens or supervised tokens."""
    zeroed = dict(batch)
    zeroed["labels"] = torch.full_like(batch["labels"], IGNORE_INDEX)
    for key in ("num_valid_tokens", "num_samples", "num_tokens"):
        zeroed[key] = torch.zeros_like(batch[key])
    return zeroed
