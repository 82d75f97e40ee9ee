"""The one runner behind the `bench` subcommands: it starts each training run in its own process, reads the run's
`metrics.jsonl`, computes the statistics every report uses and writes a report's markdown, JSON and charts.

The scenarios (this package's `memory`, `ep`, `longest`, `deepspeed_api`, `door`, `ops`, `matrix`, `parity`,
`plan_validation`) only say which runs to make and which rows to compare; how a run is started, timed and read, what a
loss error, a percentile, a saving or a throughput change is, and how the outputs are written, lives here once.

Definitions (the reference report's §3.3):
  - loss mean relative error = mean(|test - ref| / (|ref| + 1e-8)) over step-aligned pairs (a skipped step's null
    loss has no pair); max relative error and max absolute error over the same pairs;
  - samples/s = global batch x 1000 / ms/iter, where ms/iter is the window's mean (`stat="mean"`, the reference's)
    or median (`stat="median"`, the robust figure `bench memory` and `bench ep` report);
  - throughput change = (on / off - 1) x 100 of samples/s; time cost = (on / off - 1) x 100 of ms/iter;
  - memory saving = (off - on) / off x 100 (negative: more memory), on the max-rank and the avg-rank peak, where a
    rank's peak is its largest over all steps (and repeats).
"""

from __future__ import annotations

import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glm45v_fsdp.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[2]
REL_EPS = 1e-8  # the reference's denominator guard
# The mean relative loss error an exact switch must stay within in fp32 (the reference: every switch < 0.001%).
PARITY_LIMIT = 1e-5


# ----------------------------------------------------------------------------------------------------------------
# Starting runs
# ----------------------------------------------------------------------------------------------------------------


def torchrun_command(ranks: int, module: str, arguments: list[str], bind_cores: bool = False) -> list[str]:
    """`python -m torch.distributed.run` on `ranks` local processes (free rendezvous port) running `-m module`;
    `bind_cores`: each rank pinned to its share of the cores by numactl, as DeepSpeed's launcher pins them under
    `--bind_cores_to_rank` (ds_compat/utils/numa.py, which also sets OMP_NUM_THREADS to the rank's core count)."""
    from glm45v_fsdp.runtime.dist import free_port  # here: the commands' --help answers before torch is imported

    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={ranks}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{free_port()}",
    ]
    if bind_cores:
        launch += ["--no-python", sys.executable, "-m", "ds_compat.utils.numa", "--", sys.executable]
    return [*launch, "-m", module, *arguments]


def train_command(ranks: int, overrides: list[str]) -> list[str]:
    """Our trainer with `overrides`: one plain process at 1 rank, torchrun above."""
    if ranks == 1:
        return [sys.executable, "-m", "glm45v_fsdp.train", *overrides]
    return torchrun_command(ranks, "glm45v_fsdp.train", overrides)


def child_env(threads: int | None) -> dict[str, str]:
    """This process's environment without a launcher's rank variables (the child is its own job); `threads` sets
    OMP_NUM_THREADS (torch's intra-op threads per process)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_", "WORLD_", "MASTER_", "SLURM_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def load1() -> float:
    """The machine's 1-minute load average (nan where the OS has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return float("nan")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def read_records(output_dir: Path) -> list[dict]:
    """A training run's step records (`metrics.jsonl`, one JSON object per step; its eval records left out)."""
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [record for record in records if "eval_loss" not in record]


def read_json(path: Path) -> Any:
    """A result file a run wrote (a worker's result.json, a profile summary)."""
    return json.loads(Path(path).read_text())


