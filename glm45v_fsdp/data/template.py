"""GLM-4.5V chat template with the training label mask, and the 3-D (t, h, w) rope positions of a sequence.

The rendering follows the model's chat_template.jinja for string contents:

    [gMASK]<sop><|system|>\\n{system}<|user|>\\n{question}<|assistant|>\\n<think></think>\\n{answer}<|user|>...

An assistant content holding "<think>R</think>A" renders "<|assistant|>\\n<think>R</think>\\nA" (R is supervised).
Each "<image>" of a user turn becomes <|begin_of_image|> + n x <|image|> + <|end_of_image|>, and each "<video>"
<|begin_of_video|> + per temporal patch (two frames) [<|begin_of_image|> + n x <|image|> + <|end_of_image|> + its
timestamp in whole seconds as text] + <|end_of_video|>, as transformers 5's Glm4vProcessor expands them.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import torch

from glm45v_fsdp.vocab import IGNORE_INDEX, frame_grids

IMAGE_TAG = "<image>"
VIDEO_TAG = "<video>"
_TAGS = re.compile(f"({IMAGE_TAG}|{VIDEO_TAG})")


@dataclass(frozen=True)
class VideoTokens:
    """What a video's block holds: `tokens_per_patch` <|image|> tokens for each temporal patch, and each patch's
    timestamp (seconds, written as its integer part)."""

    tokens_per_patch: int
    timestamps: list[float]


PREFIX = "[gMASK]<sop>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
END_OF_TEXT = "<|endoftext|>"
EMPTY_THINK = "<think></think>\n"


def _assistant_parts(content: str) -> tuple[str, str]:
    """(unsupervised prompt after the role token, supervised answer) of an assistant turn."""
    if "</think>" in content:
        reasoning, answer = content.split("</think>", 1)
        reasoning = reasoning.split("<think>")[-1].strip()
        return "\n", f"<think>{reasoning}</think>\n{answer.strip()}"
    return "\n" + EMPTY_THINK, content.strip()


def encode_conversation(
    messages: list[dict], tokenizer, image_token_counts: list[int], videos: list[VideoTokens] = ()
) -> tuple[list[int], list[int]]:
    """Token ids and aligned labels of `messages` ([{"role": "system"|"user"|"assistant", "content": str}]); the
    user turns' "<image>" and "<video>" tags take `image_token_counts` and `videos` in order.

    Labels are IGNORE_INDEX except on each assistant turn's answer tokens and on the token ending the turn (the next
    <|user|> role token, or <|endoftext|> appended after the last turn); the loss shifts them by one.
    """

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    def token_id(token: str) -> int:
        return tokenizer.convert_tokens_to_ids(token)

    for tag, items in ((IMAGE_TAG, image_token_counts), (VIDEO_TAG, videos)):
        n_tags = sum(m["content"].count(tag) for m in messages if m["role"] == "user")
        if n_tags != len(items):
            raise ValueError(f"{n_tags} '{tag}' tags in the user turns but {len(items)} {tag[1:-1]}s")
    begin, image, end = token_id("<|begin_of_image|>"), token_id("<|image|>"), token_id("<|end_of_image|>")
    counts, video_items = iter(image_token_counts), iter(videos)

    def video_block(video: VideoTokens) -> list[int]:
        ids = [token_id("<|begin_of_video|>")]
        for timestamp in video.timestamps:
            ids += [begin] + [image] * video.tokens_per_patch + [end] + encode(str(int(timestamp)))
        return ids + [token_id("<|end_of_video|>")]

    input_ids = encode(PREFIX)
    labels = [IGNORE_INDEX] * len(input_ids)
    previous_role = None
    for message in messages:
        role, content = message["role"], message["content"]
        if role not in ROLE_TOKENS:
            raise ValueError(f"unknown role {role!r}; expected one of {sorted(ROLE_TOKENS)}")
        role_id = token_id(ROLE_TOKENS[role])
        input_ids.append(role_id)
        labels.append(role_id if previous_role == "assistant" else IGNORE_INDEX)
        if role == "assistant":
            prompt, answer = _assistant_parts(content)
            prompt_ids, answer_ids = encode(prompt), encode(answer)
            input_ids += prompt_ids + answer_ids
            labels += [IGNORE_INDEX] * len(prompt_ids) + answer_ids
        else:
            pieces = _TAGS.split("\n" + content) if role == "user" else ["\n" + content]
            for piece in pieces:
                if piece == IMAGE_TAG:
                    input_ids += [begin] + [image] * next(counts) + [end]
                elif piece == VIDEO_TAG:
                    input_ids += video_block(next(video_items))
                elif piece:
                    input_ids += encode(piece)
            labels += [IGNORE_INDEX] * (len(input_ids) - len(labels))
        previous_role = role
    if previous_role == "assistant":
        input_ids.append(token_id(END_OF_TEXT))
        labels.append(input_ids[-1])
    return input_ids, labels


def mm_token_types(
    input_ids: torch.Tensor, image_token_id: int, video_start_id: int, video_end_id: int
) -> torch.Tensor:
    """int32 [L]: 1 on an image's <|image|> tokens, 2 on a video's (inside <|begin_of_video|> ... <|end_of_video|>),
    0 elsewhere, as Glm4vProcessor.create_mm_token_type_ids."""
    in_video = torch.cumsum(input_ids == video_start_id, 0) > torch.cumsum(input_ids == video_end_id, 0)
    is_image = input_ids == image_token_id
    return (is_image & ~in_video).int() + 2 * (is_image & in_video).int()


def mrope_position_ids(
    mm_token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    spatial_merge_size: int,
    video_grid_thw: torch.Tensor | None = None,
) -> torch.LongTensor:
    """[3, L] positions of one unpadded sequence, as Glm4vMoeModel.get_rope_index computes them.

    Text tokens advance all three rows by one; an image block (or one temporal patch of a video) gets (t, h, w) grid
    coordinates offset by the current position, after which the position advances by max(h, w) / merge.
    """
    grids = {
        1: iter(image_grid_thw.tolist() if image_grid_thw is not None else []),
        2: iter(frame_grids(video_grid_thw).tolist() if video_grid_thw is not None else []),
    }
    chunks = []
    position = 0
    for modality, group in itertools.groupby(mm_token_type_ids.tolist()):
        length = len(list(group))
        if modality == 0:
            chunks.append(torch.arange(position, position + length).expand(3, -1))
            position += length
            continue
        t, h, w = next(grids[modality])
        h, w = h // spatial_merge_size, w // spatial_merge_size
        assert t * h * w == length, f"vision block of {length} tokens for grid {(t, h, w)}"
        grid = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        chunks.append(torch.stack(grid).reshape(3, -1) + position)
        position += max(h, w)
    return torch.cat(chunks, dim=1).long()
