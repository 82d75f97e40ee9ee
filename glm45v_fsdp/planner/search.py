"""Every layout of a job, its memory by preflight's estimator, its modelled step time, ranked.

`Planner.evaluate(layout)` puts the pieces together for one layout: the per-rank memory exactly as preflight's report
sums it (state of the largest shard + transient unsharded copies + activations after every plan's adjustment), the
step's FLOPs (flops.py) and collectives (traffic.py) for micro batches at the job's sequence length, which families
cross nodes (ranks placed by node), and the step time (step_time.py). `Planner.search` enumerates the layouts that
divide the world (`candidates`), keeps those that fit and ranks them by modelled ms/step. The meta model, the
parameter shards and the FLOPs are cached per what they depend on, so a 128-rank search takes seconds.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from glm45v_fsdp.config import Config
from glm45v_fsdp.errors import ConfigError
from glm45v_fsdp.memory.estimate import ParamSpec, ShardLayout, state_bytes, transient_bytes
from glm45v_fsdp.parallel.context import check_context_parallel
from glm45v_fsdp.parallel.expert import check_expert_parallel
from glm45v_fsdp.parallel.fsdp import DTYPES
from glm45v_fsdp.planner.assemble import PlannedModel, flops_shape, plan_model, traffic_shape
from glm45v_fsdp.planner.devices import GIB, Device
from glm45v_fsdp.planner.flops import Flops, step_flops
from glm45v_fsdp.planner.layout import CHUNK_LOSS, RECOMPUTE, Job, Layout
from glm45v_fsdp.planner.step_time import StepTime, step_time
from glm45v_fsdp.planner.traffic import Collective, fsdp_traffic, other_traffic
from glm45v_fsdp.preflight import activation_estimate, largest_share, sample_vision
from glm45v_fsdp.runtime.mesh import ParallelDims
from glm45v_fsdp.runtime.topology import NodeLayout, placement

TIE = 0.005  # modelled step times closer than this are not told apart (the model is not that precise)


@dataclass
class Evaluation:
    layout: Layout
    error: str | None = None  # the layout cannot run (a plan rejects it)
    memory: dict[str, int] = field(default_factory=dict)  # bytes per row of the largest rank
    fits: bool = False
    flops: Flops | None = None  # per micro batch
    collectives: list[Collective] = field(default_factory=list)
    crossing: dict[str, bool] = field(default_factory=dict)
    step: StepTime | None = None
    model_flops: float = 0.0  # the step's useful FLOPs (no recompute), for MFU
    tokens_per_s_per_device: float = 0.0
    mfu: float = 0.0

    @property
    def gib(self) -> float:
        return self.memory.get("total", 0) / GIB


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class SearchSpace:
    ep: tuple[int, ...] | None = None  # None: every divisor of the experts that fits
    ulysses: tuple[int, ...] = (1, 2, 4, 8)
    ring: tuple[int, ...] = (1, 2, 4)
    replicate: tuple[int, ...] | None = None  # None: divisors of the node count (replicas of whole nodes)
    recompute: tuple[str, ...] = RECOMPUTE
    chunk_loss: tuple[str, ...] = CHUNK_LOSS
    unit_mib: tuple[float | None, ...] = (None, 512.0)
    micro_batch: tuple[int, ...] = (1, 2, 4)


class Planner:
    def __init__(
        self,
        config: Config,
        hf_config: object,
        job: Job,
        device: Device,
        images_per_sample: int | None = None,
        image_size: int | None = None,
        videos_per_sample: int | None = None,
        video_frames: int | None = None,
    ) -> None:
        self.config, self.hf_config, self.job, self.device = config, hf_config, job, device
        job_config = Layout.of_config(config).apply(config, job)
        vision = sample_vision(job_config, hf_config, images_per_sample, image_size, videos_per_sample, video_frames)
        self.images, self.images_text = vision.items, vision.text
        self.dtype = config.parallel.fsdp_plan.param_dtype
        self._cache: dict[tuple, object] = {}

    def _cached(self, key: tuple, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    # ------------------------------------------------------------------------------------------------ candidates

    def candidates(self, space: SearchSpace = SearchSpace()) -> Iterator[Layout]:
        world, text = self.job.world_size, self.hf_config.text_config
        eps = space.ep or tuple(d for d in divisors(text.n_routed_experts) if d <= world)
        replicas = space.replicate or tuple(divisors(self.job.nodes))
        for ep, uly, ring, rep, rc, loss, unit, micro in itertools.product(
            eps, space.ulysses, space.ring, replicas, space.recompute, space.chunk_loss, space.unit_mib,
            space.micro_batch,
        ):  # fmt: skip
            layout = Layout(ep, uly, ring, rep, rc, loss, unit, micro)
            if self.divides(layout):
                yield layout

    def divides(self, layout: Layout) -> bool:
        """The layout's sizes divide the world and the global batch (accumulation >= 1)."""
        world = self.job.world_size
        if world % (layout.replicate * layout.cp):
            return False
        fsdp = world // layout.replicate
        if fsdp % layout.ep:
            return False
        dp = world // layout.cp
        return self.job.global_batch % (dp * layout.micro_batch) == 0

    # ------------------------------------------------------------------------------------------------ one layout

    def _planned(self, ep: int, unit_mib: float | None) -> PlannedModel:
        """The meta model after every plan, with recompute and the chunked loss on so their matches exist (neither
        changes a parameter), for an EP size and a unit size."""
        layout = Layout(ep=ep, recompute="full", chunk_loss="static", unit_mib=unit_mib)
        config = layout.apply(self.config, self.job)
        dims = layout.dims(self.job)
        return self._cached(("planned", ep, unit_mib), lambda: plan_model(config, dims, self.hf_config))

    def _crossing(self, dims: ParallelDims) -> dict[str, bool]:
        def make() -> dict[str, bool]:
            nodes = NodeLayout.contiguous(self.job.world_size, self.job.ranks_per_node)
            crossing = {family: where != "inside a node" for family, where in placement(dims, nodes).items()}
            crossing["cp"] = crossing.get("cp_ring", False) or crossing.get("cp_ulysses", False)
            return crossing

        return self._cached(("crossing", dims), make)

    def _flops(self, cp: int, ring: int, micro: int, recompute: str, keep_attention: bool) -> Flops:
        def make() -> Flops:
            planned = self._planned(1, None)
            training = dataclasses.replace(self.config.training, micro_batch_size=micro)
            dims = Layout(ulysses=cp).dims(Job(1, cp, self.job.tokens, 1))
            shape = flops_shape(dataclasses.replace(self.config, training=training), dims, self.job.tokens,
                                self.images * micro)  # fmt: skip
            causal = ring_causal_share(self.device.causal_share, ring)
            return step_flops(planned.model, self.hf_config, shape, causal, recompute,
                              planned.recompute_modules(), keep_attention)  # fmt: skip

        return self._cached(("flops", cp, ring, micro, recompute, keep_attention), make)

    def shard_plan(self, layout: Layout) -> tuple[list[ParamSpec], ShardLayout]:
        """The parameters of `layout` and how its ranks split them (what its memory rows and checkpoints hold)."""
        dims = layout.dims(self.job)
        specs = self._planned(layout.ep, layout.unit_mib).params.specs
        return specs, ShardLayout(dims.fsdp_size, dims.ep, dims.efsdp, dims.world_size > 1, dims.dp_replicate)

    def check(self, layout: Layout) -> None:
        """ConfigError when a plan rejects the layout (heads, experts)."""
        check_expert_parallel(self.hf_config, layout.ep)
        if layout.cp > 1:
            check_context_parallel(self.hf_config, layout.ulysses, self.config.model.attn_implementation, layout.ring)

    def evaluate(self, layout: Layout) -> Evaluation:
        found = Evaluation(layout)
        try:
            self.check(layout)
        except ConfigError as error:
            found.error = str(error)
            return found
        job, config = self.job, layout.apply(self.config, self.job)
        dims = layout.dims(job)
        planned = self._planned(layout.ep, layout.unit_mib)
        plan = config.parallel.fsdp_plan
        compute, reduce = DTYPES[plan.param_dtype].itemsize, DTYPES[plan.reduce_dtype].itemsize
        shards = ShardLayout(dims.fsdp_size, dims.ep, dims.efsdp, dims.world_size > 1, dims.dp_replicate)
        specs = planned.params.specs
        state, transient, gathered = self._cached(
            ("state", layout.ep, layout.unit_mib, dims.fsdp_size),
            lambda: (
                state_bytes(specs, shards, 0),  # shard index 0 holds the most rows: the largest rank
                transient_bytes(
                    specs, shards, compute, reduce, plan.reshard_after_forward, plan.prefetch, plan.cpu_offload
                ),
                _largest_units(specs, shards, compute),
            ),
        )
        per_rank_patches = sum(largest_share(self.images * layout.micro_batch, dims.cp))
        acts = activation_estimate(config, self.hf_config, dims, planned.matched, per_rank_patches)
        found.memory = {
            "params": state.params,
            "grads": state.grads,
            "optimizer": state.optimizer,
            "padding": state.padding,
            "transient": transient.total,
            "activations": acts.total,
        }
        found.memory["total"] = sum(found.memory.values())
        found.fits = found.memory["total"] <= self.device.usable_bytes
        recompute = config.features.recompute
        flops = self._flops(dims.cp, layout.ring, layout.micro_batch, layout.recompute, recompute.keep_attention)
        found.flops = flops
        accumulation = layout.accumulation(job)
        merge = self.hf_config.vision_config.spatial_merge_size**2
        tokens = layout.micro_batch * job.tokens // dims.cp
        rows = [p // merge for p in self.images] * layout.micro_batch
        shape = traffic_shape(config, dims, [tokens] * accumulation, [rows] * accumulation)
        sharding = self._cached(
            ("fsdp traffic", layout.ep, layout.unit_mib, layout.replicate, dims.fsdp_size, accumulation),
            lambda: fsdp_traffic(specs, shards, dims, shape),
        )
        found.collectives = [*sharding, *other_traffic(specs, dims, self.hf_config, shape)]
        found.crossing = self._crossing(dims)
        first = {family: accumulation * nbytes for family, nbytes in gathered.items()}
        attention = flops.forward["text attention"] + flops.forward["vision attention"]
        found.step = step_time(accumulation * flops.total, accumulation * 3 * attention, found.collectives,
                               found.crossing, first, state.params // 4, self.device, self.dtype)  # fmt: skip
        step_s = found.step.total_ms / 1e3
        found.model_flops = accumulation * (flops.forward_total + flops.backward)
        found.tokens_per_s_per_device = job.global_batch * job.tokens / step_s / job.world_size
        found.mfu = found.model_flops / step_s / self.device.peak_flops(self.dtype)
        return found

    def search(self, space: SearchSpace = SearchSpace()) -> list[Evaluation]:
        """Every candidate evaluated; the fitting ones first by modelled ms/step (layouts within TIE of each other by
        memory: the one with more headroom first), then the rest by memory."""
        results = [self.evaluate(layout) for layout in self.candidates(space)]
        valid = [r for r in results if r.error is None]
        fitting = sorted((r for r in valid if r.fits), key=lambda r: r.step.total_ms)
        ordered, start = [], 0
        while start < len(fitting):  # runs of layouts within TIE of the run's fastest, each by memory
            end = start
            while end < len(fitting) and fitting[end].step.total_ms <= fitting[start].step.total_ms * (1 + TIE):
                end += 1
            ordered += sorted(fitting[start:end], key=lambda r: r.memory["total"])
            start = end
        return ordered + sorted((r for r in valid if not r.fits), key=lambda r: r.memory["total"])

    def remedies(self, found: Evaluation) -> list[tuple[str, Evaluation]]:
        """For a layout that does not fit: the one-switch changes that make it fit, fastest first."""
        layout, changes = found.layout, []
        for name, changed in (
            ("recompute full", dataclasses.replace(layout, recompute="full")),
            ("recompute selective", dataclasses.replace(layout, recompute="selective")),
            ("chunk loss dynamic", dataclasses.replace(layout, chunk_loss="dynamic")),
            ("micro batch 1", dataclasses.replace(layout, micro_batch=1)),
            (f"ep {layout.ep * 2}", dataclasses.replace(layout, ep=layout.ep * 2)),
            (f"ulysses {layout.ulysses * 2}", dataclasses.replace(layout, ulysses=layout.ulysses * 2)),
            (f"ring {layout.ring * 2}", dataclasses.replace(layout, ring=layout.ring * 2)),
            ("replicate 1", dataclasses.replace(layout, replicate=1)),
        ):
            if changed == layout or not self.divides(changed):
                continue
            result = self.evaluate(changed)
            if result.error is None and result.fits:
                changes.append((name, result))
        return sorted(changes, key=lambda item: item[1].step.total_ms)


def ring_causal_share(kernel_share: float, ring: int) -> float:
    """The share of a causal attention's scores computed under Ring attention: the zigzag layout cuts the sequence
    into 2 x ring chunks; of the (2 ring)^2 chunk pairs the ring computes the 2 ring (2 ring - 1) / 2 below the
    diagonal in full and the 2 ring diagonal ones with the kernel's causal mask (`kernel_share` of each). Without
    a ring: the kernel's share."""
    if ring == 1:
        return kernel_share
    chunks = 2 * ring
    return (chunks * (chunks - 1) / 2 + chunks * kernel_share) / chunks**2


def _largest_units(specs: list, shards: ShardLayout, itemsize: int) -> dict[str, int]:
    """Bytes of the largest dense and expert unit's gather: what starts each micro batch before compute can hide
    the rest."""
    sizes: dict[str, int] = {}
    for spec in specs:
        sizes[spec.unit] = sizes.get(spec.unit, 0) + shards.unsharded(spec) * itemsize
    expert_units = {spec.unit for spec in specs if spec.expert}
    dense = [size for unit, size in sizes.items() if unit not in expert_units]
    expert = [size for unit, size in sizes.items() if unit in expert_units]
    return {"fsdp": max(dense, default=0), "efsdp": max(expert, default=0)}
