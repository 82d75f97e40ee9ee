"""ds_compat engine checks that need real FSDP2 sharding (2 ranks); tests/test_ds_engine.py runs it and reads --out.

ZeRO 3 (parameters replaced by fully_shard) with a client optimizer object (two param groups) and a client
LambdaLR object: the optimizer must stay the client's object, now holding the sharded parameters, so the scheduler
passed to initialize and one built on it but not passed (ms-swift's) both drive the live optimizer. Then
save_checkpoint / zero_to_fp32 / save_16bit_model / load_checkpoint variants, checked against the engine's own
full state dict.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ds_api_script as script  # noqa: E402

import ds_compat as deepspeed  # noqa: E402
from ds_compat.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: E402
from glm45v_fsdp.errors import UserError  # noqa: E402


def config(bf16: bool) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": bf16},
    }


def build(bf16: bool, data=None):
    torch.manual_seed(1234)
    model = script.TinyLM()
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    client = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 5e-4}], lr=1e-3
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(client, lambda step: 1.0 / (1 + step))
    engine, optimizer, loader, lr_scheduler = deepspeed.initialize(
        model=model, optimizer=client, lr_scheduler=scheduler, training_data=data, config=config(bf16)
    )
    return engine, optimizer, loader, lr_scheduler, client, scheduler


def unpassed_scheduler_drives(data) -> bool:
    """ms-swift builds its HF scheduler on the client optimizer before initialize and does not pass it: stepping
    that scheduler must change the lr the engine's steps use."""
    torch.manual_seed(1234)
    model = script.TinyLM()
    client = torch.optim.AdamW(model.parameters(), lr=1e-3)
    side = torch.optim.lr_scheduler.LambdaLR(client, lambda step: 0.5**step)
    engine, optimizer, loader, _ = deepspeed.initialize(
        model=model, optimizer=client, training_data=data, config=config(False)
    )
    lrs = []
    for index, batch in enumerate(loader):
        engine.backward(engine(batch))
        engine.step()
        if (index + 1) % engine.gradient_accumulation_steps() == 0:  # after each optimizer step, as the HF Trainer
            side.step()
            lrs.append((engine.get_lr()[0], side.get_last_lr()[0]))
    return optimizer is client and lrs == [(5e-4, 5e-4), (2.5e-4, 2.5e-4)]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].float(), b[k].float()) for k in a)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--save_dir", required=True)
    args = parser.parse_args()
    deepspeed.init_distributed()
    rank = deepspeed.comm.get_rank()
    checks: dict[str, object] = {}

    data = script.Tokens(16)
    engine, optimizer, loader, lr_scheduler, client, scheduler = build(False, data)
    checks["optimizer_kept"] = optimizer is client and engine.optimizer is client
    checks["groups_kept"] = [(g["weight_decay"], g["initial_lr"]) for g in optimizer.param_groups] == [
        (0.1, 1e-3),
        (0.0, 5e-4),
    ]
    checks["params_sharded"] = all(
        type(p).__name__ == "DTensor" or hasattr(p, "_local_tensor")
        for g in optimizer.param_groups
        for p in g["params"]
    )
    checks["scheduler_follows"] = lr_scheduler is scheduler and scheduler.optimizer is optimizer
    checks["loader_len"] = len(loader)  # 16 samples / 2 ranks / micro 2
    for batch in loader:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
    checks["global_steps"] = engine.global_steps  # 4 micro steps / accumulation 2
    checks["lr"] = engine.get_lr()  # LambdaLR after 2 steps: base / 3
    checks["grad_norm_finite"] = engine.get_global_grad_norm() is not None

    full = engine.module_state_dict()
    engine.save_checkpoint(args.save_dir, tag="mine", client_state={"k": 1}, save_latest=False)
    checks["no_latest"] = not os.path.exists(os.path.join(args.save_dir, "latest"))
    engine.save_checkpoint(args.save_dir, client_state={"k": 2})
    engine.save_16bit_model(os.path.join(args.save_dir, "export"))
    if rank == 0:
        exported = get_fp32_state_dict_from_zero_checkpoint(args.save_dir)
        checks["zero_to_fp32_equal"] = same(exported, full)
        checks["zero_to_fp32_tag_equal"] = same(get_fp32_state_dict_from_zero_checkpoint(args.save_dir, "mine"), full)
        saved = torch.load(os.path.join(args.save_dir, "export", "pytorch_model.bin"), weights_only=True)
        checks["save_16bit_fp32_equal"] = same(saved, full) and saved["embed.weight"].dtype == torch.float32

    fresh, *_ = build(False)
    checks["load_nothing"] = list(fresh.load_checkpoint(os.path.join(args.save_dir, "missing")))
    path, client_state = fresh.load_checkpoint(args.save_dir, tag="mine", load_module_only=True)
    checks["module_only"] = [
        os.path.basename(path),
        client_state,
        fresh.global_steps,
        same(fresh.module_state_dict(), full),
    ]
    path, client_state = fresh.load_checkpoint(args.save_dir)
    checks["full_load"] = [os.path.basename(path), client_state, fresh.global_steps, fresh.get_lr()]

    checks["unpassed_scheduler_drives"] = unpassed_scheduler_drives(data)
    try:
        deepspeed.initialize(model=script.TinyLM(), config={"train_batch_size": 2, "sequence_parallel_size": 2})
        checks["sequence_parallel_refused"] = None
    except UserError as error:
        checks["sequence_parallel_refused"] = str(error)
    try:
        expert_parallel = {"enabled": True, "autoep_size": 2}
        deepspeed.initialize(model=script.TinyLM(), config={"train_batch_size": 2, "expert_parallel": expert_parallel})
        checks["expert_parallel_refused"] = None
    except UserError as error:
        checks["expert_parallel_refused"] = str(error)

    bf16_engine, *_ = build(True)
    bf16_engine.save_16bit_model(os.path.join(args.save_dir, "export16"), "model16.bin")
    if rank == 0:
        saved = torch.load(os.path.join(args.save_dir, "export16", "model16.bin"), weights_only=True)
        checks["save_16bit_bf16"] = str(saved["embed.weight"].dtype)
        with open(args.out, "w") as handle:
            json.dump(checks, handle, indent=1)
    deepspeed.comm.barrier()


if __name__ == "__main__":
    main()
