"""The plan registry: every feature applied to the meta-device model, in one fixed order, from one list.

    moe -> ops -> freeze -> lora -> recompute -> activation_offload -> chunk_loss -> expert_parallel
        -> context_parallel -> fsdp -> weights

`builders.build_model` applies them for real; `tools.preflight` applies them as a dry run (no process group: the
patterns are matched and checked, nothing distributed is set up) and the memory estimate reads the same list. A new
feature (expert parallelism, Ring attention) is one new row here. Each plan says whether it is on for a config and a
layout (`enabled`), applies itself (`apply`, returning what its patterns matched; a pattern that matches nothing is an
error), says in one line what it does (`describe`) and how it changes preflight's memory figures (`estimate`).

Any other module a script passes to the DeepSpeed engine door (`deepspeed.initialize`) is built from a second,
FSDP-only list, `MODULE_PLANS` (fsdp -> weights), through the same `apply_plans`: there is one way to build a model.

`moe` comes first because it gives the model its structure (our MoE block in place of transformers'), so every later
plan's patterns see the modules that will run; `weights` comes last: the sharded meta model is materialised on the
device and, for training.load of HF or weights-only DCP files, loaded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers.models.glm4v_moe.modeling_glm4v_moe import Glm4vMoeTextMoE

from glm45v_fsdp.checkpoint.base_reference import holds_trainable_only, read_base
from glm45v_fsdp.checkpoint.dcp import load_checkpoint, resolve_load
from glm45v_fsdp.checkpoint.hf import load_hf_weights
from glm45v_fsdp.checkpoint.in_memory import FullTensors, load_full_tensors, load_some_tensors
from glm45v_fsdp.checkpoint.layout import KeyDiff, describe_diff, summarize_keys
from glm45v_fsdp.config import Config
from glm45v_fsdp.log import get_logger
from glm45v_fsdp.lora.apply import AdapterSpec, adapter_matches, apply_adapters, spec_from_config, store_frozen_in
from glm45v_fsdp.lora.peft_format import read_adapter
from glm45v_fsdp.memory.chunk_loss import apply_chunk_loss, choose_chunk
from glm45v_fsdp.memory.estimate import ActivationEstimate, loss_peak_bytes
from glm45v_fsdp.memory.offload import apply_activation_offload, describe_offload
from glm45v_fsdp.memory.recompute import apply_recompute, kept_inside
from glm45v_fsdp.model import REQUIRED_FSDP_UNITS, apply_freeze, materialize
from glm45v_fsdp.model.init import allocate
from glm45v_fsdp.model.moe import MoEBlock
from glm45v_fsdp.model.router_health import attach_router_monitor
from glm45v_fsdp.module_patterns import PlanMatch, format_matches, match_modules
from glm45v_fsdp.ops.apply import apply_ops
from glm45v_fsdp.ops.registry import REFERENCE, choose_ops, log_choice
from glm45v_fsdp.ops.verify import verify_ops
from glm45v_fsdp.parallel.context import LANGUAGE_MODEL, Ulysses, apply_context_parallel, check_context_parallel
from glm45v_fsdp.parallel.expert import apply_expert_parallel, check_expert_parallel, expert_sharded_modules
from glm45v_fsdp.parallel.fsdp import DTYPES, apply_fsdp, is_sharded
from glm45v_fsdp.parallel.ring import Ring, choose_block_kernel, verify_block_kernel
from glm45v_fsdp.parallel.sequence import SplitSequence, ZigzagSequence
from glm45v_fsdp.runtime import DeviceLayer, ParallelDims, ParallelMeshes
from glm45v_fsdp.runtime.device import import_torch_npu


@dataclass(frozen=True)
class GivenWeights:
    """Weights a script's own model holds (the DeepSpeed engine door), loaded by the weights plan instead of
    training.load: full shapes, and each full tensor on demand."""

    shapes: dict[str, tuple[int, ...]]
    tensors: FullTensors
    source: str  # for the log: where they came from


@dataclass(frozen=True)
class PlanContext:
    """What the plans apply against. `meshes` None: a dry run (preflight) on the meta model, no process group."""

    config: Config
    dims: ParallelDims
    hf_config: object
    device: DeviceLayer
    meshes: ParallelMeshes | None = None
    torch_device: torch.device = torch.device("cpu")
    weights: GivenWeights | None = None
    adapters: AdapterSpec | None = None  # a PEFT model's adapters (the DeepSpeed door); None: from model.lora
    # Modules a script calls itself before the model's forward (the DeepSpeed door, when the script hooks the model's
    # forward): each an FSDP unit of its own (parallel/fsdp.py apply_fsdp).
    own_units: tuple[str, ...] = ()

    @property
    def dry(self) -> bool:
        return self.meshes is None


class Plan:
    name: str
    key: str  # the config key that switches the plan or holds its patterns
    logs_itself = False  # its matches are logged with what it did (apply_plans logs the others')

    def enabled(self, config: Config, dims: ParallelDims, hf_config: object) -> bool:
        raise NotImplementedError

    def apply(self, model: nn.Module, ctx: PlanContext) -> list[PlanMatch]:
        raise NotImplementedError

    def describe(self, config: Config, dims: ParallelDims, hf_config: object) -> str:
        raise NotImplementedError

    def estimate(
        self, estimate: ActivationEstimate, config: Config, dims: ParallelDims, hf_config: object, matches: list
    ) -> None:
        """Adjust preflight's activation estimate the way this plan changes memory (most plans do not)."""


