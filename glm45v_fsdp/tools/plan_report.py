"""What `python -m glm45v_fsdp.tools.plan` prints (tools/plan.py parses the command line): the ranked table, the
chosen layout as overrides, the config's own layout beside it, `--explain`'s terms, `--json`."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from glm45v_fsdp.config import Config, LoraConfig, load_config
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.model import load_hf_config
from glm45v_fsdp.planner import checkpoint_time
from glm45v_fsdp.planner.devices import GIB, PRESETS, Device, load_calibration
from glm45v_fsdp.planner.layout import Job, Layout
from glm45v_fsdp.planner.search import Evaluation, Planner, SearchSpace
from glm45v_fsdp.planner.step_time import collective_ms


def device_of(args: argparse.Namespace) -> Device:
    try:
        device = load_calibration(args.calibration) if args.device == "cpu" else PRESETS[args.device]
        custom = dict(item.split("=", 1) for item in args.custom.split(",") if item.strip()) if args.custom else {}
        return device.with_custom(custom)
    except ValueError as error:
        raise UserError(str(error)) from None


def unit_sizes(text: str) -> tuple[float | None, ...]:
    try:
        return tuple(None if part.strip() == "default" else float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise UserError(f"--unit-mib {text!r}: comma-separated sizes in MiB or 'default'.") from None


def world_size(args: argparse.Namespace, device: Device) -> int:
    return args.nodes * (args.nproc_per_node or device.devices_per_node)


def config_batch(config: Config, world: int) -> int:
    """The global batch `config` runs on `world` ranks: micro batch x accumulation x data-parallel ranks."""
    training, parallel = config.training, config.parallel
    dp = world // (parallel.ulysses_parallel_size * parallel.ring_attention_size)
    return training.micro_batch_size * training.gradient_accumulation_steps * dp


def build_planner(args: argparse.Namespace, config: Config | None = None) -> tuple[Planner, Job]:
    """The planner of the command line's job for `config` (default: --config with the overrides)."""
    config = config or load_config(args.config, args.overrides)
    device = device_of(args)
    per_node = args.nproc_per_node or device.devices_per_node
    tokens = args.tokens or config.data.cutoff_len
    default_batch = config_batch(config, world_size(args, device))
    job = Job(args.nodes, per_node, tokens, args.global_batch or default_batch)
    planner = Planner(
        config,
        load_hf_config(config.model),
        job,
        device,
        args.images_per_sample,
        args.image_size,
        args.videos_per_sample,
        args.video_frames,
    )
    return planner, job


def row(rank: int, found: Evaluation, job: Job) -> dict[str, Any]:
    terms = found.step.terms()
    crossing = sorted(family for family, crosses in found.crossing.items() if crosses and family != "cp")
    return {
        "rank": rank,
        "layout": found.layout.name(),
        "gib_per_rank": round(found.gib, 2),
        "fits": found.fits,
        "ms_per_step": round(found.step.total_ms, 1),
        "tokens_per_s_per_device": round(found.tokens_per_s_per_device, 1),
        "mfu": round(found.mfu, 4),
        "dominant": {name: round(ms, 1) for name, ms in list(terms.items())[:3]},
        "across_nodes": crossing,
        "overrides": found.layout.overrides(job),
    }


def checkpoint_figures(planner: Planner, found: Evaluation, args: argparse.Namespace) -> dict[str, Any]:
    """The checkpoint model of one layout (planner/checkpoint_time.py), its async stall against its modelled step."""
    specs, shards = planner.shard_plan(found.layout)
    config, job = planner.config, planner.job
    return checkpoint_time.model(
        specs,
        shards,
        job.world_size,
        job.ranks_per_node,
        config.training,
        checkpoint_time.storage(args.fs_gbps, args.fs_node_gbps, on_cpu=args.device == "cpu"),
        step_s=found.step.total_ms / 1e3,
        trainable_only=config.model.lora.rank > 0,
    )


def explain(planner: Planner, found: Evaluation, job: Job) -> dict[str, Any]:
    """Every term of one layout: memory rows, FLOPs, each collective with its time, the step's terms."""
    device = planner.device
    if found.error:
        return {"layout": found.layout.name(), "error": found.error}
    collectives = [
        {
            "family": c.family,
            "kind": c.kind,
            "what": c.what,
            "calls": c.calls,
            "bytes": c.bytes,
            "group_size": c.group_size,
            "across_nodes": found.crossing.get(c.family, False),
            "ms": round(collective_ms(c, device, found.crossing.get(c.family, False)), 3),
            "exact": c.exact,
        }
        for c in found.collectives
    ]
    accumulation = found.layout.accumulation(job)
    return {
        "layout": found.layout.name(),
        "device": device.name,
        "job": {"world": job.world_size, "nodes": job.nodes, "tokens": job.tokens, "global_batch": job.global_batch},
        "accumulation": accumulation,
        "memory_gib": {key: round(value / GIB, 3) for key, value in found.memory.items()},
        "usable_gib": round(device.usable_bytes / GIB, 2),
        "fits": found.fits,
        "flops_per_micro_batch": {
            **{k: v for k, v in found.flops.forward.items()},
            "backward": found.flops.backward,
            "recompute": found.flops.recompute,
        },  # fmt: skip
        "collectives": collectives,
        "comm_ms": {k: round(v, 2) for k, v in found.step.comm_ms.items()},
        "step_ms": {k: round(v, 2) for k, v in found.step.terms().items()},
        "ms_per_step": round(found.step.total_ms, 1),
        "mfu": round(found.mfu, 4),
        "tokens_per_s_per_device": round(found.tokens_per_s_per_device, 1),
        "overrides": found.layout.overrides(job),
    }


