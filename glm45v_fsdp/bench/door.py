"""`python -m glm45v_fsdp.tools.bench door`: the DeepSpeed engine door on GLM-4.5V beside the trainer door.

The engine door is the DeepSpeed-API script of `bench deepspeed` (bench/deepspeed_api_worker.py: transformers' tiny
GLM-4.5V handed to `initialize` with `import ds_compat as deepspeed`, which builds it on the whole engine); the
trainer door is `python -m glm45v_fsdp.train --deepspeed ds_config.json` on the same initial weights and batches.
Both read one ds_config (ZeRO `--zero`, fp32) to which each case adds the keys that switch a plan:
  - full_logits: the extension section's `features.chunk_loss.mode: off` (the full [tokens, vocab] logits);
  - chunk_dynamic: `features.chunk_loss.mode: dynamic` with a `--logits-budget-mib` budget;
  - ep: DeepSpeed's `expert_parallel` (`enabled`, `autoep_size: --ep`) and the extension's EP balance.
Both doors hold out the same `EVAL_SPLIT` of the samples as validation data; the trainer has its evals configured
(after its last step: idle during the timed steps) and its MoE router figures on, as a fine-tuning run would.
Per case the two doors run back to back in an order rotated from round to round. Figures: median ms/step of the
steps after `--warmup` (per run, then over rounds), engine ms / trainer ms per round, the per-step loss error engine
vs trainer, and each door's peak memory per rank (max over ranks) with the chunked loss's saving against full_logits.
Goal: the engine door at most 5% slower than the trainer door (ratio <= 1.05) in every case.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

from glm45v_fsdp.bench.charts import bar_chart
from glm45v_fsdp.bench.deepspeed_api import (
    add_run_arguments,
    initial_weights,
    rotated_round,
    run_worker,
    runner,
    workload_note,
)
from glm45v_fsdp.bench.options import report_head
from glm45v_fsdp.bench.runner import errors, md_table, saving_pct, write_report
from glm45v_fsdp.errors import UserError

HELP = "the DeepSpeed engine door on GLM-4.5V beside the trainer door: chunked-loss memory, EP step time"
DESCRIPTION = "Engine door (DeepSpeed-API script) and trainer door (--deepspeed), interleaved per case."

CONTEXT_GOAL = 0.6  # a context-parallel case's peak per rank / the CP1 case's, at --context-tokens (as the trainer)
DOORS = ("ds_compat", "trainer")
DOOR_NAMES = {"ds_compat": "engine API door", "trainer": "trainer --deepspeed"}
SPEED_GOAL = 1.05  # engine ms / trainer ms: the engine door may be at most 5% slower
TRAINER_GOAL = 1.0  # trainer ms / engine ms: the trainer's step (bookkeeping, metrics, evals idle) no slower
# Held out of the workload's samples for both doors (data.validation_split): the trainer runs with its validation set
# and evals configured (once, after its last step) and its per-layer router figures on, idle between evals.
EVAL_SPLIT = 0.05
DTYPE = "fp32"


def cases(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each case's ds_config keys on top of the worker's (ZeRO, AdamW, clipping)."""
    chunk = {"mode": "dynamic", "logits_budget_mib": args.logits_budget_mib}
    return {
        "full_logits": {"glm45v_fsdp": {"features": {"chunk_loss": {"mode": "off"}}}},
        "chunk_dynamic": {"glm45v_fsdp": {"features": {"chunk_loss": chunk}}},
        "ep": {
            "expert_parallel": {"enabled": True, "autoep_size": args.ep},
            "glm45v_fsdp": {"features": {"ep_balance": {"enabled": True}}},
        },
    }


