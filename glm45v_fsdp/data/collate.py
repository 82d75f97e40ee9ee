"""Micro-batch collation: right padding, or packing all samples into one row with per-sample positions.

Besides the model inputs, a batch carries BATCH_METADATA_KEYS (token and sample counts, cu_seqlens). Pop them before
calling the model: a `cu_seqlens` keyword would reach the vision tower, which takes it for its own per-image lengths.
Call the model with use_cache=False: with a cache, transformers ignores the packed text positions and the packed
samples attend to each other.
"""

from __future__ import annotations

import torch

from glm45v_fsdp.vocab import IGNORE_INDEX, supervised_token_count

BATCH_METADATA_KEYS = ("num_valid_tokens", "num_samples", "num_tokens", "cu_seqlens", "source_ids", "sample_sources")


def _add_vision(batch: dict[str, torch.Tensor], samples: list[dict]) -> None:
    for pixels, grid in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        having = [s for s in samples if pixels in s]
        if having:
            batch[pixels] = torch.cat([s[pixels] for s in having])
            batch[grid] = torch.cat([s[grid] for s in having])


def _pad(samples: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    batch_size, seq_len = len(samples), max(len(s["input_ids"]) for s in samples)
    input_ids = torch.full((batch_size, seq_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros(batch_size, seq_len, dtype=torch.long)
    labels = torch.full((batch_size, seq_len), IGNORE_INDEX, dtype=torch.long)
    mm_token_type_ids = torch.zeros(batch_size, seq_len, dtype=torch.int32)
    position_ids = torch.zeros(3, batch_size, seq_len, dtype=torch.long)
    for row, sample in enumerate(samples):
        length = len(sample["input_ids"])
        input_ids[row, :length] = sample["input_ids"]
        attention_mask[row, :length] = 1
        labels[row, :length] = sample["labels"]
        mm_token_type_ids[row, :length] = sample["mm_token_type_ids"]
        position_ids[:, row, :length] = sample["position_ids"]
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "mm_token_type_ids": mm_token_type_ids,
        "position_ids": position_ids,
        "num_tokens": attention_mask.sum(),
    }


def _pack(samples: list[dict]) -> dict[str, torch.Tensor]:
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).int()
    labels = torch.cat([s["labels"] for s in samples])
    labels[cu_seqlens[:-1].long()] = IGNORE_INDEX  # no prediction across a sample boundary
    text_positions = torch.cat([torch.arange(n) for n in lengths.tolist()])
    rope_positions = torch.cat([s["position_ids"] for s in samples], dim=1)
    return {
        "input_ids": torch.cat([s["input_ids"] for s in samples])[None],
        "labels": labels[None],
        "mm_token_type_ids": torch.cat([s["mm_token_type_ids"] for s in samples])[None],
        # Row 0 restarts at 0 per sample: transformers derives the block-diagonal causal mask from it.
        "position_ids": torch.cat([text_positions[None], rope_positions])[:, None, :],
        "cu_seqlens": cu_seqlens,
        "num_tokens": lengths.sum(),
    }


def _add_sources(batch: dict[str, torch.Tensor], samples: list[dict], packing: bool) -> None:
    """A mixture's samples (data/mixture.py): each sample's source, and each token's (-1 on padding)."""
    sources = torch.tensor([s["source"] for s in samples])
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    batch["sample_sources"] = sources
    if packing:
        batch["source_ids"] = sources.repeat_interleave(lengths)[None]
    else:
        positions = torch.arange(batch["input_ids"].shape[1])
        batch["source_ids"] = torch.where(positions < lengths[:, None], sources[:, None], -1)


def collate(samples: list[dict], pad_token_id: int, packing: bool = False) -> dict[str, torch.Tensor]:
    """One micro batch from data set samples.

    packing=False: input_ids / attention_mask / labels / mm_token_type_ids [B, S] right-padded (pad id, 0, -100, 0)
    and position_ids [3, B, S] (0 on padding). packing=True: the samples are concatenated into one row [1, T] without
    attention_mask; position_ids [4, 1, T] = (per-sample text positions, t, h, w); the label of every sample's first
    token is -100; cu_seqlens int32 [n + 1]. Both: pixel_values / image_grid_thw and pixel_values_videos /
    video_grid_thw concatenated in sample order (absent without images, videos), num_valid_tokens (supervised labels
    after the one-token shift), num_samples, num_tokens (non-pad). Samples of a mixture (a "source" each) add
    sample_sources [n] and source_ids (each token's source, -1 on padding; shaped like input_ids).
    """
    batch = _pack(samples) if packing else _pad(samples, pad_token_id)
    _add_vision(batch, samples)
    if "source" in samples[0]:
        _add_sources(batch, samples, packing)
    batch["num_valid_tokens"] = supervised_token_count(batch["labels"])
    batch["num_samples"] = torch.tensor(len(samples))
    return batch


def move_batch(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of `batch` on `device`."""
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}
