"""The DeepSpeed engine API on the FSDP2 core: `deepspeed.initialize(...)` -> an engine with forward, backward,
step, save_checkpoint and load_checkpoint, for any nn.Module.

Nothing here re-implements training: the ds_config goes through `ds_compat.config.translate` (batch triple, ZeRO
layout, precision, clipping, optimizer and scheduler specs), the meshes through `glm45v_fsdp.runtime`, the sharding
through `glm45v_fsdp.parallel.fsdp.apply_fsdp` with an automatic plan, the end of each step (norm, clipping, skip,
optimizer, schedule, loss scaler) through the trainer's `glm45v_fsdp.step.OptimizerStep`, and the checkpoint tensors
through `glm45v_fsdp.checkpoint.dcp`. The engine adds DeepSpeed's bookkeeping around them: micro steps, the
accumulation boundary, global steps and samples, skipped steps, the `latest` file and the client state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.data import DistributedSampler, IterableDataset

from ds_compat._common import format_value, render_fields
from ds_compat.alst import alst_sequence_parallel_size, sequence_average
from ds_compat.comm import device_layer, get_local_rank
from ds_compat.config import Translation, translate
from ds_compat.dataloader import DeepSpeedDataLoader
from ds_compat.ds_keys import EXTENSION_KEY
from ds_compat.glm_door import (
    check_autoep_section,
    check_router_features,
    directly_called,
    forward_replaced,
    is_glm45v,
    lora_fields,
    model_fields,
    output_layer_in_root,
    peft_glm45v,
    take_weights,
    with_units,
)
from ds_compat.step_watch import watch_steps, watched
from ds_compat.utils import groups, z3_leaf_module
from ds_compat.zero.partition_parameters import gather_full, is_partitioned
from glm45v_fsdp.builders import adopt_model
from glm45v_fsdp.checkpoint.dcp import (
    METADATA_FILE,
    LoadAdvice,
    load_checkpoint,
    save_model_and_optimizer,
    storage_error,
    storage_failure,
)
from glm45v_fsdp.checkpoint.deepspeed import load_into, read_deepspeed, tag_dir_of
from glm45v_fsdp.checkpoint.integrity import check_manifest, merge_parts, write_part
from glm45v_fsdp.checkpoint.safe_load import load_pt, unsafe_globals
from glm45v_fsdp.checkpoint.state import ENGINE_STATE_FILE
from glm45v_fsdp.config import Config, to_dict
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.log import get_logger, setup_logging
from glm45v_fsdp.lora.peft_model import PeftAdapters, is_peft_model, keep_peft_names, peft_names_of, take_adapters
from glm45v_fsdp.model.router_health import router_monitor
from glm45v_fsdp.optim import RecipeSchedule, build_scheduler
from glm45v_fsdp.parallel.fsdp import DTYPES, apply_fsdp, compute_precision
from glm45v_fsdp.plans import moe_layer_names
from glm45v_fsdp.runtime import ParallelMeshes, build_parallel_dims
from glm45v_fsdp.step import OptimizerStep, StepOutcome

ENGINE_LOAD = LoadAdvice(
    source="Checkpoint '{path}'",
    mismatch_fix="Load it into the model it was saved from, or pass load_module_strict=False to take only the "
    "matching tensors.",
    optimizer_fix="The optimizer state must cover the same parameters; pass load_optimizer_states=False to start "
    "it afresh.",
)
LATEST_FILE = "latest"
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


def _take_zero_init_partitions(model: nn.Module) -> dict[str, nn.Parameter]:
    """Swap each zero.Init-partitioned parameter (an empty tensor plus its rows) for a meta parameter of its full
    shape, so fully_shard sees the real shapes; -> {name: the partitioned parameter, holding the rows}."""
    replacement: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and is_partitioned(param):
                meta = torch.empty(param.ds_shape, dtype=param.dtype, device="meta")
                new = replacement.setdefault(id(param), nn.Parameter(meta, requires_grad=param.requires_grad))
                new._zero_source = param
                module._parameters[name] = new
    return {
        name: param._zero_source
        for name, param in model.named_parameters(remove_duplicate=False)
        if hasattr(param, "_zero_source")
    }


def _fill_from_partitions(model: nn.Module, partitioned: dict[str, nn.Parameter], device: torch.device) -> None:
    """Allocate the sharded model's meta parameters (to_empty; the other parameters and buffers are kept) and fill
    each local shard from the zero.Init rows, one full parameter at a time (a collective per parameter)."""
    kept = {
        name: (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().clone()
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
        if not tensor.is_meta
    }
    model.to_empty(device=device)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name in kept:
                (tensor.to_local() if isinstance(tensor, DTensor) else tensor).copy_(kept[name])
        for name, param in model.named_parameters():
            if name not in partitioned:
                continue
            full = gather_full(partitioned[name]).to(device=device, dtype=param.dtype)
            if isinstance(param, DTensor):
                param.copy_(distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None))
            else:
                param.copy_(full)


SHARDED_AS = "_ds_compat_sharded_as"  # module attribute: how an engine sharded it, so a later engine can reuse it
WHOLE_STATE_DICT = "_ds_compat_whole_state_dict"  # module flag: state_dict() / load_state_dict() with full tensors


def _whole_state_dict_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """ZeRO 0-2 keep parameters whole in DeepSpeed, so `model.state_dict()` holds full tensors: the FSDP2 shards are
    gathered (a collective, as every rank calls state_dict in such code)."""
    if getattr(module, WHOLE_STATE_DICT, False):
        for key, value in state_dict.items():
            if isinstance(value, DTensor):
                state_dict[key] = value.full_tensor()


def _whole_load_state_dict_hook(module: nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
    """The other way: full tensors given to `load_state_dict` become this rank's shards (no communication)."""
    if not getattr(module, WHOLE_STATE_DICT, False):
        return
    targets = {prefix + name: t for name, t in [*module.named_parameters(), *module.named_buffers()]}
    for key, value in state_dict.items():
        target = targets.get(key)
        if isinstance(target, DTensor) and torch.is_tensor(value) and not isinstance(value, DTensor):
            full = value.to(device=target.device, dtype=target.dtype)
            state_dict[key] = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)


