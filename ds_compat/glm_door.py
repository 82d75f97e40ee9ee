"""GLM-4.5V through `deepspeed.initialize`: the engine recognises transformers' model and builds it on the same plan
registry as our trainer (glm45v_fsdp.builders.adopt_model), switched by DeepSpeed's own keys.

What reaches the plans, and from where:
- the ds_config's translation (ds_compat.config): ZeRO stage -> FSDP2 layout, precision, `expert_parallel` -> EP,
  `activation_checkpointing` -> recompute, `cpu_checkpointing` -> activation offload, and the extension section
  (ds_compat.extension) for what DeepSpeed has no key for (chunked loss, EP balance, ops, HSDP replicate);
- a PEFT LoRA model of it (get_peft_model, PeftModel.from_pretrained): the adapters PEFT built, taken apart by
  glm45v_fsdp.lora.peft_model into the lora plan's spec and values, the PEFT object kept as the script's model with
  PEFT's names on its state dicts;
- the model itself: transformers' activation checkpointing, switched on before `initialize` (the HF Trainer's
  gradient_checkpointing=True, LLaMA-Factory), becomes the recompute plan and is switched off in transformers; its
  attention implementation; its weights, requires_grad and parameter names (ds_compat/script_weights.py).

`build_glm` walks the door in one pass, from what the model decides down to builders.adopt_model; the helpers above
it are its steps.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import Glm4vMoeForConditionalGeneration
from transformers.modeling_layers import GradientCheckpointingLayer

from ds_compat._common import key_error, render_fields
from ds_compat.config import Translation
from ds_compat.ds_keys import EXTENSION_KEY
from ds_compat.engine_model import EngineModel, context_parallel_keys, reuse_sharded, sharded_before
from ds_compat.script_weights import take_weights
from ds_compat.sections import AutoEP
from glm45v_fsdp.builders import adopt_model
from glm45v_fsdp.config import Config, FsdpPlanConfig
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.log import get_logger
from glm45v_fsdp.lora.peft_model import PeftAdapters, keep_peft_names, peft_base_model, take_adapters
from glm45v_fsdp.model.hf_forward import Glm4vMoeForScripts
from glm45v_fsdp.plans import moe_layer_names
from glm45v_fsdp.runtime import DeviceLayer, ParallelMeshes, build_parallel_dims

MODEL_TYPE = "glm4v_moe"
PRESET_NAME = "glm4v_moe"  # expert_parallel.preset_model for GLM-4.5V (DeepSpeed 0.19 has no preset for it)
ROUTER, EXPERTS = "gate", "experts"  # AutoEP's router_pattern / expert_pattern: child names in the MoE layer
ATTENTION = ("sdpa", "eager", "flash_attention_2")


def is_glm45v(model: nn.Module) -> bool:
    """transformers' GLM-4.5V with its own forward (a subclass that overrides forward keeps the generic path)."""
    if not isinstance(model, Glm4vMoeForConditionalGeneration):
        return False
    if getattr(model.config, "model_type", None) != MODEL_TYPE:
        return False
    return type(model).forward in (Glm4vMoeForConditionalGeneration.forward, Glm4vMoeForScripts.forward)


def peft_glm45v(model: nn.Module) -> nn.Module | None:
    """The GLM-4.5V inside a PEFT LoRA model; None for anything else."""
    base = peft_base_model(model)
    return base if base is not None and is_glm45v(base) else None


def lora_fields(adapters: PeftAdapters) -> dict[str, Any]:
    """Our model.lora keys (key path -> value) for a PEFT model's adapters: they switch the lora plan on, which takes
    the modules, ranks and scalings from the spec itself (each layer as PEFT built it)."""
    spec = adapters.spec
    settings = [*spec.linear.values(), *(adapter for stacks in spec.experts.values() for adapter in stacks.values())]
    if not settings:
        raise UserError(
            "The PEFT model passed to deepspeed.initialize has no LoRA layer this backend adapts (nn.Linear layers, "
            "the routed experts' stacks): check its LoraConfig's target_modules / target_parameters."
        )
    return {
        "model.lora.rank": settings[0].rank,
        "model.lora.alpha": settings[0].alpha,
        "model.lora.experts": bool(spec.experts),
    }


