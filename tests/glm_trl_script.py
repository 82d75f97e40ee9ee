"""A TRL SFTTrainer script on transformers' GLM-4.5V written for DeepSpeed (run by tests/test_glm_door_trl.py):
`from_pretrained(--hf_dir)`, SFTConfig(deepspeed=ds_config, gradient_checkpointing=True) with an "auto"
ds_config, ZeRO 3, expert_parallel.autoep_size 2 and the extension's dynamic chunk loss and EP balance.

The data are our synthetic image-text samples in order, already tokenized, so TRL's dataset preparation is skipped
(`dataset_kwargs={"skip_prepare_dataset": True}`) and a collator makes the batches as HF collators do for GLM-4.5V
(right-padded input_ids / attention_mask / labels / mm_token_type_ids, pixel_values and image_grid_thw concatenated,
no position_ids). The training loop and the loss are TRL's own: SFTTrainer.compute_loss calls the model with
`fused_lm_head=True`, the forward TRL's `add_fused_lm_head` put on the model, which runs the backbone (`model.model`)
and scores the supervised positions through `lm_head.weight` in chunks (at ZeRO-3 behind `maybe_gather_lm_head_ctx`,
which reads `param.ds_status`); the model's own forward and loss do not run in training.

Rank 0 writes --out/result.json (per-step losses as the Trainer computes them, mean over the ranks; what TRL decided
about the loss normalisation; the plans applied) and --out/ds_config.json (the resolved ds_config, for the trainer
door's run); `--resume` continues from checkpoint-3 in a fresh launch and writes resumed.json. `--auto_buckets`: the
ZeRO-3 bucket sizes "auto", as HF's and TRL's ZeRO-3 templates have them (the Trainer fills them from the hidden size;
here units so small that every planned module, lm_head included, is an FSDP2 unit of its own).
SFTConfig(router_aux_loss_coef=0.0): TRL's default takes the coefficient from GLM-4.5V's text config (1e-4) and adds a
load-balancing loss in its fused forward, which reads `text_config.num_experts`, a key Glm4vMoeTextConfig does not
have (it has n_routed_experts): AttributeError at the first step with or without DeepSpeed (TRL 1.16).
"""

import argparse
import os

import torch
import trl.trainer.utils as trl_utils
from accelerate import PartialState
from datasets import Dataset
from glm_door_hf_common import (
    StepLosses,
    add_arguments,
    collate,
    finish,
    make_ds_config,
    parallelism_config,
    training_arguments,
)
from torch.distributed.fsdp import FSDPModule
from transformers import Glm4vMoeForConditionalGeneration
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from trl import SFTConfig, SFTTrainer

from glm45v_fsdp.builders import build_training_data
from glm45v_fsdp.config import load_config

parser = argparse.ArgumentParser()
add_arguments(parser)
parser.add_argument("--auto_buckets", action="store_true")
args = parser.parse_args()
KEYS = (
    "input_ids",
    "labels",
    "mm_token_type_ids",
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
)
SAMPLES = 32  # 6 steps of 2 ranks x 2 micro batches of 1 use the first 24

ds_config = make_ds_config(features=not args.features_off)
if args.auto_buckets:  # as HF's and TRL's ZeRO-3 templates: the Trainer fills them from the model's hidden size
    for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
        ds_config["zero_optimization"][key] = "auto"


gathers: list[list] = []  # per call of TRL's maybe_gather_lm_head_ctx: [ZeRO-3 on, the ds_status of each tensor]
gather_lm_head = trl_utils.maybe_gather_lm_head_ctx


def recording_gather(*params):
    """TRL's maybe_gather_lm_head_ctx (the fused forward looks it up in trl.trainer.utils at each call), recorded."""
    gathers.append([is_deepspeed_zero3_enabled(), [p.ds_status.name for p in params if p is not None]])
    return gather_lm_head(*params)


trl_utils.maybe_gather_lm_head_ctx = recording_gather


class RecordingSFTTrainer(StepLosses, SFTTrainer):
    """SFTTrainer unchanged, recording the loss of each step and what reached compute_loss."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_items: list[float | None] = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.num_items.append(None if num_items_in_batch is None else float(num_items_in_batch))
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


# CPU only: a state made for DeepSpeed over gloo first (accelerate picks no backend without an accelerator).
os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
state = PartialState(backend="gloo")
training = SFTConfig(
    output_dir=args.out,
    deepspeed=ds_config,
    parallelism_config=parallelism_config(args.sp, state.num_processes),
    **training_arguments(not args.features_off),
    bf16=False,
    dataset_kwargs={"skip_prepare_dataset": True},
    remove_unused_columns=False,  # TRL's signature columns for a text dataset would drop the image columns
    router_aux_loss_coef=0.0,  # see the module docstring: TRL's aux loss fails on GLM-4.5V's config
)
model = Glm4vMoeForConditionalGeneration.from_pretrained(args.hf_dir, dtype=torch.float32)
# image samples only: SFTTrainer refuses a GLM-4.5V video sample (tests/test_glm_door_trl.py TRL_DATA)
data = build_training_data(load_config(None, ["data.shuffle=false", "data.synthetic_video_every=0"]), model.config)
# SFTTrainer takes a `datasets` Dataset only: the first SAMPLES of ours, tensors kept (the torch format)
samples = [{k: v.numpy() for k, v in data.dataset[index].items() if k in KEYS} for index in range(SAMPLES)]
dataset = Dataset.from_list(samples).with_format("torch")
trainer = RecordingSFTTrainer(
    model=model, args=training, train_dataset=dataset, data_collator=collate, processing_class=data.tokenizer
)
trainer.train(resume_from_checkpoint=os.path.join(args.out, "checkpoint-3") if args.resume else None)
result = {
    "losses": trainer.losses,
    "grad_norms": [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry],
    "num_items_in_batch": trainer.num_items,
    "model_accepts_loss_kwargs": trainer.model_accepts_loss_kwargs,
    "aux_loss_enabled": trainer.aux_loss_enabled,
    "loss_type": training.loss_type,
    "fused_lm_head": "forward" in vars(model),  # TRL's forward on the instance, over the model's own
    "lm_head_gathers": gathers,
    "lm_head_unit": isinstance(model.lm_head, FSDPModule),  # an FSDP2 unit of its own (else in the root's)
    "applied_plans": dict(model.applied_plans),
    "transformers_checkpointing": model.is_activation_checkpointing,
    "backend": type(trainer.deepspeed).__module__,
}
finish(trainer, args, result)