def _names(matches: list[PlanMatch]) -> list[str]:
    """The matched module names in the order the training forward calls them: the vision tower, then the layers."""
    return sorted({name for match in matches for name in match.names}, key=_call_order)


def _call_order(name: str) -> tuple:
    parts = tuple(int(part) if part.isdigit() else part for part in name.split("."))
    return (not name.startswith("model.visual"), parts)


def _moe_layers(hf_config: object) -> range:
    text = hf_config.text_config
    return range(min(text.first_k_dense_replace, text.num_hidden_layers), text.num_hidden_layers)


def moe_layer_names(hf_config: object) -> list[str]:
    """The MoE layers (`...layers.N.mlp`) the moe plan replaces, in order."""
    return [f"{LANGUAGE_MODEL}.layers.{index}.mlp" for index in _moe_layers(hf_config)]


class MoEPlan(Plan):
    name, key = "moe", "model (its MoE layers)"

    def enabled(self, config: Config, dims: ParallelDims, hf_config: object) -> bool:
        return len(_moe_layers(hf_config)) > 0

    def apply(self, model: nn.Module, ctx: PlanContext) -> list[PlanMatch]:
        layers = _moe_layers(ctx.hf_config)
        pattern = f"{LANGUAGE_MODEL}.layers.{{{layers.start}-{layers.stop - 1}}}.mlp"
        matches = match_modules(model, [pattern], self.key)
        for name in matches[0].names:
            parent_name, _, attribute = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            assert isinstance(getattr(parent, attribute), Glm4vMoeTextMoE), f"{name} is not transformers' MoE block"
            frozen = {name for name, param in getattr(parent, attribute).named_parameters() if not param.requires_grad}
            with torch.device("meta"):
                block = MoEBlock(ctx.hf_config.text_config)
            block.gate.skew = ctx.config.model.router_skew
            for name, param in block.named_parameters():  # a script's frozen experts stay frozen
                param.requires_grad_(name not in frozen)
            setattr(parent, attribute, block)
        attach_router_monitor(model, matches[0].names, ctx.config.features.router)
        return matches

    def describe(self, config: Config, dims: ParallelDims, hf_config: object) -> str:
        text = hf_config.text_config
        return (
            f"our MoE block in {len(_moe_layers(hf_config))} layer(s): fp32 router (top-{text.num_experts_per_tok} of "
            f"{text.n_routed_experts}), local dispatcher, grouped experts, fp32 combine, shared expert; router figures"
            f"{_router_balancing(config)}"
        )

    def estimate(
        self, estimate: ActivationEstimate, config: Config, dims: ParallelDims, hf_config: object, matches: list
    ) -> None:
        """The auxiliary balance loss keeps every MoE layer's fp32 router logits until backward."""
        if config.features.router.aux_loss_coef:
            text = hf_config.text_config
            layers = len(_moe_layers(hf_config))
            estimate.add_term(
                "router: auxiliary loss",
                layers * estimate.base.tokens * text.n_routed_experts * 4,
                f"fp32 router logits [tokens, {text.n_routed_experts}] of {layers} MoE layer(s), kept for backward",
            )


