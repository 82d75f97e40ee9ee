"""A DeepSpeed-API training script on transformers' GLM-4.5V (tests/test_glm_door.py runs it through ds_compat.run).

`import deepspeed`, `Glm4vMoeForConditionalGeneration.from_pretrained(--hf_dir)` with a frozen vision tower, and
`loss = engine(**batch).loss; engine.backward(loss); engine.step()` on our data pipeline's synthetic image-text
batches (unshuffled; the trainer door's sampler gives the same micro batches). In one launch:
- "off": every feature off (ZeRO 3 only);
- "on": the same with expert_parallel.autoep_size 2, activation_checkpointing and the extension's dynamic chunk loss
  and EP balance; a checkpoint at --save_at; after the last step the consolidated state dict, saved by the model's
  own save_pretrained, by the engine's save_16bit_model, and the same tensors as safetensors for the test to compare;
- "resumed": a fresh model and engine that load the checkpoint and train the steps after it;
- CP_RUNS: "off" with context parallelism (Ulysses 2, Ring 2 from the extension, hybrid 2 x 2), each also with EP 2.
Rank 0 writes --out/result.json: per run the per-step losses (mean over the ranks), and what the door reported.
"""

from __future__ import annotations

import argparse
import copy
import json
import os

import deepspeed
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers import Glm4vMoeForConditionalGeneration

from glm45v_fsdp.builders import build_training_data
from glm45v_fsdp.config import load_config
from glm45v_fsdp.data import GlobalBatchSampler, build_dataloader

HF_KEYS = (
    "input_ids",
    "attention_mask",
    "labels",
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "mm_token_type_ids",
    "position_ids",
)
OFF = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2, "warmup_max_lr": 2e-3}},
    "steps_per_print": 1000,
}
ON = {
    **copy.deepcopy(OFF),
    # DeepSpeed 0.20's AutoEP shape under ZeRO 3: an explicit null balance coefficient
    "expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "glm4v_moe", "load_balance_coeff": None},
    "activation_checkpointing": {"partition_activations": False},
    "glm45v_fsdp": {
        "features": {"chunk_loss": {"mode": "dynamic", "logits_budget_mib": 0.02}, "ep_balance": {"enabled": True}}
    },
}

# Context parallelism, each sequence split over 2 ranks: on 4 ranks these are 2 data-parallel groups, the samples of
# each step those of "off" on 2 ranks. Ring sizes come from the extension section.
EP2 = {"enabled": True, "autoep_size": 2}
RING2 = {"glm45v_fsdp": {"parallel": {"ring_attention_size": 2}}}
CP_RUNS = {
    "ulysses2": {**copy.deepcopy(OFF), "sequence_parallel_size": 2},
    "ring2": {**copy.deepcopy(OFF), **copy.deepcopy(RING2)},
    "ulysses2_ep2": {**copy.deepcopy(OFF), "sequence_parallel_size": 2, "expert_parallel": EP2},
    "ring2_ep2": {**copy.deepcopy(OFF), **copy.deepcopy(RING2), "expert_parallel": EP2},
    # Ulysses 2 x Ring 2: on 4 ranks one data-parallel rank, the samples of "off" on 1 rank
    "hybrid": {**copy.deepcopy(OFF), **copy.deepcopy(RING2), "sequence_parallel_size": 2},
    "hybrid_ep2": {**copy.deepcopy(OFF), **copy.deepcopy(RING2), "sequence_parallel_size": 2, "expert_parallel": EP2},
}


def build(hf_dir: str, config: dict):
    model = Glm4vMoeForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32)
    model.model.visual.requires_grad_(False)
    frozen = sorted(name for name, param in model.named_parameters() if not param.requires_grad)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert engine.module is model, "the engine trains the script's own model object"
    kept = sorted(name for name, param in model.named_parameters() if not param.requires_grad)
    assert kept == frozen, "requires_grad as the script left it"
    return model, engine


def batches(engine, start_step: int, overrides: tuple[str, ...] = (), keys: tuple[str, ...] = HF_KEYS):
    """This rank's batches from step `start_step` on, as our trainer's unshuffled sampler makes them (`overrides`:
    more data keys; `keys`: what the batches hold)."""
    config = load_config(None, ["data.shuffle=false", *overrides])
    data = build_training_data(config, engine.module.config)
    sampler = GlobalBatchSampler(
        dataset_size=len(data.dataset),
        micro_batch_size=engine.train_micro_batch_size_per_gpu(),
        gradient_accumulation_steps=engine.gradient_accumulation_steps(),
        dp_rank=engine.get_data_parallel_rank(),
        dp_size=engine.dp_world_size,
        seed=config.training.seed,
        shuffle=False,
        start_step=start_step,
    )
    loader = build_dataloader(data.dataset, sampler, data.tokenizer.pad_token_id, packing=False, num_workers=0)
    for batch in loader:
        yield {key: batch[key] for key in keys if key in batch}