def model_fields(model: nn.Module) -> dict[str, Any]:
    """Our config keys (key path -> value) the script's model decides: its attention implementation, and
    transformers' activation checkpointing (then switched off in transformers: the recompute plan replaces it, never
    runs beside it)."""
    attention = model.config._attn_implementation
    if attention not in ATTENTION:
        raise UserError(
            f"The GLM-4.5V model passed to deepspeed.initialize uses attn_implementation={attention!r}; this backend "
            f"runs {', '.join(ATTENTION)}. Build the model with one of them (from_pretrained(..., "
            'attn_implementation="sdpa")).'
        )
    fields: dict[str, Any] = {"model.attn_implementation": attention}
    layers = [name for name, module in model.named_modules() if isinstance(module, GradientCheckpointingLayer)]
    checkpointed = [name for name in layers if model.get_submodule(name).gradient_checkpointing]
    if checkpointed:
        # transformers >= 5.23 names it activation_checkpointing_disable, earlier 5.x gradient_checkpointing_disable
        disable = getattr(model, "activation_checkpointing_disable", model.gradient_checkpointing_disable)
        disable()
        fields["features.recompute.enabled"] = True
        if checkpointed != layers:  # transformers' every_n_layers: the same layers, by name
            fields["features.recompute.apply_modules"] = checkpointed
    return fields


def forward_replaced(model: nn.Module) -> bool:
    """The script replaced `forward` on the instance (TRL's fused LM head: it runs `model.model` and computes its own
    loss from `lm_head.weight`); our forward and its chunked loss then never run."""
    return "forward" in vars(model)


def check_router_features(config: Config, model: nn.Module, alst: bool) -> None:
    """The extension's auxiliary balance loss (features.router.aux_loss_coef) is added to the loss by our forward:
    refused where our forward does not compute the loss (a forward replaced on the instance), and under DeepSpeed's
    ALST loader adapter, whose loss is this rank's slice's alone and whose gradients DeepSpeed averages over the
    sequence-parallel ranks (a whole-sequence auxiliary loss would be scaled down by their number). A model whose
    config asks for transformers' router loss (text_config.output_router_logits) must get it from the extension
    section, which our forward reads, rather than lose it."""
    router = config.features.router
    text = model.config.text_config
    if getattr(text, "output_router_logits", False) and not forward_replaced(model):
        wanted = text.router_aux_loss_coef
        if router.aux_loss_type != "transformers" or router.aux_loss_coef != wanted:
            raise UserError(
                f"The GLM-4.5V passed to deepspeed.initialize has text_config.output_router_logits=True (transformers "
                f"then adds router_aux_loss_coef={wanted} x its load-balancing loss), which this backend's forward "
                f'does not read. Ask for it in the ds_config\'s \'{EXTENSION_KEY}\' section: "features": {{"router": '
                f'{{"aux_loss_type": "transformers", "aux_loss_coef": {wanted}}}}}, or build the model with '
                "output_router_logits=False."
            )
    coefficient = router.aux_loss_coef
    if not coefficient:
        return
    key = f"DeepSpeed config key '{EXTENSION_KEY}.features.router.aux_loss_coef' = {coefficient}"
    if forward_replaced(model):
        raise UserError(
            f"{key} with a GLM-4.5V whose forward was replaced on the instance "
            f"({getattr(vars(model)['forward'], '__qualname__', 'a callable')}, e.g. TRL's fused LM head): that "
            "forward computes the loss itself, so the auxiliary loss our forward adds would never reach it. Use the "
            "script's own auxiliary loss (TRL: router_aux_loss_coef), or remove the key."
        )
    if alst:
        raise UserError(
            f"{key} under DeepSpeed's ALST sequence parallelism (deepspeed.initialize with an mpu, e.g. accelerate's "
            "parallelism_config): each rank's loss is its slice's and DeepSpeed averages the gradients over the "
            "sequence-parallel ranks, which would divide the auxiliary loss's gradient by their number. Split the "
            "sequence with the ds_config's sequence_parallel_size instead (the model splits each sequence itself and "
            "the auxiliary loss is exact there), or remove the key."
        )