def _param_groups(model_parameters: Any) -> list[dict[str, Any]]:
    """model_parameters (tensors or param-group dicts) as a list of groups with list 'params'."""
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [{**group, "params": list(group["params"])} for group in items]
    return [{"params": items}]


def _remap_groups(groups: list[dict[str, Any]], old_names: dict[int, str], new_params: dict[str, nn.Parameter]):
    """Param groups over the model's parameters before sharding, re-pointed at the sharded ones (by name)."""
    remapped = []
    for index, group in enumerate(groups):
        params = []
        for param in group["params"]:
            name = old_names.get(id(param))
            if name is None:
                if any(param is p for p in new_params.values()):
                    params.append(param)
                    continue
                raise UserError(
                    f"Parameter group {index} holds a tensor of shape {tuple(param.shape)} that is not a parameter of "
                    "the model passed to initialize(). The FSDP2 engine shards the model's parameters and can only "
                    "optimize those: pass model.parameters() (or groups of them) as model_parameters / optimizer."
                )
            params.append(new_params[name])
        remapped.append({**group, "params": params})
    return remapped


def _mark_stepped_by_scheduler(optimizer: torch.optim.Optimizer) -> None:
    """What torch's LRScheduler does to the optimizer it is built on, for a scheduler moved onto `optimizer`."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step = optimizer.step

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True
        return step(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    optimizer.step = wrapper


class DeepSpeedEngine(nn.Module):
    """DeepSpeed's engine on FSDP2; built by `ds_compat.initialize`. See docs/ds_compat.md "Engine API"."""

    def __init__(
        self,
        args: Any = None,
        model: nn.Module | None = None,
        optimizer: Any = None,
        model_parameters: Any = None,
        training_data: Any = None,
        lr_scheduler: Any = None,
        mpu: Any = None,
        collate_fn: Callable | None = None,
        config: dict | str | None = None,
    ) -> None:
        super().__init__()
        self.log = get_logger()
        if not self.log.handlers:
            setup_logging(dist.get_rank())
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_rank = get_local_rank()
        self.device_layer = device_layer()
        self.device = self.device_layer.device(self.local_rank)
        self.alst = mpu is not None  # DeepSpeed's ALST: the adapter slices the targets, the loss is the slice's
        alst_size = alst_sequence_parallel_size(mpu) if self.alst else None
        self.translation: Translation = translate(config, self.world_size, alst_sequence_parallel=alst_size)
        # GLM-4.5V, bare or inside a PEFT LoRA model, runs on the plan registry; any other module on the generic path
        peft_base = peft_glm45v(model)
        self.glm45v = is_glm45v(model) or peft_base is not None
        self.core = peft_base if peft_base is not None else model  # the model the plans (or generic FSDP) build
        if not self.glm45v:
            refuse_plan_extension(self.translation.extension, model)
            self.log.info("ds_compat: %s", generic_path_note(model))
        split = next(((key, size) for key, size in self._context_parallel_keys() if size > 1), None)
        if split is not None and not self.glm45v:
            raise UserError(
                f"DeepSpeed config key '{split[0]}' = {split[1]} is not "
                f"supported for a {type(model).__name__} by the engine API: splitting the sequence needs the "
                "model's own sequence-parallel attention, which this backend has for GLM-4.5V (transformers' "
                "Glm4vMoeForConditionalGeneration) only. Remove the key (and parallelism_config's sp_size), or pass "
                "a GLM-4.5V."
            )
        if self.translation.expert_parallel.size > 1 and not self.glm45v:
            raise UserError(
                f"DeepSpeed config key 'expert_parallel.autoep_size' = {self.translation.expert_parallel.size} is not "
                f"supported for a {type(model).__name__} by the engine API: splitting the experts of a module needs "
                "to know its MoE block (router, expert stacks, how tokens reach them), which this backend knows for "
                "GLM-4.5V (transformers' Glm4vMoeForConditionalGeneration) only. Set expert_parallel.enabled to "
                "false, or pass a GLM-4.5V."
            )
        self.config = self.translation.ds_config  # DeepSpeed's engine.config: the config dict
        old_names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
        # read now: a generator (model.parameters()) read after the model is rebuilt would yield the new parameters,
        # whose ids may be those of freed old ones
        given_groups = None if model_parameters is None else _param_groups(model_parameters)
        from_model: dict[str, Any] = {}
        self.peft: PeftAdapters | None = None
        if self.glm45v and not hasattr(model, SHARDED_AS):
            check_autoep_section(self.translation.expert_parallel, self.core, moe_layer_names(self.core.config))
            from_model = model_fields(self.core)
            if self.core is not model:
                self.peft = take_adapters(model)  # the LoRA layers unwrapped: self.core is transformers' model again
                from_model |= lora_fields(self.peft)
                old_names = {key: self.peft.names.ours(name) for key, name in old_names.items()}
        self._config = self.translation.apply(Config(), from_model)
        if self.glm45v:
            check_router_features(self._config, self.core, self.alst)
        self.dims = build_parallel_dims(self._config.parallel, self.world_size)
        self.meshes = ParallelMeshes(self.dims, self.device_layer.type)
        groups.use_meshes(self.meshes)  # deepspeed.utils.groups answers from this engine's meshes
        self.dp_world_size = self.dims.dp
        self.mp_world_size = 1
        self.client_optimizer = optimizer
        self.client_lr_scheduler = lr_scheduler
        self.collate_fn = collate_fn
        self.training_data = training_data
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._global_grad_norm: float | None = None
        self._step_applied = False
        self._is_gradient_accumulation_boundary: bool | None = None
        for note in self.translation.notes:
            if note not in self.translation.trainer_notes:
                self.log.info("ds_compat: %s", note)
        for warning in self.translation.misspelled:
            self.log.warning("ds_compat: %s", warning)
        for key, value in self.translation.fields.items():
            if key in NOT_APPLIED and value and not (self.glm45v and key in PLAN_KEYS):
                self.log.warning("ds_compat: %s=%s: %s", key, format_value(value), NOT_APPLIED[key])

        self.own_units: tuple[str, ...] = ()
        if self.glm45v:
            self._config.parallel.fsdp_plan = output_layer_in_root(self.core, self._config.parallel.fsdp_plan)
            if not hasattr(model, SHARDED_AS):
                self.own_units = directly_called(model, self.core)
                self._config.parallel.fsdp_plan = with_units(self._config.parallel.fsdp_plan, self.own_units)
            if forward_replaced(self.core) and split is not None and not self.alst:
                raise UserError(
                    f"DeepSpeed config key '{split[0]}' = {split[1]} with a GLM-4.5V whose forward was replaced on the "
                    f"instance ({getattr(vars(self.core)['forward'], '__qualname__', 'a callable')}, e.g. TRL's fused "
                    "LM head): that forward computes the loss itself from the backbone's output, which under context "
                    "parallelism is this rank's slice of the sequence, against the whole sequence's labels. Use "
                    "parallelism_config (ParallelismConfig(sp_backend='deepspeed', sp_size=N)), whose loader adapter "
                    "hands each rank its slice of the targets, or remove the key."
                )
            if forward_replaced(self.core) and not hasattr(model, SHARDED_AS):
                self.log.info(
                    "ds_compat: the model's forward was replaced on the instance (%s): it computes its own loss, so "
                    "the chunk_loss plan does not run and lm_head stays in the root FSDP unit (its weight is read "
                    "without calling lm_head)",
                    getattr(vars(self.core)["forward"], "__qualname__", "a callable"),
                )
            self.plan = self._config.parallel.fsdp_plan
            self.module = self._adopt(model, from_model)
        else:
            self.plan = dataclasses.replace(self._config.parallel.fsdp_plan, apply_modules=auto_fsdp_units(model))
            self.module = self._shard(model)
        if not hasattr(self.module, WHOLE_STATE_DICT):  # once per model (an earlier engine may have shared it)
            self.module.register_state_dict_post_hook(_whole_state_dict_hook)
            self.module.register_load_state_dict_pre_hook(_whole_load_state_dict_hook)
        setattr(self.module, WHOLE_STATE_DICT, self.translation.zero_stage <= 2)
        self.loss_scaler = None
        if self.translation.precision == "fp16":
            from glm45v_fsdp.loss_scale import LossScaler  # the trainer's scaler, DeepSpeed's rules

            self.loss_scaler = LossScaler(self._config.training.loss_scale)
            self.log.info("ds_compat: fp16 with %s", self.loss_scaler.describe())
        self.precision = compute_precision(self.core, self.plan, self.device_layer.type)
        new_params = dict(self.module.named_parameters(remove_duplicate=False))

        self.training_dataloader = self.deepspeed_io(training_data) if training_data is not None else None
        self.optimizer: torch.optim.Optimizer | None = None
        self.basic_optimizer = None
        self.lr_scheduler: Any = None
        self.step_runner: OptimizerStep | None = None  # the trainer's step object; built with the optimizer
        if optimizer is not None or self.translation.optimizer.ds_type is not None:
            self._configure_optimizer(optimizer, given_groups, old_names, new_params)
            self._configure_lr_scheduler(lr_scheduler)
            self.step_runner = OptimizerStep(
                [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad],
                self.optimizer,
                self.lr_scheduler,
                clip=self.gradient_clipping(),
                scaler=self.loss_scaler,
                hsdp_root=self.core if isinstance(self.core, FSDPModule) and self.dims.hsdp_enabled else None,
                on_skip=self._skip_step,
                router=router_monitor(self.core),  # MoE bias balancing after each step (features.router)
            )
        self.log.info(
            "ds_compat engine: ZeRO stage %d -> FSDP2 %s over %d rank(s); units %s + root; precision %s; "
            "clipping %s; batch %d = micro %d x accumulation %d x dp %d; optimizer %s; lr scheduler %s",
            self.translation.zero_stage,
            "replicated (HSDP, shard groups of one rank)"
            if self.dims.dp_replicate > 1
            else f"sharded, reshard after forward {self.plan.reshard_after_forward}",
            self.world_size,
            self.plan.apply_modules or "none",
            self.translation.precision,
            self.gradient_clipping() or "off",
            self.train_batch_size(),
            self.train_micro_batch_size_per_gpu(),
            self.gradient_accumulation_steps(),
            self.dp_world_size,
            type(self.optimizer).__name__ if self.optimizer is not None else None,
            self.lr_scheduler,
        )
        watch_steps(self._config.training, self.global_rank, self.world_size)  # a stuck job ends (step_watch.py)

    # ------------------------------------------------------------------------------------------------------
    # Setup
    # ------------------------------------------------------------------------------------------------------
    def _context_parallel_keys(self) -> list[tuple[str, int]]:
        """The ds_config keys that split sequences, with their sizes."""
        return [
            ("sequence_parallel_size", self.translation.sequence_parallel_size),
            (f"{EXTENSION_KEY}.parallel.ring_attention_size", self.translation.ring_attention_size),
        ]

    def _sharding(self) -> tuple:
        """What an engine fixed in place when it sharded a model; a later engine on the same model must agree."""
        ranks = tuple(self.meshes.dense_shard.mesh.flatten().tolist())
        sharding = (ranks, self.plan.param_dtype, self.plan.reduce_dtype, self.plan.cpu_offload)
        return (*sharding, self._plan_keys()) if self.glm45v else sharding

    def _plan_keys(self) -> tuple[str, ...]:
        """The config the plans were applied with (features, parallel, ops), for the GLM-4.5V door."""
        tree = to_dict(self._config)
        return tuple(f"{key}={tree[key]}" for key in ("model", "parallel", "features"))

    def _reuse(self, model: nn.Module) -> bool:
        """An earlier engine's model (HF's second train(), evaluate() then train()): True when it can be reused."""
        previous = getattr(model, SHARDED_AS, None)
        if previous is None:
            on_meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
            if on_meta:
                raise UserError(
                    "The model passed to initialize() has parameters on the meta device. Materialise them first "
                    "(e.g. model.to_empty(device=...) and initialise the weights) — the engine shards real tensors."
                )
            if any(isinstance(module, FSDPModule) for module in model.modules()):
                raise UserError(
                    "deepspeed.initialize was given a model already sharded with FSDP2 by something else than this "
                    "engine. Pass the plain model."
                )
            return False
        sharding = self._sharding()
        if previous != sharding:
            raise UserError(
                f"deepspeed.initialize was given a model an earlier engine sharded with FSDP2 as (ranks, param "
                f"dtype, reduce dtype, cpu offload{', plans' if self.glm45v else ''}) = {previous}; this config needs "
                f"{sharding}, which FSDP2 cannot change in place. Use the same precision, offload, world and plans, "
                "or build the model again."
            )
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
                if module is not model:
                    module.set_reshard_after_forward(self.plan.reshard_after_forward)
        self.log.info("ds_compat: the model is already sharded by an earlier engine; its FSDP2 units are kept")
        return True

    def _adopt(self, model: nn.Module, from_model: dict[str, Any]) -> nn.Module:
        """GLM-4.5V: the script's model rebuilt in place on the plan registry (ds_compat/glm_door.py)."""
        if self._reuse(model):
            return model
        self.log.info(
            "ds_compat: GLM-4.5V recognised (%s): built through the plan registry as our trainer builds it; "
            "from the model: %s",
            type(model).__name__,
            ", ".join(render_fields(from_model)),
        )
        glm = self.core
        partitioned = _take_zero_init_partitions(glm)
        pending = {name: functools.partial(gather_full, param) for name, param in partitioned.items()}
        weights = take_weights(glm, pending, self.device, broadcast=self.world_size > 1, adapters=self.peft)
        spec = self.peft.spec if self.peft is not None else None
        if self.own_units:
            self.log.info(
                "ds_compat: the script registered a forward pre-hook on the model, which may call its submodules "
                "before the forward (ms-swift's template embeds the tokens and runs the vision tower there): %s "
                "each an FSDP unit of its own, gathered when called, the root initialised before the first call",
                ", ".join(self.own_units),
            )
        matched = adopt_model(
            glm, self._config, self.dims, self.meshes, self.device_layer, self.device, weights, spec, self.own_units
        )
        if self.peft is not None:
            keep_peft_names(model, self.peft.names)
            self.log.info(
                "ds_compat: the lora plan built the %s; the %s keeps PEFT's parameter names in its state dicts",
                self.peft.describe(),
                type(model).__name__,
            )
        if "chunk_loss" in matched and not forward_replaced(glm):
            self.log.info(
                "ds_compat: the loss is chunked (%s): the model's output holds .loss and no logits",
                self._config.features.chunk_loss.mode,
            )
        setattr(model, SHARDED_AS, self._sharding())
        return model

    def _shard(self, model: nn.Module) -> nn.Module:
        if self._reuse(model):
            return model
        sharding = self._sharding()
        partitioned = _take_zero_init_partitions(model)
        device = torch.device("cpu") if self.plan.cpu_offload else self.device
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                if not tensor.is_meta:  # the zero.Init ones are meta now, their values in `partitioned`
                    tensor.data = tensor.data.to(device)
                    if self.world_size > 1:  # DeepSpeed broadcasts rank 0's values: every rank starts equal
                        dist.broadcast(tensor.data, src=0)
        sharded = apply_fsdp(model, self.plan, self.meshes.dense_shard, pin_memory=False).sharding
        self.log.info("ds_compat: %s", sharded or "not sharded: the FSDP mesh has one rank")
        setattr(model, SHARDED_AS, sharding)
        if partitioned:
            _fill_from_partitions(model, partitioned, device)
            self.log.info("ds_compat: %d zero.Init parameter(s) put in their FSDP2 shards", len(partitioned))
        return model

    def _configure_optimizer(
        self,
        client_optimizer: Any,
        given_groups: list[dict[str, Any]] | None,
        old_names: dict[int, str],
        new_params: dict[str, nn.Parameter],
    ) -> None:
        """`given_groups`: model_parameters as param groups over the model's parameters before sharding."""
        if given_groups is None:
            groups = [{"params": list(self.module.parameters())}]
        else:
            groups = _remap_groups(given_groups, old_names, new_params)
        if client_optimizer is None:
            optimizer = self.translation.optimizer.build(groups, fused=self.device_layer.has_fused_adamw())
            self.log.info("ds_compat: optimizer from the ds_config: %s", self.translation.optimizer.describe())
        elif isinstance(client_optimizer, torch.optim.Optimizer):
            optimizer = self._repoint_optimizer(client_optimizer, old_names, new_params)
        elif callable(client_optimizer):
            optimizer = client_optimizer(groups)
            self.log.info("ds_compat: optimizer from the client callable: %s", type(optimizer).__name__)
        else:
            raise UserError(
                f"initialize(optimizer=...) must be a torch.optim.Optimizer or a callable taking the parameters, got "
                f"{type(client_optimizer).__name__}."
            )
        optimizer.param_groups[:] = [group for group in optimizer.param_groups if len(group["params"]) != 0]
        seen: set[int] = set()
        for group in optimizer.param_groups:
            for param in group["params"]:
                assert id(param) not in seen, "Duplicate parameters found in optimizer param groups"
                seen.add(id(param))
        self.optimizer = self.basic_optimizer = optimizer

    def _repoint_optimizer(
        self, client: torch.optim.Optimizer, old_names: dict[int, str], new_params: dict[str, nn.Parameter]
    ) -> torch.optim.Optimizer:
        """fully_shard replaced the parameters the client optimizer holds: its param groups are re-pointed at the
        sharded ones (mapped by name) in place, so the object stays the client's, as in DeepSpeed, and a scheduler
        or anything else built on it before initialize() drives the live optimizer."""
        if any(client.state.values()):
            self.log.warning(
                "ds_compat: the client optimizer already holds state (it has stepped); it restarts without it on the "
                "sharded parameters"
            )
        groups = _remap_groups([dict(group) for group in client.param_groups], old_names, new_params)
        for group, remapped in zip(client.param_groups, groups):
            group["params"] = remapped["params"]
        client.state.clear()
        self.log.info(
            "ds_compat: the client optimizer %s now holds the sharded parameters (same object, same param-group "
            "hyperparameters)",
            type(client).__name__,
        )
        return client

    def _configure_lr_scheduler(self, client_scheduler: Any) -> None:
        if client_scheduler is not None:
            if isinstance(client_scheduler, Callable) and not hasattr(client_scheduler, "step"):
                self.lr_scheduler = client_scheduler(self.optimizer)
                self.log.info("ds_compat: lr scheduler from the client callable")
            else:
                self.lr_scheduler = client_scheduler
                if getattr(client_scheduler, "optimizer", self.optimizer) is not self.optimizer:
                    client_scheduler.optimizer = self.optimizer
                    _mark_stepped_by_scheduler(self.optimizer)
                    self.log.info("ds_compat: the client lr scheduler now drives the engine's optimizer")
        elif self.translation.scheduler is not None:
            spec = self.translation.scheduler
            self.lr_scheduler = build_scheduler(self.optimizer, spec.recipe(self.translation.optimizer))

    def deepspeed_io(
        self,
        dataset: Any,
        batch_size: int | None = None,
        route: str = "train",
        pin_memory: bool = True,
        data_sampler: Any = None,
        collate_fn: Callable | None = None,
        num_local_io_workers: int | None = None,
    ) -> DeepSpeedDataLoader:
        if not (
            (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")) or isinstance(dataset, IterableDataset)
        ):
            raise ValueError("Training data must be a torch Dataset")
        if data_sampler is None and route in ("predict", "eval") and not isinstance(dataset, IterableDataset):
            data_sampler = DistributedSampler(
                dataset, num_replicas=self.dp_world_size, rank=self.get_data_parallel_rank(), shuffle=False
            )
        return DeepSpeedDataLoader(
            dataset,
            batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
            dp_world_size=self.dp_world_size,
            dp_rank=self.get_data_parallel_rank(),
            collate_fn=collate_fn or self.collate_fn,
            drop_last=bool(self.config.get("dataloader_drop_last", False)),
            pin_memory=pin_memory and self.device.type != "cpu",
            data_sampler=data_sampler,
        )

    # ------------------------------------------------------------------------------------------------------
    # Configuration queries (DeepSpeed's names)
    # ------------------------------------------------------------------------------------------------------
    def train_batch_size(self) -> int:
        return self.translation.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.translation.batch.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.translation.batch.gradient_accumulation_steps

    def get_batch_info(self) -> tuple[int, int, int]:
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def gradient_clipping(self) -> float:
        return self.translation.clip

    def zero_optimization_stage(self) -> int:
        return self.translation.zero_stage

    def zero_optimization(self) -> bool:
        return self.translation.zero_stage > 0

    def bfloat16_enabled(self) -> bool:
        return self.translation.precision == "bf16"

    def fp16_enabled(self) -> bool:
        return self.translation.precision == "fp16"

    def cur_scale(self) -> float:
        """The fp16 loss scale (1.0 without fp16)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def get_data_parallel_rank(self) -> int:
        return self.meshes.dp.get_local_rank()

    def get_global_grad_norm(self) -> float | None:
        return self._global_grad_norm

    def was_step_applied(self) -> bool:
        return self._step_applied

    def _optimizer_param(self, name: str) -> list[Any]:
        if self.optimizer is None:
            return []
        return [group.get(name, 0.0) for group in self.optimizer.param_groups]

    def get_lr(self) -> list[float]:
        return self._optimizer_param("lr")

    def get_mom(self) -> list[Any]:
        name = "momentum" if type(self.optimizer).__name__ in ("SGD", "RMSprop") else "betas"
        return self._optimizer_param(name)

    def __getattr__(self, name: str) -> Any:
        """Attributes the engine lacks come from the wrapped module, as in DeepSpeed."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is not None and hasattr(module, name):
                return getattr(module, name)
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'") from None

    # ------------------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------------------
    def train(self, mode: bool = True) -> DeepSpeedEngine:
        self.module.train(mode)
        self.training = mode
        return self

    def eval(self) -> DeepSpeedEngine:
        return self.train(False)

    @watched
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if isinstance(self.core, FSDPModule):
            # FSDP2 takes the first sharded module run as its root: a script's pre-hook may run one of the model's
            # own units before the model (the root) starts
            self.core._get_fsdp_state()._lazy_init()
        with self.precision:
            return self.module(*inputs, **kwargs)

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._is_gradient_accumulation_boundary is not None:
            return self._is_gradient_accumulation_boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._is_gradient_accumulation_boundary = is_boundary

    @watched
    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """loss / gradient_accumulation_steps (returned, as DeepSpeed), backpropagated divided by the data-parallel
        size too: the FSDP2 core sums gradients over ranks, DeepSpeed averages them (under DeepSpeed's ALST mpu at
        ZeRO-3 also over the sequence-parallel group, as DeepSpeed 0.19.8: ds_compat/alst.py)."""
        assert self.optimizer is not None, "must provide optimizer during init in order to use backward"
        assert isinstance(loss, torch.Tensor) and loss.numel() == 1, (
            "loss must be a scalar tensor. If you need to pass output gradients, backward() of output tensors"
        )
        scaled = loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss
        self.step_runner.before_backward(last_of_step=self.is_gradient_accumulation_boundary())
        divisor = self.dp_world_size * (sequence_average(self.translation.zero_stage) if self.alst else 1)
        (scaled * (self.step_runner.loss_scale / divisor)).backward(retain_graph=retain_graph)
        return scaled

    def zero_grad(self) -> None:
        for param in self.module.parameters():
            param.grad = None

    @watched
    def step(self, lr_kwargs: dict | None = None) -> None:
        """At the accumulation boundary: the trainer's step (clip at gradient_clipping, skip on a non-finite norm,
        optimizer step, lr scheduler step with `lr_kwargs`, zero the gradients), then count the step. Every call
        counts a micro step."""
        assert self.optimizer is not None, "must provide optimizer during init in order to use step"
        self._step_applied = False
        if self.is_gradient_accumulation_boundary():
            outcome = self.step_runner.finish(scheduler_kwargs=lr_kwargs)
            self._global_grad_norm, self._step_applied = outcome.grad_norm, outcome.stepped
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
            if self.global_steps % self.translation.steps_per_print == 0:  # DeepSpeed's _report_progress
                self.log.info(
                    "step=%d, skipped=%d, lr=%s, mom=%s",
                    self.global_steps,
                    self.skipped_steps,
                    self.get_lr(),
                    self.get_mom(),
                )
        self.micro_steps += 1

    def compile(self, backend: str | None = None, compile_kwargs: dict | None = None, **_: Any) -> None:
        """DeepSpeed's engine.compile: `torch.compile` of the module in place (nn.Module.compile), with `backend`
        (None: torch's default) and `compile_kwargs`; accelerate calls it when the HF run sets torch_compile."""
        kwargs = dict(compile_kwargs or {})
        if backend is not None:
            kwargs["backend"] = backend
        self.module.compile(**kwargs)
        self._is_compiled = True
        self.log.info("ds_compat: module compiled with torch.compile(%s)", kwargs or "")

    @property
    def is_compiled(self) -> bool:
        return getattr(self, "_is_compiled", False)

    def destroy(self) -> None:
        """Release what the engine holds for training (optimizer and its state, scheduler, step runner, data
        loader), as DeepSpeed's destroy() does before accelerate's free_memory. The module stays sharded by FSDP2
        (as DeepSpeed's stays partitioned): a new deepspeed.initialize on it keeps its units and builds the rest."""
        self.optimizer = self.basic_optimizer = self.client_optimizer = None
        self.lr_scheduler = self.client_lr_scheduler = None
        self.step_runner = None
        self.training_dataloader = self.training_data = None

    def _skip_step(self, loss: float | None, outcome: StepOutcome) -> None:
        """DeepSpeed skips a step with a non-finite gradient norm, without limit, and says so."""
        self.skipped_steps += 1
        self.log.warning(
            "ds_compat: skipping step %d: the gradient norm is %s%s (skipped steps: %d)",
            self.global_steps + 1,
            outcome.grad_norm,
            "" if self.loss_scaler is None else f" at fp16 loss scale {outcome.loss_scale:g}",
            self.skipped_steps,
        )

    # ------------------------------------------------------------------------------------------------------
    # Checkpoints
    # ------------------------------------------------------------------------------------------------------
    def _engine_state(self, client_state: dict) -> dict[str, Any]:
        return {
            "global_steps": self.global_steps,
            "global_samples": self.global_samples,
            "skipped_steps": self.skipped_steps,
            "micro_steps": self.micro_steps,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
            "dp_world_size": self.dp_world_size,
            "world_size": self.world_size,
            "zero_stage": self.translation.zero_stage,
            "ds_config": self.config,
            "client_state": dict(client_state),
        }

    def save_checkpoint(
        self,
        save_dir: str | os.PathLike,
        tag: Any = None,
        client_state: dict | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """DeepSpeed's layout: `save_dir/<tag>/` (default tag `global_step<N>`) and `save_dir/latest` naming the tag.
        Inside the tag: DCP shards of {"model", "optim"} (any world size loads them) and `engine_state.pt`."""
        if not save_dir:
            raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
        if exclude_frozen_parameters:
            raise UserError(
                "save_checkpoint(exclude_frozen_parameters=True) is not supported by the FSDP2 backend: the DCP "
                "checkpoint always holds the whole model. Drop the argument."
            )
        save_dir = Path(save_dir)
        if self.global_rank == 0:
            save_dir.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        tag = str(f"global_step{self.global_steps}" if tag is None else tag)
        engine_state = self._plain_engine_state(client_state or {})
        self._check_tag(tag)
        path = save_dir / tag
        try:
            with self._sharded_state_dicts():
                save_model_and_optimizer(path, self.module, self.optimizer)
            # the checksums (checkpoint/integrity.py): each rank's shards, rank 0's metadata and engine state,
            # merged into the manifest before `latest` names the tag
            mine = list(path.glob(f"__{self.global_rank}_*.distcp"))
            if self.global_rank == 0:
                (path / ENGINE_STATE_FILE).write_bytes(engine_state)
                mine += [path / METADATA_FILE, path / ENGINE_STATE_FILE]
            write_part(path, self.global_rank, mine)
            if self.global_rank == 0:
                merge_parts(path, self.world_size)
        except (Exception, CheckpointException) as error:  # DCP's is a BaseException
            self._save_failed(error, save_dir, path)
        if self.global_rank == 0 and save_latest:
            (save_dir / LATEST_FILE).write_text(tag)
        dist.barrier()
        self.log.info("ds_compat: checkpoint saved to %s", path)
        return True

    def _save_failed(self, error: BaseException, save_dir: Path, path: Path) -> None:
        """A save that ran out of space or permission (ENOSPC, EDQUOT, EROFS, EACCES): the tag's partial directory is
        removed and `latest` keeps naming the previous tag, in one paragraph; anything else keeps its traceback."""
        cause = storage_failure(error, path if path.is_dir() else save_dir)
        if cause is None:
            raise error
        shutil.rmtree(path, ignore_errors=True)
        latest = save_dir / LATEST_FILE
        previous = save_dir / latest.read_text().strip() if latest.is_file() else None
        raise storage_error(
            cause,
            f"save_checkpoint('{save_dir}', tag '{path.name}') could not write the checkpoint",
            save_dir,
            previous if previous is not None and previous.is_dir() else None,
            path.name,
            "(load_checkpoint resumes from it)",
        ) from None

    @contextlib.contextmanager
    def _sharded_state_dicts(self) -> Iterator[None]:
        """The engine's own checkpoint code wants FSDP2's sharded state dicts, whatever the ZeRO stage."""
        whole = getattr(self.module, WHOLE_STATE_DICT, False)
        setattr(self.module, WHOLE_STATE_DICT, False)
        names = peft_names_of(self.module)  # a PEFT model's state dicts in our names meanwhile
        if names is not None:
            names.active = False
        try:
            yield
        finally:
            setattr(self.module, WHOLE_STATE_DICT, whole)
            if names is not None:
                names.active = True

    def _plain_engine_state(self, client_state: dict) -> bytes:
        """engine_state.pt's bytes; a client_state that would not load weights-only (it names a class or function
        beyond plain values and tensors) is refused on every rank before anything is written."""
        buffer = io.BytesIO()
        torch.save(self._engine_state(client_state), buffer)
        foreign = unsafe_globals(buffer)
        problems: list[Any] = [None] * self.world_size
        dist.all_gather_object(problems, ", ".join(foreign) or None)
        named = next((problem for problem in problems if problem), None)
        if named:
            raise UserError(
                f"save_checkpoint(client_state=...) holds objects pickled as {named}: a checkpoint is loaded "
                "weights-only (a file that names a class or function could run code), so this one could not be "
                "loaded back. Pass plain values: dicts, lists, tuples, strings, numbers, booleans, None and tensors "
                "(e.g. vars(args) for an argparse.Namespace). Nothing was written."
            )
        return buffer.getvalue()

    def _check_tag(self, tag: str) -> None:
        tags: list[Any] = [None] * self.world_size
        dist.all_gather_object(tags, tag)
        if len(set(tags)) != 1:
            raise UserError(
                f"save_checkpoint: the tag differs between ranks ({sorted(set(tags))}); every rank must pass the "
                "same tag (DeepSpeed checks this too)."
            )

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike,
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Callable | None = None,
    ) -> tuple[str | None, dict | None]:
        """Returns (checkpoint path, client_state); (None, None) when `load_dir/latest` is missing and no tag is
        given, as DeepSpeed."""
        if custom_load_fn is not None:
            raise UserError("load_checkpoint(custom_load_fn=...) is not supported by the FSDP2 backend.")
        load_dir = Path(load_dir)
        if tag is None:
            latest = load_dir / LATEST_FILE
            if not latest.is_file():
                self.log.warning(
                    "Unable to find latest file at %s, if trying to load latest checkpoint please ensure this file "
                    "exists or pass an explicit checkpoint tag when loading a checkpoint.",
                    latest,
                )
                return None, None
            tag = latest.read_text().strip()
        path = load_dir / str(tag)
        state_file = path / ENGINE_STATE_FILE
        with_optimizer = load_optimizer_states and not load_module_only and self.optimizer is not None
        if not state_file.is_file() and tag_dir_of(path) is not None:
            with self._sharded_state_dicts():
                return self._load_deepspeed_checkpoint(
                    path, load_module_strict, with_optimizer, load_lr_scheduler_states, load_module_only
                )
        if not state_file.is_file():
            raise UserError(
                f"load_checkpoint: '{path}' is not a checkpoint of this engine (no {ENGINE_STATE_FILE}) nor one "
                "written by DeepSpeed (no mp_rank_00_model_states.pt / zero_pp_rank_0_mp_rank_00_model_states.pt). "
                "Pass the save_dir given to save_checkpoint and one of its tags."
            )
        check_manifest(path, "DeepSpeed-API checkpoint")  # before anything of it is read
        state = load_pt(state_file)  # before the weights: a refused file leaves the engine as it was
        with self._sharded_state_dicts():
            optimizer = self.optimizer if with_optimizer else None
            load_checkpoint(self.module, optimizer, path, strict=load_module_strict, advice=ENGINE_LOAD)
        if not load_module_only:
            if load_lr_scheduler_states and self.lr_scheduler is not None and state["lr_scheduler"] is not None:
                self.lr_scheduler.load_state_dict(state["lr_scheduler"])
            if self.loss_scaler is not None and state.get("loss_scaler") is not None:
                self.loss_scaler.load_state_dict(state["loss_scaler"])
            self.global_steps = state["global_steps"]
            self.global_samples = state["global_samples"]
            self.skipped_steps = state["skipped_steps"]
        self.log.info(
            "ds_compat: loaded %s (global step %d, optimizer %s)",
            path,
            self.global_steps,
            "restored" if with_optimizer else "not restored",
        )
        return str(path), state["client_state"]

    def _load_deepspeed_checkpoint(
        self, path: Path, strict: bool, with_optimizer: bool, with_scheduler: bool, module_only: bool
    ) -> tuple[str, dict]:
        """A checkpoint the real DeepSpeed wrote (any ZeRO stage and world size): weights, Adam moments and step,
        the schedule's position, the counters; returns the client state as DeepSpeed does."""
        state = read_deepspeed(path, with_optimizer=with_optimizer)
        load_into(self.module, self.optimizer if with_optimizer else None, state, strict=strict)
        if not module_only:
            saved = state.model_states.get("lr_scheduler")
            if with_scheduler and self.lr_scheduler is not None and saved is not None:
                if isinstance(self.lr_scheduler, RecipeSchedule) and "last_batch_iteration" in saved:
                    self.lr_scheduler.step(last_batch_iteration=int(saved["last_batch_iteration"]))
                else:
                    self.lr_scheduler.load_state_dict(saved)
            if self.loss_scaler is not None and state.loss_scale is not None:
                self.loss_scaler.scale = float(state.loss_scale["cur_scale"])
            self.global_steps = int(state.model_states.get("global_steps", 0))
            self.global_samples = int(state.model_states.get("global_samples", 0))
            self.skipped_steps = int(state.model_states.get("skipped_steps", 0))
        self.log.info(
            "ds_compat: loaded DeepSpeed checkpoint %s (ZeRO %d, written by %d rank(s), global step %d, optimizer %s)",
            path,
            state.layout.stage,
            state.layout.world_size,
            self.global_steps,
            "restored" if with_optimizer and state.moments else "not restored",
        )
        return str(path), state.client_state()

    def module_state_dict(self, full: bool = True) -> dict[str, torch.Tensor]:
        """The model's full state dict (collective under FSDP2; every rank gets the tensors, on CPU)."""
        with self._sharded_state_dicts():
            return get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=full, cpu_offload=True))

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """The ds_config's zero_optimization.stage3_gather_16bit_weights_on_model_save (accelerate asks before
        `_zero3_consolidated_16bit_state_dict`)."""
        zero = self.config.get("zero_optimization") or {}
        return bool(
            zero.get("stage3_gather_16bit_weights_on_model_save", zero.get("gather_16bit_weights_on_model_save", False))
        )

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """The full state dict in the training dtype on rank 0 (None elsewhere), as DeepSpeed's. Collective."""
        state = self.module_state_dict(full=True)
        if exclude_frozen_parameters:
            frozen = {name for name, p in self.module.named_parameters() if not p.requires_grad}
            state = {key: value for key, value in state.items() if key not in frozen}
        names = peft_names_of(self.module)
        if names is not None:  # a PEFT model's, in PEFT's keys (save_pretrained filters its adapters from them)
            state = names.to_peft(state)
        if self.global_rank != 0:
            return None
        dtype = DTYPES[self.plan.param_dtype]
        return {key: value.to(dtype) if value.is_floating_point() else value for key, value in state.items()}

    def save_16bit_model(
        self, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters=False
    ) -> bool:
        """The full state dict in the training dtype (bf16 when bf16 is on, else fp32), written by rank 0 with
        torch.save as `save_dir/save_filename`. Collective: every rank must call it."""
        state = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if state is not None:
            os.makedirs(save_dir, exist_ok=True)
            torch.save(state, os.path.join(save_dir, save_filename))
            self.log.info("ds_compat: saved the %s model to %s", self.plan.param_dtype, Path(save_dir, save_filename))
        dist.barrier()
        return True

    def save_fp16_model(self, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin") -> bool:
        return self.save_16bit_model(save_dir, save_filename)
