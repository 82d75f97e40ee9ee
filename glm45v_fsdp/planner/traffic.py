"""What one optimizer step sends per rank, by collective family: FSDP2's all-gathers and reduce-scatters per unit,
the HSDP all-reduce, EP dispatch and combine, Ulysses all-to-alls, Ring P2P blocks, CP's image-row exchange, and
the loss / gradient-norm reductions.

Bytes per call follow tests' counter (glm45v_fsdp/runtime/comm_count.py): all-gather the gathered output,
reduce-scatter the full input, all-reduce and all-to-all the input (all-to-all's send buffer includes the rows a
rank keeps), P2P what a rank sends. Every figure is for A micro batches (gradient accumulation) of s tokens per rank:
  fsdp / efsdp   per micro batch, every unit all-gathers its padded parameters in param_dtype in forward and, with
                 reshard_after_forward, again in backward (the root unit is never resharded); every unit with
                 trainable parameters reduce-scatters its padded gradients in reduce_dtype. Routed expert stacks under
                 EP are units of their own on the efsdp group (E/ep experts). A group of one rank sends nothing.
  dp_replicate   HSDP: each unit's reduced shard all-reduced over the replicas, once per step (the last micro batch).
  ep (alltoall)  per MoE layer and micro batch: one all-gather of the per-expert counts (int64), the dispatch and
                 combine all-to-alls in forward and their two gradients in backward, each s k rows of hidden size in
                 the compute dtype (a rank's received rows depend on the routing: s k is their mean, exact summed over
                 the EP group); full recompute replays the forward's three. Balance adds the replica weights
                 (at most max_dup_experts_num experts per rank and layer, there and back as gradients): an upper bound.
  ep (allgather) per MoE layer and micro batch: all-gathers of the token count, hidden rows (compute dtype), routing
                 weights (fp32) and expert ids (int64) of the EP group, the fp32 reduce-scatter of the combined sums;
                 backward reduce-scatters the rows' and weights' gradients and all-gathers the sums' gradient.
  cp_ulysses     per text layer and micro batch: q, k, v and the attention output, each s x heads x head dim, in
                 forward and again as gradients in backward; full recompute replays the forward's four.
  cp_ring        per text layer and micro batch: forward sends the key and value blocks ring-1 times; backward
                 sends them ring-1 times again and the fp32 dk, dv ring times.
  cp             per micro batch: the encoded image rows all-gathered (each rank's padded to the largest share) and
                 their gradient all-reduced; the loss summed once per step (8 bytes).
  dp, grad norm  a step between the first and the last: one data-parallel sum of four float64 scalars (the step's
                 loss and tokens, the next step's valid tokens and data-error flag; the first step of a process adds
                 an all-reduce of its own valid tokens before its forward) and the gradient norm's partial sums
                 (4 bytes per sharded mesh dim; the sums of every reduction over the whole job in one all-reduce,
                 which also carries those four scalars when the data-parallel ranks are the whole job).
"""

from __future__ import annotations

from dataclasses import dataclass

from glm45v_fsdp.memory.estimate import ParamSpec, ShardLayout
from glm45v_fsdp.preflight import largest_share
from glm45v_fsdp.runtime.mesh import ParallelDims

FAMILIES = ("fsdp", "efsdp", "dp_replicate", "ep", "cp_ulysses", "cp_ring", "cp", "dp")
INT64, FP32 = 8, 4
# the trainer's data-parallel sums per step (trainer.py train_step): its loss and tokens, the next step's valid tokens
# and data-error flag
STEP_SCALARS = 4


@dataclass(frozen=True)
class Collective:
    """One kind of collective of one family, summed over the step for one rank."""

    family: str
    kind: str  # all_gather | reduce_scatter | all_reduce | all_to_all | p2p
    what: str
    calls: float
    bytes: float
    group_size: int
    exact: bool = True  # False: a mean or a bound (data-dependent routing)


@dataclass(frozen=True)
class StepShape:
    """What the traffic depends on besides the parameters."""

    micro_tokens: tuple[int, ...]  # s of each of the step's A micro batches: tokens per rank
    micro_image_rows: tuple[tuple[int, ...], ...]  # merged image tokens of each image of each micro batch
    compute_itemsize: int
    reduce_itemsize: int
    reshard_after_forward: bool
    recompute: str  # off | selective | full
    dispatcher: str  # alltoall | allgather
    balance_replicas: int  # EP balance's max_dup_experts_num (0: off)
    ep_group_tokens: tuple[int, ...] | None = None  # the allgather dispatcher pads to the EP group's largest s

    @property
    def micro_batches(self) -> int:
        return len(self.micro_tokens)

    @property
    def tokens(self) -> int:
        """All micro batches' tokens per rank."""
        return sum(self.micro_tokens)


