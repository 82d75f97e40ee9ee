"""An HF Trainer script on transformers' GLM-4.5V written for DeepSpeed (run by tests/test_glm_door.py):
`from_pretrained(--hf_dir)` after TrainingArguments, gradient_checkpointing=True, a ds_config with "auto"
values, ZeRO 3, expert_parallel.autoep_size 2 and the extension's dynamic chunk loss and EP balance. The data are our
synthetic image-text samples in order, collated as HF collators do for GLM-4.5V (right-padded input_ids /
attention_mask / labels / mm_token_type_ids, pixel_values and image_grid_thw concatenated, no position_ids: the model
derives the mRoPE positions). transformers' GLM-4.5V declares accepts_loss_kwargs=False, so the Trainer passes no
num_items_in_batch and averages the micro batches' token means (the forward's num_items_in_batch path is checked in
process by tests/test_glm_door.py).

Rank 0 writes --out/result.json (per-step losses, mean over the ranks; the plans applied; whether transformers' own
checkpointing stayed off) and --out/ds_config.json (the resolved ds_config, for the trainer door's run); `--resume`
continues from checkpoint-3 in a fresh launch and writes resumed.json.

`--eval_split F` holds out the fraction F of the samples with our builders (data.validation_split, as the trainer door
does) and evaluates on them every 2 steps (eval_strategy="steps"; result.json's evals: [step, eval_loss]). The
Trainer's eval_loss is the mean over the samples of each batch's loss; with one sample per batch and each sample's CE
sum divided by the mean supervised tokens per sample (the forward's num_items_in_batch), that mean is the
token-weighted one the trainer door reports: sum of CE / supervised tokens of the set.
"""

import argparse
import os

import torch
from accelerate import PartialState
from glm_door_hf_common import (
    StepLosses,
    add_arguments,
    collate,
    finish,
    make_ds_config,
    parallelism_config,
    training_arguments,
)
from transformers import Glm4vMoeForConditionalGeneration, Trainer, TrainingArguments

from glm45v_fsdp.builders import build_training_data
from glm45v_fsdp.config import load_config

parser = argparse.ArgumentParser()
add_arguments(parser)
parser.add_argument(
    "--eval_split", type=float, default=0.0, help="hold out this fraction, evaluate on it every 2 steps"
)
args = parser.parse_args()

ds_config = make_ds_config(features=not args.features_off)


class RecordingTrainer(StepLosses, Trainer):
    eval_divisor: float | None = None  # mean supervised tokens per validation sample (see the module docstring)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training or self.eval_divisor is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        outputs = model(**inputs, num_items_in_batch=self.eval_divisor)
        return (outputs.loss, outputs) if return_outputs else outputs.loss


# CPU only: a state made for DeepSpeed over gloo first (accelerate picks no backend without an accelerator).
os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
state = PartialState(backend="gloo")
training = TrainingArguments(
    output_dir=args.out,
    deepspeed=ds_config,
    parallelism_config=parallelism_config(args.sp, state.num_processes),
    per_device_eval_batch_size=1,
    eval_strategy="steps" if args.eval_split and not args.resume else "no",
    eval_steps=2,
    **training_arguments(not args.features_off),
)
model = Glm4vMoeForConditionalGeneration.from_pretrained(args.hf_dir, dtype=torch.float32)
split = [f"data.validation_split={args.eval_split}"] if args.eval_split else []
data = build_training_data(load_config(None, ["data.shuffle=false", *split]), model.config)
trainer = RecordingTrainer(
    model=model, args=training, train_dataset=data.dataset, eval_dataset=data.validation, data_collator=collate
)
if data.validation is not None:
    tokens = [int(data.validation[index]["num_valid_tokens"]) for index in range(len(data.validation))]
    trainer.eval_divisor = sum(tokens) / len(tokens)
trainer.train(resume_from_checkpoint=os.path.join(args.out, "checkpoint-3") if args.resume else None)
result = {
    "losses": trainer.losses,
    "grad_norms": [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry],
    "applied_plans": dict(model.applied_plans),
    "transformers_checkpointing": model.is_activation_checkpointing,
    "backend": type(trainer.deepspeed).__module__,
    "loader": type(trainer.callback_handler.train_dataloader).__name__,
}
if data.validation is not None:
    result["evals"] = [
        [entry["step"], entry["eval_loss"]] for entry in trainer.state.log_history if "eval_loss" in entry
    ]
    result["eval_samples"] = data.validation.positions  # indices of the synthetic set
finish(trainer, args, result)