# What a script's forward pre-hook calls before the model's forward: ms-swift's GLM-4.5V template embeds input_ids
# with the model's own embed_tokens and runs its vision tower, then passes inputs_embeds.
DIRECTLY_CALLED = ("model.language_model.embed_tokens", "model.visual")


def directly_called(model: nn.Module, glm: nn.Module) -> tuple[str, ...]:
    """The modules the script may call itself before the forward: DIRECTLY_CALLED when it registered a forward
    pre-hook on the model (the PEFT model or transformers' own), none otherwise."""
    return DIRECTLY_CALLED if model._forward_pre_hooks or glm._forward_pre_hooks else ()


def with_units(plan: FsdpPlanConfig, names: tuple[str, ...]) -> FsdpPlanConfig:
    """The FSDP plan with each of `names` selected (as its own pattern) when no pattern selects it yet."""
    missing = [name for name in names if name not in plan.apply_modules]
    return dataclasses.replace(plan, apply_modules=[*plan.apply_modules, *missing]) if missing else plan


def output_layer_in_root(model: nn.Module, plan: FsdpPlanConfig) -> FsdpPlanConfig:
    """Under a replaced forward, `lm_head` stays in the root's FSDP unit. A forward that reads `lm_head.weight`
    without calling `lm_head` would find a unit of its own still sharded, and a shard's `full_tensor()` gets in
    backward only this rank's gradient, never reduced over the ranks; the root unit is gathered for any call of the
    model, so the weight read there is the full one and its gradient is reduce-scattered as every other."""
    if not forward_replaced(model) or "lm_head" not in plan.apply_modules:
        return plan
    return dataclasses.replace(plan, apply_modules=[name for name in plan.apply_modules if name != "lm_head"])


def check_autoep_section(autoep: AutoEP, model: nn.Module, moe_layers: list[str]) -> None:
    """AutoEP's keys that locate the MoE layers (the translation's `expert_parallel`) must describe this model:
    `preset_model` glm4v_moe, a `moe_layer_pattern` that matches exactly its MoE layers (among the modules with an
    experts child, as AutoEP skips dense ones), `router_pattern` gate, `expert_pattern` experts."""
    if not autoep.enabled:
        return
    preset = autoep.preset_model
    if preset is not None and preset != PRESET_NAME:
        raise key_error(
            "expert_parallel.preset_model",
            preset,
            f"is not GLM-4.5V's preset; the model passed to initialize is GLM-4.5V ({MODEL_TYPE})",
            f'Write "{PRESET_NAME}" or remove the key (the MoE layers are found from the model).',
        )
    pattern = autoep.moe_layer_pattern
    if pattern is not None:
        # as AutoEP: a matched module without an experts child is a dense MLP, skipped
        matched = [
            name for name, module in model.named_modules() if re.fullmatch(pattern, name) and hasattr(module, EXPERTS)
        ]
        shown = ", ".join(matched[:3]) + (", ..." if len(matched) > 3 else "")
        if matched != moe_layers:
            raise key_error(
                "expert_parallel.moe_layer_pattern",
                pattern,
                f"matches {len(matched)} module(s) ({shown or 'none'}), not GLM-4.5V's {len(moe_layers)} MoE "
                f"layers ({moe_layers[0]} ... {moe_layers[-1]})",
                r'Write "model\.language_model\.layers\.\d+\.mlp" or remove the key.',
            )
    for key, child in (("router_pattern", ROUTER), ("expert_pattern", EXPERTS)):
        value = getattr(autoep, key)
        if value is not None and value != child:
            raise key_error(
                f"expert_parallel.{key}",
                value,
                f"names no child of GLM-4.5V's MoE layers (the {key.split('_')[0]} is '{child}')",
                f'Write "{child}" or remove the key.',
            )