def _units(specs: list[ParamSpec], layout: ShardLayout, itemsize: int, trainable: bool) -> dict[str, int]:
    """Unsharded (padded) bytes per FSDP unit, expert units apart (not merged into their layer as memory does)."""
    sizes: dict[str, int] = {}
    for spec in specs:
        if trainable and not spec.trainable:
            continue
        sizes[spec.unit] = sizes.get(spec.unit, 0) + layout.unsharded(spec) * itemsize
    return sizes


def fsdp_traffic(specs: list[ParamSpec], layout: ShardLayout, dims: ParallelDims, shape: StepShape) -> list[Collective]:
    if not layout.sharded:
        return []
    expert_units = {spec.unit for spec in specs if spec.expert}
    gathered = _units(specs, layout, shape.compute_itemsize, trainable=False)
    reduced = _units(specs, layout, shape.reduce_itemsize, trainable=True)
    a = shape.micro_batches
    found = []
    for family, size, units in (
        ("fsdp", dims.fsdp_size, [u for u in gathered if u not in expert_units]),
        ("efsdp", dims.efsdp, [u for u in gathered if u in expert_units]),
    ):
        resharded = [u for u in units if u and shape.reshard_after_forward]  # '' is the root
        trained = [u for u in units if u in reduced]
        if size > 1 and units:
            found.append(
                Collective(
                    family,
                    "all_gather",
                    f"{len(units)} unit(s): forward" + (f", {len(resharded)} again in backward" if resharded else ""),
                    a * (len(units) + len(resharded)),
                    a * (sum(gathered[u] for u in units) + sum(gathered[u] for u in resharded)),
                    size,
                )
            )
            found.append(
                Collective(
                    family,
                    "reduce_scatter",
                    f"{len(trained)} unit(s)' gradients, every micro batch",
                    a * len(trained),
                    a * sum(reduced[u] for u in trained),
                    size,
                )
            )
        if dims.hsdp_enabled and trained:
            shard = size if layout.sharded else 1
            found.append(
                Collective(
                    "dp_replicate",
                    "all_reduce",
                    f"{family} units' reduced shards over {dims.dp_replicate} replicas, once per step",
                    len(trained),
                    sum(reduced[u] // shard for u in trained),
                    dims.dp_replicate,
                )
            )
    return found


def expert_traffic(hf_config: object, dims: ParallelDims, shape: StepShape, moe_layers: int) -> list[Collective]:
    if dims.ep == 1 or moe_layers == 0:
        return []
    text = hf_config.text_config
    k, h, e, b = text.num_experts_per_tok, text.hidden_size, dims.ep, shape.compute_itemsize
    runs = shape.micro_batches * moe_layers
    full = shape.recompute == "full"
    replays = runs if full else 0
    s = shape.tokens * moe_layers  # tokens through all MoE layers of the step
    if shape.dispatcher == "alltoall":
        found = [
            Collective("ep", "all_gather", "per-expert counts", runs + replays,
                       (runs + replays) * text.n_routed_experts * INT64 * e, e),
            Collective("ep", "all_to_all", "dispatch + combine, forward and backward" +
                       (" + replayed forward" if full else ""), 4 * runs + 2 * replays,
                       (4 + 2 * full) * s * k * h * b, e, exact=False),
        ]  # fmt: skip
    else:
        s = sum(shape.ep_group_tokens or shape.micro_tokens) * moe_layers
        gathered = e * s * (h * b + k * FP32 + k * INT64) + e * INT64 * runs
        found = [
            Collective("ep", "all_gather", "token count, rows, weights, ids (+ backward's sum gradient)",
                       5 * runs + 4 * replays, (1 + full) * gathered + e * s * h * FP32, e),
            Collective("ep", "reduce_scatter", "combined sums (+ backward's row and weight gradients)",
                       3 * runs + replays, e * s * ((1 + full) * h * FP32 + h * b + k * FP32), e),
        ]  # fmt: skip
    if shape.balance_replicas:
        expert = 3 * h * text.moe_intermediate_size * b
        moved = 2 * (runs + replays) * shape.balance_replicas * expert
        found.append(
            Collective(
                "ep",
                "all_to_all",
                "EP balance replica weights and their gradients (at most)",
                2 * (runs + replays),
                moved,
                e,
                exact=False,
            )  # fmt: skip
        )
    return found


def context_traffic(hf_config: object, dims: ParallelDims, shape: StepShape) -> list[Collective]:
    if dims.cp == 1:
        return []
    text = hf_config.text_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    layers, a, b = text.num_hidden_layers, shape.micro_batches, shape.compute_itemsize
    runs, s = a * layers, shape.tokens * layers  # s: tokens through all layers of the step
    found = []
    if dims.cp_ulysses > 1:
        kv_heads = max(text.num_key_value_heads, dims.cp_ulysses)  # fewer kv heads than ranks: repeated
        forward = s * head_dim * b * 2 * (text.num_attention_heads + kv_heads)  # q and the output, k and v
        full = shape.recompute == "full"
        found.append(
            Collective(
                "cp_ulysses",
                "all_to_all",
                "q, k, v, output: forward and backward" + (" + replayed forward" if full else ""),
                (8 + 4 * full) * runs,
                (2 + full) * forward,
                dims.cp_ulysses,
            )  # fmt: skip
        )
    if dims.cp_ring > 1:
        r = dims.cp_ring
        kv_heads = max(1, text.num_key_value_heads // dims.cp_ulysses)
        block = s * dims.cp_ulysses * kv_heads * head_dim  # ring blocks (after the Ulysses exchange) of all layers
        found.append(
            Collective("cp_ring", "p2p", f"k, v blocks 2 x {r - 1} times, fp32 dk, dv {r} times per layer",
                       runs * (4 * (r - 1) + 2 * r), block * (4 * (r - 1) * b + 2 * r * FP32), r)
        )  # fmt: skip
    with_images = [rows for rows in shape.micro_image_rows if rows]
    if with_images:
        largest = sum(sum(largest_share(list(rows), dims.cp)) for rows in with_images)
        found.append(
            Collective(
                "cp",
                "all_gather",
                "image rows (every rank's padded to the largest share)",
                len(with_images),
                largest * dims.cp * text.hidden_size * b,
                dims.cp,
            )  # fmt: skip
        )
        found.append(
            Collective(
                "cp",
                "all_reduce",
                "image rows' gradient",
                len(with_images),
                sum(map(sum, with_images)) * text.hidden_size * b,
                dims.cp,
            )  # fmt: skip
        )
    found.append(Collective("cp", "all_reduce", "the step's loss", 1, INT64, dims.cp))
    return found


def reduction_traffic(specs: list[ParamSpec], dims: ParallelDims) -> list[Collective]:
    found = []
    # the gradient norm: per kind of sharded parameter, the mesh dims (family, size) its partial sum is reduced over
    norm_keys = [[("fsdp", dims.fsdp_size)]] if dims.fsdp_size > 1 else []
    if any(spec.expert for spec in specs):
        norm_keys.append([(family, size) for family, size in (("efsdp", dims.efsdp), ("ep", dims.ep)) if size > 1])
    whole_job = [key for key in norm_keys if len(key) == 1 and key[0][1] == dims.world_size]
    loss_rides = bool(whole_job) and dims.dp == dims.world_size  # the step's scalars go with those sums
    if dims.dp > 1 and not loss_rides:
        found.append(Collective("dp", "all_reduce", "loss, token counts (float64)", 1, STEP_SCALARS * INT64, dims.dp))
    if whole_job:  # these partial sums travel together (local_shards.grad_norm), in float64 with the step's scalars
        family = whole_job[0][0][0]
        nbytes = (len(whole_job) + STEP_SCALARS) * INT64 if loss_rides else len(whole_job) * FP32
        found.append(Collective(family, "all_reduce", "gradient norm's partial sums", 1, nbytes, dims.world_size))
    for key in norm_keys:
        if key not in whole_job:
            found += [
                Collective(family, "all_reduce", "gradient norm's partial sum", 1, FP32, size) for family, size in key
            ]
    return found


def step_traffic(
    specs: list[ParamSpec], layout: ShardLayout, dims: ParallelDims, hf_config: object, shape: StepShape
) -> list[Collective]:
    """Every collective one optimizer step runs on one rank."""
    return [*fsdp_traffic(specs, layout, dims, shape), *other_traffic(specs, dims, hf_config, shape)]


def other_traffic(specs: list[ParamSpec], dims: ParallelDims, hf_config: object, shape: StepShape) -> list[Collective]:
    """Every collective but FSDP's (which depends on the parameters' shards, not on the tokens)."""
    text = hf_config.text_config
    moe_layers = text.num_hidden_layers - min(text.first_k_dense_replace, text.num_hidden_layers)
    return [
        *expert_traffic(hf_config, dims, shape, moe_layers),
        *context_traffic(hf_config, dims, shape),
        *reduction_traffic(specs, dims),
    ]


def by_family(collectives: list[Collective]) -> dict[tuple[str, str], tuple[float, float]]:
    """{(family, kind): (calls, bytes)} summed."""
    found: dict[tuple[str, str], tuple[float, float]] = {}
    for c in collectives:
        calls, nbytes = found.get((c.family, c.kind), (0.0, 0.0))
        found[(c.family, c.kind)] = (calls + c.calls, nbytes + c.bytes)
    return found
