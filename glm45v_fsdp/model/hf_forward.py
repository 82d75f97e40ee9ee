"""transformers' forward contract on the training model, for scripts that call the model themselves (the DeepSpeed
engine door: the HF Trainer, accelerate, TRL, LLaMA-Factory).

`Glm4vMoeForScripts` keeps the training model's modules, names and loss path (`model_loss_sum_and_logits`: the
sequence layout, the vision tower first, the chunked loss when its plan is on) and takes the keyword batch an HF
collator makes, returning transformers' `MultimodalMoeCausalLMOutputWithPast` (`MoeCausalLMOutputWithPast` before 5.24):
- `loss`: the token mean of the micro batch's cross-entropy, or its sum over `num_items_in_batch` when the HF Trainer
  passes that count (its normalisation over the accumulation and the ranks), as transformers' ForCausalLMLoss;
- `logits`: fp32 logits when the loss is not chunked and the sequence is whole on this rank; None under the chunked
  loss, which never holds them, and under context parallelism, where each rank holds a part of the sequence.

`inputs_embeds` instead of input_ids (ms-swift's GLM-4.5V template: a forward pre-hook embeds input_ids with the
model's own `embed_tokens`, runs its vision tower on the images and scatters their features in) are taken as the
merged embeddings, with the mRoPE `position_ids` [3, B, S] the script computed (get_rope_index): they cannot be
derived from embeddings. The script ran the vision tower itself, on every rank, so it is not run again.

Under context parallelism (the CP plan installs a split `sequence_layout`) every rank of a sequence group gets the
whole micro batch and the forward splits it itself (padding to a multiple of the CP size, the text, the mRoPE
positions, the images by image). The returned loss has the value a single rank computes for the whole micro batch
(the CE sums of the group's parts added up) and the gradient of this rank's part only, so the gradients FSDP2 sums
over the ranks count each token once. Targets already sliced for this rank (`shift_labels` shorter than the sequence:
DeepSpeed's ALST loader adapter, ds_compat/runtime/sequence_parallel/ulysses_sp.py) give DeepSpeed's loss instead:
the token mean over this rank's slice, value and gradient; the inputs are still split here, once.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Glm4vMoeForConditionalGeneration

try:  # transformers >= 5.24; earlier 5.x return GLM-4.5V's loss and logits in the plain MoE output class
    from transformers.modeling_outputs import MultimodalMoeCausalLMOutputWithPast as CausalLMOutput
except ImportError:  # pragma: no cover - exercised by .ci/lowest-transformers
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast as CausalLMOutput

from glm45v_fsdp.errors import UserError
from glm45v_fsdp.model.loss import (
    Glm4vMoeForTraining,
    forward_hidden,
    lm_loss_sum_and_logits,
    model_loss_sum_and_logits,
    with_video_frames,
)
from glm45v_fsdp.model.router_health import observed_routing, router_monitor
from glm45v_fsdp.vocab import shift_labels as shifted

# Keyword arguments transformers' forward takes that change nothing in a training forward without a cache.
_NEUTRAL = {"use_cache", "return_dict", "output_attentions", "output_hidden_states", "cache_position", "rope_deltas"}
# What this forward cannot honour, with the reason (a silent ignore would train on something else).
_REFUSED = {
    "past_key_values": "the training forward runs without a key/value cache",
    "logits_to_keep": "the training forward computes the loss over the whole sequence",
}


class Glm4vMoeForScripts(Glm4vMoeForTraining):
    """GLM-4.5V for scripts written against transformers: same modules and parameter names as
    `Glm4vMoeForConditionalGeneration`, so `state_dict`, `save_pretrained` and `from_pretrained` interchange.

    `applied_plans` ({plan: modules matched}) is set when the plans are applied (builders.adopt_model)."""

    applied_plans: dict[str, int]

    def save_pretrained(self, save_directory, *args: Any, is_main_process: bool = True, **kwargs: Any) -> None:
        """transformers' save_pretrained; config.json names transformers' class (not this one), so the directory
        loads with transformers alone."""
        super().save_pretrained(save_directory, *args, is_main_process=is_main_process, **kwargs)
        if is_main_process:
            self.config.architectures = [Glm4vMoeForConditionalGeneration.__name__]
            self.config.save_pretrained(save_directory)

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=None, every_n_layers=1):
        """transformers' activation_checkpointing_enable() (the HF Trainer calls it at each train()) after the plans
        were applied: the recompute plan already does it, and transformers' own must not run on top of it."""
        if not enable:
            return
        if "recompute" not in self.applied_plans:
            raise UserError(
                "activation_checkpointing_enable() / gradient_checkpointing_enable() was called on GLM-4.5V after "
                "deepspeed.initialize, where the recompute plan is applied once, on the whole model. Call it before "
                "deepspeed.initialize (the HF Trainer does, for gradient_checkpointing=True), or add "
                '"activation_checkpointing": {} to the ds_config.'
            )

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutput:
        _check_kwargs(kwargs)
        if inputs_embeds is not None:
            images = pixel_values is not None or pixel_values_videos is not None
            _check_embedded(input_ids, images, position_ids, labels, shift_labels, self.sequence_layout)
            embedded = {"inputs_embeds": inputs_embeds, "attention_mask": attention_mask, "position_ids": position_ids}
            with observed_routing(self, embedded, self.sequence_layout):
                hidden = self.model(**embedded, use_cache=False).last_hidden_state
            targets = shift_labels if shift_labels is not None else shifted(labels)
            loss_sum, count, logits = lm_loss_sum_and_logits(hidden, self.lm_head, targets)
            return _output(loss_sum, count, logits, num_items_in_batch, self._aux_loss())
        if input_ids is None:
            raise UserError("The GLM-4.5V training forward needs input_ids (the model was called without them).")
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "pixel_values": pixel_values,
            "image_grid_thw": image_grid_thw,
            "pixel_values_videos": pixel_values_videos,
            "video_grid_thw": video_grid_thw,
            "mm_token_type_ids": mm_token_type_ids,
        }
        if labels is None and shift_labels is None:
            layout = self.sequence_layout
            if layout.size > 1:
                raise UserError(
                    "The GLM-4.5V model was called without labels under context parallelism "
                    f"({layout.describe()}): each rank holds a part of the sequence, so this forward returns only a "
                    "loss. Pass labels, or run the forward without sequence_parallel_size."
                )
            batch = with_video_frames(batch)
            with observed_routing(self, batch, layout):
                batch = layout.pad(batch)
                hidden = forward_hidden(self, batch, layout.encode_images(self, batch))
            aux = self._aux_loss()
            return CausalLMOutput(logits=self.lm_head(hidden).float(), aux_loss=aux[0] if aux is not None else None)
        layout = self.sequence_layout
        local_targets = _sliced_targets(shift_labels, input_ids, layout)
        if local_targets is not None:  # DeepSpeed's ALST adapter sliced them: this slice's loss, as DeepSpeed's
            loss_sum, count, _ = model_loss_sum_and_logits(self, batch, local_targets)
            logits = None
        else:
            batch.update(labels=labels, shift_labels=shift_labels)
            loss_sum, count, logits = model_loss_sum_and_logits(self, batch)
            if layout.size > 1:
                loss_sum = _whole_sequence_value(loss_sum, layout)
                logits = None
        return _output(loss_sum, count, logits, num_items_in_batch, self._aux_loss())

    def _aux_loss(self) -> tuple[torch.Tensor, float] | None:
        """features.router.aux_loss_coef: (the auxiliary balance loss of this forward, its coefficient), with the
        whole sequence's value under CP (each rank's part summed over the group) and this rank's part's gradient;
        None when off."""
        monitor = router_monitor(self)
        aux = monitor.take_aux_loss() if monitor is not None else None
        if aux is None:
            return None
        if self.sequence_layout.size > 1:
            aux = _whole_sequence_value(aux, self.sequence_layout)
        return aux, monitor.aux_loss_coef


