"""Forward to the last hidden state and the summed causal-LM loss (normalisation is the trainer's job).

A step enters through the root module (`Glm4vMoeForTraining.forward`), so FSDP2's root hooks run; inside, the loss
calls `model.model.visual` first (always: on a dummy image when a micro batch has none), then `model.model` and
`model.lm_head`. The vision tower thus runs outside `model.model`'s forward, so under FSDP2 it must be a unit of its
own (REQUIRED_FSDP_UNITS), which the FSDP plan checks, unless no unit but the root encloses it (size-based units:
the root gathers it at the step's entry).

Two seams let plans change the step without this module knowing them: the model's `sequence_layout` (how a sequence
lies over the context-parallel ranks; `WholeSequence` here, a split one from the CP plan) and an lm_head that
`computes_loss` itself (the chunked loss).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Glm4vMoeForConditionalGeneration

from glm45v_fsdp.errors import UserError
from glm45v_fsdp.model.router_health import observed_routing
from glm45v_fsdp.vocab import IGNORE_INDEX, frame_grids, shift_labels

# Collated batch keys passed to Glm4vMoeModel.forward when present; bookkeeping keys are ignored.
_MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "pixel_values", "image_grid_thw", "mm_token_type_ids")
REQUIRED_FSDP_UNITS = ("model.visual",)


def with_video_frames(batch: dict) -> dict:
    """The batch with its videos' temporal patches as images: pixel_values / image_grid_thw hold every image and
    every temporal patch (grid (1, h, w)) in sequence order, mm_token_type_ids is 1 on all their tokens, and the
    video keys are gone. The vision tower encodes each image and each patch on its own (transformers'
    get_video_features does the same per patch), and the model scatters the features over the <|image|> tokens in
    order, which mixes images and videos in one sample correctly (transformers' own forward scatters the images over
    the video tokens too). The mRoPE positions are unchanged: a patch counts as an image of grid (1, h, w)."""
    if batch.get("pixel_values_videos") is None:
        return batch
    if batch.get("mm_token_type_ids") is None or batch.get("video_grid_thw") is None:
        raise UserError(
            "The GLM-4.5V model was given pixel_values_videos without video_grid_thw and mm_token_type_ids (2 on a "
            "video's tokens), which place each frame's features in the sequence. Pass all three, as "
            "transformers' Glm4vProcessor returns them."
        )
    kinds = {
        1: _items(batch.get("pixel_values"), batch.get("image_grid_thw")),
        2: _items(batch["pixel_values_videos"], frame_grids(batch["video_grid_thw"])),
    }
    ordered = []
    for row in batch["mm_token_type_ids"].tolist():
        ordered += [next(kinds[kind]) for kind, _ in itertools.groupby(row) if kind]
    assert all(next(items, None) is None for items in kinds.values()), "vision items without their tokens"
    merged = {key: value for key, value in batch.items() if key not in ("pixel_values_videos", "video_grid_thw")}
    merged["pixel_values"] = torch.cat([pixels for pixels, _ in ordered])
    merged["image_grid_thw"] = torch.stack([grid for _, grid in ordered])
    merged["mm_token_type_ids"] = (batch["mm_token_type_ids"] > 0).to(batch["mm_token_type_ids"].dtype)
    return merged


def _items(pixels: torch.Tensor | None, grids: torch.Tensor | None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(patch rows, grid) of each item of a flat pixel tensor."""
    if pixels is None:
        return iter(())
    return zip(torch.split(pixels, grids.prod(-1).tolist()), grids)


