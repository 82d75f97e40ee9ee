"""PEFT's adapter format, both ways: `adapter_config.json` + `adapter_model.safetensors` with PEFT's key names.

PEFT names a linear layer's adapter `base_model.model.<module>.lora_A.weight` [r, in] / `.lora_B.weight` [out, r].
The routed experts' stacks (`target_parameters`) are wrapped one ParamWrapper inside the other in the experts
module's registration order (gate_up_proj, then down_proj): the last targeted stack is outermost
(`<experts>.lora_A.weight`), each earlier one one `.base_layer` deeper. A stack's factors are stored flat:
A [r*E, in] (expert e's rows e*r .. e*r+r-1), B [out, r*E] (expert e's columns e, E+e, 2E+e, ...). Our stacks are
[E, r, in] and [E, out, r] (glm45v_fsdp/adapters.py). Reading runs no code: JSON and safetensors only.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from glm45v_fsdp.adapters import is_adapter
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.lora.apply import EXPERT_STACKS, AdapterSpec
from glm45v_fsdp.model.builder import read_json_file

PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


def peft_key(name: str, targeted_stacks: list[str]) -> str:
    """Our adapter parameter name -> PEFT's key (`targeted_stacks`: the experts stacks with adapters, in order)."""
    module, _, leaf = name.rpartition(".")
    if leaf in ("lora_A", "lora_B"):
        return f"{PREFIX}{module}.{leaf}.weight"
    stack, _, factor = leaf.rpartition("_lora_")
    depth = len(targeted_stacks) - 1 - targeted_stacks.index(stack)
    return f"{PREFIX}{module}.{'base_layer.' * depth}lora_{factor}.weight"


def to_peft(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Our full adapter tensor -> PEFT's layout (experts' stacks flattened)."""
    if tensor.dim() != 3:
        return tensor
    experts, rows, cols = tensor.shape
    if name.endswith("lora_A"):  # [E, r, in] -> [r*E, in]
        return tensor.reshape(experts * rows, cols)
    return tensor.permute(1, 2, 0).reshape(rows, cols * experts)  # [E, out, r] -> [out, r*E]


def from_peft(name: str, tensor: torch.Tensor, experts: int) -> torch.Tensor:
    """PEFT's tensor -> ours, for a stack of `experts` experts (0: a linear layer's)."""
    if not experts:
        return tensor
    if name.endswith("lora_A"):  # [r*E, in] -> [E, r, in]
        return tensor.reshape(experts, -1, tensor.shape[-1])
    return tensor.reshape(tensor.shape[0], -1, experts).permute(2, 0, 1).contiguous()  # [out, r*E] -> [E, out, r]


def write_adapter(directory: Path, tensors: dict[str, torch.Tensor], spec: AdapterSpec, base_model: str | None) -> None:
    """Write PEFT's adapter directory from our full adapter tensors (rank 0, after gathering them)."""
    stacks = _targeted_stacks(spec)
    ranks = {adapter.rank for adapter in spec.linear.values()} | {
        adapter.rank for stack in spec.experts.values() for adapter in stack.values()
    }
    alphas = {adapter.alpha for adapter in spec.linear.values()} | {
        adapter.alpha for stack in spec.experts.values() for adapter in stack.values()
    }
    dropouts = {adapter.dropout for adapter in spec.linear.values()}
    assert len(ranks) == 1 and len(alphas) == 1 and len(dropouts) <= 1, "one rank, alpha and dropout per adapter"
    config = {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": base_model,
        "r": ranks.pop(),
        "lora_alpha": alphas.pop(),
        "lora_dropout": dropouts.pop() if dropouts else 0.0,
        "target_modules": sorted(spec.linear) or None,
        "target_parameters": [f"{name}.{stack}" for name in sorted(spec.experts) for stack in stacks] or None,
        "modules_to_save": list(spec.modules_to_save) or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    directory.mkdir(parents=True, exist_ok=True)
    weights = {peft_key(name, stacks): to_peft(name, t).contiguous() for name, t in tensors.items()}
    save_file(weights, directory / WEIGHTS_FILE, metadata={"format": "pt"})
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def read_lora_files(directory: Path, named_by: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A PEFT LoRA adapter directory -> (its adapter_config.json, its tensors by PEFT's keys); a UserError naming the
    setting that pointed at it (`named_by`) when a file is missing, the config is not JSON or the adapter not LoRA."""
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise UserError(
                f"{named_by} = '{directory}': '{path.name}' is missing. Point it at a PEFT adapter directory "
                f"(save_pretrained of a PeftModel, or a checkpoint's adapter/)."
            )
    config = read_json_file(config_path, named_by)
    if config.get("peft_type") != "LORA":
        raise UserError(
            f"{named_by} = '{directory}' holds a {config.get('peft_type')!r} adapter; this backend reads LoRA "
            f"adapters. Point it at a LoRA adapter."
        )
    return config, load_file(weights_path)


def read_adapter(directory: Path, spec: AdapterSpec, experts: int) -> dict[str, torch.Tensor]:
    """PEFT's adapter directory -> {our adapter parameter name: full tensor} for the adapters of `spec` (which the
    directory must hold, each, and nothing else); `experts`: the routed experts per stack."""
    _, found = read_lora_files(directory, "Config key 'model.lora.init_from'")
    stacks = _targeted_stacks(spec)
    names = [f"{name}.{leaf}" for name in spec.linear for leaf in ("lora_A", "lora_B")]
    names += [f"{name}.{stack}_lora_{f}" for name in spec.experts for stack in stacks for f in "AB"]
    wanted = {peft_key(name, stacks): name for name in names}
    missing = sorted(set(wanted) - set(found))
    unexpected = sorted(set(found) - set(wanted))
    if missing or unexpected:
        raise UserError(
            f"Config key 'model.lora.init_from' = '{directory}' does not hold the adapters model.lora describes: "
            f"{len(missing)} missing ({_first(missing)}), {len(unexpected)} unexpected ({_first(unexpected)}). "
            f"Set model.lora.target_modules / model.lora.experts as the adapter was trained (its "
            f"{CONFIG_FILE} lists its targets)."
        )
    return {name: from_peft(name, found[key], experts if _is_stack(name) else 0) for key, name in wanted.items()}


def _is_stack(name: str) -> bool:
    return "_lora_" in name.rpartition(".")[2]


def _targeted_stacks(spec: AdapterSpec) -> list[str]:
    targeted = {stack for stacks in spec.experts.values() for stack in stacks}
    return [stack for stack in EXPERT_STACKS if stack in targeted]


def _first(keys: list[str]) -> str:
    return ", ".join(re.sub(r"^base_model\.model\.", "", key) for key in keys[:3]) + (", ..." if len(keys) > 3 else "")


def save_adapter(model: torch.nn.Module, directory: Path, base_model: str | None) -> None:
    """The model's adapters in PEFT's format (collective: every rank gathers each full tensor; rank 0 writes)."""
    from torch.distributed.tensor import DTensor

    tensors = {}
    for name, param in model.named_parameters():
        if is_adapter(name):
            full = param.full_tensor() if isinstance(param, DTensor) else param
            tensors[name] = full.detach().float().cpu()
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        write_adapter(directory, tensors, model.adapter_spec, base_model)