def execute(
    name: str,
    command: list[str],
    output_dir: Path,
    timeout: float | None,
    threads: int | None = None,
    bench: str = "bench",
    records: bool = True,
) -> tuple[list[dict], float, float]:
    """Run one process; its stdout/stderr go to <output_dir>/train.log. Returns its step records (none with
    records=False: a process that writes its own result), its wall seconds and its CPU seconds (user + sys of it and
    its children). A failure or a timeout is a UserError naming the run and quoting the log's last lines."""
    output_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    cpu_started = _children_cpu_s()
    with (output_dir / "train.log").open("w") as log:
        log.write(" ".join(command) + "\n\n")
        log.flush()
        try:
            result = subprocess.run(
                command, cwd=REPO_ROOT, env=child_env(threads), stdout=log, stderr=subprocess.STDOUT, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            raise UserError(
                f"{bench}: run '{name}' did not finish within --run-timeout {timeout:.0f} s; see "
                f"{output_dir / 'train.log'}. Lower --steps or --tokens, or raise --run-timeout."
            ) from None
    if result.returncode != 0:
        tail = (output_dir / "train.log").read_text().splitlines()[-25:]
        raise UserError(
            f"{bench}: run '{name}' failed (exit status {result.returncode}); last lines of "
            f"{output_dir / 'train.log'}:\n" + "\n".join(tail)
        )
    found = read_records(output_dir) if records else []
    return found, time.perf_counter() - started, _children_cpu_s() - cpu_started


@dataclass
class Run:
    """One configuration's runs (one per repeat) as they came back: step records (a training run's metrics.jsonl)
    or results (a worker's own result.json), wall and CPU seconds (user + sys of the ranks, start-up included:
    insensitive to waiting for a busy CPU, unlike ms/iter) and the machine's 1-minute load before and after each."""

    name: str
    overrides: list[str] = field(default_factory=list)
    repeats: list[list[dict]] = field(default_factory=list)
    results: list[dict] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    load_avg: list[list[float]] = field(default_factory=list)

    @property
    def records(self) -> list[dict]:
        """The first repeat's records: what losses are compared on."""
        return self.repeats[0]


class Runner:
    """Starts every run of one bench: each in its own process under `out/runs/<name>[.rK]` (or a directory the
    bench names), training runs on `ranks` processes, with `threads` intra-op threads each and `timeout` seconds
    allowed."""

    def __init__(self, bench: str, out: Path, ranks: int, threads: int | None, timeout: float | None) -> None:
        self.bench, self.out, self.ranks, self.threads, self.timeout = bench, out, ranks, threads, timeout

    def run_dir(self, name: str, repeat: int = 0) -> Path:
        return self.out / "runs" / (name if repeat == 0 else f"{name}.r{repeat + 1}")

    def launch(self, run: Run, command: list[str], run_dir: Path, label: str = "", reads: str = "metrics") -> None:
        """One process of `run`: what it wrote goes to `run` by `reads` ("metrics": the trainer's step records into
        run.repeats; "result": a worker's <run_dir>/result.json into run.results; "nothing")."""
        assert reads in ("metrics", "result", "nothing"), reads
        before = load1()
        print(f"{label or run.name}, load {before:.2f} ...", flush=True)
        records, wall, cpu = execute(
            run.name, command, run_dir, self.timeout, self.threads, bench=self.bench, records=reads == "metrics"
        )
        if reads == "metrics":
            run.repeats.append(records)
        elif reads == "result":
            run.results.append(read_json(run_dir / "result.json"))
        run.load_avg.append([before, load1()])
        run.wall_s.append(round(wall, 1))
        run.cpu_s.append(round(cpu, 1))

    def train(self, run: Run, overrides: list[str], run_dir: Path, label: str = "", ranks: int | None = None) -> None:
        """One training run of `run` (its overrides already in `overrides`, with training.output_dir=run_dir) on
        `ranks` processes (default: the runner's)."""
        self.launch(run, train_command(ranks or self.ranks, overrides), run_dir, label)

    def rounds(
        self,
        plans: dict[str, Callable[[Path], list[str]]],
        repeats: int,
        alternate: bool = False,
    ) -> dict[str, Run]:
        """Every plan `repeats` times, round-robin over the plans so a drift in machine speed hits all alike
        (`alternate`: every other round in reverse order, ABBA). A plan maps its run directory to its overrides."""
        runs = {name: Run(name, make(self.run_dir(name))) for name, make in plans.items()}
        total, count = len(plans) * repeats, 0
        for repeat in range(repeats):
            order = list(plans) if not (alternate and repeat % 2) else list(reversed(plans))
            for name in order:
                count += 1
                run_dir = self.run_dir(name, repeat)
                label = f"[{count}/{total}] {name} (repeat {repeat + 1}/{repeats})"
                self.train(runs[name], plans[name](run_dir), run_dir, label=label)
        return runs


# ----------------------------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------------------------


def loss_pairs(test: Sequence[float | None], ref: Sequence[float | None]) -> list[tuple[float, float]]:
    """Step-aligned (test, ref) pairs over the common steps, leaving out steps where either side is null."""
    return [(t, r) for t, r in zip(test, ref) if t is not None and r is not None]


def relative_errors(test: Sequence[float | None], ref: Sequence[float | None]) -> list[float]:
    """|test - ref| / (|ref| + 1e-8) per step-aligned pair, null steps left out."""
    return [abs(t - r) / (abs(r) + REL_EPS) for t, r in loss_pairs(test, ref)]


def errors(test: Sequence[float | None], ref: Sequence[float | None]) -> dict[str, float]:
    """Mean and max relative error (fractions, not %) and max absolute error of test against ref."""
    pairs = loss_pairs(test, ref)
    if not pairs:
        nan = float("nan")
        return {"mean_rel": nan, "max_rel": nan, "max_abs": nan, "steps": 0}
    rel = relative_errors(test, ref)
    return {
        "mean_rel": statistics.fmean(rel),
        "max_rel": max(rel),
        "max_abs": max(abs(t - r) for t, r in pairs),
        "steps": len(pairs),
    }


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between order statistics (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def timing(records: Sequence[dict], stat: str = "mean") -> dict[str, float]:
    """ms/iter (mean or median), P95, P99, samples/s and tokens/s (non-padding) of `records` (a stats window)."""
    ms = [r["ms_per_iter"] for r in records]
    centre = statistics.fmean(ms) if stat == "mean" else statistics.median(ms)
    tokens = statistics.fmean(r["tokens"] for r in records)
    return {
        "ms_per_iter": centre,
        "p95_ms": percentile(ms, 95),
        "p99_ms": percentile(ms, 99),
        "samples_per_s": records[-1]["global_batch_size"] * 1000.0 / centre,
        "tokens_per_s": tokens * 1000.0 / centre,
        "steps": len(ms),
    }


def rank_peaks(repeats: Sequence[Sequence[dict]]) -> dict[str, Any]:
    """Each rank's peak over all steps and repeats (GiB), and their max and mean."""
    ranks = len(repeats[0][0]["mem_peak_per_rank_gib"])
    per_rank = [max(r["mem_peak_per_rank_gib"][i] for records in repeats for r in records) for i in range(ranks)]
    return {"per_rank": per_rank, "max": max(per_rank), "avg": statistics.fmean(per_rank)}


def change_pct(on: float, off: float) -> float:
    """(on / off - 1) x 100: a throughput change of samples/s, or a time cost of ms/iter."""
    return (on / off - 1.0) * 100.0 if off else float("nan")


def saving_pct(off: float, on: float) -> float:
    """(off - on) / off x 100: positive when ON needs less."""
    return (off - on) / off * 100.0 if off > 0 else float("nan")


def run_figures(run: Run, first_step: int, stat: str) -> dict[str, Any]:
    """A configuration's standard figures: the first repeat's losses and grad norms, the timing of the steps from
    `first_step` on over all repeats (`stat`: mean or median ms/iter), each rank's peak over all steps and repeats."""
    timed = [r for records in run.repeats for r in records if r["step"] >= first_step]
    peaks = rank_peaks(run.repeats)
    return {
        "name": run.name,
        "overrides": run.overrides,
        "losses": [r["loss"] for r in run.records],
        "grad_norms": [r.get("grad_norm") for r in run.records],
        "ms_timed": [r["ms_per_iter"] for r in timed],
        **timing(timed, stat),
        "global_batch_size": run.records[-1]["global_batch_size"],
        "mem_peak_max_gib": peaks["max"],
        "mem_peak_avg_gib": peaks["avg"],
        "mem_peak_per_rank_gib": peaks["per_rank"],
        "cpu_s": run.cpu_s,
        "wall_s": run.wall_s,
        "load_avg": run.load_avg,
    }


def pair_figures(off: dict[str, Any], on: dict[str, Any]) -> dict[str, Any]:
    """What every OFF -> ON row reports from two configurations' figures: the loss errors of ON against OFF, ms/iter
    and samples/s off -> on, the throughput change and the time cost."""
    loss = errors(on["losses"], off["losses"])
    return {
        "off_run": off["name"],
        "on_run": on["name"],
        "loss_mean_rel_err": loss["mean_rel"],
        "loss_max_rel_err": loss["max_rel"],
        "loss_max_abs_err": loss["max_abs"],
        "loss_steps": loss["steps"],
        "ms_per_iter": [off["ms_per_iter"], on["ms_per_iter"]],
        "samples_per_s": [off["samples_per_s"], on["samples_per_s"]],
        "throughput_change_pct": change_pct(on["samples_per_s"], off["samples_per_s"]),
        "time_cost_pct": change_pct(on["ms_per_iter"], off["ms_per_iter"]),
    }


def memory_pair(off: dict[str, Any], on: dict[str, Any]) -> dict[str, Any]:
    """The peak-memory columns of an OFF -> ON row from two figure dicts holding mem_peak_max_gib / _avg_gib."""
    off_max, on_max, off_avg, on_avg = (d[k] for k in ("mem_peak_max_gib", "mem_peak_avg_gib") for d in (off, on))
    return {
        "peak_max_gib": [off_max, on_max],
        "peak_avg_gib": [off_avg, on_avg],
        "saving_max_pct": saving_pct(off_max, on_max),
        "saving_avg_pct": saving_pct(off_avg, on_avg),
    }


def load_range(runs: Iterable[Run]) -> str:
    """The machine's 1-minute load around the runs, as 'low–high'."""
    loads = [value for run in runs for pair in run.load_avg for value in pair]
    return f"{min(loads):.2f}–{max(loads):.2f}" if loads else "n/a"


# ----------------------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------------------


def md_table(columns: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """A markdown table's lines."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def md_report(
    title: str,
    columns: Sequence[str],
    rows: Iterable[Sequence[str]],
    notes: Sequence[str] = (),
    intro: Sequence[str] = (),
) -> list[str]:
    """A report's markdown lines: the '# title', each `intro` paragraph, the table, then the notes as a list."""
    lines = [f"# {title}", ""]
    for paragraph in intro:
        lines += [paragraph, ""]
    lines += md_table(columns, rows)
    return lines + (["", *[f"- {note}" for note in notes]] if notes else [])


def write_report(
    out: Path,
    stem: str,
    report: dict[str, Any],
    text: str,
    charts: dict[str, Callable[[Path], Any]] | None = None,
    bench: str | None = None,
) -> list[Path]:
    """<out>/<stem>.json and .md, then each chart (file name -> a function drawing it to that path); prints the
    markdown and what was written. Returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / f"{stem}.json", out / f"{stem}.md"]
    written[0].write_text(json.dumps(report, indent=2) + "\n")
    written[1].write_text(text)
    for name, draw in (charts or {}).items():
        draw(out / name)
        written.append(out / name)
    print(text)
    print(f"{bench or 'bench ' + stem}: wrote {', '.join(str(path) for path in written)}")
    return written
