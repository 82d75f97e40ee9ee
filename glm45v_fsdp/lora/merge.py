"""Merge a PEFT LoRA adapter into its base: W + (alpha / r) B A for each adapted linear layer, per expert for the
routed experts' stacks (`tools.convert lora-merge`). The adapter's targets, ranks and alphas are read from its own
files (keys, shapes, `adapter_config.json` with its rank_pattern / alpha_pattern), so any PEFT LoRA adapter of
GLM-4.5V merges: ours and PEFT's own."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from glm45v_fsdp.errors import UserError
from glm45v_fsdp.lora.apply import EXPERT_STACKS
from glm45v_fsdp.lora.peft_format import PREFIX, from_peft, read_lora_files

_KEY = re.compile(r"^(?P<module>.+?)(?P<depth>(\.base_layer)*)\.lora_(?P<factor>[AB])\.weight$")


def _pattern_value(patterns: dict, key: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern: the first pattern that matches the end of `key` (a name or a regex)."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def adapter_deltas(directory: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """{base parameter name: its LoRA delta (scaling x B A), full shape} of the adapter in `directory`."""
    config, tensors = read_lora_files(directory, "lora-merge ADAPTER")
    if config.get("use_dora") or config.get("use_rslora"):
        raise UserError(
            f"lora-merge ADAPTER = '{directory}' is a LoRA adapter with DoRA / rsLoRA; lora-merge merges plain LoRA "
            f"adapters."
        )
    factors: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        found = _KEY.match(key.removeprefix(PREFIX))
        if found is None:
            raise UserError(f"lora-merge ADAPTER = '{directory}': key '{key}' is not a LoRA factor's.")
        depth = found["depth"].count(".base_layer")
        factors.setdefault((found["module"], depth), {})[found["factor"]] = tensor
    modules = dict(model.named_modules())
    stacks_of: dict[str, list[str]] = {}
    for target in config.get("target_parameters") or []:
        module, _, stack = target.rpartition(".")
        stacks_of.setdefault(stack, []).append(module)
    deltas = {}
    for (module, depth), pair in sorted(factors.items()):
        if module not in modules or set(pair) != {"A", "B"}:
            raise UserError(f"lora-merge: adapter module '{module}' is not in the base model, or lacks a factor.")
        target = modules[module]
        if isinstance(target, nn.Linear):
            name, key = f"{module}.weight", module
            rank = pair["A"].shape[0]
            delta = pair["B"].float() @ pair["A"].float()
        else:  # a routed experts module: which stack from the nesting depth (the last targeted is outermost)
            targeted = [stack for stack in EXPERT_STACKS if stack in stacks_of and hasattr(target, stack)]
            stack = targeted[len(targeted) - 1 - depth]
            name, key = f"{module}.{stack}", f"{module}.{stack}"
            experts = getattr(target, stack).shape[0]
            lora_a, lora_b = from_peft("x_lora_A", pair["A"], experts), from_peft("x_lora_B", pair["B"], experts)
            rank = lora_a.shape[1]
            delta = torch.bmm(lora_b.float(), lora_a.float())
        rank = _pattern_value(config.get("rank_pattern"), key, config.get("r", rank))
        alpha = _pattern_value(config.get("alpha_pattern"), key, config.get("lora_alpha", rank))
        deltas[name] = delta * (alpha / rank)
    return deltas


@torch.no_grad()
def merge_into(model: nn.Module, deltas: dict[str, torch.Tensor]) -> None:
    """Add each delta to its base parameter (a materialised, unsharded model)."""
    params = dict(model.named_parameters())
    for name, delta in deltas.items():
        if tuple(params[name].shape) != tuple(delta.shape):
            raise UserError(
                f"lora-merge: the adapter's update of '{name}' is {tuple(delta.shape)}, the base's weight "
                f"{tuple(params[name].shape)}. The adapter was trained on another model."
            )
        params[name].add_(delta.to(params[name].dtype))
