"""The lora plan's work on the meta-device model: which modules get adapters, and the base frozen.

An `AdapterSpec` says it per module; it comes from our config (`model.lora`: patterns matched like every plan's) or
from a PEFT model a script hands the DeepSpeed door (its LoRA layers, as PEFT built them). `apply_adapters` then
puts a `LoraLinear` in place of each adapted nn.Linear and the adapter stacks on each adapted experts module, and
leaves `requires_grad` on the adapters and the `modules_to_save` only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from glm45v_fsdp.adapters import LoraLinear, add_expert_adapters, is_adapter
from glm45v_fsdp.config import LoraConfig
from glm45v_fsdp.errors import ConfigError
from glm45v_fsdp.model.moe import GroupedExperts
from glm45v_fsdp.module_patterns import PlanMatch, match_modules

EXPERT_STACKS = ("gate_up_proj", "down_proj")  # in registration order: PEFT nests its wrappers in this order


@dataclass(frozen=True)
class LinearAdapter:
    rank: int
    alpha: float
    dropout: float = 0.0


@dataclass(frozen=True)
class AdapterSpec:
    """Which modules get which adapter: linear layers by module name, experts modules by name -> {stack: adapter}."""

    linear: dict[str, LinearAdapter] = field(default_factory=dict)
    experts: dict[str, dict[str, LinearAdapter]] = field(default_factory=dict)
    modules_to_save: tuple[str, ...] = ()
    # The parameters that train, by name, when the model decides (a PEFT model's requires_grad); None: the adapters
    # and the modules_to_save.
    trained: frozenset[str] | None = None

    def counts(self) -> str:
        """For the log: how many linear modules, experts modules and experts got adapters."""
        stacks = sum(len(stacks) for stacks in self.experts.values())
        return (
            f"{len(self.linear)} linear module(s), {len(self.experts)} experts module(s) ({stacks} stack(s)), "
            f"{len(self.modules_to_save)} module(s) trained in full"
        )


def spec_from_config(model: nn.Module, lora: LoraConfig) -> tuple[AdapterSpec, list[PlanMatch]]:
    """`model.lora` on this model: every target pattern must match nn.Linear modules, `experts` needs routed
    experts, every modules_to_save pattern must match."""
    adapter = LinearAdapter(lora.rank, lora.alpha, lora.dropout)
    matches = match_modules(model, lora.target_modules, "model.lora.target_modules") if lora.target_modules else []
    linear = {}
    for match in matches:
        for name in match.names:
            module = model.get_submodule(name)
            if type(module) is not nn.Linear:
                raise ConfigError(
                    f"Config key 'model.lora.target_modules': pattern {match.pattern!r} matches '{name}', a "
                    f"{type(module).__name__}, not an nn.Linear. LoRA adapts linear layers here; the routed experts "
                    f"get adapters with model.lora.experts=true. Narrow the pattern to the linear layers."
                )
            linear[name] = adapter
    experts = {}
    if lora.experts:
        names = tuple(name for name, module in model.named_modules() if isinstance(module, GroupedExperts))
        if not names:
            raise ConfigError(
                "Config key 'model.lora.experts' = true, but the model has no routed experts (no MoE layer). Set it "
                "to false."
            )
        if lora.dropout:
            raise ConfigError(
                f"Config key 'model.lora.dropout' = {lora.dropout} with model.lora.experts=true: an expert's adapter "
                f"has no dropout (as PEFT's target_parameters: dropout cannot be factored out of a stack's update). "
                f"Set model.lora.dropout=0, or model.lora.experts=false."
            )
        experts = {name: {stack: adapter for stack in EXPERT_STACKS} for name in names}
        matches.append(PlanMatch("routed experts: gate_up_proj, down_proj", names))
    saved = match_modules(model, lora.modules_to_save, "model.lora.modules_to_save") if lora.modules_to_save else []
    matches += saved
    spec = AdapterSpec(linear, experts, tuple(name for match in saved for name in match.names))
    return spec, matches


def apply_adapters(model: nn.Module, spec: AdapterSpec) -> None:
    """Adapters in place (meta device); then only the adapters and modules_to_save train."""
    for name, adapter in spec.linear.items():
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attribute, LoraLinear(getattr(parent, attribute), adapter.rank, adapter.alpha, adapter.dropout))
    for name, stacks in spec.experts.items():
        add_expert_adapters(
            model.get_submodule(name), {stack: (adapter.rank, adapter.alpha) for stack, adapter in stacks.items()}
        )
    saved = tuple(f"{name}." for name in spec.modules_to_save)
    for name, param in model.named_parameters():
        trains = (is_adapter(name) or name.startswith(saved)) if spec.trained is None else name in spec.trained
        param.requires_grad_(trains)


def lora_summary(model: nn.Module) -> dict[str, int]:
    """Adapter and trainable parameter counts (global sizes), for the log and the metrics."""
    adapters = sum(param.numel() for name, param in model.named_parameters() if is_adapter(name))
    trainable = sum(param.numel() for param in model.parameters() if param.requires_grad)
    return {"adapter_params": adapters, "trainable_params": trainable}


def adapter_matches(spec: AdapterSpec) -> list[PlanMatch]:
    """A given spec's modules as plan matches (for the log: what a PEFT model's adapters cover)."""
    matches = [PlanMatch("PEFT LoRA linear layers", tuple(spec.linear))] if spec.linear else []
    if spec.experts:
        matches.append(PlanMatch("PEFT LoRA routed experts (target_parameters)", tuple(spec.experts)))
    if spec.modules_to_save:
        matches.append(PlanMatch("PEFT modules_to_save", spec.modules_to_save))
    return matches


def store_frozen_in(model: nn.Module, dtype: torch.dtype) -> int:
    """Every frozen floating-point parameter in `dtype` (meta device, before FSDP): it is only ever read in the
    compute dtype, so its fp32 master copy would be dead weight. FSDP2 then all-gathers it as it is, and the weights
    plan loads it with the cast a compute copy gets. Returns how many parameters (elements) it stored so."""
    stored = 0
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and not param.requires_grad and param.is_floating_point() and param.dtype != dtype:
                module._parameters[name] = nn.Parameter(param.to(dtype), requires_grad=False)
                stored += param.numel()
    return stored