def _router_balancing(config: Config) -> str:
    """features.router's switches, in words, for the moe plan's line."""
    router = config.features.router
    parts = []
    if router.bias_update_rate:
        parts.append(f"bias update rate {router.bias_update_rate:g}")
    if router.aux_loss_coef:
        parts.append(f"{router.aux_loss_type} aux loss x {router.aux_loss_coef:g}")
    return f", {' and '.join(parts)}" if parts else ""


class OpsPlan(Plan):
    """The accelerator ops (glm45v_fsdp/ops): each op's kernel per device, verified against the reference."""

    name, key = "ops", "model.ops"

    def enabled(self, config: Config, dims: ParallelDims, hf_config: object) -> bool:
        return config.model.ops != REFERENCE

    def apply(self, model: nn.Module, ctx: PlanContext) -> list[PlanMatch]:
        npu = import_torch_npu() if ctx.device.type == "npu" else None
        choice = choose_ops(ctx.config.model.ops, ctx.device.type, npu)
        notes = []
        if ctx.dims.ep_enabled and choice.names["permute"] != REFERENCE:
            choice.names["permute"] = REFERENCE
            notes.append("permute: expert parallelism's dispatcher moves the tokens (its own permute)")
        if ctx.dims.cp_enabled and choice.names["attention"] != REFERENCE:
            notes.append("attention: the text layers run context parallelism's attention; the vision tower the kernel")
        if not ctx.dry:  # a dry run (preflight) reports the matches, which name each kernel, itself
            log_choice(choice, ctx.config.model.ops)
            for note in notes:
                get_logger().info("ops: %s", note)
            if choice.fast():
                verify_ops(choice, ctx.torch_device, DTYPES[ctx.config.parallel.fsdp_plan.param_dtype])
        return apply_ops(model, choice)

    def describe(self, config: Config, dims: ParallelDims, hf_config: object) -> str:
        return f"each op's kernel for the device (model.ops={config.model.ops}), checked against the reference"


class FreezePlan(Plan):
    name, key = "freeze", "model.freeze"

    def enabled(self, config: Config, dims: ParallelDims, hf_config: object) -> bool:
        return bool(config.model.freeze)

    def apply(self, model: nn.Module, ctx: PlanContext) -> list[PlanMatch]:
        return apply_freeze(model, ctx.config.model.freeze)

    def describe(self, config: Config, dims: ParallelDims, hf_config: object) -> str:
        return "requires_grad=False on every parameter of the matched modules"


class LoraPlan(Plan):
    """LoRA (glm45v_fsdp/lora): adapters on the matched linear layers and, with model.lora.experts, on the routed
    experts' stacks; the base frozen. From `model.lora`, or from the PEFT model a script passed (ctx.adapters)."""

    name, key = "lora", "model.lora"

    def enabled(self, config: Config, dims: ParallelDims, hf_config: object) -> bool:
        return config.model.lora.rank > 0

    def apply(self, model: nn.Module, ctx: PlanContext) -> list[PlanMatch]:
        if ctx.adapters is not None:
            spec, matches = ctx.adapters, adapter_matches(ctx.adapters)
        else:
            spec, matches = spec_from_config(model, ctx.config.model.lora)
        apply_adapters(model, spec)
        compute = DTYPES[ctx.config.parallel.fsdp_plan.param_dtype]
        if ctx.config.model.lora.frozen_in_compute_dtype and compute != torch.float32:
            stored = store_frozen_in(model, compute)
            if not ctx.dry:
                get_logger().info(
                    "lora: the frozen base (%.2fM parameters) is stored in %s, the adapters in fp32 "
                    "(model.lora.frozen_in_compute_dtype)",
                    stored / 1e6,
                    ctx.config.parallel.fsdp_plan.param_dtype,
                )
        model.adapter_spec = spec  # for the weights plan (model.lora.init_from) and the adapter export
        if not ctx.dry:
            get_logger().info("lora: adapters on %s", spec.counts())
        return matches

    def describe(self, config: Config, dims: ParallelDims, hf_config: object) -> str:
        lora = config.model.lora
        experts = ", and on the routed experts' stacks (grouped GEMM per expert)" if lora.experts else ""
        return f"LoRA rank {lora.rank} (alpha {lora.alpha:g}) on the matched linear layers{experts}; the base frozen"


