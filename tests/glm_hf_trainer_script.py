"""An HF Trainer script on transformers' GLM-4.5V written for DeepSpeed (tests/test_glm_door.py runs it under
`ds-fsdp`): `from_pretrained(--hf_dir)` after TrainingArguments, gradient_checkpointing=True, a ds_config with "auto"
values, ZeRO 3, expert_parallel.autoep_size 2 and the extension's dynamic chunk loss and EP balance. The data are our
synthetic image-text samples in order, collated as HF collators do for GLM-4.5V (right-padded input_ids /
attention_mask / labels / mm_token_type_ids, pixel_values and image_grid_thw concatenated, no position_ids: the model
derives the mRoPE positions). transformers' GLM-4.5V declares accepts_loss_kwargs=False, so the Trainer passes no
num_items_in_batch and averages the micro batches' token means (the forward's num_items_in_batch path is checked in
process by tests/test_glm_door.py).

Rank 0 writes --out/result.json (per-step losses, mean over the ranks; the plans applied; whether transformers' own
checkpointing stayed off) and --out/ds_config.json (the resolved ds_config, for the trainer door's run); `--resume`
continues from checkpoint-3 in a fresh launch and writes resumed.json.
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
args = parser.parse_args()

ds_config = make_ds_config(features=not args.features_off)


class RecordingTrainer(StepLosses, Trainer):
    pass


# CPU only: a state made for DeepSpeed over gloo first (accelerate picks no backend without an accelerator).
os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
state = PartialState(backend="gloo")
training = TrainingArguments(
    output_dir=args.out,
    deepspeed=ds_config,
    parallelism_config=parallelism_config(args.sp, state.num_processes),
    **training_arguments(not args.features_off),
)
model = Glm4vMoeForConditionalGeneration.from_pretrained(args.hf_dir, dtype=torch.float32)
data = build_training_data(load_config(None, ["data.shuffle=false"]), model.config)
trainer = RecordingTrainer(model=model, args=training, train_dataset=data.dataset, data_collator=collate)
trainer.train(resume_from_checkpoint=os.path.join(args.out, "checkpoint-3") if args.resume else None)
result = {
    "losses": trainer.losses,
    "grad_norms": [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry],
    "applied_plans": dict(model.applied_plans),
    "transformers_checkpointing": model.is_activation_checkpointing,
    "backend": type(trainer.deepspeed).__module__,
    "loader": type(trainer.callback_handler.train_dataloader).__name__,
}
finish(trainer, args, result)