def run_plan(args: argparse.Namespace) -> int:
    planner, job = build_planner(args)
    if args.explain:
        try:
            layout = Layout.parse(args.explain)
        except ValueError as error:
            raise UserError(str(error)) from None
        if not planner.divides(layout):
            raise UserError(f"--explain {args.explain}: its sizes do not divide {job.world_size} ranks and the "
                            f"global batch {job.global_batch}.")  # fmt: skip
        found = planner.evaluate(layout)
        report = explain(planner, found, job)
        if found.error is None and not found.fits:
            report["remedies"] = remedies(planner, found)
        if found.error is None:
            report["checkpoint"] = checkpoint_figures(planner, found, args)
        print(json.dumps(report, indent=1) if args.json else format_explain(report))
        return 0
    space = SearchSpace(unit_mib=unit_sizes(args.unit_mib))
    results = planner.search(space)
    fitting = [r for r in results if r.fits]
    own = planner.evaluate(Layout.of_config(planner.config))
    report: dict[str, Any] = {
        "device": planner.device.name,
        "job": {
            "world": job.world_size,
            "nodes": job.nodes,
            "ranks_per_node": job.ranks_per_node,
            "tokens": job.tokens,
            "global_batch": job.global_batch,
        },  # fmt: skip
        "usable_gib": round(planner.device.usable_bytes / GIB, 2),
        "evaluated": len(results),
        "fitting": len(fitting),
        "top": [row(i + 1, r, job) for i, r in enumerate(fitting[: args.top])],
        "config_layout": None if own.error else row(rank_of(own, fitting), own, job),
    }
    if fitting:
        report["checkpoint"] = checkpoint_figures(planner, fitting[0], args)
    if not fitting:
        closest = results[0] if results else None
        if closest is not None:
            report["closest"] = {**row(0, closest, job), "remedies": remedies(planner, closest)}
    if planner.config.model.lora.rank:
        report["full_finetuning"] = full_finetuning(args, planner.config, space)
    print(json.dumps(report, indent=1) if args.json else format_table(report))
    return 0


def full_finetuning(args: argparse.Namespace, config: Config, space: SearchSpace) -> dict[str, Any]:
    """The same job without LoRA (every parameter trained), for the report beside the LoRA plan: how many layouts fit
    and the best one, or the closest and by how much it misses."""
    full = dataclasses.replace(config, model=dataclasses.replace(config.model, lora=LoraConfig()))
    planner, job = build_planner(args, full)
    results = planner.search(space)
    fitting = [r for r in results if r.fits]
    found = fitting[0] if fitting else (results[0] if results else None)
    return {
        "fitting": len(fitting),
        "best" if fitting else "closest": None if found is None else row(1 if fitting else 0, found, job),
    }


def rank_of(found: Evaluation, fitting: list[Evaluation]) -> int:
    """1-based place of `found` in the ranked fitting layouts (0: it does not fit)."""
    places = [i for i, r in enumerate(fitting) if r.layout == found.layout]
    return places[0] + 1 if found.fits and places else 0


def remedies(planner: Planner, found: Evaluation) -> dict[str, Any]:
    over = found.memory["total"] - planner.device.usable_bytes
    changes = planner.remedies(found)
    return {
        "over_gib": round(over / GIB, 2),
        "largest_rows": {k: round(v / GIB, 2) for k, v in sorted(found.memory.items(), key=lambda kv: -kv[1])[1:4]},
        "fits_with": [
            {"change": name, "gib": round(r.gib, 2), "ms_per_step": round(r.step.total_ms, 1)} for name, r in changes
        ],  # fmt: skip
    }


