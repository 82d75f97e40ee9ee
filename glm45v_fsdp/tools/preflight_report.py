"""What `python -m glm45v_fsdp.tools.preflight` reports (tools/preflight.py parses the command line): the layout, each
plan's dry run on the meta device and, with a world size, each rank's memory."""

from __future__ import annotations

import argparse
import dataclasses
import time

from torch import nn

from ds_compat.config import Translation
from ds_compat.trainer_door import configure
from glm45v_fsdp.config import Config, load_config
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.memory.estimate import (
    ACTIVATION_FORMULA,
    experts_left_plain,
    state_bytes,
    transient_bytes,
)
from glm45v_fsdp.model import build_meta_model, describe_model, load_hf_config
from glm45v_fsdp.module_patterns import PlanMatch
from glm45v_fsdp.parallel.fsdp import DTYPES
from glm45v_fsdp.planner import checkpoint_time
from glm45v_fsdp.plans import PLANS
from glm45v_fsdp.preflight import activation_estimate, check_plans, image_patches, minimal_dims, planned_params
from glm45v_fsdp.runtime import ParallelDims, build_parallel_dims
from glm45v_fsdp.runtime.topology import FAMILIES, NodeLayout, placement

GIB = 1 << 30


def memory_report(
    model: nn.Module,
    hf_config,
    config: Config,
    dims: ParallelDims,
    matched: dict[str, list[PlanMatch]],
    device_memory_gib: float = 64.0,
    images_per_sample: int | None = None,
    image_size: int | None = None,
    videos_per_sample: int | None = None,
    video_frames: int | None = None,
) -> dict:
    """Per-rank memory (bytes) of `dims.world_size` ranks, min/max over ranks and the assumptions behind it.

    `model` and `matched` as `planned_params` takes them.
    """
    plan = config.parallel.fsdp_plan
    planned = planned_params(model, config, dims, matched)
    specs, layout, groups, fsdp_units = planned.specs, planned.layout, planned.groups, planned.fsdp_units
    size, device_type, expert_units = planned.unit_mib, planned.device_type, planned.expert_units
    sharded, shard_size = layout.sharded, layout.dense
    offloaded = sharded and plan.cpu_offload
    compute, reduce = DTYPES[plan.param_dtype].itemsize, DTYPES[plan.reduce_dtype].itemsize
    transient = transient_bytes(
        specs, layout, compute, reduce, plan.reshard_after_forward, plan.prefetch, plan.cpu_offload
    )
    plain_experts = experts_left_plain(specs, layout, compute, plan.cpu_offload)
    patches, image_text = image_patches(
        config, hf_config, images_per_sample, image_size, dims.cp, videos_per_sample, video_frames
    )
    acts = activation_estimate(config, hf_config, dims, matched, patches)
    tokens = acts.base.tokens
    per_index = [state_bytes(specs, layout, index) for index in range(shard_size)]
    ranks = []
    for rank in range(dims.world_size):
        state = per_index[rank % shard_size]  # rank = replica x fsdp_size + index on the FSDP mesh
        host = state.total if offloaded else 0
        ranks.append(
            {
                "rank": rank,
                "params": state.params,
                "expert_params": state.expert_params,
                "grads": state.grads,
                "optimizer": state.optimizer,
                "padding": state.padding,
                "transient": transient.total,
                "activations": acts.total,
                "host": host + acts.offloaded_bytes,
                "total": state.total - host + transient.total + acts.total,
            }
        )
    keys = [k for k in ranks[0] if k != "rank"]
    limit = int(device_memory_gib * GIB)
    worst = max(r["total"] for r in ranks)
    return {
        "fsdp_applied": sharded,
        "shard_size": shard_size,
        "fsdp_units": len(groups) + (0 if plain_experts else len(expert_units)) + 1,
        "cpu_offload": offloaded,
        "per_rank": ranks,
        "min": {k: min(r[k] for r in ranks) for k in keys},
        "max": {k: max(r[k] for r in ranks) for k in keys},
        "activations": {
            "terms": [{"name": name, "bytes": nbytes, "how": how} for name, nbytes, how in acts.terms()],
            "loss_peak": acts.loss_peak,
            "offloaded": acts.offloaded_bytes,
            "total": acts.total,
        },
        "transient": {"params": transient.params, "grads": transient.grads, "assumption": transient.assumption},
        "device_memory_bytes": limit,
        "fits": worst <= limit,
        "assumptions": [
            f"tokens per micro batch and rank s = micro_batch_size {config.training.micro_batch_size} x "
            f"data.cutoff_len {config.data.cutoff_len} / cp {dims.cp} = {tokens}",
            f"images: {image_text} = {patches} patches per micro batch",
            f"transient: {transient.assumption}",
            f"compute dtype {plan.param_dtype} (activations), reduce dtype {plan.reduce_dtype}",
            f"FSDP units: {len(fsdp_units)} planned module(s) in {len(groups)} unit(s) at unit_mib {size:g}"
            + ("" if plan.unit_mib is not None else f" (the {device_type} default)"),
        ],
        "formula": ACTIVATION_FORMULA,
    }


