"""Per-rank memory arithmetic for a model built on the meta device: exact state bytes, estimated activations.

Exact (what FSDP2 and AdamW allocate):
  - FSDP2 shards every dense parameter along dim 0 over the FSDP mesh (dp_shard x cp ranks; HSDP replicates over
    dp_replicate): with c = ceil(d0 / n), shard index i holds rows [i*c, min((i+1)*c, d0)), so the last indices can
    hold fewer rows, or none. The sharded parameter and the reduce-scattered gradient live in storage padded to c rows
    on every index; `padding` is that storage beyond the rows.
  - under expert parallelism an expert stack [E, d1, d2] is split on dim 0 over the ep ranks (E/ep whole experts,
    exact) and FSDP2 shards each rank's stack on dim 1 over the efsdp ranks, by the same rule on d1.
  - master parameters in their own dtype (fp32), gradients (fp32) of trainable parameters only, AdamW exp_avg and
    exp_avg_sq (like the parameter) plus a 4-byte `step` tensor per trainable parameter.
  - without FSDP (a one-rank world, no CPU offload) every rank holds the whole model, unpadded.
Estimated:
  - transient unsharded copies of FSDP units (see `transient_bytes`) and saved activations (see ACTIVATION_FORMULA).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import nn

from glm45v_fsdp.parallel.fsdp import expert_stacks_stay_plain

ADAM_STEP_BYTES = 4  # torch.optim.AdamW keeps `step` as a 0-d float32 tensor per parameter
FP32 = 4


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as FSDP2 sees it: full shape, master dtype size, trainability, its FSDP unit ('' = root),
    whether it is a routed expert stack and whether expert parallelism splits it."""

    name: str
    shape: tuple[int, ...]
    itemsize: int
    trainable: bool
    unit: str
    expert: bool = False  # split by expert parallelism
    routed: bool = False  # a routed expert stack (with or without expert parallelism)

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])


def owning_unit(name: str, units: list[str]) -> str:
    """The innermost unit whose module contains parameter `name` (FSDP2 shards nested units first); '' = root."""
    owners = [unit for unit in units if name.startswith(unit + ".")]
    return max(owners, key=len, default="")


def param_specs(
    model: nn.Module, units: list[str], expert_modules: list[str] = (), routed_modules: list[str] = ()
) -> list[ParamSpec]:
    """ParamSpec of every parameter of `model` (meta or real), with `units` the FSDP plan's matched module names,
    `expert_modules` the modules expert parallelism splits (each its own FSDP unit on the expert mesh) and
    `routed_modules` every MoE layer's routed experts."""
    experts, routed = set(expert_modules), set(routed_modules)
    return [
        ParamSpec(
            name,
            tuple(p.shape),
            p.element_size(),
            p.requires_grad,
            owning_unit(name, [*units, *experts]),
            name.rpartition(".")[0] in experts,
            name.rpartition(".")[0] in routed,
        )
        for name, p in model.named_parameters()
    ]