class RecomputePlan(Plan):
    name, key = "recompute", "features.recompute.enabled"

    def enabled(self, config: Config, dims: ParallelDims, hf_config: object) -> bool:
        return config.features.recompute.enabled

    def apply(self, model: nn.Module, ctx: PlanContext) -> list[PlanMatch]:
        return apply_recompute(model, ctx.config.features.recompute)

    def describe(self, config: Config, dims: ParallelDims, hf_config: object) -> str:
        return f"recompute keeps each module's inputs and {kept_inside(config.features.recompute)}"

    def estimate(
        self, estimate: ActivationEstimate, config: Config, dims: ParallelDims, hf_config: object, matches: list
    ) -> None:
        cfg = config.features.recompute
        keep_attention = cfg.keep_attention and not cfg.use_reentrant
        estimate.apply_recompute(cfg.granularity, keep_attention, _names(matches), hf_config)


class ActivationOffloadPlan(Plan):
    name, key = "activation_offload", "features.activation_offload.enabled"

    def enabled(self, config: Config, dims: ParallelDims, hf_config: object) -> bool:
        return config.features.activation_offload.enabled

    def apply(self, model: nn.Module, ctx: PlanContext) -> list[PlanMatch]:
        offload = ctx.config.features.activation_offload
        if not ctx.dry:
            get_logger().info(describe_offload(offload, ctx.device))
        return apply_activation_offload(model, offload, ctx.device)

    def describe(self, config: Config, dims: ParallelDims, hf_config: object) -> str:
        offload = config.features.activation_offload
        return f"saved activations of at least {offload.min_tensor_bytes} bytes wait in host memory until backward"

    def estimate(
        self, estimate: ActivationEstimate, config: Config, dims: ParallelDims, hf_config: object, matches: list
    ) -> None:
        estimate.apply_offload(_names(matches), config.features.activation_offload.min_tensor_bytes, hf_config)


class ChunkLossPlan(Plan):
    name, key = "chunk_loss", "features.chunk_loss.mode"

    def enabled(self, config: Config, dims: ParallelDims, hf_config: object) -> bool:
        return config.features.chunk_loss.mode != "off"

    def apply(self, model: nn.Module, ctx: PlanContext) -> list[PlanMatch]:
        return apply_chunk_loss(model, ctx.config.features.chunk_loss)

    def describe(self, config: Config, dims: ParallelDims, hf_config: object) -> str:
        return f"lm_head + cross-entropy chunk by chunk ({config.features.chunk_loss.mode})"

    def estimate(
        self, estimate: ActivationEstimate, config: Config, dims: ParallelDims, hf_config: object, matches: list
    ) -> None:
        tokens, vocab = estimate.base.tokens, hf_config.text_config.vocab_size
        rows = choose_chunk(config.features.chunk_loss, tokens, vocab).chunk_size
        estimate.loss_peak = loss_peak_bytes(hf_config, tokens, estimate.compute_itemsize, rows)
        estimate.loss_note = f"chunked loss ({config.features.chunk_loss.mode}): one chunk of {rows} rows"


