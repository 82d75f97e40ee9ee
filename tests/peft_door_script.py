"""A DeepSpeed-API script that fine-tunes a PEFT LoRA model of transformers' GLM-4.5V (tests/test_lora_door.py runs
it through ds_compat.run; the real DeepSpeed runs it too, for the speed benchmark): `PeftModel.from_pretrained(base,
--adapter, is_trainable=True)`, `deepspeed.initialize(model=peft_model, model_parameters=peft_model.parameters())`,
`loss = engine(**batch).loss; engine.backward(loss); engine.step()` on our synthetic image-text batches in order.

Runs (--runs, in one launch): "ep": ZeRO 3 + expert_parallel.autoep_size 2 + activation_checkpointing + the
extension's dynamic chunk loss, with a checkpoint at --save_at; "resumed": a fresh PEFT model and engine that load it
and train the steps after it; "ulysses2" / "ring2": ZeRO 3 with each sequence split over 2 ranks; "plain": ZeRO 3
alone (the real DeepSpeed runs only this). After the last step of each run, the eval loss of each rank's first batch
(eval mode, no gradient), and PEFT's `save_pretrained` from the engine's consolidated state dict (as the HF Trainer
saves under ZeRO 3). Each rank dumps its batches; rank 0 writes --out/result.json: per run the per-step losses (mean
over the ranks), the eval loss, the plans applied and the ms per step.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time

import deepspeed
import torch
from glm_door_script import batches as glm_batches
from peft_common import load_peft

HF_KEYS = ("input_ids", "attention_mask", "labels", "pixel_values", "image_grid_thw", "mm_token_type_ids")
LR = 1e-3
PLAIN = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
    "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}},
    "steps_per_print": 1000,
}
EP = {
    **copy.deepcopy(PLAIN),
    "expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "glm4v_moe"},
    "activation_checkpointing": {"partition_activations": False},
    "glm45v_fsdp": {"features": {"chunk_loss": {"mode": "dynamic", "logits_budget_mib": 0.02}}},
}
RUNS = {
    "plain": PLAIN,
    "ep": EP,
    "ulysses2": {**copy.deepcopy(PLAIN), "sequence_parallel_size": 2},
    "ring2": {**copy.deepcopy(PLAIN), "glm45v_fsdp": {"parallel": {"ring_attention_size": 2}}},
}


def build(args, config: dict):
    model = load_peft(args.hf_dir, args.adapter)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert engine.module is model, "the engine trains the script's own PEFT model object"
    return model, engine


def batches(engine, start_step: int):
    """The GLM door script's batches, images only: PEFT on transformers is the reference, whose forward cannot take
    images and videos in one batch."""
    return glm_batches(engine, start_step, ("data.synthetic_video_every=0",), HF_KEYS)


def mean_over_ranks(value: float) -> float:
    tensor = torch.tensor(value, dtype=torch.float64)
    deepspeed.comm.all_reduce(tensor)
    return tensor.item() / deepspeed.comm.get_world_size()


def train(engine, name: str, first: int, last: int, out: str, save=None) -> dict:
    """Steps first+1 .. last (each rank's batches dumped to out/<name>/), then the eval loss of its first batch."""
    rank = deepspeed.comm.get_rank()
    os.makedirs(os.path.join(out, name), exist_ok=True)
    losses, times = [], []
    loader = batches(engine, first)
    first_batch = None
    for step in range(first + 1, last + 1):
        batch = next(loader)
        if first_batch is None:
            first_batch = batch
        torch.save(batch, os.path.join(out, name, f"step{step}_rank{rank}.pt"))
        start = time.perf_counter()
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        losses.append(mean_over_ranks(loss.item()))
        if save is not None:
            save(step)
    engine.eval()
    with torch.no_grad():
        evaluated = engine(**first_batch).loss.item()
    engine.train()
    milliseconds = 1000 * mean_over_ranks(times_tail(times))
    return {"losses": losses, "eval": mean_over_ranks(evaluated), "ms_per_step": milliseconds}


def times_tail(times: list[float]) -> float:
    """The mean step time after the first step (warm-up)."""
    tail = times[1:] or times
    return sum(tail) / len(tail)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf_dir", required=True)
    parser.add_argument("--adapter", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save_at", type=int, default=2)
    parser.add_argument("--runs", default="ep,resumed,ulysses2,ring2")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = deepspeed.comm.get_rank()
    result = {"backend": type(deepspeed.initialize).__module__}
    runs = args.runs.split(",")
    checkpoint = os.path.join(args.out, "checkpoint")
    for name in (run for run in runs if run in RUNS):
        model, engine = build(args, RUNS[name])

        def save(step: int, engine=engine, name=name) -> None:
            if name == "ep" and step == args.save_at and "resumed" in runs:
                engine.save_checkpoint(checkpoint, tag=f"step{step}")

        result[name] = train(engine, name, 0, args.steps, args.out, save)
        result[name]["plans"] = dict(getattr(model.get_base_model(), "applied_plans", {}))
        state = engine._zero3_consolidated_16bit_state_dict()
        if rank == 0:
            model.save_pretrained(os.path.join(args.out, name, "peft_adapter"), state_dict=state)
        deepspeed.comm.barrier()
        engine.destroy()
    if "resumed" in runs:
        _, resumed = build(args, EP)
        resumed.load_checkpoint(checkpoint, tag=f"step{args.save_at}")
        assert resumed.global_steps == args.save_at
        result["resumed"] = train(resumed, "resumed", args.save_at, args.steps, args.out)
    if rank == 0:
        with open(os.path.join(args.out, "result.json"), "w") as handle:
            json.dump(result, handle, indent=1)
    deepspeed.comm.barrier()


if __name__ == "__main__":
    main()
