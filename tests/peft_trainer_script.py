"""LoRA fine-tuning of transformers' GLM-4.5V with the HF Trainer (`--trainer hf`: the script wraps the model with
PEFT's get_peft_model) or TRL's SFTTrainer (`--trainer trl`: SFTTrainer(peft_config=...)), written for DeepSpeed and
run unchanged on the real DeepSpeed and on ds_compat (tests/test_lora_door.py).

`from_pretrained(--hf_dir)` after the training arguments (the ZeRO-3 order), LoRA of rank 4 on the text attention
and the routed experts (target_parameters), as ms-swift's and LLaMA-Factory's GLM-4.5V recipes; an "auto" ds_config
with ZeRO 3 and expert_parallel.autoep_size 2 (the real DeepSpeed's AutoEP finds no MoE layer in a PEFT model and
trains without EP; ds-fsdp splits the experts); gradient_checkpointing=True; 4 steps of 2 ranks x micro batch 1 x
accumulation 2 on our synthetic image samples in order. After training, `save_model` writes the adapter. Rank 0
writes --out/result.json: the per-step losses (mean over the ranks) and the trainable parameter count.
"""

import argparse
import json
import os
import sys

import torch
from accelerate import PartialState
from glm_door_hf_common import StepLosses, collate, make_ds_config
from peft import LoraConfig, get_peft_model
from transformers import Glm4vMoeForConditionalGeneration, Trainer, TrainingArguments

from glm45v_fsdp.builders import build_training_data
from glm45v_fsdp.config import load_config

parser = argparse.ArgumentParser()
parser.add_argument("--hf_dir", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--trainer", choices=("hf", "trl"), required=True)
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()

# the GLM door tests' "auto" ds_config (ZeRO 3) with expert parallelism and without the extension section
DS_CONFIG = {**make_ds_config(features=False), "expert_parallel": {"enabled": True, "autoep_size": 2}}
ARGUMENTS = {
    "per_device_train_batch_size": 1,
    "gradient_accumulation_steps": 2,
    "max_steps": 4,
    "learning_rate": 2e-3,
    "warmup_steps": 1,
    "weight_decay": 0.0,
    "adam_beta2": 0.95,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": [],
    "gradient_checkpointing": True,
    "train_sampling_strategy": "sequential",
    "seed": 0,
    "dataloader_num_workers": 0,
    "remove_unused_columns": False,
    "bf16": False,
    "deepspeed": DS_CONFIG,
    "accelerator_config": {"use_configured_state": True},  # the gloo state made below (CPU)
}
LORA = LoraConfig(
    r=4,
    lora_alpha=8,
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    init_lora_weights=False,  # A and B random: the first step already tests the adapters
)
KEYS = ("input_ids", "labels", "mm_token_type_ids", "pixel_values", "image_grid_thw")
SAMPLES = 16  # 4 steps of 2 ranks x 2 micro batches of 1

os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
state = PartialState(backend="gloo")  # CPU: a state for DeepSpeed over gloo first
if args.trainer == "trl":
    from trl import SFTConfig, SFTTrainer

    # router_aux_loss_coef 0: TRL's default reads text_config.num_experts, which GLM-4.5V's config lacks (TRL 1.16)
    training = SFTConfig(
        output_dir=args.out, **ARGUMENTS, dataset_kwargs={"skip_prepare_dataset": True}, router_aux_loss_coef=0.0
    )
else:
    training = TrainingArguments(output_dir=args.out, **ARGUMENTS)
model = Glm4vMoeForConditionalGeneration.from_pretrained(args.hf_dir, dtype=torch.float32)
data = build_training_data(load_config(None, ["data.shuffle=false", "data.synthetic_video_every=0"]), model.config)
samples = [{k: v for k, v in data.dataset[index].items() if k in KEYS} for index in range(SAMPLES)]
torch.manual_seed(7)
if args.trainer == "trl":
    from datasets import Dataset

    class RecordingSFTTrainer(StepLosses, SFTTrainer):
        pass

    dataset = Dataset.from_list([{k: v.numpy() for k, v in s.items()} for s in samples]).with_format("torch")
    trainer = RecordingSFTTrainer(
        model=model,
        args=training,
        train_dataset=dataset,
        data_collator=collate,
        processing_class=data.tokenizer,
        peft_config=LORA,
    )
else:

    class RecordingTrainer(StepLosses, Trainer):
        pass

    model = get_peft_model(model, LORA)
    trainer = RecordingTrainer(model=model, args=training, train_dataset=samples, data_collator=collate)
trainer.train()
trainer.save_model(os.path.join(args.out, "adapter"))
if trainer.args.process_index == 0:
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in trainer.model.parameters() if p.requires_grad)
    result = {"losses": trainer.losses, "trainable": trainable, "backend": type(trainer.deepspeed).__module__}
    with open(os.path.join(args.out, "result.json"), "w") as handle:
        json.dump(result, handle)
torch.distributed.barrier()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # CPU / gloo: end without the process-group teardown, as tests/hf_trainer_script.py