class ExpertParallelPlan(Plan):
    name, key = "expert_parallel", "parallel.expert_parallel_size"

    def enabled(self, config: Config, dims: ParallelDims, hf_config: object) -> bool:
        return dims.ep_enabled

    def apply(self, model: nn.Module, ctx: PlanContext) -> list[PlanMatch]:
        check_expert_parallel(ctx.hf_config, ctx.dims.ep)
        ep_plan, balance = ctx.config.parallel.ep_plan, ctx.config.features.ep_balance
        matches = apply_expert_parallel(
            model,
            ep_plan.apply_modules,
            ep_plan.dispatcher,
            balance if balance.enabled else None,
            None if ctx.dry else ctx.meshes.ep,
        )
        if not ctx.dry:
            get_logger().info("expert parallel: %s", self.describe(ctx.config, ctx.dims, ctx.hf_config))
        return matches

    def describe(self, config: Config, dims: ParallelDims, hf_config: object) -> str:
        experts = hf_config.text_config.n_routed_experts
        balance = config.features.ep_balance
        return (
            f"routed experts split over {dims.ep} ranks ({experts // dims.ep} of {experts} each, sharded over "
            f"{dims.efsdp} efsdp rank(s)), {config.parallel.ep_plan.dispatcher} dispatch"
            + (f", balance up to {balance.max_dup_experts_num} replica(s)/rank" if balance.enabled else "")
        )

    def estimate(
        self, estimate: ActivationEstimate, config: Config, dims: ParallelDims, hf_config: object, matches: list
    ) -> None:
        """Dispatch buffers: the pairs sent, received, regrouped and returned, each [tokens x top-k, hidden]."""
        text = hf_config.text_config
        pairs = estimate.base.tokens * text.num_experts_per_tok
        if config.parallel.ep_plan.dispatcher == "allgather":
            pairs = estimate.base.tokens * dims.ep * (1 + text.num_experts_per_tok / dims.ep)
        layers = len(_moe_layers(hf_config))
        per_layer = pairs * text.hidden_size * estimate.compute_itemsize
        estimate.add_term(
            "expert parallel: dispatch buffers",
            per_layer * 2,
            f"pairs held for backward in one MoE layer's exchange ({layers} layers; transient peak of one layer)",
        )
        balance = config.features.ep_balance
        if balance.enabled:
            expert = 3 * text.hidden_size * text.moe_intermediate_size * estimate.compute_itemsize
            # full recompute drops a layer's replicas after its forward; selective keeps the exchange's output
            full = estimate.recompute is not None and estimate.recompute[0] == "full"
            recomputed = min(estimate.recomputed.get("moe_layer", 0), layers) if full else 0
            holding = layers - recomputed + (1 if recomputed else 0)
            estimate.add_term(
                "EP balance: replica weights",
                holding * balance.max_dup_experts_num * expert,
                f"at most {balance.max_dup_experts_num} replica(s) per layer kept for backward in {holding} layer(s)",
            )


class ContextParallelPlan(Plan):
    name, key = "context_parallel", "parallel.ulysses_parallel_size / parallel.ring_attention_size"

    def enabled(self, config: Config, dims: ParallelDims, hf_config: object) -> bool:
        return dims.cp_enabled

    def apply(self, model: nn.Module, ctx: PlanContext) -> list[PlanMatch]:
        kernel = ctx.config.model.attn_implementation
        dims = ctx.dims
        check_context_parallel(ctx.hf_config, dims.cp_ulysses, kernel, dims.cp_ring)
        if ctx.dry:
            return match_modules(model, [LANGUAGE_MODEL], self.key)
        meshes = ctx.meshes
        pad_token_id = ctx.hf_config.text_config.pad_token_id or 0
        ulysses = Ulysses(meshes.cp_ulysses.get_group(), dims.cp_ulysses, kernel)
        ring = None
        if dims.cp_ring_enabled:
            ring_rank, ulysses_rank = meshes.cp_ring.get_local_rank(), meshes.cp_ulysses.get_local_rank()
            layout = ZigzagSequence(
                meshes.cp.get_group(), dims.cp_ring, ring_rank, dims.cp_ulysses, ulysses_rank, pad_token_id
            )
            block_kernel = choose_block_kernel(kernel, ctx.device.type)
            verify_block_kernel(block_kernel, ctx.torch_device, DTYPES[ctx.config.parallel.fsdp_plan.param_dtype])
            ring = Ring(meshes.cp_ring.get_group(), dims.cp_ring, block_kernel)
        else:
            layout = SplitSequence(meshes.cp.get_group(), dims.cp, meshes.cp.get_local_rank(), pad_token_id)
        matches = apply_context_parallel(model, layout, ulysses, ring)
        if dims.cp_ulysses_enabled:
            get_logger().info(ulysses.describe())
        if ring is not None:
            get_logger().info("%s; sequence layout %s", ring.describe(), layout.describe())
        return matches

    def describe(self, config: Config, dims: ParallelDims, hf_config: object) -> str:
        parts = []
        if dims.cp_ulysses_enabled:
            parts.append(
                f"attention exchanges heads <-> sequence over {dims.cp_ulysses} (Ulysses, kernel "
                f"{config.model.attn_implementation})"
            )
        if dims.cp_ring_enabled:
            parts.append(f"key/value blocks go round a ring of {dims.cp_ring} (Ring attention, zigzag layout)")
        return f"each sequence split over {dims.cp} ranks; " + "; ".join(parts)

    def estimate(
        self, estimate: ActivationEstimate, config: Config, dims: ParallelDims, hf_config: object, matches: list
    ) -> None:
        """The tokens and images are already per rank (preflight divides them); what every CP rank still holds in
        full is the merged input embeddings of the whole sequence."""
        text = hf_config.text_config
        full = estimate.base.tokens * dims.cp * text.hidden_size * estimate.compute_itemsize
        estimate.add_term("context parallel: whole sequence", full, f"input embeddings of all {dims.cp} ranks' tokens")
        if dims.cp_ring_enabled:
            estimate.add_term(
                "ring attention: block buffers",
                ring_buffer_bytes(estimate.base.tokens, dims, text, estimate.compute_itemsize),
                f"backward of one layer's ring over {dims.cp_ring} ranks: fp32 dq, the block's dk/dv (held, arriving, "
                f"in flight) and the next key/value block (transient)",
            )


