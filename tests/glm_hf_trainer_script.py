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
import json
import os
import sys

import torch
from accelerate import PartialState
from safetensors.torch import save_file
from transformers import Glm4vMoeForConditionalGeneration, Trainer, TrainingArguments

from glm45v_fsdp.builders import build_training_data
from glm45v_fsdp.config import load_config
from glm45v_fsdp.data.vocab import IGNORE_INDEX

parser = argparse.ArgumentParser()
parser.add_argument("--hf_dir", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()

ds_config = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
    "expert_parallel": {"enabled": True, "autoep_size": 2},
    "glm45v_fsdp": {
        "features": {"chunk_loss": {"mode": "dynamic", "logits_budget_mib": 0.02}, "ep_balance": {"enabled": True}}
    },
}


def collate(samples: list[dict]) -> dict:
    """What an HF collator for GLM-4.5V returns: right padding, images concatenated, no position_ids."""
    length = max(len(sample["input_ids"]) for sample in samples)

    def padded(key: str, value: int) -> torch.Tensor:
        rows = [torch.nn.functional.pad(s[key], (0, length - len(s[key])), value=value) for s in samples]
        return torch.stack(rows)

    return {
        "input_ids": padded("input_ids", 0),
        "attention_mask": torch.stack([torch.arange(length) < len(sample["input_ids"]) for sample in samples]).long(),
        "labels": padded("labels", IGNORE_INDEX),
        "mm_token_type_ids": padded("mm_token_type_ids", 0),
        "pixel_values": torch.cat([sample["pixel_values"] for sample in samples]),
        "image_grid_thw": torch.cat([sample["image_grid_thw"] for sample in samples]),
    }


class RecordingTrainer(Trainer):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.losses: list[float] = []
        self.micro: list[float] = []

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The Trainer's loss of one micro batch (what it logs): summed over the accumulation, averaged over ranks."""
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.micro.append(self.accelerator.reduce(loss.detach(), "mean").item())
        if len(self.micro) == self.args.gradient_accumulation_steps:
            self.losses.append(sum(self.micro))
            self.micro = []
        return loss


# CPU only: a state made for DeepSpeed over gloo first (accelerate picks no backend without an accelerator).
os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
PartialState(backend="gloo")
training = TrainingArguments(
    output_dir=args.out,
    per_device_train_batch_size=1,
    gradient_accumulation_steps=2,
    max_steps=6,
    learning_rate=2e-3,
    warmup_steps=2,
    weight_decay=0.01,
    adam_beta2=0.95,
    logging_steps=1,
    save_steps=3,
    report_to=[],
    deepspeed=ds_config,
    gradient_checkpointing=True,
    train_sampling_strategy="sequential",
    seed=0,
    dataloader_num_workers=0,
    accelerator_config={"use_configured_state": True},
)
model = Glm4vMoeForConditionalGeneration.from_pretrained(args.hf_dir, dtype=torch.float32)
data = build_training_data(load_config(None, ["data.shuffle=false"]), model.config)
trainer = RecordingTrainer(model=model, args=training, train_dataset=data.dataset, data_collator=collate)
trainer.train(resume_from_checkpoint=os.path.join(args.out, "checkpoint-3") if args.resume else None)
result = {
    "losses": trainer.losses,
    "applied_plans": dict(model.applied_plans),
    "transformers_checkpointing": model.is_activation_checkpointing,
    "backend": type(trainer.deepspeed).__module__,
}
if not args.resume:
    trainer.save_model(os.path.join(args.out, "final"))
    state = trainer.accelerator.get_state_dict(trainer.deepspeed)  # what save_model wrote, for the test to compare
    if training.process_index == 0:
        save_file(
            {key: value.contiguous() for key, value in state.items()}, os.path.join(args.out, "state.safetensors")
        )
if training.process_index == 0:
    with open(os.path.join(args.out, "resumed.json" if args.resume else "result.json"), "w") as handle:
        json.dump(result, handle)
    with open(os.path.join(args.out, "ds_config.json"), "w") as handle:
        json.dump(trainer.deepspeed.config, handle)
torch.distributed.barrier()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # CPU / gloo: end without the process-group teardown, as tests/hf_trainer_script.py