def build_report(args: argparse.Namespace) -> dict:
    """Everything preflight checks and computes, as one JSON-able dict; `errors` lists every problem found."""
    started = time.perf_counter()
    config = load_config(args.config, args.overrides)
    translation = None
    if args.deepspeed:  # a ds_config that does not translate, or whose layout is impossible: one UserError
        ds_run = configure(args.deepspeed, config, args.overrides, args.world_size)
        config, translation = ds_run.config, ds_run.translation
    errors: list[str] = []
    dims = None
    if args.world_size is not None:
        try:
            dims = build_parallel_dims(config.parallel, args.world_size)
        except UserError as error:
            errors.append(f"[layout] {error}")
    hf_config = load_hf_config(config.model)
    model = build_meta_model(hf_config)
    plan_dims = dims if dims is not None else minimal_dims(config)
    matched, plan_errors = check_plans(model, config, plan_dims, hf_config)
    errors += plan_errors
    plans = []
    for plan in PLANS:
        enabled = plan.enabled(config, plan_dims, hf_config)
        plans.append(
            {
                "plan": plan.name,
                "key": plan.key,
                "enabled": enabled,
                "describe": plan.describe(config, plan_dims, hf_config) if enabled else None,
                "patterns": {m.pattern: len(m.names) for m in matched[plan.name]} if plan.name in matched else None,
            }
        )
    report = {
        "config": args.config,
        "deepspeed": None if translation is None else _deepspeed_summary(args.deepspeed, translation),
        "world_size": args.world_size,
        "layout": dataclasses.asdict(dims) | {"cp": dims.cp, "fsdp_size": dims.fsdp_size, "efsdp": dims.efsdp}
        if dims
        else None,
        "model": describe_model(model, hf_config),
        "plans": plans,
        "errors": errors,
        "memory": None,
        "nodes": None,
        "checkpoint": None,
    }
    if dims is not None:
        per_node = args.nproc_per_node or args.world_size
        if args.world_size % per_node:
            errors.append(
                f"[nodes] --nproc-per-node {per_node} does not divide --world-size {args.world_size}: every node "
                f"runs the same number of ranks"
            )
        else:
            nodes = NodeLayout.contiguous(args.world_size, per_node)
            report["nodes"] = {
                "count": nodes.node_count,
                "ranks_per_node": per_node,
                "placement": {
                    f"{family} ({FAMILIES[family]})": where for family, where in placement(dims, nodes).items()
                },
            }
    if dims is not None and "fsdp" in matched:
        report["memory"] = memory_report(
            model,
            hf_config,
            config,
            dims,
            matched,
            args.device_memory_gib,
            args.images_per_sample,
            args.image_size,
            args.videos_per_sample,
            args.video_frames,
        )
        planned = planned_params(model, config, dims, matched)
        report["checkpoint"] = checkpoint_time.model(
            planned.specs,
            planned.layout,
            dims.world_size,
            args.nproc_per_node or dims.world_size,
            config.training,
            checkpoint_time.storage(args.fs_gbps, args.fs_node_gbps, on_cpu=config.training.device == "cpu"),
            trainable_only=config.model.lora.rank > 0,
        )
    report["seconds"] = round(time.perf_counter() - started, 2)
    return report


def _scale(largest: int) -> tuple[str, int]:
    """GiB, or MiB when every figure is below 1 GiB (the tiny model)."""
    return ("GiB (2^30 bytes)", GIB) if largest >= GIB else ("MiB (2^20 bytes)", 1 << 20)


ROWS = (
    ("params", "parameters (fp32 master shards)"),
    ("expert_params", "  of which routed experts"),
    ("grads", "gradients (fp32, trainable only)"),
    ("optimizer", "AdamW exp_avg + exp_avg_sq + step"),
    ("padding", "FSDP2 padding (param + grad storage)"),
    ("transient", "unsharded units + grad buffers (transient)"),
    ("activations", "activations (estimate, see formula)"),
)