def ring_buffer_bytes(tokens: int, dims: ParallelDims, text: object, itemsize: int) -> int:
    """The ring's transient peak per rank (backward of one layer): a ring block holds tokens x ulysses tokens (after
    the Ulysses all-to-all) with heads/ulysses query heads and the key/value heads that rank holds."""
    block = tokens * dims.cp_ulysses
    heads = text.num_attention_heads // dims.cp_ulysses
    kv_heads = max(1, text.num_key_value_heads // dims.cp_ulysses)
    dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    fp32_grads = block * dim * 4 * (heads + 3 * 2 * kv_heads)
    return fp32_grads + 2 * block * kv_heads * dim * itemsize


class _PlanOnlyMesh:
    """Stands in for the FSDP mesh in a dry run: on a one-rank mesh apply_fsdp matches and checks the plan but
    shards nothing."""

    def size(self) -> int:
        return 1


class FsdpPlan(Plan):
    name, key = "fsdp", "parallel.fsdp_plan.apply_modules"
    logs_itself = True

    def enabled(self, config: Config, dims: ParallelDims, hf_config: object) -> bool:
        return True

    def apply(self, model: nn.Module, ctx: PlanContext) -> list[PlanMatch]:
        plan = ctx.config.parallel.fsdp_plan
        if ctx.dry:
            plan = dataclasses.replace(plan, cpu_offload=False)
            dry = apply_fsdp(model, plan, _PlanOnlyMesh(), pin_memory=False, required_units=REQUIRED_FSDP_UNITS)
            return dry.matches
        applied = apply_fsdp(
            model,
            plan,
            ctx.meshes.dense_shard,
            pin_memory=ctx.device.type != "cpu",
            required_units=REQUIRED_FSDP_UNITS,
            expert_units=expert_sharded_modules(model),
            expert_mesh=ctx.meshes.expert_shard,
            own_units=ctx.own_units,
        )
        sharding = applied.sharding or (
            "not sharded: the FSDP mesh has one rank; the modules stay plain and param_dtype="
            f"{plan.param_dtype} runs {'under autocast' if plan.param_dtype != 'fp32' else 'as is'}"
        )
        get_logger().info(format_matches(self.name, applied.matches, sharding))
        return applied.matches

    def describe(self, config: Config, dims: ParallelDims, hf_config: object) -> str:
        plan = config.parallel.fsdp_plan
        where = f"{dims.fsdp_size} rank(s)" + (f", replicated {dims.dp_replicate}x (HSDP)" if dims.hsdp_enabled else "")
        experts = f"; expert stacks (dim 1) over {dims.efsdp} efsdp rank(s)" if dims.ep_enabled else ""
        return f"fully_shard each matched module, then the root, over {where}{experts}; compute {plan.param_dtype}"


class WeightsPlan(Plan):
    name, key = "weights", "training.load"

    def enabled(self, config: Config, dims: ParallelDims, hf_config: object) -> bool:
        return True

    def apply(self, model: nn.Module, ctx: PlanContext) -> list[PlanMatch]:
        if ctx.dry:
            return []
        config, log = ctx.config, get_logger()
        offloaded = is_sharded(model) and config.parallel.fsdp_plan.cpu_offload
        # FSDP2's CPU offload wants the sharded parameters on the host; buffers (rotary tables) compute on the device.
        host = torch.device("cpu") if offloaded else ctx.torch_device
        if ctx.weights is not None:
            allocate(model, host)
            copied = load_full_tensors(model, ctx.weights.shapes, ctx.weights.tensors)
            log.info(
                "weights: %s: %d tensor(s), %.1f MiB copied into this rank's shards",
                ctx.weights.source,
                len(ctx.weights.shapes),
                copied / 2**20,
            )
        else:
            materialize(model, host, config.training.seed)
        if offloaded:
            _move_buffers(model, ctx.torch_device)
        if ctx.weights is None:
            _load_configured(model, config)
        if config.model.lora.init_from and ctx.adapters is None:
            _load_adapter(model, Path(config.model.lora.init_from), ctx.hf_config)
        return []

    def describe(self, config: Config, dims: ParallelDims, hf_config: object) -> str:
        load = config.training.load
        return f"materialise on the device, then load {load}" if load else "materialise, initialised from the seed"


def _load_configured(model: nn.Module, config: Config) -> None:
    """training.load's weights (HF or weights-only DCP) into the materialised model; a resume's come later."""
    log = get_logger()
    source = resolve_load(config.training)
    if source is None:
        log.info("weights: initialised from scratch (seed %d); no checkpoint was loaded", config.training.seed)
    elif source.format == "hf":
        _load_hf(model, source.path, config.training.load_strict)
    elif source.format == "dcp-weights":
        diff = load_checkpoint(model, None, source.path, strict=config.training.load_strict)
        log.info("weights: loaded from weights-only DCP checkpoint %s (training starts at step 0)", source.path)
        if not diff.ok:
            log.warning("weights: not loaded (training.load_strict=false): %s", describe_diff(diff))
    elif source.format == "dcp" and holds_trainable_only(source.path):
        base = read_base(source.path)
        log.info(
            "weights: the frozen base from %s, which checkpoint %s refers to (it holds a LoRA run's trainable state "
            "only, restored once the optimizer is built)",
            base,
            source.path,
        )
        _load_hf(model, base, strict=True)
    else:
        kind = "DeepSpeed" if source.format == "deepspeed" else "DCP"
        log.info("weights: restored from %s checkpoint %s once the optimizer is built (resume)", kind, source.path)


def _load_adapter(model: nn.Module, directory: Path, hf_config: object) -> None:
    """model.lora.init_from: a PEFT adapter's values into the adapters (this rank's slices)."""
    tensors = read_adapter(directory, model.adapter_spec, hf_config.text_config.n_routed_experts)
    copied = load_some_tensors(model, tensors, "model.lora.init_from")
    get_logger().info(
        "weights: LoRA adapters from PEFT adapter %s: %d tensor(s), %.2f MiB", directory, len(tensors), copied / 2**20
    )


def _load_hf(model: nn.Module, directory: Path, strict: bool) -> None:
    """Load HF safetensors weights (this rank's slices) into the materialised model and log what was read."""
    report = load_hf_weights(model, directory, strict=strict)
    get_logger().info(
        "weights: loaded from HF checkpoint %s (source %s): %d file(s), %d tensor(s), %.1f MiB read on this rank, "
        "expert layout %s",
        directory,
        report.source,
        report.files,
        report.tensors_read,
        report.bytes_read / 2**20,
        report.expert_layout,
    )
    if report.ignored:
        get_logger().info(
            "weights: %d checkpoint tensor(s) skipped, as transformers skips them (keys the model class declares "
            "ignorable, multi-token-prediction layers, tied-weight aliases): %s",
            len(report.ignored),
            summarize_keys(report.ignored),
        )
    leftovers = KeyDiff(report.missing, report.unexpected, report.mismatched)
    if not leftovers.ok:
        get_logger().warning(
            "weights: not loaded (training.load_strict=false; these keep their initial values): %s",
            describe_diff(leftovers),
        )


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            module._buffers[name] = buffer.to(device)


class ModuleFsdpPlan(Plan):
    """FSDP2 for any module a script built (the DeepSpeed engine door's generic path): its tensors on the device, rank
    0's values on every rank (as DeepSpeed broadcasts the model at initialize), then `fully_shard` each module that
    parallel.fsdp_plan.apply_modules selects (the door fills it from the module's ModuleLists), then the root."""

    name, key = "fsdp", "parallel.fsdp_plan.apply_modules"
    logs_itself = True

    def enabled(self, config: Config, dims: ParallelDims, hf_config: object) -> bool:
        return True

    def apply(self, model: nn.Module, ctx: PlanContext) -> list[PlanMatch]:
        assert not ctx.dry, "the module plans build a script's module; preflight dry-runs GLM-4.5V's plans"
        plan = ctx.config.parallel.fsdp_plan
        host = _module_host(ctx)
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                if not tensor.is_meta:  # a meta one's value comes with ctx.weights, after sharding
                    tensor.data = tensor.data.to(host)
                    if ctx.dims.world_size > 1:
                        dist.broadcast(tensor.data, src=0)
        applied = apply_fsdp(model, plan, ctx.meshes.dense_shard, pin_memory=False)
        sharding = applied.sharding or "not sharded: the FSDP mesh has one rank"
        get_logger().info(format_matches(self.name, applied.matches, sharding))
        return applied.matches

    def describe(self, config: Config, dims: ParallelDims, hf_config: object) -> str:
        where = f"{dims.fsdp_size} rank(s)"
        return f"rank 0's tensors on every rank; fully_shard each matched module, then the root, over {where}"


class ModuleWeightsPlan(Plan):
    """The values a script's module does not hold (ctx.weights: parameters it left on the meta device, the DeepSpeed
    door's zero.Init partitions) into their FSDP2 shards, one full tensor at a time; the others keep their values."""

    name, key = "weights", "the module's own tensors"

    def enabled(self, config: Config, dims: ParallelDims, hf_config: object) -> bool:
        return True

    def apply(self, model: nn.Module, ctx: PlanContext) -> list[PlanMatch]:
        if ctx.weights is None:
            return []
        host = _module_host(ctx)
        kept = {
            name: (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().clone()
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]
            if not tensor.is_meta
        }
        model.to_empty(device=host)
        with torch.no_grad():
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                if name in kept:
                    (tensor.to_local() if isinstance(tensor, DTensor) else tensor).copy_(kept[name])
            for name, param in model.named_parameters():
                if name not in ctx.weights.tensors:
                    continue
                full = ctx.weights.tensors[name]().to(device=host, dtype=param.dtype)
                if isinstance(param, DTensor):
                    param.copy_(distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None))
                else:
                    param.copy_(full)
        get_logger().info("weights: %s put in their FSDP2 shards", ctx.weights.source)
        return []

    def describe(self, config: Config, dims: ParallelDims, hf_config: object) -> str:
        return "the values the module left on the meta device, into their shards"


