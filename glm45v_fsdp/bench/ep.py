"""`python -m glm45v_fsdp.tools.bench ep`: expert parallelism and EP balance, every configuration a real training run.

Each configuration is `torchrun --nproc_per_node R -m glm45v_fsdp.train` in its own process (same seed, data and
weights, fp32), on a text model whose routed experts dominate the step (--hidden, --experts, --top-k,
--moe-intermediate); with `--repeats N` every configuration runs N times, round-robin, so a drift in machine speed
hits all of them alike. The runs, for R ranks:

  ep1             EP off: FSDP all-gathers every layer's E experts on every rank, forward and backward
  epR             EP R, alltoall dispatch (each rank holds E/R experts and computes the pairs routed to them)
  epR_allgather   EP R, allgather dispatch
  ep2             EP 2 on 4 ranks (efsdp 2: each EP rank's experts also sharded over 2 ranks), with --ranks 4
  skew            epR with model.router_skew (the low-numbered experts, on the first EP rank, take most pairs)
  skew_balance    skew + features.ep_balance (replicas of the hottest experts on the least-loaded ranks)
  balance         epR + features.ep_balance on the model's own routing (mostly below the trigger): no cost

The rows compare pairs of runs: throughput (samples/s = global batch x 1000 / median ms/iter of the steps after
--warmup, over all repeats), the CPU seconds of the ranks, peak memory per rank (allocator peak on cuda/npu, live tensor
bytes on cpu), the expert weights one rank computes with per MoE layer (E/ep experts x 3 x hidden x moe_intermediate
x 4 bytes: what FSDP gathers and keeps while the layer runs), the EP rank load (max/mean and coefficient of variation
of the (token, expert) pairs each EP rank computes, before and after balance, median over steps), replicas and the MiB
their weights moved per step, and the loss parity (mean relative error over aligned steps of the first repeat).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glm45v_fsdp.bench.memory import common_overrides
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
    change_pct,
    load_range,
    md_report,
    memory_pair,
    pair_figures,
    run_figures,
    write_report,
)
from glm45v_fsdp.errors import UserError

HELP = "expert parallelism: EP1 vs EP n, alltoall vs allgather, EP balance under skewed and natural routing"
DESCRIPTION = "Expert-parallel training runs side by side, each in its own process."

MIB = 2**20


@dataclass(frozen=True)
class Row:
    """One comparison: the OFF run, the ON run, and what is judged."""

    label: str
    off: str
    on: str
    kind: str  # "ep" (EP1 -> EP n), "dispatcher", "balance_skew", "balance_natural"


def model_overrides(args: argparse.Namespace) -> list[str]:
    text, vision = "model.config_overrides.text_config", "model.config_overrides.vision_config"
    heads = max(1, args.hidden // 32)
    return [
        f"{text}.hidden_size={args.hidden}",
        f"{text}.intermediate_size={2 * args.hidden}",
        f"{text}.num_attention_heads={heads}",
        f"{text}.num_key_value_heads={max(1, heads // 2)}",
        f"{text}.head_dim=32",
        f"{text}.rope_parameters.mrope_section=[4,2,2]",
        f"{text}.moe_intermediate_size={args.moe_intermediate}",
        f"{text}.n_routed_experts={args.experts}",
        f"{text}.num_experts_per_tok={args.top_k}",
        f"{text}.num_hidden_layers={args.text_layers}",
        f"{text}.max_position_embeddings={max(4096, args.tokens)}",
        f"{vision}.out_hidden_size={args.hidden}",
    ]


def shape_defaults(tokens: int, hidden: int, experts: int, top_k: int) -> dict[str, int]:
    """The defaults of the options `model_overrides` reads (`add_options` adds them), per bench where they differ."""
    return {
        "tokens": tokens,
        "images": 2,
        "hidden": hidden,
        "text_layers": 4,
        "experts": experts,
        "top_k": top_k,
        "moe_intermediate": 512,
    }


def plan_runs(args: argparse.Namespace) -> tuple[dict[str, list[str]], list[Row]]:
    """{run name: its feature overrides} and the rows comparing them."""
    ranks = args.ranks
    ep = f"parallel.expert_parallel_size={ranks}"
    skew = f"model.router_skew={args.skew}"
    balance = ["features.ep_balance.enabled=true", f"features.ep_balance.max_dup_experts_num={args.max_dup}"]
    runs = {
        "ep1": [],
        f"ep{ranks}": [ep],
        f"ep{ranks}_allgather": [ep, "parallel.ep_plan.dispatcher=allgather"],
        "skew": [ep, skew],
        "skew_balance": [ep, skew, *balance],
        "balance": [ep, *balance],
    }
    rows = [
        Row(f"EP1 → EP{ranks} (alltoall)", "ep1", f"ep{ranks}", "ep"),
        Row(f"EP{ranks}: alltoall → allgather", f"ep{ranks}", f"ep{ranks}_allgather", "dispatcher"),
        Row(f"EP{ranks} balance off → on, skewed routing", "skew", "skew_balance", "balance_skew"),
        Row(f"EP{ranks} balance off → on, natural routing", f"ep{ranks}", "balance", "balance_natural"),
    ]
    if ranks == 4:
        runs["ep2"] = ["parallel.expert_parallel_size=2"]
        rows.insert(1, Row("EP1 → EP2 (alltoall, efsdp 2)", "ep1", "ep2", "ep"))
    return runs, rows


def run_overrides(args: argparse.Namespace, features: list[str], output_dir: Path) -> list[str]:
    """The benches' common settings at a fine-tuning lr (the routing stays the one the weights give, step after
    step), the model shape, the run's features, then the user's overrides."""
    common = [*common_overrides(args, output_dir), "training.lr=1e-5"]
    return common + model_overrides(args) + features + list(args.overrides)


def expert_weights_mib(args: argparse.Namespace, ep: int) -> float:
    """One MoE layer's expert weights a rank computes with (fp32): E/ep experts of gate, up and down projections."""
    return args.experts // ep * 3 * args.hidden * args.moe_intermediate * 4 / MIB


