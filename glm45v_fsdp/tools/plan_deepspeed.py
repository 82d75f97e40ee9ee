"""`python -m glm45v_fsdp.tools.plan --deepspeed ds_config.json`: the one layout a ds_config fixes, every term of it
as `--explain` prints it, and its place among every layout of the same job.

The ds_config is translated as `python -m glm45v_fsdp.train --deepspeed` translates it (ds_compat.trainer_door.
configure: "auto" values filled from the YAML and the overrides, the layout checked for nodes x ranks per node). The
layout keys the ds_config leaves unset keep the YAML's values, as under the trainer; the output names them, and the
default the engine API (`deepspeed.initialize`, which starts from no YAML) takes instead where it differs.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ds_compat.config import ACCUMULATION, MICRO_BATCH, TRAIN_BATCH
from ds_compat.trainer_door import DeepSpeedRun, configure
from glm45v_fsdp.config import Config, load_config
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.planner.layout import Job, Layout
from glm45v_fsdp.planner.search import Evaluation, Planner, SearchSpace
from glm45v_fsdp.tools.plan_report import (
    build_planner,
    checkpoint_figures,
    config_batch,
    device_of,
    explain,
    format_explain,
    rank_of,
    remedies,
    row,
    unit_sizes,
    world_size,
)

# "auto" values that decide the layout or its memory (the text output names these; --json has every one)
LAYOUT_AUTO = (TRAIN_BATCH, MICRO_BATCH, ACCUMULATION, "bf16.", "bfloat16.", "fp16.")


def translated_run(args: argparse.Namespace) -> DeepSpeedRun:
    """--config with the overrides, the ds_config translated onto it for nodes x ranks per node (the trainer's
    door); a --global-batch must equal the batch the ds_config gives."""
    world = world_size(args, device_of(args))
    ds_run = configure(args.deepspeed, load_config(args.config, args.overrides), args.overrides, world)
    batch = config_batch(ds_run.config, world)
    if args.global_batch is not None and args.global_batch != batch:
        t = ds_run.config.training
        raise UserError(
            f"--global-batch {args.global_batch} differs from the global batch {batch} of the DeepSpeed config "
            f"'{args.deepspeed}' (micro batch {t.micro_batch_size} x accumulation {t.gradient_accumulation_steps} x "
            f"{batch // (t.micro_batch_size * t.gradient_accumulation_steps)} data-parallel ranks). Under --deepspeed "
            "the ds_config decides the batch: drop --global-batch, or change train_batch_size / "
            'train_micro_batch_size_per_gpu / gradient_accumulation_steps there (where they are "auto": '
            "training.micro_batch_size / training.gradient_accumulation_steps on the command line)."
        )
    return ds_run


def left_open(ds_run: DeepSpeedRun, args: argparse.Namespace, job: Job) -> list[dict[str, str | None]]:
    """The layout keys the ds_config does not set: their value, where it comes from, and the value the engine API
    gives them (it applies the same translation onto the defaults, not onto a YAML; None: it has no such key)."""
    mapped = set(ds_run.translation.fields)
    cli = {item.split("=", 1)[0] for item in args.overrides}
    engine = dict(item.split("=", 1) for item in Layout.of_config(ds_run.translation.apply(Config())).overrides(job))
    rows = []
    for item in Layout.of_config(ds_run.config).overrides(job):
        key, value = item.split("=", 1)
        if key in mapped or key == "data.cutoff_len":  # the sequence length is the job's (--tokens)
            continue
        rows.append({"key": key, "value": value, "from": "command line" if key in cli else "YAML",
                     "engine_api": engine.get(key)})  # fmt: skip
    return rows


def place(found: Evaluation, fitting: list[Evaluation]) -> int:
    """1-based place among the ranked fitting layouts (0: it does not fit); a layout outside the search space (a
    unit size from the ZeRO bucket, say) goes before every slower one."""
    if not found.fits:
        return 0
    return rank_of(found, fitting) or 1 + sum(r.step.total_ms < found.step.total_ms for r in fitting)


def compare(planner: Planner, found: Evaluation, job: Job, unit_mib: str) -> dict[str, Any]:
    """The ds_config's layout against the planner's search for the same job and config."""
    results = planner.search(SearchSpace(unit_mib=unit_sizes(unit_mib)))
    fitting = [r for r in results if r.fits]
    best = fitting[0] if fitting else None
    return {
        "evaluated": len(results),
        "fitting": len(fitting),
        "place": place(found, fitting),
        "best": None if best is None else row(1, best, job),
        "time_vs_best": None if best is None else round(found.step.total_ms / best.step.total_ms, 4),
    }


def deepspeed_summary(ds_run: DeepSpeedRun, args: argparse.Namespace, job: Job) -> dict[str, Any]:
    t = ds_run.translation
    return {
        "config": str(args.deepspeed),
        "base": args.config or "configs/glm45v_tiny.yaml (default)",
        "zero_stage": t.zero_stage,
        "precision": t.precision,
        "micro_batch": t.batch.micro_batch_size,
        "accumulation": t.batch.gradient_accumulation_steps,
        "overrides": t.overrides,
        "auto_filled": t.auto_filled,
        "left_open": left_open(ds_run, args, job),
        "warnings": t.misspelled,
    }


def run_deepspeed_plan(args: argparse.Namespace) -> int:
    ds_run = translated_run(args)
    planner, job = build_planner(args, ds_run.config)
    layout = Layout.of_config(ds_run.config)
    planner.check(layout)  # a layout a plan rejects: the ConfigError names the key
    found = planner.evaluate(layout)
    report = {"deepspeed": deepspeed_summary(ds_run, args, job), "layout": explain(planner, found, job)}
    if not found.fits:
        report["layout"]["remedies"] = remedies(planner, found)
    if found.error is None:  # as --explain of the layout prints it
        report["layout"]["checkpoint"] = checkpoint_figures(planner, found, args)
    report["search"] = compare(planner, found, job, args.unit_mib)
    print(json.dumps(report, indent=1) if args.json else format_deepspeed(report))
    return 0


def format_deepspeed(report: dict[str, Any]) -> str:
    ds, layout = report["deepspeed"], report["layout"]
    lines = [
        f"DeepSpeed config {ds['config']} on {ds['base']}, translated as `python -m glm45v_fsdp.train --deepspeed` "
        f"translates it: ZeRO stage {ds['zero_stage']}, {ds['precision']}, micro batch {ds['micro_batch']} x "
        f"accumulation {ds['accumulation']}, global batch {layout['job']['global_batch']}",
        *[f"  warning: {warning}" for warning in ds["warnings"]],
        *[f'  "auto" filled: {filled}' for filled in ds["auto_filled"] if filled.startswith(LAYOUT_AUTO)],
    ]
    for key in ds["left_open"]:
        engine = key["engine_api"]
        differs = "" if engine in (None, key["value"]) else f" (deepspeed.initialize runs {engine})"
        lines.append(f"  not set by the ds_config: {key['key']}={key['value']} from the {key['from']}{differs}")
    lines += ["", "the layout it runs:", format_explain(layout), "", format_comparison(report["search"], layout)]
    return "\n".join(lines)


def format_comparison(search: dict[str, Any], layout: dict[str, Any]) -> str:
    head = (
        f"against every layout of this job (same config, the planner's search): {search['evaluated']} evaluated, "
        f"{search['fitting']} fit"
    )
    best = search["best"]
    if best is None:
        return f"{head}; none fits."
    verdict = f"#{search['place']} of the fitting layouts" if search["place"] else "does NOT fit"
    return "\n".join([
        f"{head}. The ds_config's layout {layout['layout']}: {verdict}, {layout['ms_per_step']:.1f} ms/step.",
        f"  the best layout {best['layout']}: {best['gib_per_rank']:.1f} GiB, {best['ms_per_step']:.1f} ms/step; the "
        f"ds_config's layout takes {search['time_vs_best']:.3f}x its time",
        "  the best layout as overrides: " + " ".join(best["overrides"]),
    ])  # fmt: skip