def build_glm(
    model: nn.Module,
    core: nn.Module,
    translation: Translation,
    alst: bool,
    device_layer: DeviceLayer,
    device: torch.device,
) -> EngineModel:
    """GLM-4.5V (`core`), bare or inside a PEFT LoRA model (`model`), down its door in one pass: what the model
    decides (attention, transformers' checkpointing, the PEFT adapters) added to the translation, checked against
    the ds_config, the FSDP units the script needs, then rebuilt in place on the plan registry (builders.adopt_model)
    with the script's weights; an earlier engine's model keeps its units. Nothing is left to do here once the plans
    ran: the engine marks the model sharded and builds the step."""
    log = get_logger()
    world_size = dist.get_world_size()
    split = next(((key, size) for key, size in context_parallel_keys(translation) if size > 1), None)
    old_names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    from_model: dict[str, Any] = {}
    peft = None
    fresh = not sharded_before(model)
    if fresh:
        check_autoep_section(translation.expert_parallel, core, moe_layer_names(core.config))
        from_model = model_fields(core)
        if core is not model:
            peft = take_adapters(model)  # the LoRA layers unwrapped: core is transformers' model again
            from_model |= lora_fields(peft)
            old_names = {key: peft.names.ours(name) for key, name in old_names.items()}
    config = translation.apply(Config(), from_model)
    check_router_features(config, core, alst)
    dims = build_parallel_dims(config.parallel, world_size)
    built = EngineModel(model, core, True, config, dims, ParallelMeshes(dims, device_layer.type), old_names)
    own_units: tuple[str, ...] = ()
    config.parallel.fsdp_plan = output_layer_in_root(core, config.parallel.fsdp_plan)
    if fresh:
        own_units = directly_called(model, core)
        config.parallel.fsdp_plan = with_units(config.parallel.fsdp_plan, own_units)
    replaced = getattr(vars(core).get("forward"), "__qualname__", "a callable")
    if forward_replaced(core) and split is not None and not alst:
        raise UserError(
            f"DeepSpeed config key '{split[0]}' = {split[1]} with a GLM-4.5V whose forward was replaced on the "
            f"instance ({replaced}, e.g. TRL's fused LM head): that forward computes the loss itself from the "
            "backbone's output, which under context parallelism is this rank's slice of the sequence, against the "
            "whole sequence's labels. Use parallelism_config (ParallelismConfig(sp_backend='deepspeed', "
            "sp_size=N)), whose loader adapter hands each rank its slice of the targets, or remove the key."
        )
    if forward_replaced(core) and fresh:
        log.info(
            "ds_compat: the model's forward was replaced on the instance (%s): it computes its own loss, so the "
            "chunk_loss plan does not run and lm_head stays in the root FSDP unit (its weight is read without "
            "calling lm_head)",
            replaced,
        )
    if reuse_sharded(built):
        return built
    log.info(
        "ds_compat: GLM-4.5V recognised (%s): built through the plan registry as our trainer builds it; from the "
        "model: %s",
        type(model).__name__,
        ", ".join(render_fields(from_model)),
    )
    weights = take_weights(core, device, broadcast=world_size > 1, adapters=peft)
    if own_units:
        log.info(
            "ds_compat: the script registered a forward pre-hook on the model, which may call its submodules "
            "before the forward (ms-swift's template embeds the tokens and runs the vision tower there): %s each "
            "an FSDP unit of its own, gathered when called, the root initialised before the first call",
            ", ".join(own_units),
        )
    if peft is not None:
        keep_peft_names(model, peft.names)
        log.info(
            "ds_compat: the lora plan builds the %s; the %s keeps PEFT's parameter names in its state dicts",
            peft.describe(),
            type(model).__name__,
        )
    if config.features.chunk_loss.mode != "off" and not forward_replaced(core):
        log.info(
            "ds_compat: the loss is chunked (%s): the model's output holds .loss and no logits",
            config.features.chunk_loss.mode,
        )
    spec = peft.spec if peft is not None else None
    adopt_model(core, config, dims, built.meshes, device_layer, device, weights, spec, own_units)
    return built
