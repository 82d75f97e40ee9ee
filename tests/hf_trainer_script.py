"""An HF Trainer script written for DeepSpeed, run unchanged by `deepspeed` and by `ds-fsdp` (test_hf_integration.py).

A tiny Llama from the saved config/weights in --pretrained, loaded *after* TrainingArguments (the ZeRO-3 order:
`from_pretrained` under deepspeed.zero.Init), a ds_config with "auto" values, 10 steps with checkpoints every 5,
evaluate, save_model, then a second train() on the trained model. `--resume` instead continues from checkpoint-5
in a fresh process. Rank 0 writes result.json: the loss of every training micro step (exact floats, recorded in
compute_loss) of both train() calls, the eval loss.
"""

import argparse
import json
import os
import sys

import torch
from accelerate import PartialState
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--zero", type=int, default=2)
parser.add_argument("--out", required=True)
parser.add_argument("--pretrained", required=True)
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
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {"stage": args.zero, "stage3_gather_16bit_weights_on_model_save": True},
}


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int, seed: int) -> None:
        self.ids = torch.randint(0, 128, (count, 32), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class RecordingTrainer(Trainer):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.losses: list[float] = []

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        loss = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        if model.training and not return_outputs:
            self.losses.append(loss.item())
        return loss


# CPU only: accelerate picks no distributed backend without an accelerator (for the real DeepSpeed too), so a state
# made for DeepSpeed over gloo is set up first and TrainingArguments uses it. Not needed on GPUs / NPUs.
os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
PartialState(backend="gloo")
training = TrainingArguments(
    output_dir=args.out,
    per_device_train_batch_size=2,
    per_device_eval_batch_size=2,
    max_steps=10,
    learning_rate=1e-2,
    warmup_steps=2,
    weight_decay=0.01,
    logging_steps=1,
    save_steps=5,
    report_to=[],
    deepspeed=ds_config,
    seed=0,
    dataloader_num_workers=0,
    accelerator_config={"use_configured_state": True},
)
model = AutoModelForCausalLM.from_pretrained(args.pretrained, dtype=torch.float32)  # after TrainingArguments
trainer = RecordingTrainer(model=model, args=training, train_dataset=Tokens(64, 1), eval_dataset=Tokens(8, 2))
trainer.train(resume_from_checkpoint=os.path.join(args.out, "checkpoint-5") if args.resume else None)
result = {"losses": trainer.losses, "eval_loss": trainer.evaluate()["eval_loss"]}
if not args.resume:
    trainer.save_model(os.path.join(args.out, "final"))
    # A second train() in the same process (accelerate's free_memory -> engine.destroy(), a new engine on the same
    # model). transformers 5.24 would take the first engine, left in model_wrapped, as the wrapped model and never
    # rebuild accelerate's engine wrapper (the real DeepSpeed fails the same way without this line).
    trainer.model_wrapped = trainer.model
    trainer.losses = []
    trainer.args.output_dir = os.path.join(args.out, "second")  # checkpoint-5 stays the first run's, for --resume
    trainer.train()
    result["second_losses"] = trainer.losses
if training.process_index == 0:
    with open(os.path.join(args.out, "resumed.json" if args.resume else "result.json"), "w") as handle:
        json.dump(result, handle)
# CPU / gloo only: the process-group teardown at interpreter exit aborts now and then ("terminate called without an
# active exception"), on the real DeepSpeed and on this backend alike; end without it once everything is written.
torch.distributed.barrier()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
