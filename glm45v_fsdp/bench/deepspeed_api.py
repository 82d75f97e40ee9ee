"""`python -m glm45v_fsdp.tools.bench deepspeed`: one DeepSpeed workload on the real DeepSpeed and on both doors.

The workload is transformers' tiny GLM-4.5V with the same weights and batches everywhere (bench_deepspeed_worker.py):
  - deepspeed: the DeepSpeed-API script on the real DeepSpeed (`torchrun -m glm45v_fsdp.bench.deepspeed_api_worker`);
  - ds_compat: the same script with `import ds_compat as deepspeed` (the engine API door);
  - trainer: our trainer behind `--deepspeed ds_config.json` (the same ds_config, the worker's initial weights loaded
    from an HF checkpoint, the same batches unshuffled);
  - bare: the same step in one process without any backend, once per dtype and round (the per-rank rate to reach);
  - ddp: the same step on every rank under torch DDP, once per dtype and round: what plain data parallelism reaches of
    the bare rate on this machine (the yardstick for the bare-loop goal);
  - alternate: the bare step and the engine's (ZeRO-2, 1 rank) alternated step by step in one process, once per dtype
    and round: what the backend costs apart from communication, free of the machine's drift between runs.
For every (ZeRO stage, dtype) the three run back to back in an order rotated from round to round, so a drift in
machine speed hits all; `--rounds` repeats the whole set. The figures per row: median ms/step of the steps after
`--warmup` (per round, then the median over rounds), samples/s, each door's throughput ratio to DeepSpeed per round
and its share of the bare loop's rate, the peak of live tensor bytes per rank (max over ranks), and each door's loss
mean relative error against DeepSpeed. `--profile` adds torch.profiler's top ops of the worker runs' first round.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from glm45v_fsdp.bench.charts import bar_chart
from glm45v_fsdp.bench.options import add_options, report_head
from glm45v_fsdp.bench.runner import Run, Runner, errors, torchrun_command, write_report
from glm45v_fsdp.errors import UserError

HELP = "the real DeepSpeed vs ds_compat on one DeepSpeed-API script (transformers' tiny GLM-4.5V)"
DESCRIPTION = "DeepSpeed and ds_compat runs interleaved per ZeRO stage and dtype."

BACKENDS = ("deepspeed", "ds_compat", "trainer")  # the reference, the engine API door, the trainer door
DOORS = BACKENDS[1:]
PARITY_LIMIT = {"fp32": 1e-5, "bf16": 1e-2}
BARE_GOAL = 0.8  # ZeRO-1/2: at least this share of the bare loop's per-rank rate


# The workload's shape: the worker's defaults (bench/deepspeed_api_worker.py); the trainer door runs the same.
WORKLOAD = {"text_layers": 2, "text_tokens": 256, "image_size": 112}


def workload_overrides(args: argparse.Namespace, world: int) -> list[str]:
    """Our config keys for the model and the data of this workload (the trainer door runs with the same ones)."""
    return [
        f"model.config_overrides.text_config.num_hidden_layers={args.text_layers}",
        f"data.synthetic_text_tokens={args.text_tokens}",
        f"data.synthetic_image_size={args.image_size}",
        "data.synthetic_images_per_sample=1",
        "data.synthetic_video_every=0",  # the reference runs transformers' forward: no sample with both
        *sample_overrides((args.first_step + args.steps + 1) * args.micro * world, getattr(args, "eval_split", None)),
        *long_sample_overrides(getattr(args, "cutoff_len", None)),
    ]


def sample_overrides(training_samples: int, eval_split: float | None) -> list[str]:
    """Synthetic samples enough for `training_samples` to train on; with `eval_split` that fraction more is held
    out as validation data (data.validation_split), the same samples for every door (bench door's trainer evals)."""
    if not eval_split:
        return [f"data.synthetic_samples={training_samples}"]
    total = math.ceil(training_samples / (1 - eval_split)) + 1
    return [f"data.synthetic_samples={total}", f"data.validation_split={eval_split}"]


def long_sample_overrides(cutoff_len: int | None) -> list[str]:
    """Samples cut at `cutoff_len` tokens (None: the config's 1024), with rotary positions that reach that far."""
    if not cutoff_len:
        return []
    text = "model.config_overrides.text_config"
    return [f"data.cutoff_len={cutoff_len}", f"{text}.max_position_embeddings={max(4096, cutoff_len)}"]


def schedule_arguments(args: argparse.Namespace) -> list[str]:
    """The worker's lr and schedule when the caller sets them (bench parity); bench deepspeed keeps the worker's
    constant 1e-4."""
    schedule = getattr(args, "schedule", None)
    return [f"--lr={args.lr}", f"--schedule={schedule}"] if schedule else []


def extra_arguments(args: argparse.Namespace) -> list[str]:
    """The keys a caller adds to the worker's ds_config (bench door: the ones that switch a plan), as JSON."""
    extra = getattr(args, "ds_extra", None)
    return [f"--ds-extra={json.dumps(extra)}"] if extra else []


def worker_command(args: argparse.Namespace, backend: str, zero: int, dtype: str, out: Path) -> list[str]:
    arguments = [f"--backend={backend}", f"--zero={zero}", f"--dtype={dtype}", f"--steps={args.steps}"]
    arguments += [f"--micro={args.micro}", f"--out={out}", f"--world-size={args.ranks}"]
    arguments += ["--profile"] if args.profile else []
    for option in ("text_tokens", "text_layers", "cutoff_len", "eval_split"):  # a caller's workload (bench door)
        arguments += [f"--{option.replace('_', '-')}={getattr(args, option)}"] if getattr(args, option, None) else []
    arguments += [*schedule_arguments(args), *extra_arguments(args)]
    if backend in ("bare", "alternate"):  # one process
        return [sys.executable, "-m", "glm45v_fsdp.bench.deepspeed_api_worker", *arguments]
    bind_cores = getattr(args, "bind_cores", False)  # bench lora --bind-cores
    return torchrun_command(args.ranks, "glm45v_fsdp.bench.deepspeed_api_worker", arguments, bind_cores)


def runner(args: argparse.Namespace, bench: str) -> Runner:
    return Runner(bench, args.out, args.ranks, args.threads, args.run_timeout)


def initial_weights(args: argparse.Namespace, runner: Runner, zero: int, dtype: str, directory: Path) -> Path:
    """The workload's initial weights (HF safetensors) and its ds_config, written by the worker for the trainer."""
    if not (directory / "ds_config.json").exists():
        command = [sys.executable, "-m", "glm45v_fsdp.bench.deepspeed_api_worker", "--backend=bare"]
        command += [f"--zero={zero}", f"--dtype={dtype}", f"--steps={args.steps}", f"--micro={args.micro}"]
        command += [f"--world-size={args.ranks}", f"--save-initial={directory}"]
        command += [*schedule_arguments(args), *extra_arguments(args)]
        runner.launch(Run(f"initial weights {directory.name}"), command, directory, reads="nothing")
    return directory


def trainer_command(args: argparse.Namespace, initial: Path, run_dir: Path, track_memory: bool) -> list[str]:
    """Our trainer behind `--deepspeed` on the worker's model (its saved initial weights) and batches (the same
    workload keys, unshuffled: the sampler's rank-major chunks are the worker's batches); the ds_config's constant lr
    (no scheduler), as DeepSpeed keeps it."""
    eval_split = getattr(args, "eval_split", None)
    workload = argparse.Namespace(**WORKLOAD, steps=args.steps, micro=args.micro, first_step=0, eval_split=eval_split)
    overrides = [
        *workload_overrides(workload, args.ranks),
        "data.shuffle=false",
        f"training.train_iters={3 if track_memory else args.steps}",
        f"training.load={initial}",
        f"training.output_dir={run_dir}",
        "training.lr_scheduler=constant",
        "training.lr_warmup_ratio=0",
        "training.min_lr=0",  # the YAML's floor would exceed a ds_config lr below it (bench parity's 1e-5)
        f"training.log_interval={args.steps}",
        "training.progress_bar=false",
        f"training.track_memory={str(track_memory).lower()}",
        *(["training.eval_interval=0", "training.eval_iters=1"] if eval_split else []),  # evals: after the last step
    ]
    arguments = ["--deepspeed", str(initial / "ds_config.json"), *overrides]
    return torchrun_command(args.ranks, "glm45v_fsdp.train", arguments)


def run_trainer(
    args: argparse.Namespace, runner: Runner, initial: Path, run_dir: Path, track_memory: bool, label: str = ""
) -> dict[str, Any]:
    """One trainer run as the worker's result: loss per step from metrics.jsonl, ms per step without the time spent
    fetching the batches (the worker's script builds its batches before the timed loop; `ms_with_data` keeps the
    whole step), the tracked peak (3 steps)."""
    run = Run(f"trainer {run_dir.name}" + (" memory" if track_memory else ""))
    runner.launch(run, trainer_command(args, initial, run_dir, track_memory), run_dir, label)
    records = run.records
    return {
        "ms": [r["ms_per_iter"] - r["data_ms"] for r in records],
        "ms_with_data": [r["ms_per_iter"] for r in records],
        "losses": [r["loss"] for r in records],
        "grad_norms": [r["grad_norm"] for r in records],
        "peak_bytes_max": records[-1]["mem_peak_max_gib"] * 2**30,
        "profile": None,
    }


def _mean_rel_err(ours: list[float], reference: list[float]) -> float:
    return errors(ours, reference)["mean_rel"]


def _below(result: dict[str, Any], door: str, goal: float) -> list[str]:
    """The goals a door misses in one row, each named, so a row below one goal still shows the others it meets."""
    below = []
    if result["loss_mean_rel_err"][door] > PARITY_LIMIT[result["dtype"]]:
        below.append("loss parity")
    if result["throughput_ratio"][door] < goal:
        below.append(f"{goal}× DeepSpeed")
    if result["zero"] in (1, 2) and result["bare_rate_ratio"][door] < BARE_GOAL:
        below.append(f"{BARE_GOAL} bare")
    return below


def row(
    zero: int,
    dtype: str,
    runs: dict[str, list[dict]],
    bare_ms: list[float],
    ddp_ms: list[float],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One (stage, dtype): medians per backend and round, each door's ratio to DeepSpeed per round (and each
    backend's share of the bare loop's per-rank rate, DDP's alongside), the loss parity of the first round."""
    ms = {b: [statistics.median(run["ms"][args.warmup :]) for run in runs[b]] for b in BACKENDS}
    ratios = {door: [ds / ours for ds, ours in zip(ms["deepspeed"], ms[door])] for door in DOORS}
    bare = {b: [one / ours for one, ours in zip(bare_ms, ms[b])] for b in BACKENDS}
    loss_errors = {door: _mean_rel_err(runs[door][0]["losses"], runs["deepspeed"][0]["losses"]) for door in DOORS}
    goal = 1.6 if zero == 3 else 1.0
    result = {
        "zero": zero,
        "dtype": dtype,
        "ms_per_step": {b: statistics.median(ms[b]) for b in BACKENDS},
        "ms_per_round": ms,
        "bare_ms_per_step": statistics.median(bare_ms),
        "trainer_ms_with_data": statistics.median(
            statistics.median(run["ms_with_data"][args.warmup :]) for run in runs["trainer"]
        ),
        "samples_per_s": {b: args.micro * args.ranks * 1000.0 / statistics.median(ms[b]) for b in BACKENDS},
        "throughput_ratio": {door: statistics.median(ratios[door]) for door in DOORS},
        "ratio_per_round": ratios,
        "bare_rate_ratio": {b: statistics.median(bare[b]) for b in BACKENDS},
        "ddp_ms_per_step": statistics.median(ddp_ms),
        "ddp_bare_rate_ratio": statistics.median(one / ddp for one, ddp in zip(bare_ms, ddp_ms)),
        "peak_mib": {b: max(run["peak_bytes_max"] or 0.0 for run in runs[b]) / 2**20 for b in BACKENDS},
        "loss_mean_rel_err": loss_errors,
        "target": f"≥ {goal}× DeepSpeed" + (f", ≥ {BARE_GOAL} of the bare loop's rate" if zero in (1, 2) else ""),
    }
    result["below"] = {door: _below(result, door, goal) for door in DOORS}
    result["pass"] = {door: not result["below"][door] for door in DOORS}
    result["profile"] = {b: runs[b][0].get("profile") for b in BACKENDS}
    return result


def alone_row(dtype: str, runs: list[dict], args: argparse.Namespace) -> dict[str, Any]:
    """The engine's step time over the bare loop's with both in one process at 1 rank (steps alternated): < 1 means
    the backend's own work (hooks, copies, its optimizer step) costs less than the bare loop's, and so everything
    above the bare rate at 2 ranks is communication and waiting for the other rank."""
    ratios = [
        statistics.median(run["ms"][args.warmup :]) / statistics.median(run["bare_ms"][args.warmup :]) for run in runs
    ]
    return {
        "dtype": dtype,
        "engine_over_bare_ms": statistics.median(ratios),
        "per_round": ratios,
        "loss_mean_rel_err": _mean_rel_err(runs[0]["losses"], runs[0]["bare_losses"]),
    }


def _verdict(result: dict[str, Any], door: str) -> str:
    return "below " + ", ".join(result["below"][door]) if result["below"][door] else "pass"


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# DeepSpeed vs this backend's two doors, {report['ranks']} ranks, {report['rounds']} interleaved round(s)",
        "",
        "Doors: **engine** = the same DeepSpeed-API script with `import ds_compat as deepspeed`; **trainer** = "
        "`python -m glm45v_fsdp.train --deepspeed ds_config.json` on the same weights and batches; its ms/step "
        "leaves out fetching the batches, as the script builds them before its timed loop (in brackets: with the "
        "fetch, the trainer's `ms_per_iter`). Throughput ratio: "
        "DeepSpeed ms / door ms per round (> 1: faster than DeepSpeed); bare: the one-process loop's ms / door ms "
        "(the door's per-rank rate as a share of the bare loop's; in brackets DeepSpeed's and torch DDP's, what "
        "data parallelism itself reaches on this machine).",
        "",
        "| ZeRO | dtype | ms/step DeepSpeed · engine · trainer [with fetch] (bare loop) | engine / DeepSpeed "
        "(rounds) | trainer / DeepSpeed (rounds) | share of bare rate engine · trainer (DeepSpeed · DDP) | "
        "peak MiB/rank DeepSpeed · "
        "engine · trainer | loss rel err engine · trainer | target | engine | trainer |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        ms, peak, err = r["ms_per_step"], r["peak_mib"], r["loss_mean_rel_err"]
        rounds = {d: ", ".join(f"{x:.2f}" for x in r["ratio_per_round"][d]) for d in DOORS}
        ratio, bare = r["throughput_ratio"], r["bare_rate_ratio"]
        lines.append(
            f"| {r['zero']} | {r['dtype']} | {ms['deepspeed']:.1f} · {ms['ds_compat']:.1f} · {ms['trainer']:.1f} "
            f"[{r['trainer_ms_with_data']:.1f}] ({r['bare_ms_per_step']:.1f}) | "
            f"{ratio['ds_compat']:.2f}× ({rounds['ds_compat']}) | "
            f"{ratio['trainer']:.2f}× ({rounds['trainer']}) | {bare['ds_compat']:.2f} · {bare['trainer']:.2f} "
            f"({bare['deepspeed']:.2f} · {r['ddp_bare_rate_ratio']:.2f}) | "
            f"{peak['deepspeed']:.1f} · {peak['ds_compat']:.1f} · "
            f"{peak['trainer']:.1f} | {err['ds_compat']:.1e} · {err['trainer']:.1e} | {r['target']} | "
            f"{_verdict(r, 'ds_compat')} | {_verdict(r, 'trainer')} |"
        )
    lines += [
        "",
        "Apart from communication: the engine (ZeRO-2) and the bare loop in one process at 1 rank, steps alternated:",
        "",
        "| dtype | engine ms / bare ms (rounds) | loss rel err |",
        "|---|---|---|",
        *[
            f"| {a['dtype']} | {a['engine_over_bare_ms']:.2f} ({', '.join(f'{x:.2f}' for x in a['per_round'])}) | "
            f"{a['loss_mean_rel_err']:.1e} |"
            for a in report["alone"]
        ],
    ]
    lines += ["", *[f"- {note}" for note in report["notes"]], ""]
    for r in report["rows"]:
        for backend, table in r["profile"].items():
            if table:
                lines += [f"Profile, ZeRO {r['zero']} {r['dtype']}, {backend} (steps 6-10):", "```", table, "```", ""]
    return "\n".join(lines)


def chart(report: dict[str, Any], path: Path) -> None:
    groups = [(f"ZeRO-{r['zero']} {r['dtype']}: samples/s", [r["samples_per_s"][b] for b in BACKENDS])
              for r in report["rows"]]  # fmt: skip
    notes = [
        f"engine {r['throughput_ratio']['ds_compat']:.2f}x, trainer {r['throughput_ratio']['trainer']:.2f}x"
        for r in report["rows"]
    ]
    bar_chart(
        groups,
        series=("DeepSpeed", "engine API", "trainer --deepspeed"),
        title=f"DeepSpeed vs ds_compat - {report['ranks']} ranks, CPU gloo",
        notes=notes,
        path=path,
    )


def run_worker(
    args: argparse.Namespace, runner: Runner, backend: str, zero: int, dtype: str, run_dir: Path, label: str
) -> dict[str, Any]:
    """One run of the DeepSpeed-API worker script (or its bare / DDP / alternate loops): the result it wrote."""
    run = Run(f"{backend} {run_dir.name}")
    runner.launch(run, worker_command(args, backend, zero, dtype, run_dir / "result.json"), run_dir, label, "result")
    return run.results[0]


def rotated_round(
    args: argparse.Namespace,
    bench: Runner,
    sides: dict[str, str],
    initial: Path,
    case: tuple[str, int, str],
    round_index: int,
) -> dict[str, dict[str, Any]]:
    """One round of a case's sides ({side: its label}), in an order rotated by the round so a drift in machine speed
    hits every side alike. `case` = (its name in the run folders and labels, ZeRO stage, dtype). A DeepSpeed-API
    side is one worker run; `trainer` is one trainer run, with its tracked peak from a separate 3-step run in the
    first round."""
    name, zero, dtype = case
    found = {}
    shift = round_index % len(sides)
    order = list(sides)[shift:] + list(sides)[:shift]
    for side in order:
        run_dir = args.out / "runs" / f"{name}_{side}_r{round_index + 1}"
        label = f"[round {round_index + 1}/{args.rounds}] {name} {sides[side]}"
        if side == "trainer":
            found[side] = run_trainer(args, bench, initial, run_dir, False, label)
            if round_index == 0:
                memory = run_trainer(args, bench, initial, run_dir / "memory", True, f"{label} memory")
                found[side]["peak_bytes_max"] = memory["peak_bytes_max"]
        else:
            found[side] = run_worker(args, bench, side, zero, dtype, run_dir, label)
    return found


def workload_note(args: argparse.Namespace, optimizer: str) -> str:
    """The report note on the script's workload and how ms/step is taken (bench deepspeed, bench door)."""
    return (
        f"workload: transformers' tiny GLM-4.5V (2 text layers, 8 routed experts, 2-block vision tower), micro batch "
        f"{args.micro} per rank, 256 text tokens + one 64-patch image per sample, {optimizer}, clipping 1.0; "
        f"ms/step: median of steps {args.warmup + 1}-{args.steps} per run, then over rounds"
    )


def notes(args: argparse.Namespace) -> list[str]:
    return [
        workload_note(args, "AdamW (torch_adam)") + ". Each round runs the three in a rotated order.",
        "FSDP2 unit size from the ds_config's bucket sizes (DeepSpeed's defaults here: reduce/all-gather 5e8 "
        "elements at stages 1-2, prefetch 5e7 at stage 3): on this model every block is below one unit, so the "
        "root is the only unit (one all-gather and one reduce-scatter per step).",
        "bare loop: the same model, batches of rank 0 and step in one process without any backend (plain "
        "foreach AdamW, clipping; bf16 under autocast). DDP: that step on every rank under "
        "torch.nn.parallel.DistributedDataParallel (gloo, 25 MB buckets overlapping the backward).",
        "peak: live tensor bytes of one extra untimed step (every tensor reachable at its start counts as "
        "live): DeepSpeed's figure includes its 5e8-element gradient bucket. Trainer: its own tracked peak "
        "(training.track_memory, parameters and optimizer state live) of a separate 3-step run.",
        f"OMP_NUM_THREADS per rank: {args.threads}.",
    ]


def run_deepspeed_bench(args: argparse.Namespace) -> dict[str, Any]:
    stages = [int(z) for z in args.zero.split(",")]
    dtypes = args.dtype.split(",")
    runs: dict[tuple[int, str], dict[str, list[dict]]] = {
        (z, d): {b: [] for b in BACKENDS} for z in stages for d in dtypes
    }
    references: dict[str, dict[str, list[float]]] = {r: {d: [] for d in dtypes} for r in ("bare", "ddp")}
    alone: dict[str, list[dict]] = {d: [] for d in dtypes}
    bench = runner(args, "bench deepspeed")
    for round_index in range(args.rounds):
        for dtype in dtypes:
            run_dir = args.out / "runs" / f"alternate_{dtype}_r{round_index + 1}"
            label = f"[round {round_index + 1}/{args.rounds}] bare and engine alternated, 1 rank, {dtype}"
            alone[dtype].append(run_worker(args, bench, "alternate", 2, dtype, run_dir, label))
            for reference, by_dtype in references.items():
                run_dir = args.out / "runs" / f"{reference}_{dtype}_r{round_index + 1}"
                label = f"[round {round_index + 1}/{args.rounds}] {reference} loop {dtype}"
                found = run_worker(args, bench, reference, 0, dtype, run_dir, label)
                by_dtype[dtype].append(statistics.median(found["ms"][args.warmup :]))
        for (zero, dtype), by_backend in runs.items():
            initial = initial_weights(args, bench, zero, dtype, args.out / "initial" / f"zero{zero}_{dtype}")
            case = (f"zero{zero}_{dtype}", zero, dtype)
            found = rotated_round(args, bench, {backend: backend for backend in BACKENDS}, initial, case, round_index)
            for backend in BACKENDS:
                by_backend[backend].append(found[backend])
    rows = [
        row(zero, dtype, by_backend, references["bare"][dtype], references["ddp"][dtype], args)
        for (zero, dtype), by_backend in runs.items()
    ]
    report = {
        **report_head("deepspeed", args, "ranks", "rounds"),
        "rows": rows,
        "alone": [alone_row(dtype, runs, args) for dtype, runs in alone.items()],
        "notes": notes(args),
    }
    write_report(args.out, "deepspeed", report, markdown(report), {"deepspeed.png": lambda path: chart(report, path)})
    return report


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("deepspeed", help=HELP, description=DESCRIPTION)
    parser.add_argument("--zero", default="1,2,3", help="ZeRO stages, comma-separated")
    parser.add_argument("--dtype", default="fp32", help="fp32 and/or bf16, comma-separated")
    add_run_arguments(parser, Path("output/bench/deepspeed"))


def add_run_arguments(parser: argparse.ArgumentParser, out: Path) -> None:
    """The options of the interleaved worker / trainer runs (bench deepspeed, bench door)."""
    add_options(parser, ranks=2, steps=20, warmup=5, micro=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="torch.profiler's top ops of steps 6-10 (the script)")
    add_options(parser, out=out, run_timeout=None, threads=1)


def require_deepspeed(bench: str) -> None:
    """The real DeepSpeed, the reference of `bench`, is installed; else a UserError naming the install."""
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        raise UserError(
            f"bench {bench}: the reference needs DeepSpeed: DS_BUILD_OPS=0 pip install --no-build-isolation "
            "'deepspeed>=0.19,<0.20' (CPU: DS_ACCELERATOR=cpu is set for the runs)."
        ) from None


def main_deepspeed(args: argparse.Namespace, argv: list[str]) -> int:
    require_deepspeed("deepspeed")
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
    below = [
        f"ZeRO {r['zero']} {r['dtype']} {door} ({', '.join(r['below'][door])})"
        for r in report["rows"]
        for door in DOORS
        if r["below"][door]
    ]
    if below:
        print(f"bench deepspeed: below target: {', '.join(below)}")
    return 0
