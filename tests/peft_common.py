"""The PEFT LoRA model the PEFT door tests train (tests/test_lora_door.py, tests/peft_door_script.py): transformers'
tiny GLM-4.5V with LoRA on the text attention, the dense and shared-expert MLP linears, the vision blocks' qkv, and
the routed experts' stacks (target_parameters), A and B both random so the first step already tests the update.

PEFT 0.21 on transformers 5 rewrites the targets gate_proj / up_proj / down_proj of an MoE model into its experts'
target_parameters (its conversion of adapters trained on transformers 4, where each expert was an nn.Linear): a
model that exists only on transformers 5 has nothing to convert, so `no_v4_conversion` switches that off and the
MLP linears are PEFT targets as a user of PEFT would name them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

RANK, ALPHA = 4, 8.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv"]
EXPERT_STACKS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# the same modules as our model.lora patterns: PEFT's suffixes match the vision MLPs' and the merger's too
MLP = ("gate_proj", "up_proj", "down_proj")
OUR_TARGETS = (
    [f"model.language_model.layers.{{*}}.self_attn.{name}" for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    + [f"model.language_model.layers.0.mlp.{name}" for name in MLP]
    + [f"model.language_model.layers.{{*}}.mlp.shared_experts.{name}" for name in MLP]
    + ["model.visual.blocks.{*}.attn.qkv"]
    + [f"model.visual.blocks.{{*}}.mlp.{name}" for name in MLP]
    + [f"model.visual.merger.{name}" for name in MLP]
)


@contextlib.contextmanager
def no_v4_conversion() -> Iterator[None]:
    from peft.utils import transformers_weight_conversion as conversion

    original = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = original


def make_adapter(hf_dir: Path, out: Path, seed: int = 11) -> None:
    """A PEFT adapter of the model at `hf_dir` with random A and B, saved to `out`."""
    from peft import LoraConfig, get_peft_model
    from transformers import Glm4vMoeForConditionalGeneration

    torch.manual_seed(seed)
    model = Glm4vMoeForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32)
    config = LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, target_parameters=EXPERT_STACKS, init_lora_weights=False
    )
    with no_v4_conversion():
        get_peft_model(model, config).save_pretrained(out)


def load_peft(hf_dir: Path, adapter: Path) -> torch.nn.Module:
    """transformers' GLM-4.5V from `hf_dir` with the PEFT adapter `adapter`, trainable, in fp32."""
    from peft import PeftModel
    from transformers import Glm4vMoeForConditionalGeneration

    model = Glm4vMoeForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32)
    with no_v4_conversion():
        return PeftModel.from_pretrained(model, adapter, is_trainable=True)


def loss_sum(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, int]:
    """The summed next-token cross-entropy of a batch and its supervised token count (from the logits)."""
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    logits = model(**inputs, use_cache=False).logits
    labels = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    total = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return total, int((labels != -100).sum())


def reference_run(
    hf_dir: Path, adapter: Path, steps: list[list[dict]], eval_batches: list[dict], lr: float
) -> tuple[list[float], float]:
    """PEFT on transformers in one process: per step the data-parallel ranks' batches averaged (each batch's token
    mean, then the mean over the ranks, as DeepSpeed averages the ranks' gradients), AdamW (betas 0.9 / 0.95, no
    weight decay, no clipping, constant lr); then the mean eval loss of `eval_batches`."""
    model = load_peft(hf_dir, adapter)
    trainable = [param for param in model.parameters() if param.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    losses = []
    for batches in steps:
        sums = [loss_sum(model, batch) for batch in batches]
        loss = sum(total / count for total, count in sums) / len(sums)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, eval_loss(model, eval_batches)


def eval_loss(model: torch.nn.Module, batches: list[dict]) -> float:
    model.eval()
    with torch.no_grad():
        means = [total / count for total, count in (loss_sum(model, batch) for batch in batches)]
    model.train()
    return float(sum(means) / len(means))
