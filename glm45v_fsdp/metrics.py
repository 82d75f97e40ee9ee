"""Step metrics: the rank-0 progress bar and log line, metrics.jsonl, TensorBoard, and the end-of-run summary.

Definitions follow the reference report (§3.3): samples/s = global batch x 1000 / ms per iteration; tokens/s counts
non-padding tokens of the global batch; memory figures are per-rank peaks reduced to their max and mean.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from glm45v_fsdp.config import TrainingConfig
from glm45v_fsdp.errors import UserError

GIB = 1024**3
TENSORBOARD_GROUPS = (
    "data/",
    "router/",
)  # extra figures under these prefixes are TensorBoard scalars too (data.mixture's, the MoE routers')


@dataclass
class StepRecord:
    step: int
    loss: float
    grad_norm: float
    lr: float
    ms_per_iter: float
    samples_per_s: float
    tokens_per_s: float
    mem_peak_max_gib: float
    mem_peak_avg_gib: float
    global_batch_size: int
    tokens: int
    skipped: bool
    skipped_steps_total: int
    ms_per_iter_per_rank: list[float] = field(default_factory=list)
    mem_peak_per_rank_gib: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe dict: non-finite figures (a skipped step's loss) become null."""
        record = asdict(self)
        record.update(record.pop("extra"))
        return {
            key: None if isinstance(value, float) and not math.isfinite(value) else value
            for key, value in record.items()
        }


def format_line(record: StepRecord, total_steps: int, memory_kind: str) -> str:
    """The one line rank 0 prints per log interval."""
    memory = (
        f"mem peak {record.mem_peak_max_gib:.3f}/{record.mem_peak_avg_gib:.3f} GiB (max/avg, {memory_kind})"
        if memory_kind != "off"
        else "mem off"
    )
    skipped = f" | skipped {record.skipped_steps_total}" if record.skipped_steps_total else ""
    return (
        f"step {record.step}/{total_steps} | loss {record.loss:.6f} | grad norm {record.grad_norm:.4f} | "
        f"lr {record.lr:.3e} | {record.ms_per_iter:.1f} ms/iter | {record.samples_per_s:.2f} samples/s | "
        f"{record.tokens_per_s:.0f} tokens/s | {memory}{skipped}{_expert_load(record.extra)}{_router(record.extra)}"
    )


def _router(extra: dict[str, Any]) -> str:
    """The MoE routers' summary (model/router_health.py): the worst layer's expert load max/mean, dead experts."""
    if "router/worst_load_max_over_mean" not in extra:
        return ""
    return (
        f" | router max/mean {extra['router/worst_load_max_over_mean']:.2f} (layer "
        f"{extra['router/worst_load_layer']}), dead {100 * extra['router/dead_fraction']:.1f}%"
    )


def _expert_load(extra: dict[str, Any]) -> str:
    """Expert parallelism's EP rank load (max/mean), before -> after balance when a replica ran."""
    if "ep_load_max_over_mean_before" not in extra:
        return ""
    before, after = extra["ep_load_max_over_mean_before"], extra["ep_load_max_over_mean_after"]
    if not extra["ep_replicas"]:
        return f" | EP load max/mean {before:.2f}"
    return f" | EP load max/mean {before:.2f} -> {after:.2f} ({extra['ep_replicas']:.0f} replicas)"


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method), q in [0, 100]."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(records: list[StepRecord], start_step: int, memory_kind: str) -> dict[str, Any]:
    """Summary over the stats window (steps >= start_step, skipped steps included: they cost time too).

    Memory: the max over ranks of each rank's peak in the window, and the mean over ranks of those peaks, of the
    figure `memory_kind` names (null when it is "off": nothing was measured).
    """
    window = [r for r in records if r.step >= start_step]
    assert window, f"stats window starts at step {start_step}, after the last step {records[-1].step}"
    ms = [r.ms_per_iter for r in window]
    mean_ms = statistics.fmean(ms)
    global_batch = window[-1].global_batch_size
    rank_peaks = [max(step_peaks) for step_peaks in zip(*(r.mem_peak_per_rank_gib for r in window))]
    tokens = statistics.fmean(r.tokens for r in window)
    return {
        "window": [window[0].step, window[-1].step],
        "steps": len(window),
        "ms_per_iter_mean": mean_ms,
        "ms_per_iter_p95": percentile(ms, 95),
        "ms_per_iter_p99": percentile(ms, 99),
        "samples_per_s": global_batch * 1000.0 / mean_ms,
        "tokens_per_s": tokens * 1000.0 / mean_ms,
        "memory_figure": memory_kind,
        "mem_peak_max_gib": max(rank_peaks) if memory_kind != "off" else None,
        "mem_peak_avg_gib": statistics.fmean(rank_peaks) if memory_kind != "off" else None,
        "loss_first": records[0].loss,
        "loss_last": records[-1].loss,
        "skipped_steps": records[-1].skipped_steps_total,
    }


