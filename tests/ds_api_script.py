"""A plain training script written against the DeepSpeed API; tests/test_ds_engine.py runs it on both backends.

DS_API_BACKEND="deepspeed": `import deepspeed` (the real one; this backend under ds-fsdp or `python -m ds_compat.run`),
anything else: `import ds_compat as deepspeed`.
A tiny transformer LM (embedding, two blocks in an nn.ModuleList, lm head) trains on synthetic tokens with
`loss = engine(batch); engine.backward(loss); engine.step()`. Rank 0 writes per optimizer step the loss (mean over
the accumulation micro steps, averaged over ranks), the lr and global_steps to --out (JSON). At the end the script
saves a checkpoint with a client state, builds a fresh engine, loads it, and checks the client state, `latest`,
the step counter and the loss on a fixed batch.

torchrun --nproc_per_node 2 tests/ds_api_script.py --zero 0,2,3 --steps 30 --out result.json --save_dir ckpt
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

if os.environ.get("DS_API_BACKEND") == "deepspeed":
    import deepspeed
else:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import ds_compat as deepspeed

VOCAB, DIM, HEADS, SEQ = 64, 32, 4, 16
LOSS_WEIGHT = 4.0  # gradient norms come out near 3: clipping at 1.0 is active on every step


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, DIM))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block() for _ in range(2)])
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, batch: dict) -> torch.Tensor:
        tokens = batch["input_ids"]
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        return LOSS_WEIGHT * F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))


class Tokens(torch.utils.data.Dataset):
    """Sequences with structure to learn: each token is the previous one plus a per-sequence stride."""

    def __init__(self, count: int) -> None:
        generator = torch.Generator().manual_seed(7)
        start = torch.randint(0, VOCAB, (count, 1), generator=generator)
        stride = torch.randint(1, 4, (count, 1), generator=generator)
        self.data = (start + stride * torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.data[index]}


def ds_config(zero: int, accumulation: int, micro: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": zero},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01, "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 10, "warmup_type": "linear"},
        },
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
    }


def build(args: argparse.Namespace, config: dict, data: Tokens | None):
    torch.manual_seed(1234)
    model = TinyLM()
    return deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=data, config=config
    )


def to_device(batch: dict, device) -> dict:
    return {key: value.to(device) for key, value in batch.items()}


def train(args: argparse.Namespace, zero: int, world: int) -> dict:
    config = ds_config(zero, args.accumulation, args.micro)
    data = Tokens(args.steps * args.accumulation * args.micro * world)
    engine, optimizer, loader, scheduler = build(args, config, data)
    assert optimizer is not None and loader is not None and scheduler is not None
    assert engine.train_batch_size() == args.micro * args.accumulation * world
    iterator = iter(loader)
    records = []
    for _ in range(args.steps):
        losses = []
        for _ in range(engine.gradient_accumulation_steps()):
            batch = to_device(next(iterator), engine.device)
            loss = engine(batch)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        mean = torch.tensor(sum(losses) / len(losses), dtype=torch.float64)
        deepspeed.comm.all_reduce(mean)
        norm = engine.get_global_grad_norm()  # DeepSpeed: None at ZeRO 0 in fp32, a tensor under ZeRO 1-3
        records.append(
            {
                "loss": mean.item() / world,
                "lr": engine.get_lr()[0],
                "global_steps": engine.global_steps,
                "grad_norm": None if norm is None else float(norm),
            }
        )

    result = {"records": records, "micro_steps": engine.micro_steps, "global_samples": engine.global_samples}
    if args.save_dir:
        save_dir = os.path.join(args.save_dir, f"zero{zero}")
        probe = to_device(next(iter(torch.utils.data.DataLoader(data, batch_size=4))), engine.device)
        engine.eval()
        with torch.no_grad():
            probe_loss = engine(probe).item()
        client = {"note": "from the client", "step": engine.global_steps, "values": [1, 2, 3]}
        engine.save_checkpoint(save_dir, client_state=client)
        fresh, _, _, _ = build(args, config, None)
        path, client_state = fresh.load_checkpoint(save_dir)
        fresh.eval()
        with torch.no_grad():
            fresh_loss = fresh(probe).item()
        with open(os.path.join(save_dir, "latest")) as handle:
            latest = handle.read().strip()
        result["checkpoint"] = {
            "path": path,
            "latest": latest,
            "client_state_ok": all(client_state.get(key) == value for key, value in client.items()),
            "global_steps": fresh.global_steps,
            "lr": fresh.get_lr()[0],
            "probe_loss": probe_loss,
            "fresh_probe_loss": fresh_loss,
            "probe_close": math.isclose(probe_loss, fresh_loss, rel_tol=1e-6),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero", default="2", help="ZeRO stage(s), comma-separated: each trains a fresh model")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--save_dir", default=None)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    world = deepspeed.comm.get_world_size()
    results = {stage: train(args, int(stage), world) for stage in args.zero.split(",")}
    results["deepspeed_module"] = deepspeed.__name__  # "ds_compat" where `import deepspeed` was switched (ds-fsdp)
    if deepspeed.comm.get_rank() == 0:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=1)
    deepspeed.comm.barrier()


if __name__ == "__main__":
    main()
