"""`python -m glm45v_fsdp.tools.bench memory`: OFF/ON pairs of the memory switches, each side a real training run.

Every side of a pair is `python -m glm45v_fsdp.train` (or torchrun with `--ranks N`) in its own process, with the
same seed, data, weights and fp32 parameters; the figures come from its `metrics.jsonl` (one record per step). A
configuration shared by several pairs (the full-logits run is the OFF side of both chunk-loss rows) runs once. With
`--repeats R` every configuration runs R times, round-robin over the configurations, so a drift in machine speed
hits OFF and ON alike; ms/iter is the median over all repeats of the steps after `--warmup`.

The figures, per pair (the reference report's §3.3 and §4.2):
  - loss mean relative error = mean(|on - off| / (|off| + 1e-8)) over aligned steps (first repeat), in %, and the
    max absolute loss difference;
  - ms/iter: median of the steps after the warmup; samples/s = global batch x 1000 / that median;
  - peak max / avg GiB: each rank's peak over all steps (cuda/npu: the allocator peak; cpu: live tensor bytes, see
    runtime/memory_meter.py), then the max and the mean over ranks; the largest over repeats;
  - saving % = (off - on) / off x 100 (max-rank and avg-rank); time cost % = (on / off - 1) x 100 of ms/iter.

A "token" is a non-padding position of a rank's micro batch: each rank's micro batch is ONE synthetic sample cut at
`--tokens` (text, the template and `--images` pictures of 56 px, 4 image tokens each), so every run checks that its
records hold `tokens == ranks x --tokens`.
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glm45v_fsdp.bench.options import (
    add_run_options,
    announce_failures,
    check_counts,
    report_head,
    settle,
)
from glm45v_fsdp.bench.runner import (
    PARITY_LIMIT,
    Run,
    Runner,
    load_range,
    md_report,
    memory_pair,
    pair_figures,
    run_figures,
    write_report,
)
from glm45v_fsdp.errors import UserError

HELP = "OFF/ON training runs per memory switch: loss error, ms/iter, peak memory, saving"
DESCRIPTION = "OFF/ON pairs of the memory switches, each side a training run in its own process."

OFFLOAD_KEY = "features.activation_offload.enabled"

CHUNK_SHAPE = "chunk"  # --vocab on the model's own layer count
LAYERS_SHAPE = "layers"  # --text-layers on the model's own vocabulary
BOTH_SHAPE = "both"  # --vocab and --text-layers
STATIC = "features.chunk_loss.mode=static"
RECOMPUTE = "features.recompute.enabled=true"
OFFLOAD = f"{OFFLOAD_KEY}=true"
# Ulysses CP 2 at the same world size and global batch, as the reference report compares CP1 and CP2: half the
# data-parallel ranks, each micro batch (one sample) split over 2 ranks, twice the accumulation.
ULYSSES2 = ("parallel.ulysses_parallel_size=2", "training.gradient_accumulation_steps=2")
RING2 = ("parallel.ring_attention_size=2", "training.gradient_accumulation_steps=2")
# CP 4 on 4 ranks: Ulysses 2 x Ring 2 (hybrid), one data-parallel rank, 4 x the accumulation
HYBRID4 = (
    "parallel.ulysses_parallel_size=2",
    "parallel.ring_attention_size=2",
    "training.gradient_accumulation_steps=4",
)
# Context parallelism's goals (against CP1 at the same ranks and global batch): peak per rank, time cost.
CP2_MIN_SAVING, CP4_MIN_SAVING, CP2_MAX_TIME_COST = 40.0, 65.0, 20.0


@dataclass(frozen=True)
class RunSpec:
    """One training configuration: a model shape and the feature overrides that differ between runs."""

    shape: str
    features: tuple[str, ...]
    offload: bool = False  # needs the activation offload feature
    cp: int = 1  # context-parallel ranks: --ranks must be a multiple


@dataclass(frozen=True)
class Switch:
    """One row: the OFF run, the ON run and the targets (None: reported, not judged)."""

    label: str
    off: str
    on: str
    min_saving_pct: float | None = None
    max_time_cost_pct: float | None = None
    accelerator_only_target: bool = False  # the target is judged on cuda/npu only (cpu has no device memory)
    note: str = ""


RUNS: dict[str, RunSpec] = {
    "full_logits": RunSpec(CHUNK_SHAPE, ("features.chunk_loss.mode='off'",)),
    "chunk_static": RunSpec(CHUNK_SHAPE, (STATIC,)),
    "chunk_dynamic": RunSpec(CHUNK_SHAPE, ("features.chunk_loss.mode=dynamic",)),
    "no_recompute": RunSpec(LAYERS_SHAPE, (STATIC,)),
    "recompute": RunSpec(LAYERS_SHAPE, (STATIC, RECOMPUTE)),
    "recompute_keep_nothing": RunSpec(LAYERS_SHAPE, (STATIC, RECOMPUTE, "features.recompute.keep_attention=false")),
    "recompute_selective": RunSpec(LAYERS_SHAPE, (STATIC, RECOMPUTE, "features.recompute.granularity=selective")),
    "recompute_offload": RunSpec(LAYERS_SHAPE, (STATIC, RECOMPUTE, OFFLOAD), offload=True),
    "recompute_ulysses_cp2": RunSpec(LAYERS_SHAPE, (STATIC, RECOMPUTE, *ULYSSES2), cp=2),
    "recompute_ring_cp2": RunSpec(LAYERS_SHAPE, (STATIC, RECOMPUTE, *RING2), cp=2),
    "recompute_hybrid_cp4": RunSpec(LAYERS_SHAPE, (STATIC, RECOMPUTE, *HYBRID4), cp=4),
    "all_off": RunSpec(BOTH_SHAPE, ("features.chunk_loss.mode='off'",)),
    "all_on": RunSpec(BOTH_SHAPE, (STATIC, RECOMPUTE, OFFLOAD), offload=True),
}

SWITCHES: dict[str, Switch] = {
    "chunk_static": Switch("ChunkLoss off→static", "full_logits", "chunk_static", 60.0, 5.0),
    "chunk_dynamic": Switch("ChunkLoss off→dynamic", "full_logits", "chunk_dynamic", 60.0, 5.0),
    "recompute": Switch(
        "Recompute off→on (default plan)",
        "no_recompute",
        "recompute",
        40.0,
        30.0,
        note="full granularity keeping the attention kernels' outputs (features.recompute.keep_attention=true)",
    ),
    "recompute_full": Switch(
        "Recompute off→full, keep nothing",
        "no_recompute",
        "recompute_keep_nothing",
        note="features.recompute.keep_attention=false: attention runs again in backward",
    ),
    "recompute_selective": Switch("Recompute off→selective", "no_recompute", "recompute_selective"),
    "offload": Switch(
        "Async Offload off→on (on recompute)",
        "recompute",
        "recompute_offload",
        25.0,
        5.0,
        accelerator_only_target=True,
        note="cpu: no separate device memory, the copies are host memory the tracker counts; judged on cuda/npu",
    ),
    "combined": Switch("All off→chunk+recompute+offload", "all_off", "all_on"),
    "ulysses": Switch(
        "Ulysses CP1→CP2 (on recompute)",
        "recompute",
        "recompute_ulysses_cp2",
        CP2_MIN_SAVING,
        CP2_MAX_TIME_COST,
        note="same ranks and global batch: CP2 halves the data-parallel ranks and doubles the accumulation, each "
        "sample split over 2 ranks (the reference report's CP1/CP2 set-up)",
    ),
    "ring": Switch(
        "Ring CP1→CP2 (on recompute)",
        "recompute",
        "recompute_ring_cp2",
        CP2_MIN_SAVING,
        CP2_MAX_TIME_COST,
        note="Ring attention over 2 ranks, zigzag layout; same ranks and global batch as the Ulysses row",
    ),
    "hybrid": Switch(
        "Hybrid Ulysses 2 × Ring 2: CP1→CP4 (on recompute)",
        "recompute",
        "recompute_hybrid_cp4",
        CP4_MIN_SAVING,
        note="4 ranks: one data-parallel rank, 4 x the accumulation, each sample split over 4 ranks",
    ),
}


def runnable_switches(ranks: int) -> list[str]:
    """The switches whose runs fit `ranks` processes (a CP run needs a multiple of its CP size)."""
    return [name for name, sw in SWITCHES.items() if all(ranks % RUNS[run].cp == 0 for run in (sw.off, sw.on))]


# ----------------------------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------------------------


def shape_overrides(shape: str, args: argparse.Namespace) -> list[str]:
    text = "model.config_overrides.text_config"
    shaped = [f"{text}.max_position_embeddings={max(4096, args.tokens)}"]
    if shape in (CHUNK_SHAPE, BOTH_SHAPE):
        shaped.append(f"{text}.vocab_size={args.vocab}")
    if shape in (LAYERS_SHAPE, BOTH_SHAPE):
        shaped.append(f"{text}.num_hidden_layers={args.text_layers}")
    return shaped


def common_overrides(args: argparse.Namespace, output_dir: Path) -> list[str]:
    """What every benchmark run shares (`bench memory` and `bench ep`): fp32, micro batch 1 without accumulation, a
    constant lr, memory tracked, one synthetic sample of --tokens (with --images pictures) per rank and step."""
    return [
        f"training.device={args.device}",
        f"training.train_iters={args.steps}",
        f"training.log_interval={args.steps}",
        "training.progress_bar=false",
        "training.track_memory=true",
        "training.micro_batch_size=1",
        "training.gradient_accumulation_steps=1",
        "training.lr_scheduler=constant",
        "training.lr_warmup_ratio=0",
        "training.min_lr=0",
        "parallel.fsdp_plan.param_dtype=fp32",
        "parallel.fsdp_plan.reduce_dtype=fp32",
        "data.dataset=synthetic",
        f"data.synthetic_samples={max(8, args.steps * args.ranks)}",
        f"data.synthetic_text_tokens={args.tokens}",
        f"data.cutoff_len={args.tokens}",
        f"data.synthetic_images_per_sample={args.images}",
        "data.packing=false",
        f"training.output_dir={output_dir}",
    ]


def run_overrides(spec: RunSpec, args: argparse.Namespace, output_dir: Path) -> list[str]:
    """Everything a run is given: the common settings, its shape, its features, then the user's overrides."""
    common = common_overrides(args, output_dir)
    return common + shape_overrides(spec.shape, args) + list(spec.features) + list(args.overrides)


