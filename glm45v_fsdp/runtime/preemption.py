"""Preemption: SIGTERM (Kubernetes, Slurm at the time limit) or SIGUSR1 (Slurm's `--signal`) on any rank ends the
run at a step boundary with a checkpoint.

The handler only records the first signal (later ones are logged and ignored, so a second signal during the save is
not fatal). The trainer carries the flag in its per-step all-gather, so every rank learns of it at the end of the
same step, finishes that step, writes a synchronous checkpoint, publishes it as `latest` and exits with
EXIT_PREEMPTED.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

from glm45v_fsdp.log import get_logger

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EXIT_PREEMPTED = 143  # 128 + SIGTERM: what schedulers read as "terminated", not as a crash


class PreemptionWatch:
    """Records the first preemption signal this process receives while `installed()`."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal is None:
            self.signal = signum
            get_logger().warning("%s received: finishing the step in flight, then a checkpoint and exit", name)
        else:
            get_logger().warning("%s received while already stopping for %s: ignored", name, self.name)

    @property
    def name(self) -> str | None:
        return None if self.signal is None else signal.Signals(self.signal).name

    @contextlib.contextmanager
    def installed(self) -> Iterator[PreemptionWatch]:
        """The handlers, for the training loop (main thread only; elsewhere the defaults stay)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {number: signal.signal(number, self._handle) for number in PREEMPTION_SIGNALS}
        try:
            yield self
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)