def groups_seen(engine) -> dict:
    """What deepspeed.utils.groups answers for the engine's layout, beside the engine's own meshes."""
    from deepspeed.utils import groups

    seen = {
        "sp_size": groups._get_sequence_parallel_world_size(),
        "sp_ranks": dist.get_process_group_ranks(groups._get_sequence_parallel_group()),
        "cp_ranks": dist.get_process_group_ranks(engine.meshes.cp.get_group()),
        "dp_size": groups._get_data_parallel_world_size(),
        "engine_dp_size": engine.dp_world_size,
        "train_batch_size": engine.train_batch_size(),
    }
    if engine.meshes.dims.ep > 1:
        name = groups._get_max_expert_size_name()
        seen.update(
            ep_name=name,
            ep_ranks=groups._get_expert_parallel_group_ranks(name),
            engine_ep_ranks=dist.get_process_group_ranks(engine.meshes.ep.get_group()),
        )
    return seen


def train(engine, first: int, last: int, save=None) -> list[float]:
    """Steps first+1 .. last; `save(step)` after each."""
    losses = []
    loader = batches(engine, first)
    for step in range(first + 1, last + 1):
        total = 0.0
        for _ in range(engine.gradient_accumulation_steps()):
            output = engine(**next(loader))
            engine.backward(output.loss)
            engine.step()
            total += output.loss.item()
        mean = torch.tensor(total / engine.gradient_accumulation_steps(), dtype=torch.float64)
        deepspeed.comm.all_reduce(mean)
        losses.append(mean.item() / deepspeed.comm.get_world_size())
        if save is not None:
            save(step)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf_dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save_at", type=int, default=3)
    parser.add_argument("--runs", default="off,on,resumed", help="which of the runs, comma-separated")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = deepspeed.comm.get_rank()
    result = {"backend": deepspeed.__name__}

    runs = args.runs.split(",")
    if "off" in runs:
        _, off = build(args.hf_dir, OFF)
        result["off"] = train(off, 0, args.steps)
        off.destroy()

    for name in (run for run in runs if run in CP_RUNS):
        model, engine = build(args.hf_dir, CP_RUNS[name])
        result[name] = train(engine, 0, args.steps)
        result[f"{name}_plans"] = dict(model.applied_plans)
        result[f"{name}_groups"] = groups_seen(engine)
        engine.destroy()
    if "on" not in runs:
        if rank == 0:
            with open(os.path.join(args.out, "result.json"), "w") as handle:
                json.dump(result, handle, indent=1)
        return

    model, on = build(args.hf_dir, ON)
    checkpoint = os.path.join(args.out, "checkpoint")

    def save(step: int) -> None:
        if step == args.save_at and "resumed" in runs:
            on.save_checkpoint(checkpoint, tag=f"step{step}", client_state={"step": step})

    result["on"] = train(on, 0, args.steps, save)
    result["applied_plans"] = dict(model.applied_plans)
    state = on._zero3_consolidated_16bit_state_dict()
    if rank == 0:
        model.save_pretrained(os.path.join(args.out, "export"), state_dict=state)
        save_file(
            {key: value.contiguous() for key, value in state.items()}, os.path.join(args.out, "state.safetensors")
        )
    on.save_16bit_model(os.path.join(args.out, "16bit"))  # DeepSpeed's pytorch_model.bin (collective)
    deepspeed.comm.barrier()
    on.destroy()

    if "resumed" in runs:
        _, resumed = build(args.hf_dir, ON)
        _, client = resumed.load_checkpoint(checkpoint, tag=f"step{args.save_at}")
        assert client == {"step": args.save_at} and resumed.global_steps == args.save_at
        result["resumed"] = train(resumed, args.save_at, args.steps)
    if rank == 0:
        with open(os.path.join(args.out, "result.json"), "w") as handle:
            json.dump(result, handle, indent=1)
    deepspeed.comm.barrier()


if __name__ == "__main__":
    main()