def offload_figures(records: list[dict]) -> dict[str, float]:
    """The median over the timed steps of every `offload_*` figure a step record holds (lists are summed)."""
    keys = sorted({key for record in records for key in record if key.startswith("offload_")})
    figures = {}
    for key in keys:
        values = [record[key] for record in records if key in record]
        values = [sum(v) if isinstance(v, list) else v for v in values if v is not None]
        if values and all(isinstance(v, (int, float)) for v in values):
            figures[key] = statistics.median(values)
    return figures


def summarise(run: Run, warmup: int, expected_tokens: int) -> dict[str, Any]:
    """One configuration's figures over all its repeats: ms/iter the median of every repeat's steps after the warmup,
    each rank's peak over all steps and repeats, the offload figures; the losses of the first repeat."""
    bad = sorted({r["tokens"] for records in run.repeats for r in records} - {expected_tokens})
    if bad:
        raise UserError(
            f"bench memory: run '{run.name}' had steps of {bad} tokens, not {expected_tokens} (ranks x --tokens): "
            f"a sample came out shorter than data.cutoff_len. Raise the text budget or lower --tokens."
        )
    timed = [r for records in run.repeats for r in records if r["step"] > warmup]
    figures = run_figures(run, warmup + 1, stat="median")
    figures |= {"steps": len(run.records), "tokens_per_step": run.records[-1]["tokens"]}
    figures["offload"] = offload_figures(timed)
    return figures


