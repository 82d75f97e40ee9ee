"""An accelerate training loop written for DeepSpeed (Accelerator(deepspeed_plugin=...)), run unchanged by `deepspeed`
and by `ds-fsdp` (test_hf_integration.py): a tiny Llama, a client AdamW, ZeRO from --zero, 10 steps with save_state
after step 5; `--resume` loads that state in a fresh process and runs steps 6-10. Rank 0 writes the losses."""

import argparse
import json
import os
import sys

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DeepSpeedPlugin
from transformers import AutoModelForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--zero", type=int, default=2)
parser.add_argument("--out", required=True)
parser.add_argument("--pretrained", required=True)
parser.add_argument("--resume", action="store_true")
parser.add_argument(
    "--offload", action="store_true", help="offload_optimizer to cpu: accelerate swaps in DeepSpeedCPUAdam"
)
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()

# CPU only: accelerate picks no distributed backend without an accelerator (for the real DeepSpeed too).
os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
PartialState(backend="gloo")
plugin = DeepSpeedPlugin(
    hf_ds_config={
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.zero, **({"offload_optimizer": {"device": "cpu"}} if args.offload else {})},
    }
)
accelerator = Accelerator(deepspeed_plugin=plugin)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(args.pretrained, dtype=torch.float32)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
ids = torch.randint(0, 128, (64, 32), generator=torch.Generator().manual_seed(1))
loader = torch.utils.data.DataLoader([{"input_ids": row, "labels": row} for row in ids], batch_size=2)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
state_dir = os.path.join(args.out, "state-5")
start = 0
if args.resume:
    accelerator.load_state(state_dir)
    loader, start = accelerator.skip_first_batches(loader, 5), 5
losses = []
model.train()
for step, batch in enumerate(loader, start=start + 1):
    loss = model(**batch).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
    if step == 5 and not args.resume:
        accelerator.save_state(state_dir)
    if step == 10:
        break
if accelerator.is_main_process:
    with open(os.path.join(args.out, "resumed.json" if args.resume else "result.json"), "w") as handle:
        json.dump({"losses": losses, "optimizer": type(optimizer.optimizer).__name__}, handle)
# CPU / gloo only: the process-group teardown at interpreter exit aborts now and then ("terminate called without an
# active exception"), on the real DeepSpeed and on this backend alike; end without it once everything is written.
torch.distributed.barrier()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
