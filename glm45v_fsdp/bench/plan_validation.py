"""`python -m glm45v_fsdp.tools.plan --validate`: the step-time model against measured steps on this machine.

Six layouts of the tiny model on 2 ranks (one node), fp32, at the same global batch: FSDP with micro batch 2 and 1
(accumulation 1 and 2), full recompute, EP 2, Ulysses 2, Ring 2. Each is modelled with the `cpu` preset
(--calibration, measured by --calibrate first when missing) and trained for --steps steps through the bench runner,
--repeats times in alternating order (ABBA: a drift of the machine's speed hits all alike); a run's ms/step is the
median of its steps after the first two, without the batch fetch, and a layout's the mean over its repeats, their
spread its noise. The report (<out>/plan_validate.md / .json) lists both, their ratio and ranks, and whether the
model orders the layouts as the measurement does: a pair whose measured difference is within the larger of the
two spreads is a tie the measurement cannot order; any other pair the model orders the other way is named.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from glm45v_fsdp.bench.runner import Runner, md_table, write_report
from glm45v_fsdp.planner.devices import load_calibration
from glm45v_fsdp.planner.layout import Job, Layout

RANKS = 2
GLOBAL_BATCH = 4
TOKENS = 1024  # synthetic text tokens per sample: enough that the matmuls are not all overhead
OVERRIDES = [
    "training.device=cpu",
    "parallel.fsdp_plan.param_dtype=fp32",
    "data.shuffle=false",
    f"data.synthetic_text_tokens={TOKENS}",
    f"data.cutoff_len={2 * TOKENS}",
    "training.log_interval=1000",
    "training.progress_bar=false",
]
LAYOUTS = {
    "fsdp mb2": Layout(micro_batch=2),
    "fsdp mb1 (accumulation 2)": Layout(micro_batch=1),
    "full recompute": Layout(micro_batch=2, recompute="full"),
    "ep2": Layout(micro_batch=2, ep=2),
    "ulysses2": Layout(micro_batch=2, ulysses=2),
    "ring2": Layout(micro_batch=2, ring=2),
}


def pairs(modelled: dict[str, float], measured: dict[str, float], spread: dict[str, float]) -> dict[str, list[str]]:
    """{"discordant": pairs the model orders the other way round, "ties": pairs the measurement cannot order}."""
    names, found = list(modelled), {"discordant": [], "ties": []}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if abs(measured[a] - measured[b]) <= max(spread[a], spread[b]):
                found["ties"].append(f"{a} / {b}")
            elif (modelled[a] - modelled[b]) * (measured[a] - measured[b]) < 0:
                found["discordant"].append(f"{a} / {b}")
    return found


def validate(args: argparse.Namespace) -> int:
    from glm45v_fsdp.config import load_config
    from glm45v_fsdp.model import load_hf_config
    from glm45v_fsdp.planner.calibrate import calibrate
    from glm45v_fsdp.planner.search import Planner

    if not args.calibration.exists():
        calibrate(args.calibration)
    device = load_calibration(args.calibration)
    config = load_config(args.config, [*OVERRIDES, *args.overrides])
    sample_tokens = _sample_tokens(config)
    job = Job(1, RANKS, sample_tokens, GLOBAL_BATCH)
    planner = Planner(config, load_hf_config(config.model), job, device)
    runner = Runner("plan validate", args.out, RANKS, 1, None)

    def plan_of(layout: Layout):
        return lambda run_dir: [*OVERRIDES, *layout.overrides(job)[:-1], f"training.train_iters={args.steps}",
                                f"training.output_dir={run_dir}", *args.overrides]  # fmt: skip

    runs = runner.rounds({name: plan_of(layout) for name, layout in LAYOUTS.items()}, args.repeats, alternate=True)
    modelled, measured, spread, rows = {}, {}, {}, []
    for name, layout in LAYOUTS.items():
        found = planner.evaluate(layout)
        medians = [statistics.median(r["ms_per_iter"] - r["data_ms"] for r in records[2:])
                   for records in runs[name].repeats]  # fmt: skip
        measured[name], spread[name] = statistics.fmean(medians), max(medians) - min(medians)
        modelled[name] = found.step.total_ms
        rows.append({"layout": name, "name": layout.name(), "modelled_ms": modelled[name],
                     "measured_ms": measured[name], "measured_repeats": medians,
                     "terms": found.step.terms()})  # fmt: skip
    by_model = sorted(modelled, key=modelled.get)
    by_measure = sorted(measured, key=measured.get)
    for row in rows:
        row["ratio"] = row["modelled_ms"] / row["measured_ms"]
        row["model_rank"], row["measured_rank"] = by_model.index(row["layout"]) + 1, by_measure.index(row["layout"]) + 1
    ratios = [row["ratio"] for row in rows]
    report: dict[str, Any] = {
        "benchmark": "plan validate",
        "device": device.__dict__,
        "sample_tokens": sample_tokens,
        "steps": args.steps,
        "command": [sys.executable, "-m", "glm45v_fsdp.tools.plan", *sys.argv[1:]],
        "rows": rows,
        "same_order": by_model == by_measure,
        **pairs(modelled, measured, spread),
        "repeats": args.repeats,
        "ratio_range": [min(ratios), max(ratios)],
    }
    write_report(args.out, "plan_validate", report, markdown(report))
    return 0


def _sample_tokens(config) -> int:
    """The synthetic samples' padded length (every sample has about the same)."""
    from glm45v_fsdp.data import build_dataset, build_image_processor, build_tiny_tokenizer
    from glm45v_fsdp.model import load_hf_config

    hf_config = load_hf_config(config.model)
    tokenizer = build_tiny_tokenizer()
    dataset = build_dataset(config.data, hf_config, tokenizer, build_image_processor(hf_config.vision_config))
    return max(len(dataset[i]["input_ids"]) for i in range(8))


def markdown(report: dict[str, Any]) -> str:
    columns = ("layout", "modelled ms/step", "measured ms/step (repeats)", "model / measured", "rank: model",
               "rank: measured", "largest modelled terms")  # fmt: skip
    cells = [
        [r["layout"], f"{r['modelled_ms']:.1f}",
         f"{r['measured_ms']:.1f} ({', '.join(f'{m:.1f}' for m in r['measured_repeats'])})", f"{r['ratio']:.2f}",
         str(r["model_rank"]), str(r["measured_rank"]),
         ", ".join(f"{k} {v:.1f}" for k, v in list(r["terms"].items())[:3])]
        for r in report["rows"]
    ]  # fmt: skip
    low, high = report["ratio_range"]
    order = "the same" if report["same_order"] else "not the same"
    order += f"; pairs the model orders against the measurement: {'; '.join(report['discordant']) or 'none'}"
    order += f"; pairs within the measurement's spread (ties): {'; '.join(report['ties']) or 'none'}"
    return "\n".join(
        [
            f"# Step-time model vs measured, tiny model on {RANKS} ranks ({report['sample_tokens']} tokens/sample)",
            "",
            *md_table(columns, cells),
            "",
            f"- ordering: {order}; model / measured between {low:.2f} and {high:.2f}.",
            f"- device: {report['device']['name']}: matmul {report['device']['fp32_tflops'] * 1e3:.1f} GFLOP/s, "
            f"gloo {report['device']['intra_gbps']:.2f} GB/s, latency {report['device']['intra_latency_us']:.0f} us.",
            f"- measured: median of steps 3-{report['steps']} per run, ms/iter less the batch fetch, mean of "
            f"{report['repeats']} repeats (ABBA order); command "
            f"`{' '.join(report['command'][2:])}`.",
            "",
        ]
    )