def format_report(report: dict) -> str:
    lines = [f"preflight: {report['config'] or 'configs/glm45v_tiny.yaml (default)'}"]
    if report["deepspeed"]:
        lines += _format_deepspeed(report["deepspeed"], report["world_size"])
    lines.append(report["model"])
    layout = report["layout"]
    if report["world_size"] is not None and layout is None:
        lines.append(f"layout: FAILED for world size {report['world_size']}: see the error")
    if layout:
        lines.append(
            f"layout: world {layout['world_size']} = dp_replicate {layout['dp_replicate']} x dp_shard "
            f"{layout['dp_shard']} x cp_ring {layout['cp_ring']} x cp_ulysses {layout['cp_ulysses']}; FSDP mesh "
            f"{layout['fsdp_size']} ranks = efsdp {layout['efsdp']} x ep {layout['ep']}"
        )
    if report.get("nodes"):
        nodes = report["nodes"]
        lines.append(
            f"nodes: {nodes['count']} x {nodes['ranks_per_node']} rank(s) (ranks placed by node, as launchers do):"
        )
        lines += [f"  {family}: {where}" for family, where in nodes["placement"].items()]
    lines.append("plans (matched on the meta device, in build order):")
    for plan in report["plans"]:
        if not plan["enabled"]:
            lines.append(f"  [plan {plan['plan']}] not applied ({plan['key']}: empty or off)")
        elif plan["patterns"] is None:
            lines.append(f"  [plan {plan['plan']}] FAILED ({plan['key']}): see the error")
        else:
            count = f"{len(plan['patterns'])} pattern(s) " if plan["patterns"] else ""
            lines.append(f"  [plan {plan['plan']}] {count}({plan['key']}): {plan['describe']}")
            lines += [f"    {pattern}: {count} module(s)" for pattern, count in plan["patterns"].items()]
    memory = report["memory"]
    if memory:
        lines += _format_memory(memory, report)
    if report["checkpoint"]:
        lines += ["", *checkpoint_time.format_lines(report["checkpoint"])]
    elif report["world_size"] is None:
        lines.append("per-rank memory: pass --world-size N")
    lines.append(f"preflight took {report['seconds']} s")
    return "\n".join(lines)


def _deepspeed_summary(source: str, translation: Translation) -> dict:
    return {
        "config": source,
        "overrides": translation.overrides,
        "auto_filled": translation.auto_filled,
        "warnings": translation.misspelled,
    }


def _format_deepspeed(deepspeed: dict, world_size: int) -> list[str]:
    return [
        f"DeepSpeed config {deepspeed['config']} for {world_size} ranks, translated as `python -m glm45v_fsdp.train "
        "--deepspeed` translates it, sets:",
        "  " + " ".join(deepspeed["overrides"]),
        *[f'  "auto" filled: {filled}' for filled in deepspeed["auto_filled"]],
        *[f"  warning: {warning}" for warning in deepspeed["warnings"]],
    ]


def _format_memory(memory: dict, report: dict) -> list[str]:
    rank0 = memory["per_rank"][0]
    unit, scale = _scale(memory["max"]["total"])
    if memory["fsdp_applied"]:
        how = f"FSDP2 over {memory['shard_size']} shard(s), {memory['fsdp_units']} FSDP units (root included)"
    else:
        how = "FSDP plan matched but not applied (one rank: nothing to shard)"
    lines = [
        "",
        f"memory per rank, {unit}; world {report['world_size']}, {how}:",
        f"  {'':44}{'min':>10}{'max':>10}{'rank 0':>10}",
    ]
    for key, label in (*ROWS, ("total", "total on the device")):
        values = memory["min"][key], memory["max"][key], rank0[key]
        lines.append(f"  {label:44}" + "".join(f"{v / scale:10.2f}" for v in values))
    if memory["max"]["host"]:
        values = memory["min"]["host"], memory["max"]["host"], rank0["host"]
        what = "rows 1-4 (cpu_offload)" if memory["cpu_offload"] else ""
        what += (" + " if what else "") + "offloaded activations" if memory["activations"]["offloaded"] else ""
        lines.append(f"  {'on the host: ' + what:44}" + "".join(f"{v / scale:10.2f}" for v in values))
    lines.append("  activations, by term (each plan that is on adjusts them):")
    for term in memory["activations"]["terms"]:
        lines.append(f"    {term['name']:44}{term['bytes'] / scale:10.2f}  {term['how']}")
    verdict = "fits" if memory["fits"] else "does NOT fit"
    lines.append(
        f"  device memory {memory['device_memory_bytes'] / GIB:g} GiB: {verdict} "
        f"(max over ranks {memory['max']['total'] / GIB:.2f} GiB)"
    )
    lines += ["assumptions:"] + [f"  - {a}" for a in memory["assumptions"]]
    lines += ["activation formula:"] + [f"  {line}" for line in memory["formula"].splitlines()]
    return lines
