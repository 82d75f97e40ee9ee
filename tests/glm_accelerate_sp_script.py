"""An accelerate training loop on transformers' GLM-4.5V with DeepSpeed's ALST sequence parallelism, written as
accelerate's sequence-parallelism guide writes it (tests/test_glm_door.py runs it through ds_compat.run):
- `Accelerator(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=--sp, dp_shard_size=world/sp,
  sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa")), deepspeed_plugin=...)`;
- `accelerator.prepare(model, optimizer, loader, scheduler)`, which calls
  `UlyssesSPAttentionHF.register_with_transformers`, passes its mpu to `deepspeed.initialize` and wraps the loader
  in `UlyssesSPDataLoaderAdapter`;
- the guide's loss: each rank's loss over its slice of `shift_labels`, weighted by its supervised tokens over the
  sequence-parallel group through a differentiable all_gather (written out here: torch's fails on gloo for a
  subgroup).

ZeRO 3, and with `--ep`, expert_parallel.autoep_size 2 and the extension's dynamic chunk loss and EP balance. Micro
batch 1, accumulation 2, 6 steps, the samples in order (accelerate hands rank r the samples r, r + world, ...).
`--sp 1` is the same script without parallelism_config (the CP1 reference, on world / sp ranks). Rank 0 writes
--out/result.json: per-step losses (the micro batches' whole-sequence losses, averaged over the accumulation and the
data-parallel groups) and gradient norms, the plans applied, and what the groups and the loader said.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator, PartialState
from accelerate.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler
from glm_door_hf_common import collate, parallelism_config
from transformers import Glm4vMoeForConditionalGeneration

from glm45v_fsdp.builders import build_training_data
from glm45v_fsdp.config import load_config

parser = argparse.ArgumentParser()
parser.add_argument("--hf_dir", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--sp", type=int, default=2)
parser.add_argument("--ep", action="store_true", help="expert_parallel.autoep_size 2 and the extension's features")
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()
STEPS, ACCUMULATION = 6, 2

ds_config = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": ACCUMULATION,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-3, "warmup_num_steps": 2}},
    "zero_optimization": {"stage": 3},
}
if args.ep:
    ds_config["expert_parallel"] = {"enabled": True, "autoep_size": 2}
    ds_config["glm45v_fsdp"] = {
        "features": {"chunk_loss": {"mode": "dynamic", "logits_budget_mib": 0.02}, "ep_balance": {"enabled": True}}
    }

# CPU only: a state made for DeepSpeed over gloo first (accelerate picks no backend without an accelerator).
os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
state = PartialState(backend="gloo")
accelerator = Accelerator(
    parallelism_config=parallelism_config(args.sp, state.num_processes),
    deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config),
)
model = Glm4vMoeForConditionalGeneration.from_pretrained(args.hf_dir, dtype=torch.float32, attn_implementation="sdpa")
data = build_training_data(load_config(None, ["data.shuffle=false"]), model.config)
loader = torch.utils.data.DataLoader(data.dataset, batch_size=1, collate_fn=collate, shuffle=False)
optimizer = DummyOptim(model.parameters())
scheduler = DummyScheduler(optimizer)
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

sp_group = None
if args.sp > 1:
    from deepspeed.utils import groups

    sp_group = groups._get_sequence_parallel_group()


class AllGather(torch.autograd.Function):
    """torch.distributed.nn.functional.all_gather's semantics (backward: each rank's gradient summed over the group),
    which on gloo fails for a subgroup (its all-to-all path canonicalises global rank 0 into the group)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def step_loss(batch: dict) -> torch.Tensor:
    """accelerate's guide: the slice's loss, weighted by its supervised tokens over the sequence-parallel group."""
    loss = model(**batch).loss
    if sp_group is None:
        return loss
    good = (batch["shift_labels"] != -100).sum()
    losses = AllGather.apply(loss, sp_group)
    goods = AllGather.apply(good.float(), sp_group)
    total = sum(part * count for part, count in zip(losses, goods) if count > 0)
    return total / max(goods.sum(), 1)


losses, norms, micro, shapes = [], [], [], []
model.train()
for batch in loader:
    if len(shapes) < 2:
        shapes.append({key: list(value.shape) for key, value in batch.items() if torch.is_tensor(value)})
    with accelerator.accumulate(model):
        loss = step_loss(batch)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    micro.append(accelerator.reduce(loss.detach(), "mean").item())
    if len(micro) == ACCUMULATION:
        losses.append(sum(micro) / ACCUMULATION)
        norms.append(float(accelerator.deepspeed_engine_wrapped.engine.get_global_grad_norm()))
        micro = []
    if len(losses) == STEPS:
        break

engine = accelerator.deepspeed_engine_wrapped.engine
if accelerator.is_main_process:
    result = {
        "losses": losses,
        "grad_norms": norms,  # Adam hardly sees a gradient's scale: the norm does
        "applied_plans": dict(engine.module.applied_plans),
        "loader": type(loader).__name__,
        "loader_length": len(loader),
        "shapes": shapes,
        "train_batch_size": engine.train_batch_size(),
        "sp_size": 1 if sp_group is None else dist.get_world_size(sp_group),
    }
    with open(os.path.join(args.out, "result.json"), "w") as handle:
        json.dump(result, handle)
dist.barrier()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # CPU / gloo: end without the process-group teardown, as the other HF scripts