def _module_host(ctx: PlanContext) -> torch.device:
    """Where a script's module lives: FSDP2's CPU offload wants the sharded parameters on the host."""
    return torch.device("cpu") if ctx.config.parallel.fsdp_plan.cpu_offload else ctx.torch_device


PLANS: tuple[Plan, ...] = (
    MoEPlan(),
    OpsPlan(),
    FreezePlan(),
    LoraPlan(),
    RecomputePlan(),
    ActivationOffloadPlan(),
    ChunkLossPlan(),
    ExpertParallelPlan(),
    ContextParallelPlan(),
    FsdpPlan(),
    WeightsPlan(),
)


# Any other module a script passes to the DeepSpeed engine door: FSDP2 and the values it left on the meta device.
MODULE_PLANS: tuple[Plan, ...] = (ModuleFsdpPlan(), ModuleWeightsPlan())


def enabled_plans(
    config: Config, dims: ParallelDims, hf_config: object, plans: tuple[Plan, ...] = PLANS
) -> Iterator[Plan]:
    return (plan for plan in plans if plan.enabled(config, dims, hf_config))


def apply_plans(model: nn.Module, ctx: PlanContext, plans: tuple[Plan, ...] = PLANS) -> dict[str, list[PlanMatch]]:
    """Apply every enabled plan of `plans` (GLM-4.5V's PLANS, or MODULE_PLANS) in order and log what each matched;
    returns {plan name: matches}."""
    log = get_logger()
    matched: dict[str, list[PlanMatch]] = {}
    for plan in enabled_plans(ctx.config, ctx.dims, ctx.hf_config, plans):
        matched[plan.name] = plan.apply(model, ctx)
        if matched[plan.name] and not plan.logs_itself:
            log.info(format_matches(plan.name, matched[plan.name]))
    return matched
