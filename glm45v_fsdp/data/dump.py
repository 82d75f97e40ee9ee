"""Write the first micro batches of a rank to disk, as transformers' forward takes them (training.dump_batches).

`<output_dir>/batches/rank{R}_micro{K}.pt` holds a dict of CPU tensors keyed like the keyword arguments of
`Glm4vMoeForConditionalGeneration.forward` (MODEL_KEYS; absent keys stay absent), so

    batch = torch.load(path); loss = Glm4vMoeForConditionalGeneration(config)(**batch, use_cache=False).loss

is the reference for that micro batch (use_cache=False matters for packed rows: with a cache, transformers ignores
their per-sample positions). Compare two runs' dumps with `python -m glm45v_fsdp.tools.compare-batches A B`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from glm45v_fsdp.data.collate import BATCH_METADATA_KEYS

MODEL_KEYS = (
    "input_ids",
    "attention_mask",
    "labels",
    "mm_token_type_ids",
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "position_ids",
)
BATCH_DIR = "batches"


def dump_path(output_dir: Path, rank: int, micro: int) -> Path:
    return Path(output_dir) / BATCH_DIR / f"rank{rank}_micro{micro}.pt"


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The forward keyword arguments of a collated batch, as compact CPU copies; bookkeeping keys are dropped.

    A key that is neither a model input nor bookkeeping is an error: dropping it silently would make the dump
    disagree with what the model saw.
    """
    unknown = sorted(set(batch) - set(MODEL_KEYS) - set(BATCH_METADATA_KEYS))
    if unknown:
        raise KeyError(
            f"batch keys {unknown} are neither model inputs nor bookkeeping; add them to MODEL_KEYS in "
            f"glm45v_fsdp/data/dump.py or to BATCH_METADATA_KEYS in glm45v_fsdp/data/collate.py"
        )
    return {key: batch[key].detach().to("cpu", copy=True) for key in MODEL_KEYS if key in batch}


class BatchDumper:
    """Writes this rank's first `count` micro batches, in the order `dump` is called (training order).

    At the first write it removes this rank's earlier dump files, so a directory never mixes two runs.
    """

    def __init__(self, output_dir: Path, rank: int, count: int) -> None:
        self.output_dir = Path(output_dir)
        self.rank = rank
        self.count = count
        self.written = 0

    def dump(self, batch: dict[str, torch.Tensor]) -> None:
        """Write `batch` (collated, not yet on the device) if fewer than `count` were written; else do nothing."""
        if self.written >= self.count:
            return
        path = dump_path(self.output_dir, self.rank, self.written)
        if self.written == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            for stale in path.parent.glob(f"rank{self.rank}_micro*.pt*"):
                stale.unlink()
        tmp = path.with_name(path.name + ".tmp")
        torch.save(model_inputs(batch), tmp)
        os.replace(tmp, path)
        self.written += 1
