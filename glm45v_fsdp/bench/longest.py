"""`python -m glm45v_fsdp.tools.bench longest`: the longest sequence each context-parallel layout trains within a
fixed per-rank memory budget, found by doubling.

Every layout runs on the same `--ranks` processes at the same global batch (as `bench memory`'s CP rows: CP n has
1/n of the data-parallel ranks and n x the accumulation), on the `bench memory` Recompute shape (--text-layers, the
static chunked loss and full recompute on every run). For each layout the sequence length starts at --start tokens
and doubles while a short training run's peak per rank (max over ranks and steps: the allocator peak on cuda/npu,
live tensor bytes on cpu) stays within --budget-mib; the longest length that fitted is the layout's figure, and the
ratio to CP1's is judged against --min-ratio (the issue's goal: CP2 trains >= 1.8 x the CP1 length).
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from glm45v_fsdp.bench.memory import RUNS, run_overrides
from glm45v_fsdp.bench.options import add_run_options, report_head, settle
from glm45v_fsdp.bench.runner import Run, Runner, md_report, write_report
from glm45v_fsdp.errors import UserError

HELP = "longest sequence per CP layout within a per-rank memory budget, by doubling"
DESCRIPTION = "Short training runs at doubling sequence lengths until the peak per rank exceeds the budget."

GIB = 2**30
# bench memory's CP rows: the Recompute shape with static chunked loss and recompute, CP n at the same global batch
LAYOUTS = {
    "cp1": RUNS["recompute"],
    "ulysses2": RUNS["recompute_ulysses_cp2"],
    "ring2": RUNS["recompute_ring_cp2"],
    "hybrid4": RUNS["recompute_hybrid_cp4"],
}


@dataclass
class Search:
    """One layout's doubling: the peak per rank (MiB) at each length tried, and the longest that fitted."""

    layout: str
    cp: int
    peaks_mib: dict[int, float] = field(default_factory=dict)
    longest: int = 0


def peak_mib(records: list[dict]) -> float:
    return max(max(r["mem_peak_per_rank_gib"]) for r in records) * GIB / 2**20


def search(layout: str, args: argparse.Namespace, measure) -> Search:
    """Double the sequence from --start while `measure(layout, tokens)` (peak MiB per rank) fits the budget."""
    found = Search(layout, LAYOUTS[layout].cp)
    tokens = args.start
    while tokens <= args.max_tokens:
        peak = measure(layout, tokens)
        found.peaks_mib[tokens] = peak
        print(f"  {layout} at {tokens} tokens: peak {peak:.1f} MiB per rank (budget {args.budget_mib:g})", flush=True)
        if peak > args.budget_mib:
            break
        found.longest = tokens
        tokens *= 2
    return found


def training_measure(args: argparse.Namespace):
    """measure(layout, tokens) -> peak MiB per rank of a short training run of that layout at that length."""

    runner = Runner("bench longest", args.out, args.ranks, args.threads, args.run_timeout)

    def measure(layout: str, tokens: int) -> float:
        run_args = copy.copy(args)
        run_args.tokens = tokens
        run = Run(f"{layout}_{tokens}")
        run_dir = runner.run_dir(run.name)
        runner.train(run, run_overrides(LAYOUTS[layout], run_args, run_dir), run_dir)
        return peak_mib(run.records)

    return measure


def report(args: argparse.Namespace, searches: list[Search]) -> dict[str, Any]:
    base = next(s for s in searches if s.layout == "cp1")
    rows = []
    for found in searches:
        ratio = found.longest / base.longest if base.longest else float("nan")
        judged = found.layout != "cp1"
        rows.append(
            {
                "layout": found.layout,
                "cp": found.cp,
                "longest_tokens": found.longest,
                "ratio_to_cp1": ratio,
                "peaks_mib": found.peaks_mib,
                "target": f"≥ {args.min_ratio:g} × CP1" if judged else "reference",
                "pass": (ratio >= args.min_ratio) if judged else True,
            }
        )
    return {
        **report_head("longest", args, "device", "ranks", "budget_mib", "start", "steps"),
        "rows": rows,
        "searches": [asdict(found) for found in searches],
    }


def _cells(row: dict[str, Any]) -> list[str]:
    peaks = ", ".join(f"{tokens}: {peak:.1f}" for tokens, peak in row["peaks_mib"].items())
    verdict = "pass" if row["pass"] else "FAIL"
    return [
        row["layout"],
        row["cp"],
        row["longest_tokens"],
        f"{row['ratio_to_cp1']:.2f}",
        peaks,
        row["target"],
        verdict,
    ]


def markdown(result: dict[str, Any]) -> str:
    title = (
        f"Longest sequence within {result['budget_mib']:g} MiB per rank ({result['device']}, {result['ranks']} "
        "ranks, same global batch)"
    )
    columns = ("layout", "cp", "longest tokens", "× CP1", "peak MiB per rank at each length", "target", "result")
    return "\n".join(md_report(title, columns, [_cells(row) for row in result["rows"]])) + "\n"


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("longest", help=HELP, description=DESCRIPTION)
    parser.add_argument("--ranks", type=int, default=2, help="processes per run (a multiple of every layout's cp)")
    parser.add_argument("--images", type=int, default=16, help="synthetic images per sample")
    parser.add_argument("--layouts", default="cp1,ulysses2,ring2", help=f"comma-separated, from {','.join(LAYOUTS)}")
    parser.add_argument("--budget-mib", type=float, default=48.0, help="peak memory allowed per rank (MiB)")
    parser.add_argument("--start", type=int, default=1024, help="first sequence length (tokens per sample)")
    parser.add_argument("--max-tokens", type=int, default=65536, help="stop doubling past this length")
    parser.add_argument("--min-ratio", type=float, default=1.8, help="goal: longest CP n length / CP1's")
    add_run_options(parser, Path("output/bench/longest"), device="cpu", steps=3, text_layers=6)


def main_longest(args: argparse.Namespace, argv: list[str], measure=None) -> int:
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown or "cp1" not in layouts:
        raise UserError(
            f"bench longest: --layouts {args.layouts!r} must name cp1 (the reference) and layouts from "
            f"{', '.join(LAYOUTS)}; unknown: {unknown}."
        )
    unfit = [name for name in layouts if args.ranks % LAYOUTS[name].cp]
    if unfit:
        raise UserError(f"bench longest: --ranks {args.ranks} is not a multiple of the cp size of {unfit}.")
    if args.start < 1 or args.max_tokens < args.start or args.budget_mib <= 0:
        raise UserError("bench longest: need --start >= 1, --max-tokens >= --start and --budget-mib > 0.")
    settle(args, argv, args.device)
    measure = measure or training_measure(args)
    searches = [search(layout, args, measure) for layout in layouts]
    result = report(args, searches)
    write_report(args.out, "longest", result, markdown(result))
    failed = [row["layout"] for row in result["rows"] if not row["pass"]]
    if failed:
        print(f"bench longest: below target: {', '.join(failed)}")
    return 0