def shard_rows(rows: int, shard_size: int, index: int) -> int:
    """Rows of a dim-0 size `rows` that FSDP2 shard index `index` of `shard_size` holds (torch.chunk semantics)."""
    chunk = -(-rows // shard_size)
    return max(0, min((index + 1) * chunk, rows) - index * chunk)


def padded_rows(rows: int, shard_size: int) -> int:
    """Rows of the padded shard every index allocates: ceil(rows / shard_size)."""
    return -(-rows // shard_size)


@dataclass(frozen=True)
class ShardLayout:
    """How parameters are split over the ranks: dense ones on dim 0 over `dense` FSDP ranks; expert stacks on dim 0
    over `ep` ranks and on dim 1 over `efsdp` FSDP ranks; `replicas` HSDP replicas of both. `sharded` False: no FSDP
    (one rank), nothing split."""

    dense: int
    ep: int = 1
    efsdp: int = 1
    sharded: bool = True
    replicas: int = 1

    def index(self, fsdp_index: int) -> tuple[int, int]:
        """(dense shard index, efsdp index) of the rank at `fsdp_index` on the FSDP mesh (ep is innermost)."""
        return fsdp_index, fsdp_index // self.ep

    def local(self, spec: ParamSpec, fsdp_index: int) -> tuple[int, int]:
        """(elements this rank holds, elements of its padded storage) of one parameter."""
        if not self.sharded:
            numel = math.prod(spec.shape)
            return numel, numel
        dense_index, efsdp_index = self.index(fsdp_index)
        if spec.expert:
            experts, d1, rest = spec.shape[0] // self.ep, spec.shape[1], math.prod(spec.shape[2:])
            return (
                experts * shard_rows(d1, self.efsdp, efsdp_index) * rest,
                experts * padded_rows(d1, self.efsdp) * rest,
            )
        rows = shard_rows(spec.shape[0], self.dense, dense_index)
        return rows * spec.row_numel, padded_rows(spec.shape[0], self.dense) * spec.row_numel

    def unsharded(self, spec: ParamSpec) -> int:
        """Elements of one parameter once FSDP2 has all-gathered it (padded): the whole tensor, or for an expert
        stack this rank's E/ep experts."""
        if not self.sharded:
            return math.prod(spec.shape)
        if spec.expert:
            experts, d1, rest = spec.shape[0] // self.ep, spec.shape[1], math.prod(spec.shape[2:])
            return experts * padded_rows(d1, self.efsdp) * self.efsdp * rest
        return padded_rows(spec.shape[0], self.dense) * self.dense * spec.row_numel


@dataclass(frozen=True)
class StateBytes:
    """Bytes of one rank's persistent training state."""

    params: int
    grads: int
    optimizer: int
    padding: int
    expert_params: int = 0  # of `params`: the routed expert stacks' share

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.padding


def state_bytes(specs: list[ParamSpec], layout: ShardLayout, fsdp_index: int) -> StateBytes:
    """Parameters, gradients, AdamW states and FSDP2 padding of the rank at `fsdp_index` on the FSDP mesh."""
    params = grads = optimizer = padding = experts = 0
    for spec in specs:
        if not spec.shape:
            raise ValueError(f"{spec.name}: FSDP2 cannot shard a 0-d parameter")
        numel, storage = layout.local(spec, fsdp_index)
        local, pad = numel * spec.itemsize, (storage - numel) * spec.itemsize
        params += local
        padding += pad
        experts += local if spec.routed else 0
        if spec.trainable:
            grads += local
            padding += pad
            optimizer += 2 * local + ADAM_STEP_BYTES
    return StateBytes(params, grads, optimizer, padding, experts)


def unit_bytes(
    specs: list[ParamSpec], layout: ShardLayout, itemsize: int, trainable_only: bool = False
) -> dict[str, int]:
    """Unsharded (all-gathered, padded) bytes per unit in `itemsize`. An expert unit counts with the unit around it
    (its decoder layer): both are gathered while the layer runs."""
    dense_units = sorted({spec.unit for spec in specs if not spec.expert and spec.unit})
    sizes: dict[str, int] = {}
    for spec in specs:
        if trainable_only and not spec.trainable:
            continue
        unit = owning_unit(spec.unit, dense_units) if spec.expert else spec.unit
        sizes[unit] = sizes.get(unit, 0) + layout.unsharded(spec) * itemsize
    return sizes


@dataclass(frozen=True)
class Transient:
    """Unsharded copies that exist only during a step; `assumption` says which ones are counted."""

    params: int
    grads: int
    assumption: str

    @property
    def total(self) -> int:
        return self.params + self.grads


def experts_left_plain(specs: list[ParamSpec], layout: ShardLayout, compute_itemsize: int, cpu_offload: bool) -> bool:
    """Expert stacks that parallel/fsdp.py leaves out of FSDP (`expert_stacks_stay_plain`; their mesh is replicas x
    efsdp): no gathered copy, no gradient buffer."""
    experts = [spec for spec in specs if spec.expert]
    return (
        bool(experts)
        and layout.sharded
        and expert_stacks_stay_plain(
            layout.replicas * layout.efsdp, cpu_offload, all(spec.itemsize == compute_itemsize for spec in experts)
        )
    )


def transient_bytes(
    specs: list[ParamSpec],
    layout: ShardLayout,
    compute_itemsize: int,
    reduce_itemsize: int,
    reshard_after_forward: bool,
    prefetch: int = 0,
    cpu_offload: bool = False,
) -> Transient:
    """Peak of the unsharded compute copies (param dtype) and the gradient buffers of a backward step.

    FSDP2: the root unit's own parameters stay gathered for the whole step; of the other units, the one running and
    the ones prefetched (max(1, `prefetch`), taken as the largest) are gathered, or all of them when
    reshard_after_forward=False. In
    backward the running unit's unsharded gradients (param dtype) are copied into a reduce-scatter buffer (reduce
    dtype) of the same padded size. Under expert parallelism a layer's expert stacks are a unit of their own that
    gathers only this rank's E/ep experts, counted with its layer, unless they are left plain (`experts_left_plain`).
    Without FSDP, bf16 autocast holds a bf16 copy of every weight from its first use in forward until backward has
    used it.
    """
    if not layout.sharded:
        copies = sum(math.prod(s.shape) for s in specs) * compute_itemsize if compute_itemsize < FP32 else 0
        return Transient(copies, 0, "no FSDP: autocast keeps a param-dtype copy of every weight through the step")
    if experts_left_plain(specs, layout, compute_itemsize, cpu_offload):
        specs = [spec for spec in specs if not spec.expert]
    params = unit_bytes(specs, layout, compute_itemsize)
    grads = unit_bytes(specs, layout, compute_itemsize + reduce_itemsize, trainable_only=True)
    root = params.pop("", 0)
    grads.pop("", None)
    gathered = sorted(params.values(), reverse=True)
    if reshard_after_forward:
        ahead = max(1, prefetch)
        gathered = gathered[: 1 + ahead]
        what = f"root unit + the {1 + ahead} largest units gathered (running + {ahead} prefetched)"
    else:
        what = "every unit stays gathered from its forward to its backward (reshard_after_forward=false)"
    return Transient(
        root + sum(gathered),
        max(grads.values(), default=0),
        f"{what}; largest unit's unsharded grads (param dtype) + reduce-scatter input (reduce dtype)",
    )


# --------------------------------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------------------------------

ACTIVATION_FORMULA = """\
Saved for backward, per micro batch of s = micro_batch_size x data.cutoff_len / cp tokens (image tokens included) and
P = image patches (M = P / merge^2 merged image tokens); b = bytes of param_dtype (2 for bf16), fp32 terms 4 bytes:
  RMSNorm               s x (4h + 4 + b h)        fp32 input copy, rsqrt, normalised input of the weight multiply
  attention             s x (b (h + 3 a d + 2 g d) + 4 a)
                          input, rotated q, k (g kv heads), v, attention output and its contiguous copy (o_proj
                          input), fp32 log-sum-exp per head: a fused kernel (flash / sdpa is_causal) without an
                          s x s mask or repeated kv heads
  dense MLP             s x b (h + 4 I)           input, gate, up, act(gate), act(gate) x up
  MoE                   s x (4h + 4E + 12k + 4 + b (h + 4 I_s)) + s k x (b (2h + 4 I_e) + 20) + 4 h E
                          router: fp32 input copy, sigmoid scores (E), top-k ids and weights, their normaliser,
                          the fp32 copy of the router weight; shared expert (I_s); per (token, expert) pair:
                          gathered input, gate_up, act, product, expert output, token and expert ids, weight
                          (group-limited selection and its masks feed only top-k ids: nothing of it is saved)
  decoder layer         2 RMSNorm + attention + (dense MLP | MoE)
  text other            s x (8 + 2 b r + (4h + 4 + b h) + b h + 8 + 1) + 12
                          ids, rotary cos/sin (r = rotary dim), final norm, lm_head input, labels (their shifted
                          storage holds s + 1), the image-token mask (with images), the loss normaliser
  vision tower          P x (b 1176' + 2 (4v + 4 + b v) + 8 + 8 d_v + b v)
                          + depth x P x (2 (4v + 4 + b v) + b 8v + 4 a_v + b (v + 4 o))
                          + M x (b (4o + 4 I_v) + 2b) + fp32 position table
                          (1176' = channels x temporal patch x patch^2; o = out_hidden_size: the block MLP width
                          and the merger width; I_v = intermediate_size: the merger's gate/up width)
  loss peak             3 x s x V x 4             log-probs [s, V] fp32 saved by cross-entropy + their gradient +
                          the logits' gradient, all live at the start of backward; with features.chunk_loss:
                          2 x c x V x 4 + 2 x V x h x 4 + s x b h  (c = rows per chunk, all tokens supervised)
Total = all decoder layers + vision tower + text other + loss peak. Not counted: the workspace of one layer's
backward (about its own saved activations, which are freed as it runs), temporaries inside forward, allocator
fragmentation."""


@dataclass(frozen=True)
class Saved:
    """What one module saves for backward, by who keeps it under recompute: its `inputs` (what every recompute keeps;
    not saved without recompute), the attention kernels' outputs and log-sum-exp (`attention`: kept by full recompute
    with keep_attention, and by selective), the matmul / grouped-GEMM / router outputs (`matmul`: kept by
    selective) and the rest (`elementwise`: norms, rotary, activations, products, gathers, casts)."""

    inputs: int
    attention: int
    matmul: int
    elementwise: int

    @property
    def total(self) -> int:
        """Without recompute."""
        return self.attention + self.matmul + self.elementwise

    def kept(self, granularity: str, keep_attention: bool) -> int:
        """Under recompute: what stays between forward and backward."""
        if granularity == "selective":
            return self.inputs + self.attention + self.matmul
        return self.inputs + (self.attention if keep_attention else 0)

    def recomputed(self, granularity: str, keep_attention: bool) -> int:
        """Under recompute: what its backward holds again while it runs (the workspace of one module)."""
        return self.total + self.inputs - self.kept(granularity, keep_attention)


@dataclass(frozen=True)
class Activations:
    """ACTIVATION_FORMULA's parts: per module kind, one module's `Saved` and how many there are."""

    tokens: int
    image_patches: int
    dense_layer: Saved
    moe_layer: Saved
    vision_block: Saved
    counts: dict[str, int]  # "dense_layer" / "moe_layer" / "vision_block" -> modules of that kind
    vision_other: int
    text_other: int
    loss_peak: int

    def modules(self) -> dict[str, Saved]:
        return {"dense_layer": self.dense_layer, "moe_layer": self.moe_layer, "vision_block": self.vision_block}

    @property
    def total(self) -> int:
        layers = sum(self.counts[kind] * saved.total for kind, saved in self.modules().items())
        return layers + self.vision_other + self.text_other + self.loss_peak


def _norm(tokens: int, width: int, b: int) -> int:
    return tokens * (4 * width + 4 + b * width)


def loss_peak_bytes(hf_config, tokens: int, compute_itemsize: int, chunk_rows: int | None) -> int:
    """The loss's peak: full-logits cross-entropy, or one chunk of the chunked loss (`chunk_rows` rows)."""
    t = hf_config.text_config
    if chunk_rows is None:
        return 3 * tokens * t.vocab_size * FP32
    # one chunk's fp32 logits + a temporary of that size, fp32 weight copy and gradient, hidden-state gradient
    return (
        2 * chunk_rows * t.vocab_size * FP32
        + 2 * t.vocab_size * t.hidden_size * FP32
        + tokens * t.hidden_size * (compute_itemsize)
    )


def activation_bytes(
    hf_config, tokens: int, image_patches: int, compute_itemsize: int, chunk_rows: int | None = None
) -> Activations:
    """ACTIVATION_FORMULA for a Glm4vMoeConfig, `tokens` per micro batch and `image_patches` in it; `chunk_rows`:
    the chunked loss's rows per chunk (features.chunk_loss), None for the full-logits loss."""
    t, v = hf_config.text_config, hf_config.vision_config
    b, s = compute_itemsize, tokens
    h, a, g = t.hidden_size, t.num_attention_heads, t.num_key_value_heads
    d = getattr(t, "head_dim", h // a)
    fp32_copy = 4 * h if b < FP32 else 0  # `.to(float32)` of an fp32 tensor is the tensor itself
    norms = 2 * _norm(s, h, b)
    # attention: kernel output + lse | q, k, v projections | input (norm output) and the output's contiguous copy
    attention, attention_mm, attention_rest = s * (b * a * d + 4 * a), s * b * (a * d + 2 * g * d), s * b * (h + a * d)
    intermediate, expert, k, experts = (
        t.intermediate_size,
        t.moe_intermediate_size,
        t.num_experts_per_tok,
        t.n_routed_experts,
    )
    shared = expert * t.n_shared_experts
    router = 4 * experts + 12 * k + 4  # sigmoid scores, top-k ids and weights, their normaliser
    router_weight = 4 * h * experts if b < FP32 else 0  # its fp32 copy (an fp32 weight is used as it is)
    dense_layer = Saved(
        inputs=s * h * b,
        attention=attention,
        matmul=attention_mm + s * b * 2 * intermediate,  # gate, up
        elementwise=norms + attention_rest + s * b * (h + 2 * intermediate),  # input, act(gate), act x up
    )
    moe_layer = Saved(
        inputs=s * h * b,
        attention=attention,
        # router; shared gate, up; per (token, expert) pair: gate_up and expert output (grouped GEMMs)
        matmul=attention_mm + s * router + s * b * 2 * shared + s * k * b * (2 * expert + h),
        # fp32 router input and weight; shared input, act, product; per pair: gathered input, act, product, token
        # and expert ids, weight
        elementwise=norms
        + attention_rest
        + router_weight
        + s * (fp32_copy + b * (h + 2 * shared))
        + s * k * (b * (h + 2 * expert) + 20),
    )
    n_dense = min(t.first_k_dense_replace, t.num_hidden_layers)
    rotary = int(d * t.rope_parameters.get("partial_rotary_factor", 1.0))
    image_mask = s if image_patches else 0  # bool, where the image embeddings are scattered in
    text_other = s * (8 + 2 * b * rotary + b * h + 8) + 8 + image_mask + FP32 + _norm(s, h, b)

    p, hv, out = image_patches, v.hidden_size, v.out_hidden_size
    patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size**2
    merged = p // v.spatial_merge_size**2
    vision_block = Saved(
        inputs=p * hv * b,
        attention=p * (b * hv + 4 * v.num_heads),
        matmul=p * b * (3 * hv + 2 * out),  # qkv; MLP gate, up
        # norms; input, rotated q, k, output copy; MLP input, act, product
        elementwise=2 * _norm(p, hv, b) + p * b * 4 * hv + p * b * (hv + 2 * out),
    )
    position_table = (v.image_size // v.patch_size) ** 2 * hv * FP32
    vision_other = (
        p * b * patch_dim
        + 2 * _norm(p, hv, b)
        + p * (8 + 2 * FP32 * (hv // v.num_heads) + b * hv)
        + merged * (b * (4 * out + 4 * v.intermediate_size) + 2 * b)
        + (position_table if p else 0)
    )
    return Activations(
        tokens=s,
        image_patches=p,
        dense_layer=dense_layer,
        moe_layer=moe_layer,
        vision_block=vision_block,
        counts={"dense_layer": n_dense, "moe_layer": t.num_hidden_layers - n_dense, "vision_block": v.depth},
        vision_other=vision_other,
        text_other=text_other,
        loss_peak=loss_peak_bytes(hf_config, s, b, chunk_rows),
    )


MODULE_KINDS = {
    "dense_layer": "decoder layer (dense MLP)",
    "moe_layer": "decoder layer (MoE)",
    "vision_block": "vision block",
}


def module_kind(name: str, hf_config) -> str | None:
    """Which kind of module of the estimate a module name is (None: not one of the three)."""
    parts = name.split(".")
    if name.startswith("model.language_model.layers.") and len(parts) == 4:
        dense = int(parts[3]) < hf_config.text_config.first_k_dense_replace
        return "dense_layer" if dense else "moe_layer"
    if name.startswith("model.visual.blocks.") and len(parts) == 4:
        return "vision_block"
    return None


@dataclass
class ActivationEstimate:
    """The activation estimate as named terms, adjusted by each plan that is on (`plans.Plan.estimate`).

    Starts from ACTIVATION_FORMULA (no recompute, no offload); the recompute plan replaces the matched modules'
    saved tensors by what it keeps plus one module's recomputation workspace, the offload plan moves the saved
    tensors of all but the last two matched modules to the host, the chunked loss and context parallelism change
    the loss peak and the tokens."""

    base: Activations
    compute_itemsize: int
    loss_peak: int = -1  # the base's, unless a plan (the chunked loss) changes it
    loss_note: str = "full-logits cross-entropy: log-probs, their gradient and the logits' gradient"
    recompute: tuple[str, bool] | None = None  # (granularity, keep_attention)
    recomputed: dict[str, int] = field(default_factory=dict)  # kind -> modules recomputed
    workspace: int = 0
    offloaded_bytes: int = 0
    offload_note: str = ""
    extra_terms: list[tuple[str, int, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.loss_peak < 0:
            self.loss_peak = self.base.loss_peak

    def apply_recompute(self, granularity: str, keep_attention: bool, matched: list[str], hf_config) -> None:
        self.recompute = (granularity, keep_attention)
        for name in matched:
            kind = module_kind(name, hf_config)
            if kind is not None:
                self.recomputed[kind] = self.recomputed.get(kind, 0) + 1
        modules = self.base.modules()
        self.workspace = max(
            (modules[kind].recomputed(granularity, keep_attention) for kind in self.recomputed), default=0
        )

    def apply_offload(self, matched: list[str], min_tensor_bytes: int, hf_config) -> None:
        """Saved tensors of the matched modules (in call order) go to the host, except those of the last module
        before backward: at the start of backward all but that one module's worth is off the device (later, each
        module's tensors come back one module ahead of its backward while the finished ones are freed). A module's
        tensors count when its hidden-state-sized tensor reaches min_tensor_bytes. Call after apply_recompute (the
        registry's order)."""
        kinds = [kind for kind in (module_kind(name, hf_config) for name in matched) if kind is not None]
        width = {
            "vision_block": self.base.image_patches * hf_config.vision_config.hidden_size,
            "dense_layer": self.base.tokens * hf_config.text_config.hidden_size,
            "moe_layer": self.base.tokens * hf_config.text_config.hidden_size,
        }
        remaining = dict(self.recomputed)
        per_module = []
        for kind in kinds:  # model order: vision blocks, then decoder layers
            recomputed = remaining.get(kind, 0) > 0
            remaining[kind] = remaining.get(kind, 0) - 1
            eligible = width[kind] * self.compute_itemsize >= min_tensor_bytes
            # a recomputed module's kept outputs sit in the checkpoint's own cache, out of the hooks' reach: only its
            # inputs move
            moved = self.base.modules()[kind].inputs if recomputed else self.base.modules()[kind].total
            per_module.append(moved if eligible else 0)
        self.offloaded_bytes = sum(per_module[:-1])
        self.offload_note = f"{len(per_module)} module(s), all but the last leave the device"

    def add_term(self, name: str, nbytes: int, how: str) -> None:
        self.extra_terms.append((name, nbytes, how))

    def terms(self) -> list[tuple[str, int, str]]:
        """(name, bytes, how) of every part; they add up to `total`."""
        rows = []
        for kind, saved in self.base.modules().items():
            count = self.base.counts[kind]
            recomputed = min(self.recomputed.get(kind, 0), count)
            if recomputed:
                granularity, keep_attention = self.recompute
                what = "inputs + attention outputs" if granularity == "full" and keep_attention else "inputs"
                what = "inputs + attention + matmul outputs" if granularity == "selective" else what
                rows.append(
                    (
                        f"{MODULE_KINDS[kind]} x {recomputed}, recomputed",
                        recomputed * saved.kept(granularity, keep_attention),
                        f"keeps {what} ({granularity} recompute)",
                    )
                )
            if count - recomputed:
                rows.append(
                    (f"{MODULE_KINDS[kind]} x {count - recomputed}", (count - recomputed) * saved.total, "saved")
                )
        if self.workspace:
            rows.append(("recompute workspace", self.workspace, "one module's recomputed activations in its backward"))
        rows.append(("vision tower other", self.base.vision_other, "patch embedding, merger, position table"))
        rows.append(("text other", self.base.text_other, "ids, rotary, final norm, lm_head input, labels"))
        rows.append(("loss peak", self.loss_peak, self.loss_note))
        rows.extend(self.extra_terms)
        if self.offloaded_bytes:
            rows.append(("offloaded to host", -self.offloaded_bytes, self.offload_note))
        return rows

    @property
    def total(self) -> int:
        return sum(nbytes for _, nbytes, _ in self.terms())
