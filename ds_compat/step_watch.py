"""The DeepSpeed door's step deadline: a stuck job ends as under our trainer (glm45v_fsdp/runtime/stuck.py).

One deadline per process, started by the first `deepspeed.initialize` whose config leaves it on: the extension
section's `training.step_timeout_s` (null, the default: max(600 s, 20 x the median step after the first 3); 0: off).
A step is `engine.step()` at a gradient-accumulation boundary. The deadline counts while the script is inside the
engine (`forward`, `backward`, `step`) or waits in a blocking torch.distributed collective of its own (the HF
Trainer gathers each step's token count): such a call that does not return within the timeout is stuck. The
script's other time between engine calls (its data loading, its logging, whatever it does after training) is not
watched, so a long pause of a healthy script never ends it. A rank that hangs there (a deadlocked loader) leaves
the other ranks waiting in a collective: their deadline fires, rank 0 names it as the rank behind, and it joins the
verdict through the job's fast-failure watchdog. Every rank writes its Python stacks and its last collectives
to `<training.output_dir>/stuck/rank{R}.txt` (the extension section's key; our default `output/glm45v_tiny`), logs
the verdict and exits 5.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from glm45v_fsdp.config import TrainingConfig
from glm45v_fsdp.log import get_logger
from glm45v_fsdp.runtime.stuck import StepDeadline, start_step_deadline

Method = TypeVar("Method", bound=Callable[..., Any])


class StepWatch:
    """The process's deadline and its step count over every engine of the process (a script may build several)."""

    def __init__(self, deadline: StepDeadline) -> None:
        self.deadline = deadline
        self.steps = 0
        self.depth = 0  # engine calls in progress (a call may reach another engine method)
        self.last_step = time.perf_counter()

    def enter(self) -> None:
        if self.depth == 0:
            self.deadline.note_progress()
        self.depth += 1

    def leave(self, stepped: bool) -> None:
        self.depth -= 1
        if stepped:
            now = time.perf_counter()
            self.steps += 1
            self.deadline.step_done(self.steps, now - self.last_step)
            self.last_step = now
        if self.depth == 0:
            self.deadline.pause()


_watch: StepWatch | None = None


def watch_steps(training: TrainingConfig, rank: int, world: int) -> None:
    """Start the process's deadline (once; a later engine's different timeout is named and not applied)."""
    global _watch
    if training.step_timeout_s == 0:
        return
    if _watch is not None:
        if training.step_timeout_s != _watch.deadline.fixed:
            get_logger().warning(
                "ds_compat: this process's step deadline runs with training.step_timeout_s=%s from its first "
                "deepspeed.initialize; this engine's %s is not applied",
                _watch.deadline.fixed,
                training.step_timeout_s,
            )
        return
    dump_dir = Path(training.output_dir) / "stuck"
    _watch = StepWatch(start_step_deadline(training.step_timeout_s, rank, world, dump_dir))
    _watch.deadline.pause()  # counts from the first call into an engine
    timeout = "max(600 s, 20 x the median step)" if training.step_timeout_s is None else f"{training.step_timeout_s} s"
    if rank == 0:
        get_logger().info(
            "ds_compat: step deadline %s inside forward / backward / step and blocking collectives "
            "(glm45v_fsdp.training.step_timeout_s; 0: off); a stuck job's stacks go to %s",
            timeout,
            dump_dir,
        )


def watched(method: Method) -> Method:
    """An engine method the deadline watches; a call that completes an optimizer step (global_steps grows) is a
    step."""

    @functools.wraps(method)
    def call(engine: Any, *args: Any, **kwargs: Any) -> Any:
        watch = _watch
        if watch is None:
            return method(engine, *args, **kwargs)
        steps = engine.global_steps
        watch.enter()
        stepped = False
        try:
            result = method(engine, *args, **kwargs)
            stepped = engine.global_steps > steps
            return result
        finally:
            watch.leave(stepped)

    return call  # type: ignore[return-value]
