"""One sample's tensors from a conversation with its images and videos: `ImageTextDataset`, the base of every data
set (synthetic and JSON in datasets.py, the checked records' `RecordDataset` in records.py, Hugging Face rows in
hf_datasets.py).

`__getitem__(i)` loads, tokenises and lays out ONE sample lazily (so data workers do it) and returns tensors:
input_ids [L], labels [L], mm_token_type_ids [L] (int32, 1 on an image's <|image|>, 2 on a video's),
position_ids [3, L] (3-D rope positions), pixel_values [patches, D] and image_grid_thw [n_images, 3] (absent without
images), pixel_values_videos [patches, D] and video_grid_thw [n_videos, 3] (absent without videos), num_valid_tokens
(0-d: labels[1:] that are supervised).

Truncation to data.cutoff_len never cuts an image or a video block: when the cut falls inside a block
(<|begin_of_image|> to <|end_of_image|>, <|begin_of_video|> to <|end_of_video|>), the sample ends just before the
block, and that image or video and every later one are dropped. A sample left without any supervised token is a
UserError.
"""

from __future__ import annotations

import itertools

import torch
from PIL import Image
from torch.utils.data import Dataset

from glm45v_fsdp.data.processor import image_token_counts, process_images, video_processor_for
from glm45v_fsdp.data.template import VideoTokens, encode_conversation, mm_token_types, mrope_position_ids
from glm45v_fsdp.data.video import SampledVideo
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.vocab import supervised_token_count


class ImageTextDataset(Dataset):
    """Shared encoding of one (messages, images, videos) sample; subclasses provide `__len__`, `conversation`,
    `describe`."""

    skipped_records = 0  # bad records left out of the data set (data.on_bad_record=skip)

    def __init__(self, tokenizer, image_processor, cutoff_len: int, spatial_merge_size: int):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.video_processor = video_processor_for(image_processor)
        self.cutoff_len = cutoff_len
        self.spatial_merge_size = spatial_merge_size
        self.token_ids = {
            name: tokenizer.convert_tokens_to_ids(name)
            for name in ("<|image|>", "<|begin_of_video|>", "<|end_of_video|>")
        }

    def conversation(self, index: int) -> tuple[list[dict], list[Image.Image], list[SampledVideo]]:
        raise NotImplementedError

    def describe(self, index: int) -> str:
        raise NotImplementedError

    def summary(self) -> str:
        """What data this is, for the start-up log: kind, source, number of records."""
        raise NotImplementedError

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.encode(index, *self.conversation(index))

    def encode(
        self, index: int, messages: list[dict], images: list[Image.Image], videos: list[SampledVideo]
    ) -> dict[str, torch.Tensor]:
        """The sample of `conversation(index)`'s result (`index` only names it in messages)."""
        pixel_values, grid, counts = None, None, []
        if images:
            try:
                pixel_values, grid = process_images(self.image_processor, images)
            except ValueError as error:
                raise UserError(
                    f"{self.describe(index)}: an image cannot be processed: {error}. Resize or replace it."
                ) from None
            counts = image_token_counts(grid, self.spatial_merge_size)
        video_pixels, video_grids, video_tokens = self._videos(index, videos)
        input_ids, labels = encode_conversation(messages, self.tokenizer, counts, video_tokens)
        input_ids, labels = torch.tensor(input_ids), torch.tensor(labels)
        ids = self.token_ids
        mm_token_type_ids = mm_token_types(
            input_ids, ids["<|image|>"], ids["<|begin_of_video|>"], ids["<|end_of_video|>"]
        )
        expected = sum(counts) + sum(v.tokens_per_patch * len(v.timestamps) for v in video_tokens)
        assert int((mm_token_type_ids > 0).sum()) == expected, "text holds reserved image tokens"
        length, kept_images, kept_videos = _cut_point(input_ids, mm_token_type_ids, self.cutoff_len, ids)
        num_valid = int(supervised_token_count(labels[:length]))
        if num_valid == 0:
            raise UserError(
                f"{self.describe(index)} has no supervised token left after truncation to data.cutoff_len="
                f"{self.cutoff_len} (it is {len(input_ids)} tokens long, image and video tokens included; an image "
                f"or video block is never cut). Raise data.cutoff_len, or shorten or drop this sample."
            )
        sample = {
            "input_ids": input_ids[:length],
            "labels": labels[:length],
            "mm_token_type_ids": mm_token_type_ids[:length],
            "num_valid_tokens": torch.tensor(num_valid),
        }
        if kept_images:
            grid = grid[:kept_images]
            sample["pixel_values"] = pixel_values[: int(grid.prod(-1).sum())]
            sample["image_grid_thw"] = grid
        if kept_videos:
            sample["pixel_values_videos"] = torch.cat(video_pixels[:kept_videos])
            sample["video_grid_thw"] = torch.cat(video_grids[:kept_videos])
        sample["position_ids"] = mrope_position_ids(
            sample["mm_token_type_ids"],
            sample.get("image_grid_thw"),
            self.spatial_merge_size,
            sample.get("video_grid_thw"),
        )
        return sample

    def _videos(
        self, index: int, videos: list[SampledVideo]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[VideoTokens]]:
        """Each video's patches, (t, h, w) grid and block contents (tokens per temporal patch, each patch's timestamp:
        its first frame's, as Glm4vProcessor takes every other frame's)."""
        pixels, grids, tokens = [], [], []
        for number, video in enumerate(videos):
            try:
                patches, grid = self.video_processor(video.frames)
            except ValueError as error:
                raise UserError(
                    f"{self.describe(index)}: video {number} cannot be processed: {error}. Resize or replace it."
                ) from None
            t, h, w = grid[0].tolist()
            pixels.append(patches)
            grids.append(grid)
            tokens.append(VideoTokens(h * w // self.spatial_merge_size**2, video.timestamps[::2][:t]))
        return pixels, grids, tokens


def _cut_point(
    input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor, cutoff_len: int, token_ids: dict[str, int]
) -> tuple[int, int, int]:
    """(length to keep, images kept, videos kept): at most cutoff_len tokens, never inside an image or video block
    (a block that does not end before the cut goes, with every later one)."""
    length = min(len(input_ids), cutoff_len)
    starts = (input_ids == token_ids["<|begin_of_video|>"]).nonzero().flatten().tolist()
    ends = (input_ids == token_ids["<|end_of_video|>"]).nonzero().flatten().tolist()
    blocks = [(start, end, "video") for start, end in zip(starts, ends)]
    position = 0
    for modality, group in itertools.groupby(mm_token_type_ids.tolist()):
        size = len(list(group))
        if modality == 1:  # <|begin_of_image|> just before the run, <|end_of_image|> just after
            blocks.append((position - 1, position + size, "image"))
        position += size
    kept = {"image": 0, "video": 0}
    for first, last, kind in sorted(blocks):
        if last >= length:
            return min(length, first), kept["image"], kept["video"]
        kept[kind] += 1
    return length, kept["image"], kept["video"]
