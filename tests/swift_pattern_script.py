"""What ms-swift's GLM-4.5V template does to the model, in a DeepSpeed-API script (tests/test_lora_door.py runs it
on the real DeepSpeed and on ds_compat), without ms-swift: the collator computes the mRoPE positions with the model's
own `get_rope_index`, and a forward pre-hook registered on the model before `initialize` embeds input_ids with the
model's own `embed_tokens`, runs its own vision tower on the images, scatters their features into the embeddings and
calls the forward with `inputs_embeds` (no input_ids, no pixel values), the positions and the labels.

`--runs` in one launch, each `<full|lora>_zero<2|3>[_ep]`: full fine-tuning or PEFT's LoRA of the model (attention +
routed experts, A and B random; the hook on the PEFT model, as ms-swift registers it), the ZeRO stage, and with `_ep`
expert_parallel.autoep_size 2 (the real DeepSpeed's AutoEP skips a PEFT model). 4 steps of our synthetic image samples
in order, micro batch 2 per rank. Rank 0 writes --out/result.json: per run the per-step losses (mean over the ranks)
and the plans applied.
"""

from __future__ import annotations

import argparse
import json
import os

import deepspeed
import torch
from peft import LoraConfig, get_peft_model
from transformers import Glm4vMoeForConditionalGeneration

from glm45v_fsdp.builders import build_training_data
from glm45v_fsdp.config import load_config
from glm45v_fsdp.data import GlobalBatchSampler, build_dataloader

STEPS = 4


def ds_config(zero: int, ep: bool) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": zero},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.0}},
        "steps_per_print": 1000,
    }
    if ep:
        config["expert_parallel"] = {"enabled": True, "autoep_size": 2}
    return config


def post_encode(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """ms-swift's `_post_encode` as a forward pre-hook: the embeddings built from the model's own modules."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    input_ids = kwargs.pop("input_ids")
    embeds = base.model.language_model.embed_tokens(input_ids)
    vision = base.model.visual(kwargs.pop("pixel_values"), grid_thw=kwargs.pop("image_grid_thw"))
    features = vision.pooler_output if hasattr(vision, "pooler_output") else vision
    mask = (input_ids == base.config.image_token_id).unsqueeze(-1).expand_as(embeds)
    kwargs["inputs_embeds"] = embeds.masked_scatter(mask, features.to(embeds.dtype))
    kwargs.pop("mm_token_type_ids")
    return args, kwargs


def batches(engine, base: torch.nn.Module):
    config = load_config(None, ["data.shuffle=false", "data.synthetic_video_every=0"])
    data = build_training_data(config, base.config)
    world = deepspeed.comm.get_world_size()
    sampler = GlobalBatchSampler(
        dataset_size=len(data.dataset),
        micro_batch_size=engine.train_micro_batch_size_per_gpu(),
        gradient_accumulation_steps=1,
        dp_rank=deepspeed.comm.get_rank(),
        dp_size=world,
        seed=config.training.seed,
        shuffle=False,
        start_step=0,
    )
    loader = build_dataloader(data.dataset, sampler, data.tokenizer.pad_token_id, packing=False, num_workers=0)
    for batch in loader:
        keys = ("input_ids", "attention_mask", "labels", "pixel_values", "image_grid_thw", "mm_token_type_ids")
        batch = {key: batch[key] for key in keys}
        # the collator's mRoPE positions, as ms-swift's _get_position_ids
        batch["position_ids"], _ = base.model.get_rope_index(
            batch["input_ids"], batch["mm_token_type_ids"], batch["image_grid_thw"], None, batch["attention_mask"]
        )
        yield batch


def train(args: argparse.Namespace, run: str) -> dict:
    """One run, named `<full|lora>_zero<N>[_ep]`: a fresh model, the hook, initialize, STEPS steps."""
    kind, zero, *ep = run.split("_")
    model = Glm4vMoeForConditionalGeneration.from_pretrained(args.hf_dir, dtype=torch.float32)
    base = model
    if kind == "lora":
        torch.manual_seed(7)
        config = LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
            init_lora_weights=False,
        )
        model = get_peft_model(model, config)
    model.register_forward_pre_hook(post_encode, with_kwargs=True)
    # the vision tower gathered whole when the hook calls it: its patch embedding reads the position embedding's weight
    # without calling that module, which DeepSpeed's ZeRO 3 gathers only inside the model's own forward
    deepspeed.utils.set_z3_leaf_modules(base, [type(base.model.visual)])
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(int(zero.removeprefix("zero")), bool(ep))
    )
    losses = []
    loader = batches(engine, base)
    for _ in range(STEPS):
        loss = engine(**next(loader)).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone().double()
        deepspeed.comm.all_reduce(mean)
        losses.append(mean.item() / deepspeed.comm.get_world_size())
    engine.destroy()
    return {"losses": losses, "plans": dict(getattr(base, "applied_plans", {}))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf_dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs", required=True, help="comma-separated, e.g. full_zero3_ep,lora_zero3_ep,full_zero2")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    result = {run: train(args, run) for run in args.runs.split(",")}
    if deepspeed.comm.get_rank() == 0:
        with open(os.path.join(args.out, "result.json"), "w") as handle:
            json.dump(result, handle)
    deepspeed.comm.barrier()


if __name__ == "__main__":
    main()