def _output(
    loss_sum: torch.Tensor,
    count: torch.Tensor,
    logits: torch.Tensor | None,
    num_items_in_batch: torch.Tensor | int | None,
    aux: tuple[torch.Tensor, float] | None = None,
) -> CausalLMOutput:
    """transformers' loss: the CE sum over the supervised tokens, or over `num_items_in_batch` when given; plus, as
    transformers adds its router loss, coefficient x `aux` (returned as `aux_loss`)."""
    divisor = count if num_items_in_batch is None else num_items_in_batch
    if torch.is_tensor(divisor):
        divisor = divisor.to(loss_sum.device)
    if aux is None:
        return CausalLMOutput(loss=loss_sum / divisor, logits=logits)
    aux_loss, coefficient = aux
    return CausalLMOutput(loss=loss_sum / divisor + coefficient * aux_loss, aux_loss=aux_loss, logits=logits)


def _check_embedded(
    input_ids: torch.Tensor | None,
    images: bool,
    position_ids: torch.Tensor | None,
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None,
    layout: Any,
) -> None:
    """What a forward from `inputs_embeds` needs: the embeddings alone (no input_ids, images already merged), the
    mRoPE positions, targets, and the whole sequence on this rank."""
    problem = None
    if input_ids is not None:
        problem = "input_ids and inputs_embeds together (transformers takes exactly one of them); pass one"
    elif images:
        problem = "pixel values beside inputs_embeds: merge the image features into the embeddings, or pass input_ids"
    elif position_ids is None or position_ids.ndim != 3:
        problem = (
            "inputs_embeds without the mRoPE position_ids [3, batch, sequence], which cannot be derived from "
            "embeddings; pass model.model.get_rope_index(...)'s positions, or pass input_ids"
        )
    elif labels is None and shift_labels is None:
        problem = "inputs_embeds without labels: this training forward returns the loss; pass labels"
    elif layout.size > 1:
        problem = (
            f"inputs_embeds under context parallelism ({layout.describe()}), where the forward splits input_ids, the "
            "images and the positions itself; pass input_ids and the images"
        )
    if problem is not None:
        raise UserError(f"The GLM-4.5V model was called with {problem}.")


