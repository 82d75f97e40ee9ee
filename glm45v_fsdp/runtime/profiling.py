"""A torch.profiler window over chosen training steps, reduced to what the step spent communicating.

`training.profile_steps: [first, last]` profiles those steps (inclusive) on every rank and writes
`<output_dir>/profile/rank{R}.json`: the window's wall ms per step, the communication ms per step (the union of the
intervals of every collective event on any thread, so overlapping calls count once), its share of the step, and
each collective's call count and summed duration. A collective event is one whose name starts with a backend's
prefix: `gloo:` (CPU), `nccl` (CUDA kernels), `hcom`/`hccl` (Ascend; unverified on hardware). The share is the
reference report's "Communication / Stage" figure: it covers FSDP, EP and CP traffic together, not one feature's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

COLLECTIVE_PREFIXES = ("gloo:", "nccl", "hcom", "hccl")


def is_collective(name: str) -> bool:
    return name.lower().startswith(COLLECTIVE_PREFIXES)


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals given in microseconds, in ms."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total / 1000.0


def communication_summary(events: Any, window_ms: float, steps: int) -> dict[str, Any]:
    """Per-step communication figures of a finished profile's events over a window of `steps` steps."""
    intervals, by_op = [], {}
    for event in events:
        if not is_collective(event.name):
            continue
        start, end = event.time_range.start, event.time_range.end
        intervals.append((start, end))
        op = by_op.setdefault(event.name, {"calls": 0, "ms": 0.0})
        op["calls"] += 1
        op["ms"] += (end - start) / 1000.0
    comm_ms = union_ms(intervals)
    return {
        "steps": steps,
        "step_ms": window_ms / steps,
        "comm_ms": comm_ms / steps,
        "comm_share": comm_ms / window_ms if window_ms > 0 else 0.0,
        "collectives": dict(sorted(by_op.items(), key=lambda item: -item[1]["ms"])),
    }


class StepProfiler:
    """Starts torch.profiler before step `first` and stops it after step `last` (1-based), then writes the rank's
    summary. Inactive (every call a no-op) when `steps` is None."""

    def __init__(self, steps: list[int] | None, output_dir: Path, rank: int, device_type: str) -> None:
        self.first, self.last = steps if steps else (0, -1)
        self.path = output_dir / "profile" / f"rank{rank}.json"
        self.device_type = device_type
        self.profiler: torch.profiler.profile | None = None
        self.started = 0.0

    def before_step(self, step: int) -> None:
        if step != self.first:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.__enter__()
        self.started = time.perf_counter()

    def after_step(self, step: int) -> None:
        if step != self.last or self.profiler is None:
            return
        window_ms = (time.perf_counter() - self.started) * 1000.0
        self.profiler.__exit__(None, None, None)
        summary = communication_summary(self.profiler.events(), window_ms, self.last - self.first + 1)
        summary["window"] = [self.first, self.last]
        self.profiler = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(summary, indent=2) + "\n")