def context_cases(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The context-parallel cases over all --ranks ranks (CP1: every rank its own samples), with activation
    checkpointing and the chunked loss, as the trainer's CP rows (bench memory --switches ulysses)."""
    features = {"features": {"chunk_loss": {"mode": "dynamic", "logits_budget_mib": args.logits_budget_mib}}}
    recompute, ring = {"activation_checkpointing": {}}, {"parallel": {"ring_attention_size": args.ranks}}
    return {
        "cp1": {**recompute, "glm45v_fsdp": features},
        f"ulysses{args.ranks}": {**recompute, "sequence_parallel_size": args.ranks, "glm45v_fsdp": features},
        f"ring{args.ranks}": {**recompute, "glm45v_fsdp": {**ring, **features}},
    }


def run_context(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The engine door's peak per rank at --context-tokens text tokens per sample (micro batch 1), once per case."""
    bench = runner(args, "bench door")
    rows, cp1 = [], None
    for name, extra in context_cases(args).items():
        case_args = argparse.Namespace(
            **{**vars(args), "ds_extra": extra, "text_tokens": args.context_tokens, "text_layers": args.context_layers}
            | {"cutoff_len": args.context_tokens, "micro": 1, "steps": 2}
        )
        label = f"[context] {name}, {args.context_tokens} text tokens"
        run_dir = args.out / "runs" / f"context_{name}"
        found = run_worker(case_args, bench, "ds_compat", args.zero, DTYPE, run_dir, label)
        peak = found["peak_bytes_max"] / 2**20
        cp1 = peak if cp1 is None else cp1
        rows.append({"case": name, "ds_config_keys": extra, "peak_mib": peak, "over_cp1": peak / cp1,
                     "pass": name == "cp1" or peak / cp1 <= CONTEXT_GOAL, "losses": found["losses"]})  # fmt: skip
    return rows


def run_case(args: argparse.Namespace, name: str, extra: dict[str, Any]) -> dict[str, list[dict]]:
    """`--rounds` of both doors on one case; the trainer's tracked peak from one 3-step run per case."""
    case_args = argparse.Namespace(**{**vars(args), "ds_extra": extra, "eval_split": EVAL_SPLIT})
    bench = runner(case_args, "bench door")
    initial = initial_weights(case_args, bench, args.zero, DTYPE, args.out / "initial" / name)
    case = (name, args.zero, DTYPE)
    rounds = [rotated_round(case_args, bench, DOOR_NAMES, initial, case, i) for i in range(args.rounds)]
    return {door: [found[door] for found in rounds] for door in DOORS}


def row(name: str, extra: dict[str, Any], runs: dict[str, list[dict]], warmup: int) -> dict[str, Any]:
    ms = {door: [statistics.median(run["ms"][warmup:]) for run in runs[door]] for door in DOORS}
    ratios = [engine / trainer for engine, trainer in zip(ms["ds_compat"], ms["trainer"])]
    ratio = statistics.median(ratios)
    trainer_ratio = statistics.median(trainer / engine for engine, trainer in zip(ms["ds_compat"], ms["trainer"]))
    return {
        "case": name,
        "ds_config_keys": extra,
        "ms_per_step": {door: statistics.median(ms[door]) for door in DOORS},
        "engine_over_trainer_ms": ratio,
        "ratio_per_round": ratios,
        "peak_mib": {door: max(run["peak_bytes_max"] or 0.0 for run in runs[door]) / 2**20 for door in DOORS},
        "loss_mean_rel_err": errors(runs["ds_compat"][0]["losses"], runs["trainer"][0]["losses"])["mean_rel"],
        "pass": ratio <= SPEED_GOAL,
        "trainer_over_engine_ms": trainer_ratio,
        "trainer_pass": trainer_ratio <= TRAINER_GOAL,
    }


def chunk_saving(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """What the chunked loss saves at each door against the full logits: MiB and percent of the peak."""
    off, on = rows["full_logits"]["peak_mib"], rows["chunk_dynamic"]["peak_mib"]
    return {door: {"mib": off[door] - on[door], "pct": saving_pct(off[door], on[door])} for door in DOORS}


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# The DeepSpeed engine door on GLM-4.5V beside the trainer door, {report['ranks']} ranks, ZeRO "
        f"{report['zero']}, {DTYPE}, {report['rounds']} interleaved round(s)",
        "",
        *md_table(
            [
                "case",
                "ms/step engine · trainer",
                "engine / trainer (rounds)",
                "peak MiB/rank engine · trainer",
                "loss rel err",
                f"≤ {SPEED_GOAL}",
                f"trainer / engine ≤ {TRAINER_GOAL}",
            ],
            [
                [
                    r["case"],
                    f"{r['ms_per_step']['ds_compat']:.1f} · {r['ms_per_step']['trainer']:.1f}",
                    f"{r['engine_over_trainer_ms']:.3f} ({', '.join(f'{x:.3f}' for x in r['ratio_per_round'])})",
                    f"{r['peak_mib']['ds_compat']:.2f} · {r['peak_mib']['trainer']:.2f}",
                    f"{r['loss_mean_rel_err']:.1e}",
                    "pass" if r["pass"] else "below",
                    f"{r['trainer_over_engine_ms']:.3f} {'pass' if r['trainer_pass'] else 'above'}",
                ]
                for r in report["rows"]
            ],
        ),
        "",
        "Chunked loss (dynamic) against the full logits, peak memory saved per rank: "
        + "; ".join(
            f"{DOOR_NAMES[door]} {saved['mib']:.2f} MiB ({saved['pct']:.1f}%)"
            for door, saved in report["chunk_saving"].items()
        ),
        "",
        *context_markdown(report),
        *[f"- {note}" for note in report["notes"]],
        "",
    ]
    return "\n".join(lines)


def context_markdown(report: dict[str, Any]) -> list[str]:
    if not report["context_rows"]:
        return []
    return [
        f"Context parallelism through the engine door, {report['context_tokens']} text tokens per sample (one per "
        f"micro batch), {report['context_layers']} text layers, peak per rank (goal: a CP case at most "
        f"{CONTEXT_GOAL}x CP1):",
        "",
        *md_table(
            ["case", "ds_config keys", "peak MiB/rank", "/ CP1", f"≤ {CONTEXT_GOAL}"],
            [
                [
                    r["case"],
                    f"`{json.dumps(r['ds_config_keys'])}`",
                    f"{r['peak_mib']:.1f}",
                    f"{r['over_cp1']:.2f}",
                    "pass" if r["pass"] else "below",
                ]
                for r in report["context_rows"]
            ],
        ),  # fmt: skip
        "",
        f"- context rows: the engine door only (the trainer's own: bench memory --switches ulysses,ring); one sample "
        f"cut at {report['context_tokens']} tokens per micro batch (one 64-patch image included), activation "
        "checkpointing and the dynamic chunk loss; CP1: every rank its own sample, a CP case: the group one sample; "
        "peak: live tensor bytes of one untimed step, max over ranks.",
        "",
    ]


def chart(report: dict[str, Any], path: Path) -> None:
    bar_chart(
        [(f"{r['case']}: ms/step", [r["ms_per_step"][door] for door in DOORS]) for r in report["rows"]],
        series=tuple(DOOR_NAMES[door] for door in DOORS),
        title=f"Engine door vs trainer door on GLM-4.5V - {report['ranks']} ranks, CPU gloo",
        notes=[f"{r['case']} engine/trainer {r['engine_over_trainer_ms']:.3f}" for r in report["rows"]],
        path=path,
    )


def run_door_bench(args: argparse.Namespace) -> dict[str, Any]:
    chosen = cases(args) if not args.context_only else {}
    rows = {name: row(name, extra, run_case(args, name, extra), args.warmup) for name, extra in chosen.items()}
    context_rows = run_context(args) if args.context_tokens else []
    report = {
        **report_head("door", args, "ranks", "zero", "rounds"),
        "rows": list(rows.values()),
        "chunk_saving": chunk_saving(rows) if rows else {},
        "context_tokens": args.context_tokens,
        "context_layers": args.context_layers,
        "context_rows": context_rows,
        "notes": [
            workload_note(args, "AdamW") + "; the trainer's leaves out fetching its batches, which the script does "
            "before its timed loop.",
            f"chunk_dynamic: logits budget {args.logits_budget_mib} MiB; ep: autoep_size {args.ep} with EP balance.",
            "peak: engine door = live tensor bytes of one extra untimed step of the script (every tensor reachable "
            "at its start counts, the script's prepared batches included); trainer = its tracked peak "
            "(training.track_memory) of a separate 3-step run. The two meters start from different live sets, so "
            "compare each door's saving, not the absolute peaks.",
            f"OMP_NUM_THREADS per rank: {args.threads}.",
        ],
    }
    write_report(args.out, "door", report, markdown(report), {"door.png": lambda path: chart(report, path)})
    return report


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("door", help=HELP, description=DESCRIPTION)
    parser.add_argument("--zero", type=int, default=3, choices=(1, 2, 3), help="ZeRO stage of every case's ds_config")
    parser.add_argument("--ep", type=int, default=2, help="autoep_size of the ep case")
    parser.add_argument("--logits-budget-mib", type=float, default=0.25, help="the dynamic chunk loss's budget")
    parser.add_argument(
        "--context-tokens", type=int, default=8192, help="text tokens per sample of the context-parallel rows (0: none)"
    )
    parser.add_argument("--context-layers", type=int, default=6, help="text layers of the context-parallel rows")
    parser.add_argument("--context-only", action="store_true", help="only the context-parallel rows")
    add_run_arguments(parser, Path("output/bench/door"))


def main_door(args: argparse.Namespace, argv: list[str]) -> int:
    if not 0 <= args.warmup < args.steps or args.rounds < 1 or args.ranks % args.ep or args.logits_budget_mib <= 0:
        raise UserError(
            f"bench door: need 0 <= --warmup < --steps, --rounds >= 1, --ranks a multiple of --ep and "
            f"--logits-budget-mib > 0; got warmup {args.warmup}, steps {args.steps}, rounds {args.rounds}, ranks "
            f"{args.ranks}, ep {args.ep}, budget {args.logits_budget_mib}."
        )
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    args.argv = argv
    report = run_door_bench(args)
    below = [r["case"] for r in report["rows"] if not r["pass"]]
    if below:
        print(f"bench door: engine door more than {SPEED_GOAL}x the trainer's ms/step in: {', '.join(below)}")
    above = [r["case"] for r in report["rows"] if not r["trainer_pass"]]
    if above:
        print(f"bench door: trainer door more than {TRAINER_GOAL}x the engine's ms/step in: {', '.join(above)}")
    return 0
