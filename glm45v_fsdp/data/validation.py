"""The validation set: read from data.validation_path by the training data's own readers, or held out of the
training data by data.validation_split (a fraction, chosen with training.seed)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch.utils.data import Dataset

from glm45v_fsdp.config import DataConfig, validation_format
from glm45v_fsdp.data.datasets import build_dataset
from glm45v_fsdp.errors import UserError


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
