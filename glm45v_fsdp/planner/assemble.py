"""The planned meta model of one config and layout: what the FLOPs, traffic and memory models read.

`plan_model` builds GLM-4.5V on the meta device and runs the plan registry as preflight does (glm45v_fsdp/plans.py),
then takes FSDP2's units and every parameter's shard layout from the same code preflight's memory report uses, so
the planner and preflight can never disagree on what a layout holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from glm45v_fsdp.config import Config
from glm45v_fsdp.errors import ConfigError
from glm45v_fsdp.model import build_meta_model
from glm45v_fsdp.module_patterns import PlanMatch
from glm45v_fsdp.parallel.fsdp import DTYPES
from glm45v_fsdp.planner.flops import Shape
from glm45v_fsdp.planner.traffic import StepShape
from glm45v_fsdp.preflight import PlannedParams, check_plans, largest_share, planned_params
from glm45v_fsdp.runtime.mesh import ParallelDims


@dataclass
class PlannedModel:
    model: nn.Module
    matched: dict[str, list[PlanMatch]]
    params: PlannedParams

    def recompute_modules(self) -> list[str]:
        return sorted({name for match in self.matched.get("recompute", []) for name in match.names})


def plan_model(config: Config, dims: ParallelDims, hf_config: object) -> PlannedModel:
    """The meta model after every plan of `config` for `dims`; a plan that rejects the layout raises ConfigError
    naming the key (e.g. a Ulysses size that does not divide the heads)."""
    model = build_meta_model(hf_config)
    matched, errors = check_plans(model, config, dims, hf_config)
    if errors:
        raise ConfigError("; ".join(errors))
    return PlannedModel(model, matched, planned_params(model, config, dims, matched))


def flops_shape(config: Config, dims: ParallelDims, sample_tokens: int, image_patches: list[int]) -> Shape:
    """One rank's micro batch: `sample_tokens` per sample, `image_patches` the patches of each image of the whole
    micro batch (CP gives each rank whole images: the largest share counts, as the slowest rank sets the pace)."""
    micro = config.training.micro_batch_size
    mine = largest_share(image_patches, dims.cp)
    return Shape(micro * sample_tokens // dims.cp, sample_tokens, micro, dims.cp, sum(mine), mine)


def traffic_shape(
    config: Config,
    dims: ParallelDims,
    micro_tokens: list[int],
    micro_image_rows: list[list[int]],
    ep_group_tokens: list[int] | None = None,
) -> StepShape:
    """`micro_tokens`: each micro batch's tokens per rank (micro batch size x padded length / cp);
    `micro_image_rows`: each micro batch's merged image tokens per image; `ep_group_tokens`: per micro batch the
    largest tokens per rank of the EP group (what the allgather dispatcher pads to; default: this rank's)."""
    plan = config.parallel.fsdp_plan
    recompute = config.features.recompute
    balance = config.features.ep_balance
    return StepShape(
        micro_tokens=tuple(micro_tokens),
        micro_image_rows=tuple(tuple(rows) for rows in micro_image_rows),
        compute_itemsize=DTYPES[plan.param_dtype].itemsize,
        reduce_itemsize=DTYPES[plan.reduce_dtype].itemsize,
        reshard_after_forward=plan.reshard_after_forward,
        recompute=recompute.granularity if recompute.enabled else "off",
        dispatcher=config.parallel.ep_plan.dispatcher,
        balance_replicas=balance.max_dup_experts_num if balance.enabled else 0,
        ep_group_tokens=tuple(ep_group_tokens) if ep_group_tokens else None,
    )