# ----------------------------------------------------------------------------------------------------------------
# Rows
# ----------------------------------------------------------------------------------------------------------------


def compare(switch_name: str, off: dict[str, Any], on: dict[str, Any], device: str, ranks: int) -> dict[str, Any]:
    switch = SWITCHES[switch_name]
    row: dict[str, Any] = {"switch": switch_name, "label": switch.label, **pair_figures(off, on), "ranks": ranks}
    if not row["loss_steps"]:
        raise UserError(f"bench memory: {switch.label}: no step has a finite loss on both sides.")
    row["loss_mean_rel_err_pct"] = row["loss_mean_rel_err"] * 100.0
    row |= memory_pair(off, on)
    # The cpu caveat of an accelerator-judged switch says nothing about a cuda/npu run.
    row["note"] = "" if switch.accelerator_only_target and device != "cpu" else switch.note
    row["cpu_s_per_run"] = [statistics.median(off["cpu_s"]), statistics.median(on["cpu_s"])]
    if on["offload"]:
        row["offload"] = on["offload"]
    judged = switch.min_saving_pct is not None and not (switch.accelerator_only_target and device == "cpu")
    parity_ok = row["loss_mean_rel_err_pct"] <= PARITY_LIMIT * 100.0
    if switch.min_saving_pct is None:
        row["target"] = f"parity ≤ {PARITY_LIMIT * 100:g}%"
    else:
        row["target"] = f"≥{switch.min_saving_pct:g}% lower peak" + (
            f", ≤{switch.max_time_cost_pct:g}% time" if switch.max_time_cost_pct is not None else ""
        )
        if not judged:
            row["target"] += " (cuda/npu)"
    failures = [] if parity_ok else ["loss parity"]
    if judged:
        if not row["saving_max_pct"] >= switch.min_saving_pct:
            failures.append("memory")
        if switch.max_time_cost_pct is not None and not row["time_cost_pct"] <= switch.max_time_cost_pct:
            failures.append("time")
    row["judged"] = judged
    row["pass"] = not failures
    row["result"] = "pass" if not failures else "FAIL: " + ", ".join(failures)
    if not judged and parity_ok:
        row["result"] = "pass (parity only)"
    return row


