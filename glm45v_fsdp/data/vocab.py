"""Special tokens of the tiny GLM-4.5V tokenizer, shared by the tokenizer and the tiny model config.

The real GLM-4.5V tokenizer uses the same token strings at ids around 151329-151364; the tiny one puts them first
so the embedded model can keep a small vocabulary. Also the label conventions (IGNORE_INDEX, the one-token shift).
"""

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
