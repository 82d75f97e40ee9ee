"""GLM-4.5V chat template with the training label mask, and the 3-D (t, h, w) rope positions of a sequence.

The rendering follows the model's chat_template.jinja for string contents:

    [gMASK]<sop><|system|>\\n{system}<|user|>\\n{question}<|assistant|>\\n<think></think>\\n{answer}<|user|>...

An assistant content holding "<think>R</think>A" renders "<|assistant|>\\n<think>R</think>\\nA" (R is supervised).
Each "<image>" of a user turn becomes <|begin_of_image|> + n x <|image|> + <|end_of_image|>, as Glm4vProcessor
expands it.
"""

from __future__ import annotations

import itertools

import torch

from glm45v_fsdp.data.vocab import IGNORE_INDEX

IMAGE_TAG = "<image>"
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


def encode_conversation(messages: list[dict], tokenizer, image_token_counts: list[int]) -> tuple[list[int], list[int]]:
    """Token ids and aligned labels of `messages` ([{"role": "system"|"user"|"assistant", "content": str}]).

    Labels are IGNORE_INDEX except on each assistant turn's answer tokens and on the token ending the turn (the next
    <|user|> role token, or <|endoftext|> appended after the last turn); the loss shifts them by one.
    """

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    def token_id(token: str) -> int:
        return tokenizer.convert_tokens_to_ids(token)

    n_tags = sum(m["content"].count(IMAGE_TAG) for m in messages if m["role"] == "user")
    if n_tags != len(image_token_counts):
        raise ValueError(f"{n_tags} '{IMAGE_TAG}' tags in the user turns but {len(image_token_counts)} images")
    begin, image, end = token_id("<|begin_of_image|>"), token_id("<|image|>"), token_id("<|end_of_image|>")
    counts = iter(image_token_counts)
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
            pieces = ("\n" + content).split(IMAGE_TAG) if role == "user" else ["\n" + content]
            for i, piece in enumerate(pieces):
                if i > 0:
                    input_ids += [begin] + [image] * next(counts) + [end]
                input_ids += encode(piece)
            labels += [IGNORE_INDEX] * (len(input_ids) - len(labels))
        previous_role = role
    if previous_role == "assistant":
        input_ids.append(token_id(END_OF_TEXT))
        labels.append(input_ids[-1])
    return input_ids, labels


def mrope_position_ids(
    mm_token_type_ids: torch.Tensor, image_grid_thw: torch.Tensor | None, spatial_merge_size: int
) -> torch.LongTensor:
    """[3, L] positions of one unpadded sequence, as Glm4vMoeModel.get_rope_index computes them.

    Text tokens advance all three rows by one; an image block gets (t, h, w) grid coordinates offset by the current
    position, after which the position advances by max(h, w) / merge.
    """
    grids = iter(image_grid_thw.tolist() if image_grid_thw is not None else [])
    chunks = []
    position = 0
    for modality, group in itertools.groupby(mm_token_type_ids.tolist()):
        length = len(list(group))
        if modality == 0:
            chunks.append(torch.arange(position, position + length).expand(3, -1))
            position += length
            continue
        t, h, w = next(grids)
        h, w = h // spatial_merge_size, w // spatial_merge_size
        assert t * h * w == length, f"image block of {length} tokens for grid {(t, h, w)}"
        grid = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        chunks.append(torch.stack(grid).reshape(3, -1) + position)
        position += max(h, w)
    return torch.cat(chunks, dim=1).long()
