"""Special tokens of the tiny GLM-4.5V tokenizer, shared by the tokenizer and the tiny model config.

The real GLM-4.5V tokenizer uses the same token strings at ids around 151329-151364; the tiny one puts them first
so the embedded model can keep a small vocabulary. Also the conventions the data and the model share: the labels'
(IGNORE_INDEX, the one-token shift) and a video's (its temporal patches counted as frame blocks).

On the ground floor (docs/architecture.md, "Floors"): the model and the data pipeline both stand on it, so the model
needs no data pipeline to know its token ids and labels.
"""

import torch
import torch.nn.functional as F

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|video|>",
    "<think>",
    "</think>",
)
SPECIAL_TOKEN_IDS: dict[str, int] = {token: index for index, token in enumerate(SPECIAL_TOKENS)}

PAD_TOKEN_ID = SPECIAL_TOKEN_IDS["<|endoftext|>"]
EOS_TOKEN_ID = SPECIAL_TOKEN_IDS["<|endoftext|>"]
IMAGE_TOKEN_ID = SPECIAL_TOKEN_IDS["<|image|>"]
VIDEO_TOKEN_ID = SPECIAL_TOKEN_IDS["<|video|>"]
IMAGE_START_TOKEN_ID = SPECIAL_TOKEN_IDS["<|begin_of_image|>"]
IMAGE_END_TOKEN_ID = SPECIAL_TOKEN_IDS["<|end_of_image|>"]
VIDEO_START_TOKEN_ID = SPECIAL_TOKEN_IDS["<|begin_of_video|>"]
VIDEO_END_TOKEN_ID = SPECIAL_TOKEN_IDS["<|end_of_video|>"]

# Byte-level tokens follow the special tokens; the tiny model's vocabulary leaves room above them.
BYTE_TOKEN_OFFSET = len(SPECIAL_TOKENS)
TINY_VOCAB_SIZE = 512
IGNORE_INDEX = -100


def shift_labels(labels):
    """Targets aligned to the positions: target[..., t] = labels[..., t + 1]; the last position predicts nothing."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def supervised_token_count(labels):
    """Tokens the loss supervises: labels[..., 1:] that are not IGNORE_INDEX (position t predicts label t + 1)."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()


def frame_grids(video_grid_thw: torch.Tensor) -> torch.Tensor:
    """Each video's (t, h, w) grid as t grids (1, h, w), one per temporal patch (two frames): how the vision tower
    encodes a video (transformers' get_video_features) and how its mRoPE positions count it (get_rope_index), each
    patch a block of its own between the timestamps."""
    grids = torch.repeat_interleave(video_grid_thw, video_grid_thw[:, 0], dim=0)
    grids[:, 0] = 1
    return grids