def forward_hidden(model: nn.Module, batch: dict, image_outputs: object | None = None) -> torch.Tensor:
    """Run `model.model` (vision tower + language model) on a collated batch -> last hidden state [B, S, H].

    position_ids may be [3, B, S] (mRoPE) or [4, B, S] (packed: row 0 holds the per-sequence text positions), or
    absent: the model then derives the mRoPE positions from input_ids, image_grid_thw and mm_token_type_ids.
    `image_outputs` are the batch's vision features computed beforehand (see `encode_images`); without them the
    model runs its vision tower itself on `pixel_values`.
    """
    inputs = {key: batch[key] for key in _MODEL_INPUTS if batch.get(key) is not None}
    if "position_ids" in inputs and inputs["position_ids"].shape[0] == 4 and batch.get("cu_seqlens") is not None:
        # a packed row: the sample boundaries for a varlen attention kernel (ops/apply.py), device and host copies
        inputs["ops_cu_seqlens"] = batch["cu_seqlens"]
        inputs["ops_seqlens"] = batch["cu_seqlens"].tolist()
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
    return no_image_features(model, batch["input_ids"].device)


def no_image_features(model: nn.Module, device: torch.device) -> object:
    """The vision tower run on a one-token dummy image, handing on an empty slice of its features."""
    vision = model.model.visual.config
    merge = vision.spatial_merge_size
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.zeros(merge * merge, patch_dim, device=device)
    outputs = model.model.get_image_features(pixels, torch.tensor([[1, merge, merge]], device=device))
    outputs.pooler_output = (outputs.pooler_output[0][:0],)
    return outputs


class WholeSequence:
    """The sequence layout without context parallelism: each rank holds whole sequences, so padding, splitting,
    un-splitting and summing over the ranks of a sequence are all the identity. parallel/sequence.py holds the split
    layout the CP plan installs instead (same methods)."""

    size = 1

    def pad(self, batch: dict) -> dict:
        return batch

    def shard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return tensor

    def local_length(self, length: int) -> int:
        """How many positions of a `length`-long sequence this rank holds (after the padding)."""
        return length

    def unshard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return tensor

    def reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a figure each rank of the sequence computed on its slice (in place); here: the figure itself."""
        return tensor

    def encode_images(self, model: nn.Module, batch: dict) -> object:
        return encode_images(model, batch)

    def describe(self) -> str:
        return "whole sequences on every rank"


def lm_loss_sum(hidden: torch.Tensor, lm_head: nn.Module, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of fp32 token cross-entropy, number of supervised tokens) of `hidden` against per-position `targets`
    (already shifted: position t predicts targets[t]; IGNORE_INDEX is unsupervised). An lm_head that
    `computes_loss` (the chunked loss) computes the same sum itself, inside its own forward."""
    loss_sum, count, _ = lm_loss_sum_and_logits(hidden, lm_head, targets)
    return loss_sum, count


