"""What the HF Trainer and TRL scripts of the GLM-4.5V door tests share (tests/glm_hf_trainer_script.py,
tests/glm_trl_script.py): the "auto" ds_config with the features on, the Trainer arguments, an HF-style collator, the
per-step loss record, and the end of a run (save, result files, exit)."""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch
from safetensors.torch import save_file

from glm45v_fsdp.vocab import IGNORE_INDEX

# ZeRO 3, expert_parallel.autoep_size 2 and the extension's dynamic chunk loss and EP balance; "auto" as in HF's
# templates (the Trainer fills them from its arguments).
DS_CONFIG = {
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
# 6 steps of micro batch 1 x accumulation 2, checkpoint-3, gradient_checkpointing=True, samples in order.
TRAINING_ARGUMENTS = {
    "per_device_train_batch_size": 1,
    "gradient_accumulation_steps": 2,
    "max_steps": 6,
    "learning_rate": 2e-3,
    "warmup_steps": 2,
    "weight_decay": 0.01,
    "adam_beta2": 0.95,
    "logging_steps": 1,
    "save_steps": 3,
    "report_to": [],
    "gradient_checkpointing": True,
    "train_sampling_strategy": "sequential",
    "seed": 0,
    "dataloader_num_workers": 0,
    "accelerator_config": {"use_configured_state": True},
}


def make_ds_config(features: bool) -> dict:
    """DS_CONFIG; without `features`, ZeRO 3 alone (no expert_parallel, no extension section)."""
    config = copy.deepcopy(DS_CONFIG)
    if not features:
        del config["expert_parallel"], config["glm45v_fsdp"]
    return config


def training_arguments(features: bool) -> dict:
    """TRAINING_ARGUMENTS; without `features`, no gradient checkpointing (so no recompute plan)."""
    return {**TRAINING_ARGUMENTS, "gradient_checkpointing": features}


VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def collate(samples: list[dict]) -> dict:
    """What an HF collator for GLM-4.5V returns: right padding, images and videos concatenated (each pair only when a
    sample has one), no position_ids."""
    length = max(len(sample["input_ids"]) for sample in samples)

    def padded(key: str, value: int) -> torch.Tensor:
        rows = [torch.nn.functional.pad(s[key], (0, length - len(s[key])), value=value) for s in samples]
        return torch.stack(rows)

    return {
        "input_ids": padded("input_ids", 0),
        "attention_mask": torch.stack([torch.arange(length) < len(sample["input_ids"]) for sample in samples]).long(),
        "labels": padded("labels", IGNORE_INDEX),
        "mm_token_type_ids": padded("mm_token_type_ids", 0),
        **{  # (a `datasets` row without a video holds None there)
            key: torch.cat([torch.as_tensor(sample[key]) for sample in samples if sample.get(key) is not None])
            for key in VISION_KEYS
            if any(sample.get(key) is not None for sample in samples)
        },
    }


class StepLosses:
    """Mixin for a transformers Trainer: `losses` holds each optimizer step's loss as the Trainer logs it (the micro
    batches' losses summed over the accumulation, averaged over the ranks)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.losses: list[float] = []
        self.micro: list[float] = []

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.micro.append(self.accelerator.reduce(loss.detach(), "mean").item())
        if len(self.micro) == self.args.gradient_accumulation_steps:
            self.losses.append(sum(self.micro))
            self.micro = []
        return loss


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf_dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume", action="store_true", help="continue from --out/checkpoint-3 (resumed.json)")
    parser.add_argument("--features_off", action="store_true", help="ZeRO 3 alone, no gradient checkpointing")
    parser.add_argument(
        "--sp", type=int, default=1, help="parallelism_config sp_size (DeepSpeed's ALST, sp_backend='deepspeed')"
    )
    parser.add_argument("--local_rank", type=int, default=-1)


def parallelism_config(sp: int, world: int):
    """TrainingArguments' parallelism_config for DeepSpeed's ALST at `sp` (None at 1): the data-parallel groups
    are the rest of the world, as accelerate's guide sets them."""
    if sp == 1:
        return None
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    handler = DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa")  # must name the model's, as DeepSpeed's
    return ParallelismConfig(sp_backend="deepspeed", sp_size=sp, dp_shard_size=world // sp, sp_handler=handler)


def finish(trainer, args: argparse.Namespace, result: dict) -> None:
    """First run: save_model to --out/final and its tensors as state.safetensors; rank 0 writes result.json (or
    resumed.json) and the resolved ds_config.json (for the trainer door's run); then exit without gloo's teardown."""
    if not args.resume:
        trainer.save_model(os.path.join(args.out, "final"))
        state = trainer.accelerator.get_state_dict(trainer.deepspeed)  # what save_model wrote, for the test
        if trainer.args.process_index == 0:
            contiguous = {key: value.contiguous() for key, value in state.items()}
            save_file(contiguous, os.path.join(args.out, "state.safetensors"))
    if trainer.args.process_index == 0:
        with open(os.path.join(args.out, "resumed.json" if args.resume else "result.json"), "w") as handle:
            json.dump(result, handle)
        with open(os.path.join(args.out, "ds_config.json"), "w") as handle:
            json.dump(trainer.deepspeed.config, handle)
    torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # CPU / gloo: end without the process-group teardown, as tests/hf_trainer_script.py