# ----------------------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------------------

COLUMNS = (
    "switch",
    "runs off→on",
    "ranks",
    "loss mean rel err",
    "max abs err",
    "ms/iter off→on",
    "samples/s off→on",
    "peak max GiB off→on",
    "peak avg GiB off→on",
    "saving % max / avg",
    "time cost %",
    "target",
    "pass/fail",
)


def _cells(row: dict[str, Any]) -> list[str]:
    off_ms, on_ms = row["ms_per_iter"]
    off_sps, on_sps = row["samples_per_s"]
    return [
        row["label"],
        f"{row['off_run']} → {row['on_run']}",
        str(row["ranks"]),
        f"{row['loss_mean_rel_err_pct']:.6f}%",
        f"{row['loss_max_abs_err']:.6f}",
        f"{off_ms:.1f} → {on_ms:.1f}",
        f"{off_sps:.3f} → {on_sps:.3f}",
        f"{row['peak_max_gib'][0]:.6f} → {row['peak_max_gib'][1]:.6f}",
        f"{row['peak_avg_gib'][0]:.6f} → {row['peak_avg_gib'][1]:.6f}",
        f"{row['saving_max_pct']:+.2f}% / {row['saving_avg_pct']:+.2f}%",
        f"{row['time_cost_pct']:+.2f}%",
        row["target"],
        row["result"],
    ]


def markdown(report: dict[str, Any]) -> str:
    title = f"Memory switches: OFF/ON pairs ({report['device']}, {report['ranks']} rank(s))"
    lines = md_report(title, COLUMNS, [_cells(row) for row in report["rows"]], report["notes"])
    cpu = [
        f"{row['label']} {row['cpu_s_per_run'][0]:.1f} → {row['cpu_s_per_run'][1]:.1f} s "
        f"({(row['cpu_s_per_run'][1] / row['cpu_s_per_run'][0] - 1) * 100:+.1f}%)"
        for row in report["rows"]
        if "cpu_s_per_run" in row
    ]
    if cpu:
        lines.append(
            "- CPU seconds per run (user + sys of the training processes, start-up and all steps; median over "
            "repeats; not slowed by other load the way ms/iter is): " + "; ".join(cpu)
        )
    lines += [f"- {row['label']}: {row['note']}" for row in report["rows"] if row.get("note")]
    for row in report["rows"]:
        if row.get("offload"):
            figures = ", ".join(f"{k} {v:g}" for k, v in row["offload"].items())
            lines.append(f"- {row['label']}: ON side's per-step offload figures (median): {figures}")
    lines.append("")
    return "\n".join(lines)


def notes(args: argparse.Namespace, runs: dict[str, Run], memory_kind: str) -> list[str]:
    return [
        f"tokens: {args.tokens} per rank per step = one synthetic sample per micro batch (micro batch 1, no "
        f"accumulation), cut at data.cutoff_len={args.tokens}; non-padding positions, {args.images} images of 4 "
        f"image tokens included. ChunkLoss rows: vocabulary {args.vocab}, the model's own layers; Recompute and "
        f"Offload rows: {args.text_layers} text layers, the model's own vocabulary, static chunk loss on both sides; "
        f"combined row: both.",
        f"ms/iter: median of steps {args.warmup + 1}-{args.steps} over {args.repeats} repeat(s) per configuration "
        f"(round-robin); samples/s = global batch x 1000 / that median; time cost = ms/iter on/off - 1.",
        f"peak memory: {memory_kind}; each rank's peak over all steps and repeats, then max / mean over ranks; "
        f"saving = (off - on) / off.",
        f"loss errors: step-aligned over {args.steps} steps of the first repeat, fp32 parameters and reductions; "
        f"parity limit {PARITY_LIMIT * 100:g}% mean relative error.",
        f"machine load (1-min average) around the runs: {load_range(runs.values())} on {os.cpu_count()} CPU(s); "
        "OMP_NUM_THREADS per training process: "
        + (
            str(args.threads)
            if args.threads is not None
            else os.environ.get("OMP_NUM_THREADS", "unset (torch default)")
        )
        + ".",
    ]


