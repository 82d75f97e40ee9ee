"""`python -m glm45v_fsdp.tools.bench deepspeed`: the same DeepSpeed-API script on the real DeepSpeed and on ds_compat.

Each run is `torchrun -m glm45v_fsdp.tools.bench_deepspeed_worker` (transformers' tiny GLM-4.5V, the same weights and
batches on both backends; see that module). For every (ZeRO stage, dtype) the two backends run back to back, in
alternating order from round to round, so a drift in machine speed hits both; `--rounds` repeats the whole set. The
figures per row: median ms/step of the steps after `--warmup` (per round, then the median over rounds), samples/s,
the throughput ratio ds_compat / DeepSpeed per round, the peak of live tensor bytes per rank (max over ranks), and the
loss mean relative error of ds_compat against DeepSpeed. `--profile` adds torch.profiler's top ops of each backend's
first run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from glm45v_fsdp.errors import UserError
from glm45v_fsdp.tools.bench_memory import execute, torchrun_command

BACKENDS = ("deepspeed", "ds_compat")
PARITY_LIMIT = {"fp32": 1e-5, "bf16": 1e-2}


def worker_command(args: argparse.Namespace, backend: str, zero: int, dtype: str, out: Path) -> list[str]:
    arguments = [f"--backend={backend}", f"--zero={zero}", f"--dtype={dtype}", f"--steps={args.steps}"]
    arguments += [f"--micro={args.micro}", f"--out={out}", *(["--profile"] if args.profile else [])]
    return torchrun_command(args.ranks, "glm45v_fsdp.tools.bench_deepspeed_worker", arguments)


def row(zero: int, dtype: str, runs: dict[str, list[dict]], args: argparse.Namespace) -> dict[str, Any]:
    """One (stage, dtype): medians per backend and round, ratio per round, parity of the first round."""
    ms = {b: [statistics.median(run["ms"][args.warmup :]) for run in runs[b]] for b in BACKENDS}
    ratios = [ds / ours for ds, ours in zip(ms["deepspeed"], ms["ds_compat"])]
    reference, ours = runs["deepspeed"][0]["losses"], runs["ds_compat"][0]["losses"]
    error = statistics.fmean(abs(a - b) / (abs(b) + 1e-8) for a, b in zip(ours, reference))
    samples = args.micro * args.ranks
    result = {
        "zero": zero,
        "dtype": dtype,
        "ms_per_step": {b: statistics.median(ms[b]) for b in BACKENDS},
        "ms_per_round": ms,
        "samples_per_s": {b: samples * 1000.0 / statistics.median(ms[b]) for b in BACKENDS},
        "throughput_ratio": statistics.median(ratios),
        "ratio_per_round": ratios,
        "peak_mib": {b: max(run["peak_bytes_max"] for run in runs[b]) / 2**20 for b in BACKENDS},
        "loss_mean_rel_err": error,
        "parity_pass": error <= PARITY_LIMIT[dtype],
        "target": "≥ 1.6× DeepSpeed" if zero == 3 else "≥ 1.0× DeepSpeed",
    }
    result["pass"] = result["parity_pass"] and result["throughput_ratio"] >= (1.6 if zero == 3 else 1.0)
    result["profile"] = {b: runs[b][0].get("profile") for b in BACKENDS}
    return result


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# DeepSpeed vs ds_compat (engine API), {report['ranks']} ranks, {report['rounds']} interleaved round(s)",
        "",
        "| ZeRO | dtype | DeepSpeed ms/step | ds_compat ms/step | throughput ds_compat / DeepSpeed (rounds) | peak MiB "
        "per rank DeepSpeed → ds_compat | loss mean rel err | target | result |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        rounds = ", ".join(f"{ratio:.2f}" for ratio in r["ratio_per_round"])
        lines.append(
            f"| {r['zero']} | {r['dtype']} | {r['ms_per_step']['deepspeed']:.1f} | {r['ms_per_step']['ds_compat']:.1f} "
            f"| {r['throughput_ratio']:.2f}× ({rounds}) | {r['peak_mib']['deepspeed']:.1f} → "
            f"{r['peak_mib']['ds_compat']:.1f} | {r['loss_mean_rel_err']:.1e} | {r['target']} | "
            f"{'pass' if r['pass'] else 'below'} |"
        )
    lines += ["", *[f"- {note}" for note in report["notes"]], ""]
    for r in report["rows"]:
        for backend, table in r["profile"].items():
            if table:
                lines += [f"Profile, ZeRO {r['zero']} {r['dtype']}, {backend} (steps 6-10):", "```", table, "```", ""]
    return "\n".join(lines)


def run_deepspeed_bench(args: argparse.Namespace) -> dict[str, Any]:
    stages = [int(z) for z in args.zero.split(",")]
    dtypes = args.dtype.split(",")
    runs: dict[tuple[int, str], dict[str, list[dict]]] = {
        (z, d): {b: [] for b in BACKENDS} for z in stages for d in dtypes
    }
    for round_index in range(args.rounds):
        for (zero, dtype), by_backend in runs.items():
            order = BACKENDS if round_index % 2 == 0 else tuple(reversed(BACKENDS))
            for backend in order:
                run_dir = args.out / "runs" / f"zero{zero}_{dtype}_{backend}_r{round_index + 1}"
                run_dir.mkdir(parents=True, exist_ok=True)
                out = run_dir / "result.json"
                print(f"[round {round_index + 1}/{args.rounds}] ZeRO {zero} {dtype} {backend}", flush=True)
                command = worker_command(args, backend, zero, dtype, out)
                execute(f"{backend} zero{zero} {dtype}", command, run_dir, args.run_timeout, args.threads,
                        bench="bench deepspeed", records=False)  # fmt: skip
                by_backend[backend].append(json.loads(out.read_text()))
    rows = [row(zero, dtype, by_backend, args) for (zero, dtype), by_backend in runs.items()]
    report = {
        "benchmark": "deepspeed",
        "ranks": args.ranks,
        "rounds": args.rounds,
        "command": [sys.executable, "-m", "glm45v_fsdp.tools.bench", *args.argv],
        "rows": rows,
        "notes": [
            f"workload: transformers' tiny GLM-4.5V (2 text layers, 8 routed experts, 2-block vision tower), micro "
            f"batch {args.micro} per rank, 256 text tokens + one 64-patch image per sample, AdamW (torch_adam), "
            f"clipping 1.0; ms/step: median of steps {args.warmup + 1}-{args.steps} per run, then over rounds.",
            "ds_compat's FSDP2 unit size comes from the ds_config's bucket sizes (DeepSpeed's defaults here: "
            "reduce/all-gather 5e8 elements at stages 1-2, prefetch 5e7 at stage 3).",
            "peak: live tensor bytes of one extra untimed step (every tensor reachable at its start counts as "
            "live): DeepSpeed's figure includes its 5e8-element gradient bucket.",
            f"OMP_NUM_THREADS per rank: {args.threads}.",
        ],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "deepspeed.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "deepspeed.md").write_text(markdown(report))
    print(markdown(report))
    return report


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "deepspeed",
        help="the real DeepSpeed vs ds_compat on one DeepSpeed-API script (transformers' tiny GLM-4.5V)",
        description="DeepSpeed and ds_compat runs interleaved per ZeRO stage and dtype.",
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--zero", default="1,2,3", help="ZeRO stages, comma-separated")
    parser.add_argument("--dtype", default="fp32", help="fp32 and/or bf16, comma-separated")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of ms/step")
    parser.add_argument("--micro", type=int, default=2, help="micro batch per rank")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="torch.profiler's top ops of steps 6-10")
    parser.add_argument("--out", type=Path, default=Path("output/bench/deepspeed"))
    parser.add_argument("--run-timeout", type=float, default=None)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")


def main_deepspeed(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        raise UserError(
            "bench deepspeed: the reference needs DeepSpeed: DS_BUILD_OPS=0 pip install --no-build-isolation "
            "'deepspeed>=0.19,<0.20' (CPU: DS_ACCELERATOR=cpu is set for the runs)."
        ) from None
    bad = [d for d in args.dtype.split(",") if d not in PARITY_LIMIT] + [
        z for z in args.zero.split(",") if z not in ("0", "1", "2", "3")
    ]
    if bad or not 0 <= args.warmup < args.steps or args.rounds < 1:
        raise UserError(
            f"bench deepspeed: need --zero from 0-3, --dtype from fp32/bf16, 0 <= --warmup < --steps and --rounds "
            f">= 1; got {bad or (args.warmup, args.steps, args.rounds)}."
        )
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    args.argv = argv
    report = run_deepspeed_bench(args)
    below = [f"ZeRO {r['zero']} {r['dtype']}" for r in report["rows"] if not r["pass"]]
    if below:
        print(f"bench deepspeed: below target: {', '.join(below)}")
    return 0
