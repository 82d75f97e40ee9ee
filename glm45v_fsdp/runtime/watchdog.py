"""Fast failure: a rank that dies ends every rank of the job within seconds, under any launcher (or none).

Without this, the surviving ranks of a job whose launcher does not watch them (no launcher, srun without
--kill-on-bad-exit, a Kubernetes pod per rank) wait in their next collective for the process-group timeout.

Each rank runs a daemon thread on the job's rendezvous store (a client connection of its own, this attempt's keys):
- it bumps its heartbeat key every `heartbeat_s`;
- rank 0's thread reads every rank's heartbeat, and posts a rank that stayed silent for `peer_timeout_s` as failed
  (SIGKILL, an out-of-memory kill, a lost node: nothing else can speak for it);
- a rank that ends with an exception posts itself as failed first (`report_failure`, also from sys.excepthook);
- every thread polls the failure key; when it is set, the rank logs which rank failed first and why, and exits
  EXIT_PEER_FAILED at once. A store that stops answering (its host, rank 0 or the launcher's agent, is gone) is a
  failure too: a store call that fails, or one that has not come back for `peer_timeout_s` (this rank's node is
  cut off: a call into a dead link blocks rather than fails), which a second thread watches.
A rank that finished (`finish`) or is stopping on its own error (`disarm`) is never ended by its thread, and neither is
a rank whose end another mechanism has taken over (`defer_to`: once any rank has started the stuck-job verdict, every
rank joins it and exits with its code, rather than with this one's when the verdict's first rank exits and takes the
store with it).
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from glm45v_fsdp.log import get_logger

EXIT_PEER_FAILED = 4
PEER_TIMEOUT_S = 30.0  # the default silence after which rank 0 declares a rank dead
# How long `finish` waits for a thread inside a store call: a script that returns (the engine API) ends with the
# interpreter's teardown, and a daemon thread still inside the store's C++ client then can hang or abort the rank.
FINISH_JOIN_S = 5.0


class Watchdog:
    def __init__(
        self, store: Any, rank: int, world: int, peer_timeout_s: float, poll_s: float = 0.5, heartbeat_s: float = 1.0
    ) -> None:
        self.store, self.rank, self.world = store, rank, world
        # the store is the job's, one key space per restart attempt (runtime/dist.py init_distributed)
        self.failed_key = "watchdog/failed"
        self.heartbeat_keys = [f"watchdog/heartbeat/{r}" for r in range(world)]
        self.done_keys = [f"watchdog/done/{r}" for r in range(world)]
        self.peer_timeout_s, self.poll_s, self.heartbeat_s = peer_timeout_s, poll_s, heartbeat_s
        self._armed = threading.Event()
        self._armed.set()
        self._stop = threading.Event()
        self.host_keys = [f"watchdog/host/{r}" for r in range(world)]
        self._thread = threading.Thread(target=self._run, name="glm45v-watchdog", daemon=True)
        self._guard = threading.Thread(target=self._guard_store, name="glm45v-watchdog-guard", daemon=True)
        self._last_answer = time.monotonic()
        self._previous_hook = sys.excepthook
        self._deferrals: list[tuple[str, Callable[[], None]]] = []

    def start(self) -> Watchdog:
        self.store.set(self.host_keys[self.rank], socket.gethostname())
        self.store.set(self.heartbeat_keys[self.rank], "0")
        sys.excepthook = self._excepthook
        atexit.register(self.finish)  # a script that simply returns (the engine API) has finished, not failed
        self._last_answer = time.monotonic()
        self._thread.start()
        self._guard.start()
        return self

    def report_failure(self, reason: str) -> None:
        """Tell every rank that this one is failing (the first report wins); this rank's own thread stands down."""
        self.disarm()
        try:
            self.store.compare_set(self.failed_key, "", f"rank {self.rank} on {socket.gethostname()}: {reason}")
        except Exception:  # the store is gone as well: the others find out through it
            pass

    def defer_to(self, key: str, callback: Callable[[], None]) -> None:
        """When `key` appears on the store, this rank's end belongs to someone else: the thread disarms (checked
        before the failure key, in the same poll) and calls `callback` once."""
        self._deferrals.append((key, callback))

    def disarm(self) -> None:
        """This rank is ending on its own terms (an error it reports itself): never end it from the thread."""
        self._armed.clear()

    def finish(self) -> None:
        """A normal end: the threads stop (joined, so none is inside a store call when the interpreter tears the
        store and the process group down), then rank 0 stops expecting heartbeats from this rank."""
        self.disarm()
        self._stop.set()
        for thread in (self._thread, self._guard):
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(timeout=self.poll_s + FINISH_JOIN_S)
        try:
            self.store.set(self.done_keys[self.rank], "1")
        except Exception:
            pass

    def _excepthook(self, kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
        self.report_failure(f"{kind.__name__}: {error}")
        self._previous_hook(kind, error, trace)

    def _end(self, reason: str) -> None:
        if not self._armed.is_set():
            return
        get_logger().error("ending this rank (exit %d): %s", EXIT_PEER_FAILED, reason)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_PEER_FAILED)

    def _run(self) -> None:
        beats, next_beat = 0, 0.0
        heard: dict[int, tuple[str, float]] = {}  # rank 0: last heartbeat value and when it changed
        while not self._stop.wait(self.poll_s):
            now = time.monotonic()
            try:
                if now >= next_beat:
                    beats += 1
                    self.store.set(self.heartbeat_keys[self.rank], str(beats))
                    next_beat = now + self.heartbeat_s
                self._check_deferrals()
                if self.store.check([self.failed_key]):
                    self._end(f"another rank failed first: {self.store.get(self.failed_key).decode()}")
                if self.rank == 0:
                    self._check_heartbeats(heard, now)
                self._last_answer = time.monotonic()
            except Exception as error:
                if self._stop.is_set():
                    return
                self._end(f"the rendezvous store stopped answering ({type(error).__name__}): its host is gone")

    def _check_deferrals(self) -> None:
        for index, (key, callback) in enumerate(self._deferrals):
            if self.store.check([key]):
                self.disarm()
                del self._deferrals[index]
                callback()
                return

    def _guard_store(self) -> None:
        while not self._stop.wait(self.poll_s):
            silent = time.monotonic() - self._last_answer
            if silent > self.peer_timeout_s:
                self._end(
                    f"the rendezvous store has not answered for {silent:.0f} s: this rank's node "
                    f"({socket.gethostname()}) is cut off from the store's host (a link or switch down), or that "
                    f"host is gone"
                )
                return

    def _host(self, rank: int) -> str:
        key = self.host_keys[rank]
        return self.store.get(key).decode() if self.store.check([key]) else "unknown host"

    def _check_heartbeats(self, heard: dict[int, tuple[str, float]], now: float) -> None:
        for rank, key in enumerate(self.heartbeat_keys):
            value = self.store.get(key) if self.store.check([key]) else b""  # b"": its thread has not started yet
            last = heard.get(rank)
            if last is None or last[0] != value:
                heard[rank] = (value, now)
            elif now - last[1] > self.peer_timeout_s and not self.store.check([self.done_keys[rank]]):
                silent = now - last[1]
                self.store.compare_set(
                    self.failed_key,
                    "",
                    f"rank {rank} on {self._host(rank)}: no heartbeat for {silent:.0f} s (killed, out of memory, or "
                    f"its node is lost)",
                )
                heard[rank] = (value, float("inf"))  # reported once


_watchdog: Watchdog | None = None


def start_watchdog(store: Any, rank: int, world: int, peer_timeout_s: float) -> Watchdog:
    """The process's watchdog (one per process; init_distributed decides whether the job needs one)."""
    global _watchdog
    if _watchdog is None:
        _watchdog = Watchdog(store, rank, world, peer_timeout_s).start()
    return _watchdog


def current_watchdog() -> Watchdog | None:
    return _watchdog