def format_summary(summary: dict[str, Any]) -> str:
    if summary["memory_figure"] == "off":
        memory = "mem off"
    else:
        memory = (
            f"mem peak {summary['mem_peak_max_gib']:.3f}/{summary['mem_peak_avg_gib']:.3f} GiB (max/avg, "
            f"{summary['memory_figure']})"
        )
    return (
        f"summary steps {summary['window'][0]}-{summary['window'][1]} ({summary['steps']}): "
        f"ms/iter mean {summary['ms_per_iter_mean']:.1f} P95 {summary['ms_per_iter_p95']:.1f} "
        f"P99 {summary['ms_per_iter_p99']:.1f} | {summary['samples_per_s']:.2f} samples/s | "
        f"{summary['tokens_per_s']:.0f} tokens/s | {memory} | loss {summary['loss_first']:.4f} -> "
        f"{summary['loss_last']:.4f} | skipped {summary['skipped_steps']}"
        + (f" | {summary['skipped_records']} bad record(s) skipped" if summary.get("skipped_records") else "")
    )


def check_outputs(training: TrainingConfig) -> None:
    """Fail on every rank, before any collective, if rank 0 could not write its outputs."""
    if training.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise UserError(
            "Config key 'training.tensorboard' = true but the tensorboard package is not installed. "
            "Install it (pip install 'glm45v-fsdp[tensorboard]') or set training.tensorboard=false."
        )
    check_writable_dir("training.output_dir", training.output_dir)


def check_writable_dir(key: str, value: str) -> None:
    """`value` (config key `key`) is a directory or can become one; nothing is left behind by the check."""
    path = Path(value).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise UserError(
            f"Config key '{key}' = '{value}' is an existing file, not a directory. Choose a directory path (it is "
            f"created when missing) or move the file away."
        )
    existing = next(parent for parent in (path, *path.parents) if parent.exists())
    try:  # a real probe: permission bits say little to root or on network file systems
        os.rmdir(tempfile.mkdtemp(prefix=".glm45v_probe_", dir=existing))
    except OSError as error:
        raise UserError(
            f"Config key '{key}' = '{value}' cannot be created: '{existing}' is not a writable directory "
            f"({error.strerror}). Choose a writable path for {key}."
        ) from None


def previous_run(output_dir: Path) -> str | None:
    """What an earlier run left in `output_dir` that a fresh run (not a resume) replaces, in words; None if nothing."""
    metrics = output_dir / "metrics.jsonl"
    if not metrics.is_file():
        return None
    steps = sum(1 for line in metrics.read_text().splitlines() if line.strip() and '"eval_loss"' not in line)
    finished = "finished (summary.json present)" if (output_dir / "summary.json").is_file() else "unfinished"
    return f"metrics.jsonl of {steps} step(s), {finished}"


class MetricsSink:
    """Rank 0's writers: metrics.jsonl (one record per step, and one per eval), summary.json and optional
    TensorBoard scalars."""

    def __init__(self, output_dir: Path, tensorboard: bool, continue_after_step: int = 0) -> None:
        """A fresh metrics.jsonl, or (a resumed run) the existing one cut after `continue_after_step`: records of
        a run that went further before it died are dropped, so the file stays one curve."""
        output_dir.mkdir(parents=True, exist_ok=True)
        self.path = output_dir / "metrics.jsonl"
        kept = []
        if continue_after_step and self.path.is_file():
            kept = [
                line for line in self.path.read_text().splitlines() if json.loads(line)["step"] <= continue_after_step
            ]
        self._file: IO[str] = self.path.open("w")
        self._file.writelines(line + "\n" for line in kept)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(output_dir / "tensorboard"))
        self.output_dir = output_dir

    def write(self, record: StepRecord) -> None:
        self._file.write(json.dumps(record.to_json()) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key in ("loss", "grad_norm", "lr", "ms_per_iter", "samples_per_s", "tokens_per_s", "mem_peak_max_gib"):
                self._tb.add_scalar(f"train/{key}", getattr(record, key), record.step)
            for key, value in record.extra.items():
                if key.startswith(TENSORBOARD_GROUPS):
                    self._tb.add_scalar(key, value, record.step)

    def write_eval(self, record: dict[str, Any]) -> None:
        """An eval's record (evaluation.py: step, eval_loss, eval_ppl, ...): a line of its own, TensorBoard eval/*."""
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key in ("loss", "ppl"):
                if record[f"eval_{key}"] is not None:
                    self._tb.add_scalar(f"eval/{key}", record[f"eval_{key}"], record["step"])

    def write_summary(self, summary: dict[str, Any]) -> None:
        (self.output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
