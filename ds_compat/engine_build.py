"""initialize's build: the model passed to `deepspeed.initialize` recognised (transformers' GLM-4.5V, a PEFT LoRA
model of it, any other module) and sent down its door: GLM-4.5V onto the plan registry (ds_compat/glm_door.py), any
other module onto the FSDP-only module plans (glm45v_fsdp.plans.MODULE_PLANS, through builders.adopt_module), with
FSDP units found from its ModuleLists: the generic path, here. The engine gets an EngineModel back and builds the
step on it."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ds_compat._common import format_value
from ds_compat.config import Translation
from ds_compat.ds_keys import EXTENSION_KEY
from ds_compat.engine_model import EngineModel, context_parallel_keys, reuse_sharded
from ds_compat.glm_door import build_glm, is_glm45v, peft_glm45v
from ds_compat.script_weights import module_partitions
from ds_compat.utils import z3_leaf_module
from glm45v_fsdp.builders import adopt_module
from glm45v_fsdp.config import Config
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.log import get_logger
from glm45v_fsdp.lora.peft_model import is_peft_model
from glm45v_fsdp.plans import PlanContext
from glm45v_fsdp.runtime import DeviceLayer, ParallelMeshes, build_parallel_dims

# Overrides the translation emits for our trainer that the engine (any nn.Module) does not apply, and why.
NOT_APPLIED = {
    "features.recompute.enabled": (
        "activation_checkpointing has no effect on the engine, as in DeepSpeed, where it applies only inside models "
        "that call deepspeed.checkpointing.checkpoint (ds_compat.checkpointing.checkpoint here)"
    ),
    "features.activation_offload.enabled": (
        "cpu_checkpointing has no effect on the engine (no activation offload for an arbitrary module)"
    ),
    "training.tensorboard": "the engine writes no tensorboard events (our trainer does)",
}
PLAN_KEYS = {"features.recompute.enabled", "features.activation_offload.enabled"}  # applied to GLM-4.5V by plan


# The extension section's keys that switch a plan of the registry: the generic path applies none of them.
PLAN_EXTENSION_PREFIXES = ("features.", "model.")


def build_engine_model(
    model: nn.Module, translation: Translation, alst: bool, device_layer: DeviceLayer, device: torch.device
) -> EngineModel:
    """Recognise the model and build it down its door: GLM-4.5V, bare or inside a PEFT LoRA model, on the plan
    registry; any other module on the generic path."""
    peft_base = peft_glm45v(model)
    glm45v = is_glm45v(model) or peft_base is not None
    log_translation_notes(translation, glm45v)
    if glm45v:
        return build_glm(model, peft_base if peft_base is not None else model, translation, alst, device_layer, device)
    return build_generic(model, translation, device_layer, device)


def log_translation_notes(translation: Translation, glm45v: bool) -> None:
    """The translation's notes for the engine (the trainer's own are not), misspellings, and the keys the engine
    does not apply."""
    log = get_logger()
    for note in translation.notes:
        if note not in translation.trainer_notes:
            log.info("ds_compat: %s", note)
    for warning in translation.misspelled:
        log.warning("ds_compat: %s", warning)
    for key, value in translation.fields.items():
        if key in NOT_APPLIED and value and not (glm45v and key in PLAN_KEYS):
            log.warning("ds_compat: %s=%s: %s", key, format_value(value), NOT_APPLIED[key])


def generic_path_note(model: nn.Module) -> str:
    """The one line that says a module takes the generic path, and what is therefore off."""
    peft = " (a PEFT model whose base model is not transformers' GLM-4.5V)" if is_peft_model(model) else ""
    return (
        f"{type(model).__name__} is not a model this backend builds on its plan registry (transformers' GLM-4.5V)"
        f"{peft}: it runs generic FSDP2 (each child of its ModuleLists a unit, then the root); expert parallelism, "
        f"context parallelism, the chunked loss, recompute, activation offload and the accelerator ops are off"
    )


def refuse_plan_extension(extension: dict[str, Any], model: nn.Module) -> None:
    """An extension key (the translation's `extension`) that switches a plan is refused on the generic path, never
    logged as taken and dropped."""
    leaves = [(path, value) for path, value in extension.items() if path.startswith(PLAN_EXTENSION_PREFIXES)]
    if leaves:
        path, value = leaves[0]
        raise UserError(
            f"DeepSpeed config key '{EXTENSION_KEY}.{path}' = {value!r} switches a plan of this backend's plan "
            f"registry, which a {type(model).__name__} does not run on: {generic_path_note(model)}. Remove the key "
            f"(and the section's other features / model keys), or pass transformers' GLM-4.5V."
        )


def auto_fsdp_units(model: nn.Module) -> list[str]:
    """The automatic FSDP plan for an arbitrary module: every child of an nn.ModuleList is a unit of its own (the
    outermost ModuleLists only: their children already hold the nested ones, and none inside a ZeRO-3 leaf module,
    `deepspeed.utils.set_z3_leaf_modules`); the root is always a unit."""
    patterns: list[str] = []
    taken = [name for name, module in model.named_modules() if name and z3_leaf_module(module)]
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if any(name == t or name.startswith(t + ".") for t in taken):
            continue
        patterns.append(f"{name}.{{*}}" if name else "{*}")
        taken.extend(f"{name}.{index}" if name else str(index) for index in range(len(module)))
    return patterns


def build_generic(
    model: nn.Module, translation: Translation, device_layer: DeviceLayer, device: torch.device
) -> EngineModel:
    """Any other module: the keys that need a model's own code refused, the FSDP units from its ModuleLists, then
    sharded in place by the module plans with its own values (rank 0's) and its zero.Init partitions."""
    refuse_plan_extension(translation.extension, model)
    get_logger().info("ds_compat: %s", generic_path_note(model))
    split = next(((key, size) for key, size in context_parallel_keys(translation) if size > 1), None)
    if split is not None:
        raise UserError(
            f"DeepSpeed config key '{split[0]}' = {split[1]} is not "
            f"supported for a {type(model).__name__} by the engine API: splitting the sequence needs the "
            "model's own sequence-parallel attention, which this backend has for GLM-4.5V (transformers' "
            "Glm4vMoeForConditionalGeneration) only. Remove the key (and parallelism_config's sp_size), or pass "
            "a GLM-4.5V."
        )
    if translation.expert_parallel.size > 1:
        raise UserError(
            f"DeepSpeed config key 'expert_parallel.autoep_size' = {translation.expert_parallel.size} is not "
            f"supported for a {type(model).__name__} by the engine API: splitting the experts of a module needs "
            "to know its MoE block (router, expert stacks, how tokens reach them), which this backend knows for "
            "GLM-4.5V (transformers' Glm4vMoeForConditionalGeneration) only. Set expert_parallel.enabled to "
            "false, or pass a GLM-4.5V."
        )
    old_names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    config = translation.apply(Config(), {})
    config.parallel.fsdp_plan = dataclasses.replace(config.parallel.fsdp_plan, apply_modules=auto_fsdp_units(model))
    dims = build_parallel_dims(config.parallel, dist.get_world_size())
    built = EngineModel(model, model, False, config, dims, ParallelMeshes(dims, device_layer.type), old_names)
    if not reuse_sharded(built):
        weights = module_partitions(model)
        context = PlanContext(config, dims, getattr(model, "config", None), device_layer, built.meshes, device, weights)
        adopt_module(model, context)
    return built
