"""`python -m glm45v_fsdp.tools.bench parity`: a long run against the backend being replaced.

The DeepSpeed-API script of `bench deepspeed` (transformers' tiny GLM-4.5V, the same initial weights and batches
everywhere; bench/deepspeed_api_worker.py) runs `--steps` steps (default 2000) on the real DeepSpeed, and this
backend runs the same workload through both of its doors: the same script with `import ds_compat as deepspeed`
(engine) and our trainer behind `--deepspeed ds_config.json` (trainer). Per dtype (bf16, the acceptance run, and
fp32 beside it) and door, against DeepSpeed:
  - loss mean and max relative error over every step (the reference's definition, runner.errors), the
    mean signed and mean absolute difference;
  - grad-norm mean and max relative error (the global norm before clipping, as each backend reports it);
  - throughput ratio = DeepSpeed's mean ms/step / the door's over the steps after `--warmup` (> 1: faster); the
    trainer's step leaves out fetching its batches, which the script does before its timed loop;
  - the loss-comparison plot (two curves, the per-step relative error under them with the 2% line).
Goal (the reference's acceptance): mean relative loss error < 2% in bf16 and throughput ≥ 1.0 × DeepSpeed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from glm45v_fsdp.bench.deepspeed_api import initial_weights, require_deepspeed, run_trainer, run_worker, runner
from glm45v_fsdp.bench.options import add_options, report_head
from glm45v_fsdp.bench.runner import Runner, errors, md_report, write_report
from glm45v_fsdp.errors import UserError

HELP = "a long run on the real DeepSpeed against this backend's two doors: loss, grad-norm and speed parity"
DESCRIPTION = (
    "The DeepSpeed-API script on DeepSpeed, on ds_compat and through our trainer, same weights and "
    "batches, --steps steps per dtype; loss/grad-norm errors, throughput ratio, loss-comparison plots."
)

DOORS = ("ds_compat", "trainer")
DOOR_NAMES = {"deepspeed": "DeepSpeed", "ds_compat": "engine API (ds_compat)", "trainer": "trainer --deepspeed"}
LOSS_GOAL = 0.02  # mean relative loss error, bf16 (the reference: 1.618% over 2000 steps)
SPEED_GOAL = 1.0  # throughput ratio to DeepSpeed


def run_backend(args: argparse.Namespace, runner: Runner, backend: str, dtype: str, initial: Path) -> dict[str, Any]:
    """One `--steps` run of a backend: its ms per step, losses and grad norms (rank 0's view of the global ones)."""
    run_dir = args.out / "runs" / f"{dtype}_{backend}"
    label = f"{dtype} {DOOR_NAMES[backend]}: {args.steps} steps"
    started = time.perf_counter()
    if backend == "trainer":
        found = run_trainer(args, runner, initial, run_dir, False, label)
    else:
        found = run_worker(args, runner, backend, args.zero, dtype, run_dir, label)
    found["wall_s"] = time.perf_counter() - started
    return found


def compare(reference: dict[str, Any], door: dict[str, Any], warmup: int) -> dict[str, Any]:
    loss = errors(door["losses"], reference["losses"])
    grad = errors(door["grad_norms"], reference["grad_norms"])
    pairs = [(d, r) for d, r in zip(door["losses"], reference["losses"]) if d is not None and r is not None]
    ms_ref = statistics.fmean(reference["ms"][warmup:])
    ms_door = statistics.fmean(door["ms"][warmup:])
    return {
        "loss_mean_rel_err": loss["mean_rel"],
        "loss_max_rel_err": loss["max_rel"],
        "loss_mean_signed_diff": statistics.fmean(r - d for d, r in pairs),
        "loss_mean_abs_diff": statistics.fmean(abs(r - d) for d, r in pairs),
        "grad_norm_mean_rel_err": grad["mean_rel"],
        "grad_norm_max_rel_err": grad["max_rel"],
        "steps": loss["steps"],
        "ms_per_step": [ms_ref, ms_door],
        "throughput_ratio": ms_ref / ms_door,
    }


def verdict(dtype: str, row: dict[str, Any]) -> str:
    """bf16 is judged against the goals; fp32 is reported beside it."""
    if dtype != "bf16":
        return "reported"
    below = []
    if not row["loss_mean_rel_err"] < LOSS_GOAL:
        below.append(f"loss ≥ {LOSS_GOAL:.0%}")
    if not row["throughput_ratio"] >= SPEED_GOAL:
        below.append(f"throughput < {SPEED_GOAL}× DeepSpeed")
    return "pass" if not below else "below: " + ", ".join(below)


def markdown(report: dict[str, Any]) -> str:
    columns = ("dtype", "door", "loss mean rel err", "loss max rel err", "grad-norm mean / max rel err",
               "ms/step DeepSpeed → door", "throughput × DeepSpeed", "goal")  # fmt: skip
    cells = [
        [dtype, DOOR_NAMES[door], f"{r['loss_mean_rel_err'] * 100:.4f}%", f"{r['loss_max_rel_err'] * 100:.4f}%",
         f"{r['grad_norm_mean_rel_err'] * 100:.4f}% / {r['grad_norm_max_rel_err'] * 100:.4f}%",
         f"{r['ms_per_step'][0]:.1f} → {r['ms_per_step'][1]:.1f}", f"{r['throughput_ratio']:.3f}×", r["verdict"]]
        for dtype, rows in report["rows"].items() for door, r in rows.items()
    ]  # fmt: skip
    title = f"Against DeepSpeed: {report['steps']} steps, ZeRO-{report['zero']}, {report['ranks']} ranks"
    command = f"Command: `{' '.join(report['command'][2:])}`; wall time {report['wall_s'] / 60:.1f} min."
    return "\n".join(md_report(title, columns, cells, report["notes"], intro=[command])) + "\n"


def charts(report: dict[str, Any], runs: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """plots/parity_<dtype>_<door>.png: the loss comparison of each door against DeepSpeed."""
    from glm45v_fsdp.bench.charts import loss_comparison_chart

    def plot(dtype: str, door: str) -> Any:
        reference, test = runs[dtype]["deepspeed"]["losses"], runs[dtype][door]["losses"]
        title = (
            f"DeepSpeed vs {DOOR_NAMES[door]}, {dtype}, ZeRO-{report['zero']}, {report['ranks']} ranks, "
            f"{report['steps']} steps"
        )
        steps = list(range(1, min(len(reference), len(test)) + 1))
        return lambda path: loss_comparison_chart(
            steps, reference, test, "DeepSpeed", f"this backend: {DOOR_NAMES[door]}", title, path
        )

    return {f"plots/parity_{dtype}_{door}.png": plot(dtype, door) for dtype in runs for door in DOORS}


def run_parity(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    bench = runner(args, "bench parity")
    for index, dtype in enumerate(args.dtypes):
        initial = initial_weights(args, bench, args.zero, dtype, args.out / "initial" / f"zero{args.zero}_{dtype}")
        order = ("deepspeed", *DOORS) if index % 2 == 0 else (*reversed(DOORS), "deepspeed")  # drift hits all
        runs[dtype] = {backend: run_backend(args, bench, backend, dtype, initial) for backend in order}
    rows = {}
    for dtype, by_backend in runs.items():
        rows[dtype] = {}
        for door in DOORS:
            row = compare(by_backend["deepspeed"], by_backend[door], args.warmup)
            row["verdict"] = verdict(dtype, row)
            rows[dtype][door] = row
    report = {
        **report_head("parity", args, "steps", "zero", "ranks", "warmup"),
        "wall_s": time.perf_counter() - started,
        "rows": rows,
        "notes": [
            "workload: the DeepSpeed-API script of `bench deepspeed` (transformers' tiny GLM-4.5V: 2 text layers, 8 "
            f"routed experts top-2, a 2-block vision tower), micro batch {args.micro} per rank, 256 text tokens and "
            "one 112 px image per sample, every step new samples in the same order on every backend; the reference's "
            f"acceptance schedule: AdamW lr {args.lr:g}, 10% linear warmup then cosine to 0 over the run (the "
            "ds_config's WarmupCosineLR, which the trainer door follows step by step), no weight decay, betas "
            "0.9/0.95; clipping 1.0; the same initial weights (the trainer loads them from an HF checkpoint the "
            "script wrote).",
            "bf16: DeepSpeed's bf16 mode (bf16 weights and activations, fp32 master weights in its optimizer) against "
            "this backend's bf16 compute with fp32 parameters and reductions; fp32 on both sides beside it.",
            "loss: the mean of the ranks' losses per step; errors over every step (none dropped), relative to "
            "DeepSpeed: mean(|door − DeepSpeed| / (|DeepSpeed| + 1e-8)). Signed difference: DeepSpeed − door.",
            f"ms/step: mean of steps {args.warmup + 1}–{args.steps} of one run per backend, run back to back (the "
            "order reversed for the second dtype, so a drift of the machine's speed does not favour one side); the "
            "trainer's leaves out its batch fetch, which the script does before its timed loop.",
            f"OMP_NUM_THREADS per rank: {args.threads}.",
        ],
        "losses": {dtype: {b: r["losses"] for b, r in by_backend.items()} for dtype, by_backend in runs.items()},
        "grad_norms": {
            dtype: {b: r["grad_norms"] for b, r in by_backend.items()} for dtype, by_backend in runs.items()
        },
        "ms": {dtype: {b: r["ms"] for b, r in by_backend.items()} for dtype, by_backend in runs.items()},
    }
    write_report(args.out, "parity", report, markdown(report), charts(report, runs))
    return report


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("parity", help=HELP, description=DESCRIPTION)
    add_options(parser, steps=2000)
    parser.add_argument("--dtype", default="bf16,fp32", help="bf16 and/or fp32, comma-separated (bf16 is judged)")
    parser.add_argument(
        "--zero",
        type=int,
        choices=(0, 1, 2, 3),
        default=3,
        help="ZeRO stage of the ds_config (3: what a 106B job runs, and what FSDP2's full sharding is)",
    )
    add_options(parser, ranks=2, micro=2, warmup=10)
    parser.add_argument("--lr", type=float, default=1e-5, help="peak lr of the warmup-cosine schedule")
    add_options(parser, out=Path("output/bench/parity"), run_timeout=None, threads=1)


def main_parity(args: argparse.Namespace, argv: list[str]) -> int:
    require_deepspeed("parity")
    from glm45v_fsdp.bench.charts import require_matplotlib

    require_matplotlib()
    args.dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    if not args.dtypes or any(d not in ("bf16", "fp32") for d in args.dtypes):
        raise UserError(f"bench parity: --dtype {args.dtype!r}: choose bf16 and/or fp32, comma-separated.")
    if not 0 <= args.warmup < args.steps or args.ranks < 1 or args.micro < 1:
        raise UserError(
            f"bench parity: need 0 <= --warmup < --steps, --ranks >= 1 and --micro >= 1; got --warmup {args.warmup}, "
            f"--steps {args.steps}, --ranks {args.ranks}, --micro {args.micro}."
        )
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    args.profile, args.argv, args.schedule = False, argv, "cosine"
    report = run_parity(args)
    below = [
        f"{door} ({row['verdict']})" for door, row in report["rows"].get("bf16", {}).items() if row["verdict"] != "pass"
    ]
    if below:
        print(f"bench parity: bf16 below the goal: {', '.join(below)}")
    return 0