def format_table(report: dict[str, Any]) -> str:
    job = report["job"]
    lines = [
        f"plan: {job['nodes']} node(s) x {job['ranks_per_node']} = {job['world']} ranks of {report['device']}; "
        f"{job['tokens']} tokens per sample, global batch {job['global_batch']}; {report['usable_gib']} GiB usable "
        f"per device",
        f"{report['evaluated']} layouts evaluated, {report['fitting']} fit.",
        "",
        f"{'#':>3}  {'layout':58} {'GiB':>6} {'ms/step':>9} {'tok/s/dev':>10} {'MFU':>6}  dominant terms (ms); "
        "groups across nodes",
    ]
    for r in report["top"]:
        dominant = ", ".join(f"{k} {v:g}" for k, v in r["dominant"].items())
        lines.append(
            f"{r['rank']:>3}  {r['layout']:58} {r['gib_per_rank']:6.1f} {r['ms_per_step']:9.1f} "
            f"{r['tokens_per_s_per_device']:10.1f} {r['mfu']:6.1%}  {dominant}; {', '.join(r['across_nodes']) or '-'}"
        )
    if report["top"]:
        lines += ["", "best layout as overrides:", "  " + " ".join(report["top"][0]["overrides"])]
    own = report["config_layout"]
    if own is not None:
        place = f"#{own['rank']} of the fitting layouts" if own["fits"] else "does NOT fit"
        lines += [
            "",
            f"the config's own layout {own['layout']}: {own['gib_per_rank']:.1f} GiB, {own['ms_per_step']:.1f} "
            f"ms/step ({place})",
        ]
    if "closest" in report and report["closest"]:
        closest = report["closest"]
        fix = closest["remedies"]
        changes = "; ".join(f"{c['change']} ({c['gib']:.1f} GiB)" for c in fix["fits_with"])
        lines += [
            "",
            f"nothing fits; closest: {closest['layout']} needs {closest['gib_per_rank']:.1f} GiB, "
            f"{fix['over_gib']:.1f} GiB over (largest rows: "
            + ", ".join(f"{k} {v:g}" for k, v in fix["largest_rows"].items())
            + "). "
            + (f"It fits with: {changes}." if changes else "No single switch makes it fit: add nodes or shorten it."),
        ]
    full = report.get("full_finetuning")
    if full is not None:
        if full["fitting"]:
            best = full["best"]
            text = f"{full['fitting']} layouts fit, the best {best['layout']} at {best['gib_per_rank']:.1f} GiB"
        elif full.get("closest"):
            closest = full["closest"]
            text = f"nothing fits; closest {closest['layout']} needs {closest['gib_per_rank']:.1f} GiB"
        else:
            text = "no layout divides the job"
        lines += ["", f"full fine-tuning of the same job (model.lora.rank=0) on these ranks: {text}"]
    if "checkpoint" in report:
        lines += ["", f"the best layout's {checkpoint_time.format_lines(report['checkpoint'])[0]}"]
        lines += checkpoint_time.format_lines(report["checkpoint"])[1:]
    lines += ["", "every term of one layout: --explain LAYOUT; the model and its assumptions: docs/planning.md"]
    return "\n".join(lines)


def format_explain(report: dict[str, Any]) -> str:
    if "error" in report:
        return f"layout {report['layout']} cannot run: {report['error']}"
    lines = [
        f"layout {report['layout']} on {report['job']['world']} ranks of {report['device']}, "
        f"{report['job']['tokens']} tokens per sample, accumulation {report['accumulation']}",
        "memory per rank (GiB, the largest rank):",
        *[f"  {k:14} {v:10.3f}" for k, v in report["memory_gib"].items()],
        f"  usable {report['usable_gib']} GiB: " + ("fits" if report["fits"] else "does NOT fit"),
        "FLOPs per micro batch per rank:",
        *[f"  {k:18} {v:14.4g}" for k, v in report["flops_per_micro_batch"].items()],
        "collectives per step per rank:",
    ]
    for c in report["collectives"]:
        where = "across nodes" if c["across_nodes"] else "in a node"
        bound = "" if c["exact"] else " (mean/bound)"
        lines.append(
            f"  {c['family']:13} {c['kind']:14} {c['calls']:8g} calls {c['bytes'] / 2**20:12.1f} MiB{bound} "
            f"group {c['group_size']:4} {where:12} {c['ms']:10.2f} ms  {c['what']}"
        )
    lines += ["step (ms):", *[f"  {k:22} {v:10.2f}" for k, v in report["step_ms"].items()]]
    lines.append(
        f"  total {report['ms_per_step']} ms/step, {report['tokens_per_s_per_device']} tokens/s per device, "
        f"MFU {report['mfu']:.1%}"
    )
    lines += ["overrides:", "  " + " ".join(report["overrides"])]
    if "remedies" in report:
        fix = report["remedies"]
        lines.append(f"does not fit by {fix['over_gib']} GiB; fits with: " +
                     ("; ".join(f"{c['change']} ({c['gib']} GiB, {c['ms_per_step']} ms)" for c in fix["fits_with"])
                      or "no single switch: add nodes or shorten the sequence"))  # fmt: skip
    if "checkpoint" in report:
        lines += checkpoint_time.format_lines(report["checkpoint"])
    return "\n".join(lines)
