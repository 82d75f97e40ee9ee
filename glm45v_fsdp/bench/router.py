"""`python -m glm45v_fsdp.tools.bench router`: MoE router balancing against no balancing, each a real training run.

Every run trains the tiny GLM-4.5V (text MoE layers with --experts routed experts, top --top-k) for --steps steps
on one process, fp32, the same seed, data and weights, under a skewed router: model.router_skew adds
skew x (E-1-e)/(E-1) to expert e's selection score (not to its routing weight), so the low-numbered experts win
most tokens, as in a router collapsing onto a few experts while it trains. The runs:

  off    skewed routing, no balancing
  bias   + features.router.bias_update_rate (aux-loss-free: the routers' e_score_correction_bias after each step)
  aux    + features.router.aux_loss_coef (DeepSeek-V3's sequence-wise auxiliary loss)

The router figures come from each run's metrics.jsonl (model/router_health.py; one report per --interval steps
over the interval's tokens): the worst MoE layer's expert load max/mean and the dead-expert fraction, at the
start (the first interval) and at the end (the mean over the last --tail-intervals intervals); the bias's largest
magnitude at the end; the CE loss at the start and the end (no timing: the update is a few small ops per step and
one all-reduce on more than one rank). The bias row passes when its end max/mean is below off's and below its own
start.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from glm45v_fsdp.bench.options import add_run_options, check_counts, report_head, settle
from glm45v_fsdp.bench.runner import Runner, load_range, md_report, write_report
from glm45v_fsdp.errors import UserError

HELP = "MoE router balancing (bias update, auxiliary loss) against none, under skewed routing"
DESCRIPTION = "Training runs under a skewed router: no balancing, the bias update, the auxiliary loss."


def run_features(args: argparse.Namespace) -> dict[str, list[str]]:
    return {
        "off": [],
        "bias": [f"features.router.bias_update_rate={args.rate}"],
        "aux": [f"features.router.aux_loss_coef={args.aux_coef}"],
    }


def run_overrides(args: argparse.Namespace, features: list[str], output_dir: Path) -> list[str]:
    text = "model.config_overrides.text_config"
    return [
        f"training.output_dir={output_dir}",
        f"training.train_iters={args.steps}",
        f"training.log_interval={args.interval}",
        "training.progress_bar=false",
        "parallel.fsdp_plan.param_dtype=fp32",
        "parallel.fsdp_plan.reduce_dtype=fp32",
        f"data.synthetic_samples={max(64, 2 * args.steps)}",
        f"{text}.n_routed_experts={args.experts}",
        f"{text}.num_experts_per_tok={args.top_k}",
        f"model.router_skew={args.skew}",
        *features,
        *args.overrides,
    ]


def summarise(records: list[dict], tail: int) -> dict[str, Any]:
    """The router figures of one run: the first interval's, and the mean of the last `tail` intervals'."""
    reports = [r for r in records if "router/worst_load_max_over_mean" in r]
    if len(reports) <= tail:
        raise UserError(
            f"bench router: {len(reports)} router report(s) per run, need more than --tail-intervals {tail}; "
            "raise --steps or lower --interval."
        )
    last = reports[-tail:]
    return {
        "max_over_mean": [
            reports[0]["router/worst_load_max_over_mean"],
            statistics.fmean(r["router/worst_load_max_over_mean"] for r in last),
        ],
        "dead_fraction": [
            reports[0]["router/dead_fraction"],
            statistics.fmean(r["router/dead_fraction"] for r in last),
        ],
        "entropy_min": [_min_entropy(reports[0]), statistics.fmean(_min_entropy(r) for r in last)],
        "bias_max_abs": reports[-1].get("router/bias_max_abs", 0.0),
        "aux_loss": [reports[0].get("router/aux_loss"), reports[-1].get("router/aux_loss")],
        "loss": [records[0]["loss"], statistics.fmean(r["loss"] for r in records[-tail:])],
        "curve": [[r["step"], r["router/worst_load_max_over_mean"]] for r in reports],
    }


def _min_entropy(record: dict) -> float:
    return min(value for key, value in record.items() if key.startswith("router/layer") and key.endswith("/entropy"))


COLUMNS = (
    "run",
    "worst layer load max/mean start → end",
    "dead experts start → end",
    "min layer entropy start → end",
    "max abs(bias) at the end",
    "CE loss start → end",
    "result",
)


def _cells(name: str, row: dict[str, Any]) -> list[str]:
    mom, dead, entropy, loss = row["max_over_mean"], row["dead_fraction"], row["entropy_min"], row["loss"]
    return [
        name,
        f"{mom[0]:.3f} → {mom[1]:.3f}",
        f"{dead[0]:.1%} → {dead[1]:.1%}",
        f"{entropy[0]:.4f} → {entropy[1]:.4f}",
        f"{row['bias_max_abs']:.3f}",
        f"{loss[0]:.4f} → {loss[1]:.4f}",
        row["result"],
    ]


def markdown(report: dict[str, Any]) -> str:
    title = f"MoE router balancing under skewed routing ({report['steps']} steps)"
    cells = [_cells(name, row) for name, row in report["runs"].items()]
    return "\n".join(md_report(title, COLUMNS, cells, report["notes"])) + "\n"


def run_router(args: argparse.Namespace) -> dict[str, Any]:
    runner = Runner("bench router", args.out, 1, args.threads, args.run_timeout)
    plans = {
        name: (lambda run_dir, feats=feats: run_overrides(args, feats, run_dir))
        for name, feats in run_features(args).items()
    }
    runs = runner.rounds(plans, repeats=1)
    rows = {name: summarise(run.records, args.tail_intervals) for name, run in runs.items()}
    off_end = rows["off"]["max_over_mean"][1]
    for name, row in rows.items():
        start, end = row["max_over_mean"]
        if name == "off":
            row["result"] = "reference"
        elif end < off_end and end < start:
            row["result"] = f"pass: {100 * (1 - end / off_end):.0f}% below off"
        else:
            row["result"] = "FAIL: not below off" if name == "bias" else f"reported ({end / off_end:.2f}x off)"
    rows["bias"]["pass"] = rows["bias"]["result"].startswith("pass")
    report = {
        **report_head("router", args, "steps"),
        "runs": rows,
        "notes": [
            f"model: the tiny GLM-4.5V (3 MoE layers, hidden 64) with {args.experts} routed experts top-{args.top_k}; "
            f"1 process, fp32, micro batch 2, lr 1e-3 cosine (configs/glm45v_tiny.yaml); {args.steps} steps.",
            f"skewed routing: model.router_skew={args.skew}; bias: features.router.bias_update_rate={args.rate}; "
            f"aux: features.router.aux_loss_coef={args.aux_coef} (sequence-wise).",
            f"start: the first report (steps 1-{args.interval}); end: the mean of the last {args.tail_intervals} "
            f"reports (the last {args.tail_intervals * args.interval} steps), each over its {args.interval} steps' "
            "tokens; CE loss end: the mean of the last as many steps' losses.",
            f"machine load (1-min average) around the runs: {load_range(runs.values())}.",
        ],
    }
    write_report(args.out, "router", report, markdown(report))
    return report


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("router", help=HELP, description=DESCRIPTION)
    parser.add_argument("--interval", type=int, default=10, help="steps per router report (training.log_interval)")
    parser.add_argument("--tail-intervals", type=int, default=5, help="reports averaged for the end figures")
    parser.add_argument("--skew", type=float, default=0.1, help="model.router_skew of every run")
    parser.add_argument("--rate", type=float, default=1e-3, help="features.router.bias_update_rate of the bias run")
    parser.add_argument("--aux-coef", type=float, default=1e-2, help="features.router.aux_loss_coef of the aux run")
    add_run_options(parser, Path("output/bench/router"), steps=200, experts=32, top_k=4)


def main_router(args: argparse.Namespace, argv: list[str]) -> int:
    check_counts("router", args, ("steps", "interval", "tail_intervals", "experts", "top_k"))
    settle(args, argv, "cpu")
    report = run_router(args)
    if not report["runs"]["bias"]["pass"]:
        print("bench router: the bias update did not lower the load below no balancing")
    return 0