def chart(report: dict[str, Any], path: Path) -> None:
    from glm45v_fsdp.bench.charts import bar_chart

    bar_chart(
        [(row["label"], row["peak_max_gib"]) for row in report["rows"]],
        series=("OFF", "ON"),
        title=f"Peak memory, max over ranks (GiB; each switch on its own scale) — {report['device']}, "
        f"{report['ranks']} rank(s), {report['tokens']} tokens",
        value_format="{:.3f}",
        notes=[f"saving {row['saving_max_pct']:+.1f}%\ntime {row['time_cost_pct']:+.1f}%" for row in report["rows"]],
        path=path,
    )


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------


def run_memory(args: argparse.Namespace) -> dict[str, Any]:
    if args.switches is None:
        args.switches = runnable_switches(args.ranks)
    unknown = [name for name in args.switches if name not in SWITCHES]
    if unknown:
        raise UserError(f"bench memory: unknown switch(es) {unknown}; choose from {', '.join(SWITCHES)}.")
    unfit = [name for name in args.switches if name not in runnable_switches(args.ranks)]
    if unfit:
        raise UserError(
            f"bench memory: switch(es) {unfit} run context parallelism and need --ranks to be a multiple of its "
            f"size ({', '.join(f'{name}: {RUNS[SWITCHES[name].on].cp}' for name in unfit)}); got --ranks "
            f"{args.ranks}."
        )
    planned: list[str] = []
    for name in args.switches:
        switch = SWITCHES[name]
        planned += [run for run in (switch.off, switch.on) if run not in planned]
    runner = Runner("bench memory", args.out, args.ranks, args.threads, args.run_timeout)
    plans = {name: (lambda run_dir, name=name: run_overrides(RUNS[name], args, run_dir)) for name in planned}
    runs = runner.rounds(plans, args.repeats)
    memory_kind = "allocator peak" if args.device != "cpu" else "live tensor bytes (CPU tracker)"
    figures = {name: summarise(runs[name], args.warmup, args.ranks * args.tokens) for name in planned}
    rows = [
        compare(name, figures[SWITCHES[name].off], figures[SWITCHES[name].on], args.device, args.ranks)
        for name in args.switches
    ]
    report = {
        **report_head("memory", args, "device", "ranks", "tokens", "vocab", "text_layers", "steps", "warmup"),
        "repeats": args.repeats,
        "threads": args.threads,
        "memory_kind": memory_kind,
        "rows": rows,
        "notes": notes(args, runs, memory_kind),
        "runs": figures,
    }
    write_report(args.out, "memory", report, markdown(report), {"memory.png": lambda path: chart(report, path)})
    return report


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("memory", help=HELP, description=DESCRIPTION)
    parser.add_argument(
        "--text-layers", type=int, default=6, help="text decoder layers of the Recompute, Offload and combined rows"
    )
    parser.add_argument(
        "--images",
        type=int,
        default=16,
        help="synthetic images per sample: the text generator's cost grows with the square of the text it repeats, "
        "so more (tiny) images make an 8192-token sample in ~60 ms instead of ~1.5 s",
    )
    parser.add_argument("--vocab", type=int, default=65536, help="vocabulary of the ChunkLoss and combined rows")
    parser.add_argument(
        "--switches",
        type=lambda text: [name.strip() for name in text.split(",") if name.strip()],
        default=None,
        metavar="A,B,...",
        help=f"comma-separated rows to measure, in order (default: all that fit --ranks): {','.join(SWITCHES)}",
    )
    add_run_options(
        parser, Path("output/bench/memory"), device="cpu", ranks=1, steps=6, warmup=2, repeats=1, tokens=8192
    )


def main_memory(args: argparse.Namespace, argv: list[str]) -> int:
    check_counts("memory", args, ("ranks", "steps", "repeats", "tokens", "vocab", "text_layers", "images"))
    settle(args, argv, args.device)
    announce_failures("memory", run_memory(args)["rows"])
    return 0