def _whole_sequence_value(part: torch.Tensor, layout: Any) -> torch.Tensor:
    """This rank's CE sum with the value of the whole sequence's (summed over the sequence group) and the gradient of
    this rank's part alone."""
    whole = layout.reduce(part.detach().clone())
    return part + (whole - part.detach())


def _sliced_targets(shift_labels: torch.Tensor | None, input_ids: torch.Tensor, layout: Any) -> torch.Tensor | None:
    """`shift_labels` when they are already this rank's slice (shorter than the sequence: DeepSpeed's ALST loader
    adapter slices the targets and leaves the inputs whole), else None; a length that is neither is an error."""
    if shift_labels is None or layout.size == 1 or shift_labels.shape[-1] == input_ids.shape[-1]:
        return None
    local = layout.local_length(input_ids.shape[-1])
    if shift_labels.shape[-1] != local:
        raise UserError(
            f"The GLM-4.5V model was called with shift_labels of length {shift_labels.shape[-1]} for input_ids of "
            f"length {input_ids.shape[-1]} under context parallelism ({layout.describe()}): they must be the whole "
            f"sequence's ({input_ids.shape[-1]}) or this rank's slice ({local}, as DeepSpeed's "
            "UlyssesSPDataLoaderAdapter makes them). Pass the whole labels, or the adapter's batches unchanged."
        )
    return shift_labels


def _check_kwargs(kwargs: dict[str, Any]) -> None:
    for key, value in kwargs.items():
        if key in _NEUTRAL or value is None:
            continue
        reason = _REFUSED.get(key, "it is not an input of transformers' Glm4vMoeForConditionalGeneration.forward")
        raise UserError(
            f"The GLM-4.5V model was called with '{key}' ({type(value).__name__}), which this backend's training "
            f"forward does not take: {reason}. Remove it from the batch (the collator or the forward call)."
        )