def lm_loss_sum_and_logits(
    hidden: torch.Tensor, lm_head: nn.Module, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """lm_loss_sum and the fp32 logits it computed on the way; None for the logits of an lm_head that `computes_loss`
    (the chunked loss never holds the whole sequence's logits)."""
    if getattr(lm_head, "computes_loss", False):
        return (*lm_head(hidden, targets), None)
    logits = lm_head(hidden).float()
    targets = targets.to(logits.device)
    loss_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss_sum, (targets != IGNORE_INDEX).sum(), logits


def causal_lm_loss_sum(
    hidden: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """lm_loss_sum with labels aligned to the input ids: position t predicts labels[:, t+1], as transformers'
    ForCausalLMLoss (same shift and ignore_index; the last position of each row predicts nothing)."""
    return lm_loss_sum(hidden, lm_head, shift_labels(labels))


def model_loss_sum(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The training forward: (CE sum of this rank's part of the micro batch, supervised tokens of the whole micro
    batch). The labels are shifted on the whole (padded) sequence before the layout takes this rank's part, and the
    count is the unsplit one, so every rank of a split sequence normalises its partial sum by the same number."""
    loss_sum, count, _ = model_loss_sum_and_logits(model, batch)
    return loss_sum, count


def model_loss_sum_and_logits(
    model: nn.Module, batch: dict, local_targets: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """model_loss_sum and this rank's fp32 logits (None under the chunked loss). `batch["shift_labels"]`, when
    given, are the targets already shifted (as transformers accepts them); else `labels` are shifted here.
    `local_targets`: this rank's slice of the shifted targets, given already sliced (DeepSpeed's ALST loader adapter);
    the count is then this slice's supervised tokens."""
    layout = model.sequence_layout
    batch = with_video_frames(batch)
    with observed_routing(model, batch, layout):
        batch = layout.pad(batch)
        hidden = forward_hidden(model, batch, layout.encode_images(model, batch))
    if local_targets is None:
        targets = batch["shift_labels"] if batch.get("shift_labels") is not None else shift_labels(batch["labels"])
        local_targets = layout.shard(targets, dim=1)
    else:
        targets = local_targets
    loss_sum, _, logits = lm_loss_sum_and_logits(hidden, model.lm_head, local_targets)
    if getattr(model, "keeps_token_losses", False):
        model.token_losses = token_losses(model.lm_head, logits, local_targets)
    return loss_sum, (targets != IGNORE_INDEX).sum(), logits


TOKEN_LOSS_ROWS = 4096  # positions per log-sum-exp pass of `token_losses`: bounds its [rows, vocab] fp32 temporary


def keep_token_losses(model: nn.Module) -> None:
    """From now on the training forward also leaves the cross-entropy of each of this rank's positions in
    `model.token_losses` (fp32, detached, 0 where unsupervised, shaped like this rank's shifted targets), for figures
    that split the loss (per-source losses of a mixture). The loss itself is computed exactly as before."""
    model.keeps_token_losses = True
    if getattr(model.lm_head, "computes_loss", False):
        model.lm_head.keep_row_losses = True


@torch.no_grad()
def token_losses(lm_head: nn.Module, logits: torch.Tensor | None, targets: torch.Tensor) -> torch.Tensor:
    """Each position's CE against `targets` (0 where IGNORE_INDEX): from the chunked loss's own row losses, or from
    the fp32 logits (log-sum-exp minus the target's logit, TOKEN_LOSS_ROWS positions at a time)."""
    supervised = targets != IGNORE_INDEX
    if logits is None:
        losses = torch.zeros(targets.shape, dtype=torch.float32, device=targets.device)
        losses[supervised] = lm_head.last_row_losses
        return losses
    flat = logits.detach().reshape(-1, logits.shape[-1])
    wanted = targets.to(flat.device).reshape(-1).clamp(min=0)
    losses = torch.empty(wanted.shape[0], dtype=torch.float32, device=flat.device)
    for start in range(0, wanted.shape[0], TOKEN_LOSS_ROWS):
        rows = flat[start : start + TOKEN_LOSS_ROWS]
        target_logits = rows.gather(1, wanted[start : start + TOKEN_LOSS_ROWS, None]).squeeze(1)
        losses[start : start + TOKEN_LOSS_ROWS] = torch.logsumexp(rows, dim=-1) - target_logits
    return losses.view(targets.shape).masked_fill_(~supervised.to(flat.device), 0.0)


class Glm4vMoeForTraining(Glm4vMoeForConditionalGeneration):
    """transformers' GLM-4.5V with a training forward: collated batch -> (CE sum, supervised tokens).

    Same modules and parameter names as the parent, so checkpoints and state dicts are interchangeable; only
    `forward` differs. Calling the root module keeps FSDP2's root logic (lazy init, root hooks) on the normal path.
    """

    sequence_layout: WholeSequence = WholeSequence()
    keeps_token_losses = False  # keep_token_losses() turns it on; the forward then sets token_losses
    token_losses: torch.Tensor | None = None

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        """As the parent: transformers decides it from the source of the class's own module (its experts'
        decorator) and caches the answer on the class it first asked, so without this the answer for our subclass
        (False: this module has no such decorator) depended on whether the parent had been asked before."""
        return Glm4vMoeForConditionalGeneration._can_set_experts_implementation()

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return model_loss_sum(self, batch)