def summarise(run: Run, warmup: int, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration's figures over all its repeats (steps after the warmup): median ms/iter, each rank's peak,
    the EP load medians, replicas, and the spread between the repeats' medians (the noise floor)."""
    timed = [r for records in run.repeats for r in records if r["step"] > warmup]
    figures = run_figures(run, warmup + 1, stat="median")
    keys = [k for k, v in timed[0].items() if k.startswith("ep_load_") and not isinstance(v, list)]
    balanced = "ep_replicas" in timed[0]
    medians = [statistics.median(r["ms_per_iter"] for r in records if r["step"] > warmup) for records in run.repeats]
    return figures | {
        "ep": _ep_of(run.overrides),
        # tokens/s here: the median step's tokens over the median ms/iter
        "tokens_per_s": statistics.median(r["tokens"] for r in timed) * 1000.0 / figures["ms_per_iter"],
        "expert_weights_mib": expert_weights_mib(args, _ep_of(run.overrides)),
        "load": {key: statistics.median(r[key] for r in timed) for key in keys},
        "replicas_per_step": statistics.fmean(r["ep_replicas"] for r in timed) if balanced else 0.0,
        "replica_mib_per_step": statistics.fmean(r["ep_replica_mib"] for r in timed) if balanced else 0.0,
        "balanced_steps": sum(r["ep_replicas"] > 0 for r in timed) / len(timed) if balanced else 0.0,
        "repeat_spread_pct": change_pct(max(medians), min(medians)),
    }


def compare(row: Row, off: dict[str, Any], on: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {
        "label": row.label,
        "kind": row.kind,
        **pair_figures(off, on),
        **memory_pair(off, on),
        "tokens_per_s": [off["tokens_per_s"], on["tokens_per_s"]],
        "cpu_s_per_run": [statistics.median(off["cpu_s"]), statistics.median(on["cpu_s"])],
        "expert_weights_mib": [off["expert_weights_mib"], on["expert_weights_mib"]],
        "load_max_over_mean": [
            on["load"].get("ep_load_max_over_mean_before"),
            on["load"].get("ep_load_max_over_mean_after"),
        ],
        "load_cv": [on["load"].get("ep_load_cv_before"), on["load"].get("ep_load_cv_after")],
        "replicas_per_step": on["replicas_per_step"],
        "replica_mib_per_step": on["replica_mib_per_step"],
        "balanced_steps": on["balanced_steps"],
        "noise_pct": max(off["repeat_spread_pct"], on["repeat_spread_pct"]),
    }
    failures = [] if result["loss_mean_rel_err"] <= PARITY_LIMIT else ["loss parity"]
    if row.kind == "ep":
        result["target"] = "throughput ≥ EP1; expert weights per rank = 1/ep"
        if not result["throughput_change_pct"] >= 0:
            failures.append("throughput")
    elif row.kind == "balance_skew":
        result["target"] = "max/mean ≤ 1.10, CV ≤ 0.05, throughput above balance off"
        mom, cv = result["load_max_over_mean"][1], result["load_cv"][1]
        if mom is None or mom > 1.10 or cv > 0.05:
            failures.append("rank load")
        if not result["throughput_change_pct"] > 0:
            failures.append("throughput")
    elif row.kind == "balance_natural":
        allowed = max(args.no_cost_tolerance_pct, result["noise_pct"])
        result["target"] = (
            f"no cost: ms/iter at most {allowed:.1f}% above balance off (the larger of "
            f"{args.no_cost_tolerance_pct:g}% and the spread between repeats)"
        )
        if change_pct(on["ms_per_iter"], off["ms_per_iter"]) > allowed:
            failures.append("time")
    else:
        result["target"] = "parity (reported)"
    result["pass"] = not failures
    result["result"] = "pass" if not failures else "FAIL: " + ", ".join(failures)
    return result


COLUMNS = (
    "comparison",
    "runs off→on",
    "loss mean rel err",
    "ms/iter off→on",
    "samples/s off→on",
    "throughput",
    "peak max / avg GiB off→on",
    "expert MiB per rank+layer off→on",
    "EP rank load max/mean (CV) before→after",
    "replicas / MiB per step (steps balanced)",
    "target",
    "result",
)


def _pair(values: list[float], fmt: str) -> str:
    return " → ".join(fmt.format(v) for v in values)


def _cells(row: dict[str, Any]) -> list[str]:
    mom, cv = row["load_max_over_mean"], row["load_cv"]
    load = "–" if mom[0] is None else f"{mom[0]:.3f} ({cv[0]:.3f}) → {mom[1]:.3f} ({cv[1]:.3f})"
    peaks = f"{_pair(row['peak_max_gib'], '{:.4f}')} / {_pair(row['peak_avg_gib'], '{:.4f}')}"
    return [
        row["label"],
        f"{row['off_run']} → {row['on_run']}",
        f"{row['loss_mean_rel_err']:.2e}",
        _pair(row["ms_per_iter"], "{:.1f}"),
        _pair(row["samples_per_s"], "{:.2f}"),
        f"{row['throughput_change_pct']:+.1f}%",
        peaks,
        _pair(row["expert_weights_mib"], "{:.2f}"),
        load,
        f"{row['replicas_per_step']:.2g} / {row['replica_mib_per_step']:.2f} ({row['balanced_steps']:.0%} of steps)",
        row["target"],
        row["result"],
    ]


def markdown(report: dict[str, Any]) -> str:
    title = f"Expert parallelism and EP balance ({report['device']}, {report['ranks']} ranks)"
    return "\n".join(md_report(title, COLUMNS, [_cells(row) for row in report["rows"]], report["notes"])) + "\n"


def notes(args: argparse.Namespace, runs: dict[str, Run], figures: dict[str, dict[str, Any]]) -> list[str]:
    cpu = "; ".join(f"{name} {statistics.median(run.cpu_s):.1f} s" for name, run in runs.items())
    return [
        f"model: text hidden {args.hidden}, {args.text_layers} layers (1 dense), {args.experts} routed experts top-"
        f"{args.top_k} (moe_intermediate {args.moe_intermediate}) + 1 shared; {args.tokens} tokens per rank per step "
        f"(one sample, {args.images} image(s)); fp32; micro batch 1 per rank.",
        f"ms/iter: median of steps {args.warmup + 1}-{args.steps} over {args.repeats} repeat(s) per run "
        f"(round-robin, every other round in reverse order); samples/s = global batch x 1000 / that median. Spread "
        f"between repeats of one run (noise floor): "
        + "; ".join(f"{name} {run['repeat_spread_pct']:.1f}%" for name, run in figures.items())
        + ".",
        f"skewed routing: model.router_skew={args.skew} (a test knob: adds skew x (E-1-e)/(E-1) to expert e's "
        f"selection score); balance: max_dup_experts_num={args.max_dup}, trigger 1.2, target 1.02 (the defaults).",
        "peak memory: "
        + ("allocator peak" if args.device != "cpu" else "live tensor bytes (CPU tracker)")
        + "; each rank's peak over all steps and repeats, then max / mean over ranks.",
        "expert MiB per rank+layer: the expert weights one rank gathers and computes with while an MoE layer runs "
        "(E/ep experts); the persistent expert state per rank (parameters, gradients, Adam) is 1/(dp_shard x cp) of "
        "the experts with or without EP.",
        f"CPU seconds per run (user + sys of all ranks, start-up included; median over repeats): {cpu}.",
        f"machine load (1-min average) around the runs: {load_range(runs.values())}; OMP_NUM_THREADS per rank: "
        f"{args.threads}.",
    ]


def chart(report: dict[str, Any], path: Path) -> None:
    from glm45v_fsdp.bench.charts import bar_chart

    groups, chart_notes = [], []
    for row in report["rows"]:
        groups.append((f"{row['label']}: samples/s", row["samples_per_s"]))
        chart_notes.append(f"{row['throughput_change_pct']:+.1f}%")
    for row in report["rows"]:
        if row["kind"] == "ep":
            groups.append((f"{row['label']}: expert MiB/rank/layer", row["expert_weights_mib"]))
            chart_notes.append(f"x{row['expert_weights_mib'][1] / row['expert_weights_mib'][0]:.2f}")
        if row["kind"] == "balance_skew":
            groups.append((f"{row['label']}: rank load max/mean", row["load_max_over_mean"]))
            chart_notes.append(f"CV {row['load_cv'][0]:.2f} -> {row['load_cv'][1]:.2f}")
    bar_chart(
        groups,
        series=("OFF", "ON"),
        title=f"Expert parallelism and EP balance — {report['device']}, {report['ranks']} ranks",
        value_format="{:.3g}",
        notes=chart_notes,
        path=path,
    )


def run_ep(args: argparse.Namespace) -> dict[str, Any]:
    features, rows = plan_runs(args)
    runner = Runner("bench ep", args.out, args.ranks, args.threads, args.run_timeout)
    plans = {
        name: (lambda run_dir, feats=feats: run_overrides(args, feats, run_dir))
        for name, feats in features.items()
        if _used(name, rows)
    }
    runs = runner.rounds(plans, args.repeats, alternate=True)  # ABBA: drift cancels
    figures = {name: summarise(run, args.warmup, args) for name, run in runs.items()}
    report = {
        **report_head("ep", args, "device", "ranks", "steps", "warmup", "repeats", "threads"),
        "rows": [compare(row, figures[row.off], figures[row.on], args) for row in rows],
        "notes": notes(args, runs, figures),
        "runs": figures,
    }
    write_report(args.out, "ep", report, markdown(report), {"ep.png": lambda path: chart(report, path)})
    return report


def _ep_of(features: list[str]) -> int:
    sizes = [int(item.split("=", 1)[1]) for item in features if item.startswith("parallel.expert_parallel_size=")]
    return sizes[-1] if sizes else 1


def _used(name: str, rows: list[Row]) -> bool:
    return any(name in (row.off, row.on) for row in rows)


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("ep", help=HELP, description=DESCRIPTION)
    parser.add_argument("--ranks", type=int, choices=(2, 4), default=2, help="processes per run (torchrun)")
    shape = shape_defaults(tokens=1024, hidden=256, experts=32, top_k=8)
    parser.add_argument(
        "--skew",
        type=float,
        default=0.2,
        help="model.router_skew of the skewed-routing runs (0.2: EP rank load max/mean about 1.6 on 2 ranks)",
    )
    parser.add_argument("--max-dup", type=int, default=4, help="features.ep_balance.max_dup_experts_num")
    parser.add_argument(
        "--no-cost-tolerance-pct",
        type=float,
        default=3.0,
        help="balance on the model's own routing: allowed ms/iter increase over balance off (%%)",
    )
    add_run_options(parser, Path("output/bench/ep"), device="cpu", steps=12, warmup=2, repeats=2, **shape)


def main_ep(args: argparse.Namespace, argv: list[str]) -> int:
    check_counts(
        "ep", args, ("steps", "repeats", "tokens", "hidden", "text_layers", "experts", "top_k", "moe_intermediate")
    )
    if args.experts % args.ranks:
        raise UserError(f"bench ep: --experts {args.experts} must be a multiple of --ranks {args.ranks}.")
    settle(args, argv, args.device)
    announce_failures("ep", run_ep(args)["rows"])
    return 0
