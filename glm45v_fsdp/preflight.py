"""The checks the trainer's preflight and the layout planner share, on a meta model: each enabled plan's dry run,
the images and videos of one sample, the activation estimate with every plan's effect, and the parameters as FSDP2
will shard them for a layout. `python -m glm45v_fsdp.tools.preflight` prints them (tools/preflight_report.py); the
planner (planner/search.py, planner/assemble.py) ranks layouts by them."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from PIL import Image
from torch import nn

from glm45v_fsdp.config import Config
from glm45v_fsdp.data import load_image_processor
from glm45v_fsdp.data.processor import process_images, video_processor_for
from glm45v_fsdp.errors import ConfigError
from glm45v_fsdp.memory.estimate import ActivationEstimate, ParamSpec, ShardLayout, activation_bytes, param_specs
from glm45v_fsdp.model import REQUIRED_FSDP_UNITS
from glm45v_fsdp.module_patterns import PlanMatch
from glm45v_fsdp.parallel.fsdp import DTYPES, unit_groups, unit_mib
from glm45v_fsdp.parallel.sequence import image_owners
from glm45v_fsdp.plans import PlanContext, enabled_plans
from glm45v_fsdp.runtime import ParallelDims, build_parallel_dims, select_device


def minimal_dims(config: Config) -> ParallelDims:
    """The smallest layout the config's parallel sizes allow (dp_shard = ep): what the plans are checked against when
    no --world-size is given."""
    p = config.parallel
    cp = p.ulysses_parallel_size * p.ring_attention_size
    return build_parallel_dims(p, p.data_parallel_replicate_size * cp * p.expert_parallel_size)


def check_plans(
    model: nn.Module, config: Config, dims: ParallelDims, hf_config
) -> tuple[dict[str, list[PlanMatch]], list[str]]:
    """Apply every enabled plan of the registry as a dry run, in order, on to the end; returns ({plan: matches} of
    the plans that ran and passed, [errors])."""
    context = PlanContext(config, dims, hf_config, select_device("cpu"))
    matched, errors = {}, []
    for plan in enabled_plans(config, dims, hf_config):
        try:
            matched[plan.name] = plan.apply(model, context)
        except ConfigError as error:
            errors.append(f"[plan {plan.name}] {error}")
    return matched, errors


@dataclass(frozen=True)
class SampleVision:
    """What one sample's vision inputs are for the estimates: the patches of each item the vision tower encodes on
    its own (each image, each temporal patch of each video) in sequence order, and how they were derived."""

    items: list[int]
    text: str


def sample_vision(
    config: Config,
    hf_config,
    images_per_sample: int | None,
    image_size: int | None,
    videos_per_sample: int | None = None,
    video_frames: int | None = None,
) -> SampleVision:
    """The vision items of the largest sample.

    Defaults: the synthetic data's images, and its video when it has one (every data.synthetic_video_every-th
    sample: the largest sample sets the peak); for JSON or HF data (a data.mixture with such a source too) one image
    of the vision config's image_size and no video. A video's frames (default: data.synthetic_video_frames, else
    data.video_max_frames) are square frames of the image side, downscaled to data.video_max_pixels. Whatever does
    not fit data.cutoff_len is dropped, as the data sets drop a block they would cut.
    """
    data, vision = config.data, hf_config.vision_config
    kinds = {data.dataset} if data.mixture is None else {source.dataset for source in data.mixture}
    synthetic = kinds == {"synthetic"}
    images = data.synthetic_images_per_sample if synthetic and images_per_sample is None else images_per_sample
    images = 1 if images is None else images
    videos = videos_per_sample
    if videos is None:
        videos = int(synthetic and data.synthetic_video_every > 0)
    frames = video_frames or (data.synthetic_video_frames if synthetic else data.video_max_frames)
    size = image_size or (data.synthetic_image_size if synthetic else vision.image_size)
    if images == 0 and videos == 0:
        return SampleVision([], "no images")
    processor = load_image_processor(config.model.name_or_path, vision)
    merge = vision.spatial_merge_size**2
    items, budget, parts = [], config.data.cutoff_len, []
    if images:
        _, grid = process_images(processor, [Image.new("RGB", (size, size))])
        patches = int(grid.prod())
        kept = min(images, budget // (patches // merge + 2))  # an image block never gets cut: it is dropped
        items += [patches] * kept
        budget -= kept * (patches // merge + 2)
        parts.append(
            f"{kept} image(s) of {size}x{size} px per sample -> {patches} patches ({patches // merge} tokens) each"
        )
    if videos:
        side = min(size, math.isqrt(data.video_max_pixels))
        frames += frames % 2  # an odd count gets its last frame repeated
        t, h, w = video_processor_for(processor).grid(frames, side, side)
        # per temporal patch: <|begin_of_image|>, its tokens, <|end_of_image|>, the timestamp's digits
        seconds = (frames - 2) / data.video_fps  # the last patch's timestamp
        block = 2 + t * (h * w // merge + 2 + len(str(int(seconds))))
        kept = min(videos, budget // block)
        items += [h * w] * (t * kept)
        parts.append(
            f"{kept} video(s) of {frames} frames {side}x{side} px per sample -> {t} temporal patches of {h * w} "
            f"patches ({h * w // merge} tokens) each"
        )
    return SampleVision(items, "; ".join(parts))


def image_patches(
    config: Config,
    hf_config,
    images_per_sample: int | None,
    image_size: int | None,
    cp: int = 1,
    videos_per_sample: int | None = None,
    video_frames: int | None = None,
) -> tuple[int, str]:
    """Patches per micro batch and rank for the activation estimate, and how they were derived. Under context
    parallelism the items are split over the `cp` ranks whole (parallel/sequence.py's image_owners): the rank
    that encodes the most counts."""
    vision = sample_vision(config, hf_config, images_per_sample, image_size, videos_per_sample, video_frames)
    if not vision.items:
        return 0, vision.text
    per_micro_batch = vision.items * config.training.micro_batch_size
    mine = largest_share(per_micro_batch, cp)
    text = (
        vision.text
        + f", x micro_batch_size {config.training.micro_batch_size}"
        + (f", split over cp {cp}: {len(mine)} item(s) per rank" if cp > 1 else "")
    )
    return sum(mine), text


def largest_share(sizes: list[int], cp: int) -> list[int]:
    """The vision items (by patches) of the CP rank that encodes the most: CP gives each rank whole items."""
    if cp == 1 or not sizes:
        return list(sizes)
    owners = image_owners(sizes, cp)
    return max(([size for size, owner in zip(sizes, owners) if owner == rank] for rank in range(cp)), key=sum)


def activation_estimate(
    config: Config, hf_config, dims: ParallelDims, matched: dict[str, list[PlanMatch]], patches: int
) -> ActivationEstimate:
    """ACTIVATION_FORMULA for s tokens and `patches` image patches per rank, then every enabled plan's effect on it,
    in the registry's order (recompute, offload, chunk loss, context parallelism)."""
    tokens = config.training.micro_batch_size * config.data.cutoff_len // dims.cp  # context parallelism splits it
    compute = DTYPES[config.parallel.fsdp_plan.param_dtype].itemsize
    estimate = ActivationEstimate(activation_bytes(hf_config, tokens, patches, compute), compute)
    for plan in enabled_plans(config, dims, hf_config):
        plan.estimate(estimate, config, dims, hf_config, matched.get(plan.name, []))
    return estimate


@dataclass(frozen=True)
class PlannedParams:
    """Every parameter as FSDP2 will shard it for one layout: the specs (each with its unit's leader name, '' =
    root), how they split over the ranks, the FSDP units built and the unit size that built them."""

    specs: list[ParamSpec]
    layout: ShardLayout
    fsdp_units: list[str]
    groups: list[list[str]]
    expert_units: list[str]
    unit_mib: float
    device_type: str


def planned_params(
    model: nn.Module, config: Config, dims: ParallelDims, matched: dict[str, list[PlanMatch]]
) -> PlannedParams:
    """`model` is the meta model after every plan but FSDP (freeze decides what is trainable); `matched` is what
    each plan's patterns matched (the FSDP units among them)."""
    expert_units = sorted({name for match in matched.get("expert_parallel", []) for name in match.names})
    plan = config.parallel.fsdp_plan
    # The units apply_fsdp builds: merged to the unit size, what cannot fill a unit left to the enclosing one. The
    # default unit size is the target device's (training.device; auto: npu, the backend's target).
    device_type = config.training.device if config.training.device != "auto" else "npu"
    size = unit_mib(plan, device_type)
    required = set(REQUIRED_FSDP_UNITS)
    groups = unit_groups(model, matched["fsdp"], required | set(expert_units), size, required=required)
    fsdp_units = sorted(name for group in groups for name in group)
    leader = {name: group[0] for group in groups for name in group}
    sharded = dims.world_size > 1 or plan.cpu_offload
    layout = ShardLayout(dims.fsdp_size if sharded else 1, dims.ep, dims.efsdp, sharded, dims.dp_replicate)
    routed = [f"{name}.experts" for match in matched.get("moe", []) for name in match.names]
    specs = param_specs(model, fsdp_units, expert_units, routed)
    specs = [dataclasses.replace(spec, unit=leader.get(spec.unit, spec.unit)) for spec in specs]
    return PlannedParams(specs, layout, fsdp_units, groups, expert_units, size, device_type)
