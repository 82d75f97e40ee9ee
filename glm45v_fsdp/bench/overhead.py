"""The overhead benchmark: our 1-rank training step (the Trainer's step with its metrics, built by the same builders
as a real run) against a bare PyTorch loop over the same transformers model, weights, batch and optimizer, timed side
by side in one process (alternating blocks). `python -m glm45v_fsdp.tools.bench overhead` runs it."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from transformers import Glm4vMoeForConditionalGeneration

from glm45v_fsdp.errors import UserError

BARE_INPUT_KEYS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "pixel_values",
    "image_grid_thw",
    "mm_token_type_ids",
    "labels",
)
PARITY_OVERRIDES = [
    "parallel.fsdp_plan.param_dtype=fp32",
    "parallel.fsdp_plan.reduce_dtype=fp32",
    "training.progress_bar=false",
    "training.lr_scheduler=constant",
    "training.lr_warmup_ratio=0",
    "training.min_lr=0",
    # transformers' own forward scatters image features over a video's tokens too, so the bare loop cannot take a
    # sample holding both (data.md, "Videos"): images only on both sides
    "data.synthetic_video_every=0",
]


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        key: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
        for key, value in model.state_dict().items()
    }


class BareLoop:
    """What a user would write without any framework: HF model, its own loss, AdamW, clipping."""

    def __init__(self, hf_config, state_dict: dict[str, torch.Tensor], config, device) -> None:
        self.device = device
        self.model = Glm4vMoeForConditionalGeneration(hf_config).to(device.device(0))
        self.model.load_state_dict(state_dict, strict=True)
        self.model.train()
        training = config.training
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=training.lr,
            betas=(training.adam_beta1, training.adam_beta2),
            eps=training.adam_eps,
            weight_decay=training.weight_decay,
            fused=device.has_fused_adamw() or None,
        )
        self.clip = training.clip_grad

    def step(self, micro_batches: list[dict[str, torch.Tensor]]) -> float:
        """One step; returns the loss (mean over the micro batches) after the device finished."""
        total = torch.zeros(())
        for batch in micro_batches:
            inputs = {key: batch[key].to(self.device.device(0)) for key in BARE_INPUT_KEYS if key in batch}
            loss = self.model(**inputs).loss / len(micro_batches)
            loss.backward()
            total = total + loss.detach().cpu()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.device.synchronize()
        return float(total)


def run_overhead(steps: int, warmup: int, blocks: int, overrides: list[str], output: Path | None) -> dict:
    from glm45v_fsdp.builders import build_data, build_model, build_runtime
    from glm45v_fsdp.config import load_config
    from glm45v_fsdp.log import setup_logging
    from glm45v_fsdp.runtime import shutdown
    from glm45v_fsdp.trainer import Trainer

    config = load_config(None, PARITY_OVERRIDES + overrides)
    setup_logging(0)
    runtime = build_runtime(config)
    if runtime.env.world_size != 1:
        raise UserError("bench overhead measures one rank: run it without a launcher (world size 1).")
    try:
        model, hf_config = build_model(config, runtime)
        loader, _ = build_data(config, runtime, hf_config)
        trainer = Trainer(config, runtime, model, loader)
        micro_batches = trainer._next_micro_batches(iter(loader))
        bare = BareLoop(hf_config, full_state_dict(model), config, runtime.device)

        first_ours = trainer.train_step(micro_batches)[0]
        first_bare = bare.step(micro_batches)
        for _ in range(warmup):
            trainer.step_once(micro_batches)
            bare.step(micro_batches)

        ours_ms: list[float] = []
        bare_ms: list[float] = []
        per_block = max(1, steps // blocks)
        for _ in range(blocks):
            for _ in range(per_block):
                ours_ms.append(trainer.step_once(micro_batches)[0].ms_per_iter)
            for _ in range(per_block):
                start = time.perf_counter()
                bare.step(micro_batches)
                bare_ms.append((time.perf_counter() - start) * 1000.0)
    finally:
        shutdown()

    result = {
        "benchmark": "overhead",
        "steps_each": len(ours_ms),
        "first_step_loss_ours": first_ours,
        "first_step_loss_bare": first_bare,
        "ours_ms_median": statistics.median(ours_ms),
        "bare_ms_median": statistics.median(bare_ms),
        "ours_ms_mean": statistics.fmean(ours_ms),
        "bare_ms_mean": statistics.fmean(bare_ms),
        "torch_threads": torch.get_num_threads(),
    }
    result["ratio_median"] = result["ours_ms_median"] / result["bare_ms_median"]
    result["ratio_mean"] = result["ours_ms_mean"] / result["bare_ms_mean"]
    print(
        f"overhead: ours {result['ours_ms_median']:.1f} ms/iter vs bare PyTorch {result['bare_ms_median']:.1f} ms/iter "
        f"(median of {len(ours_ms)} steps each, alternating blocks) -> ratio {result['ratio_median']:.3f}x "
        f"(mean {result['ratio_mean']:.3f}x); first-step loss ours {first_ours:.6f} bare {first_bare:.6f}"
    )
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(result, indent=2) + "\n")
    return result
