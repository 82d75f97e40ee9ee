"""Forward to the last hidden state and the summed causal-LM loss (normalisation is the trainer's job).

A step enters through the root module (`Glm4vMoeForTraining.forward`), so FSDP2's root hooks run; inside, the loss
calls `model.model.visual` first (always: on a dummy image when a micro batch has none), then `model.model` and
`model.lm_head` (the chunked loss will need the hidden states). The vision tower thus runs outside `model.model`'s
forward, so under FSDP2 it must be a unit of its own (REQUIRED_FSDP_UNITS), which the FSDP plan checks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Glm4vMoeForConditionalGeneration

from glm45v_fsdp.data.vocab import IGNORE_INDEX, shift_labels
from glm45v_fsdp.memory.chunk_loss import ChunkedLossHead
from glm45v_fsdp.parallel.context import ContextParallel, gather_rows, image_owners, pad_to_multiple

# Collated batch keys passed to Glm4vMoeModel.forward when present; bookkeeping keys are ignored.
_MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "pixel_values", "image_grid_thw", "mm_token_type_ids")
REQUIRED_FSDP_UNITS = ("model.visual",)


def forward_hidden(model: nn.Module, batch: dict, image_outputs: object | None = None) -> torch.Tensor:
    """Run `model.model` (vision tower + language model) on a collated batch -> last hidden state [B, S, H].

    position_ids may be [3, B, S] (mRoPE) or [4, B, S] (packed: row 0 holds the per-sequence text positions).
    `image_outputs` are the batch's vision features computed beforehand (see `encode_images`); without them the
    model runs its vision tower itself on `pixel_values`.
    """
    inputs = {key: batch[key] for key in _MODEL_INPUTS if batch.get(key) is not None}
    if image_outputs is not None:
        inputs.pop("pixel_values", None)
        inputs["mm_encoder_outputs"] = {"image": image_outputs}
    return model.model(**inputs, use_cache=False).last_hidden_state


def encode_images(model: nn.Module, batch: dict) -> object:
    """Run the vision tower first, on every rank and for every micro batch, and return its outputs.

    A micro batch without images runs a one-token dummy image and hands on an empty slice of its features, so the
    autograd graph has the same shape on every rank: vision tower -> image features (as an input of `model.model`)
    -> merge into the text embeddings. Skipping the vision tower on a text-only batch, or feeding it in elsewhere,
    would change which FSDP collectives run and in what order (a hang or silent corruption across ranks). The
    vision parameters then get a zero gradient, on every rank and in every layout alike.
    """
    if batch.get("pixel_values") is not None:
        return model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"])
    return _no_image_features(model, batch["input_ids"].device)


def _no_image_features(model: nn.Module, device: torch.device) -> object:
    """The vision tower run on a one-token dummy image, handing on an empty slice of its features."""
    vision = model.model.visual.config
    merge = vision.spatial_merge_size
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.zeros(merge * merge, patch_dim, device=device)
    outputs = model.model.get_image_features(pixels, torch.tensor([[1, merge, merge]], device=device))
    outputs.pooler_output = (outputs.pooler_output[0][:0],)
    return outputs


def encode_images_split(model: nn.Module, batch: dict, cp: ContextParallel) -> object:
    """encode_images under context parallelism: each CP rank encodes a contiguous run of the micro batch's images
    (balanced by patches; a rank without one runs the dummy image), and the features of all images are gathered
    in order, so every rank merges the whole set into its copy of the embeddings."""
    if batch.get("pixel_values") is None:
        return _no_image_features(model, batch["input_ids"].device)
    grid = batch["image_grid_thw"]
    patches = grid.prod(-1).tolist()
    owners = image_owners(patches, cp.size)
    mine = [index for index, owner in enumerate(owners) if owner == cp.rank]
    if mine:
        first, end = mine[0], mine[-1] + 1
        pixels = batch["pixel_values"][sum(patches[:first]) : sum(patches[:end])]
        outputs = model.model.get_image_features(pixels, grid[first:end])
    else:
        outputs = _no_image_features(model, batch["input_ids"].device)
    rows = torch.cat(outputs.pooler_output)
    merged = model.model.visual.spatial_merge_size**2
    counts = [sum(p // merged for p, owner in zip(patches, owners) if owner == rank) for rank in range(cp.size)]
    outputs.pooler_output = (gather_rows(rows, counts, cp),)
    return outputs


def causal_lm_loss_sum(
    hidden: torch.Tensor, lm_head: nn.Linear, labels: torch.Tensor, shifted: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of fp32 token cross-entropy, number of supervised tokens), position t predicting labels[:, t+1].

    Same shift and ignore_index as transformers' ForCausalLMLoss; the last position of each row predicts nothing.
    `shifted=True`: `labels` are already the per-position targets (context parallelism shifts before splitting).
    A ChunkedLossHead (features.chunk_loss) computes the same sum chunk by chunk, through its own forward.
    """
    if isinstance(lm_head, ChunkedLossHead):
        return lm_head(hidden, labels, shifted=shifted)
    logits = lm_head(hidden).float()
    targets = (labels if shifted else shift_labels(labels)).to(logits.device)
    loss_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss_sum, (targets != IGNORE_INDEX).sum()


def model_loss_sum(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """encode_images + forward_hidden + causal_lm_loss_sum with the model's lm_head.

    Under context parallelism (`model.context_parallel`, set by the CP plan) the batch is padded to a multiple of the
    CP size, the hidden state and the shifted labels are this rank's slice, and the returned token count is the
    whole micro batch's, so every CP rank normalises its partial CE sum by the same (unsplit) count.
    """
    cp = getattr(model, "context_parallel", None)
    if cp is None:
        hidden = forward_hidden(model, batch, encode_images(model, batch))
        return causal_lm_loss_sum(hidden, model.lm_head, batch["labels"])
    batch = pad_to_multiple(batch, cp.size, model.config.text_config.pad_token_id or 0)
    hidden = forward_hidden(model, batch, encode_images_split(model, batch, cp))
    targets = shift_labels(batch["labels"])
    loss_sum, _ = causal_lm_loss_sum(hidden, model.lm_head, cp.local(targets, dim=1), shifted=True)
    return loss_sum, (targets != IGNORE_INDEX).sum()


class Glm4vMoeForTraining(Glm4vMoeForConditionalGeneration):
    """transformers' GLM-4.5V with a training forward: collated batch -> (CE sum, supervised tokens).

    Same modules and parameter names as the parent, so checkpoints and state dicts are interchangeable; only
    `forward` differs. Calling the root module keeps FSDP2's root logic (lazy init, root hooks) on the normal path.
    """

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return model_loss_sum(self, batch)
