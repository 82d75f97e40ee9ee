"""A stuck job ends: a rank that is alive but makes no progress (a deadlocked loader, a collective a peer never
enters, a hung NCCL/HCCL call) still heartbeats, so the fast-failure watchdog cannot tell; the step deadline can.

`CollectiveLog` records every torch.distributed collective this process enters and leaves (a sequence number, the
name, the group) in a ring of the last 64; `collective_log()` is the process's one log. `StepDeadline` runs a daemon
thread: when no step has finished for `training.step_timeout_s` (default: max(600 s, 20 x the median step after the
first 3), 0: off), the rank
- writes its Python stacks (faulthandler, every thread) and its collective log to <output_dir>/stuck/rank{R}.txt and
  stderr,
- posts that the verdict has started, and its last finished step and its last collective, to the job's store,
- every other rank joins the verdict at once (its fast-failure watchdog sees the start and hands over: it will not end
  the rank as "another rank failed first" when the first rank exits and takes the store with it), dumps and posts too,
- rank 0 waits up to `verdict_wait_s` for every rank's post and names the ranks that are behind (the fewest steps,
  then the fewest collectives) and the collective where the ranks differ, in its log and on the store, then waits up
  to `verdict_wait_s` for every rank that posted to have read it,
- and every rank exits EXIT_STUCK, so every launcher ends the job within the timeout + about `verdict_wait_s`.
Which rank's timer fires first changes nothing: one outcome, every rank logs the verdict and exits 5. Once a rank's
verdict has started, an error its main thread meets meanwhile (a collective whose peer has already exited) waits for
the verdict's exit instead of ending the process with its own code (`hold_for_stuck_exit`).
`training.resume=auto` then continues from the last checkpoint.
`start_step_deadline` starts one for either door: the trainer watches its whole step loop; the DeepSpeed door
(ds_compat/step_watch.py) watches the time spent inside the engine's calls and `pause`s the deadline between them.
"""

from __future__ import annotations

import collections
import faulthandler
import functools
import json
import os
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from glm45v_fsdp.log import get_logger
from glm45v_fsdp.runtime.watchdog import Watchdog, current_watchdog

EXIT_STUCK = 5
DEFAULT_FLOOR_S = 600.0
DEFAULT_FACTOR = 20.0
WARMUP_STEPS = 3
STARTED_KEY = "stuck/started"  # the first rank whose deadline fired; every rank's watchdog watches for it
_ending = threading.Event()  # this process's verdict has started: it ends with EXIT_STUCK


def hold_for_stuck_exit(limit_s: float = 120.0) -> None:
    """Called where the main thread is about to end the process on an error: when this rank's stuck verdict has
    started, wait for it to end the process with EXIT_STUCK (a collective whose peer already exited fails here first).
    Returns at once otherwise, or after `limit_s` if the verdict never ends."""
    if _ending.is_set():
        time.sleep(limit_s)


COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single", "broadcast",
    "broadcast_object_list", "barrier", "gather", "gather_object", "scatter", "send", "recv",
)  # fmt: skip


class CollectiveLog:
    """The last `size` collectives of this process: (sequence number, name, group, "entered" / "left")."""

    def __init__(self, size: int = 64) -> None:
        self.entries: collections.deque[dict[str, Any]] = collections.deque(maxlen=size)
        self.count = 0
        self.waiting_since: float | None = None  # time.monotonic() when the blocking collective now running began
        self._lock = threading.Lock()

    def install(self) -> None:
        """Wrap torch.distributed's collectives (once per process): callers that reach them as `dist.<name>`
        (FSDP2, DTensor, our code) are recorded."""
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None or getattr(original, "_glm45v_logged", False):
                continue
            setattr(dist, name, self._wrap(name, original))

    def _wrap(self, name: str, original):
        @functools.wraps(original)
        def logged(*args, **kwargs):
            group = kwargs.get("group")
            with self._lock:
                self.count += 1
                entry = {"seq": self.count, "name": name, "group": _group_name(group), "state": "entered"}
                self.entries.append(entry)
            blocking = not kwargs.get("async_op") and self.waiting_since is None
            if blocking:
                self.waiting_since = time.monotonic()
            try:
                result = original(*args, **kwargs)
            finally:
                if blocking:
                    self.waiting_since = None
            entry["state"] = "left" if not kwargs.get("async_op") else "issued (async)"
            return result

        logged._glm45v_logged = True
        return logged

    def last(self) -> dict[str, Any] | None:
        return dict(self.entries[-1]) if self.entries else None


_process_log: CollectiveLog | None = None


def collective_log() -> CollectiveLog:
    """This process's collective log, installed on first use (every deadline of the process reads the same one)."""
    global _process_log
    if _process_log is None:
        _process_log = CollectiveLog()
        _process_log.install()
    return _process_log


def start_step_deadline(timeout_s: float | None, rank: int, world: int, dump_dir: Path) -> StepDeadline:
    """A running step deadline (timeout_s: training.step_timeout_s, None: the default rule), on the fast-failure
    watchdog's store when the job has one (its verdict names the ranks behind), with every collective logged."""
    return StepDeadline(timeout_s, rank, world, current_watchdog(), dump_dir, collective_log()).start()


def _group_name(group: Any) -> str:
    if group is None:
        return "default"
    try:
        return f"{group.group_name} (size {group.size()})"
    except Exception:
        return repr(group)


class StepDeadline:
    def __init__(
        self,
        timeout_s: float | None,
        rank: int,
        world: int,
        watchdog: Watchdog | None,
        dump_dir: Path,
        collectives: CollectiveLog,
        poll_s: float = 1.0,
        verdict_wait_s: float = 10.0,
    ) -> None:
        self.fixed = timeout_s  # None: derived from the step times
        self.rank, self.world, self.watchdog, self.dump_dir = rank, world, watchdog, dump_dir
        self.store = watchdog.store if watchdog is not None else None
        self.collectives, self.poll_s, self.verdict_wait_s = collectives, poll_s, verdict_wait_s
        self.step = 0
        self.step_seconds: list[float] = []
        self._progress = time.monotonic()
        self._paused = False  # between the watched calls (the DeepSpeed door): the deadline does not count
        self._stop = threading.Event()
        self._joined = threading.Event()  # another rank started the verdict
        self._thread = threading.Thread(target=self._run, name="glm45v-step-deadline", daemon=True)

    @property
    def timeout_s(self) -> float:
        if self.fixed is not None:
            return self.fixed
        timed = self.step_seconds[WARMUP_STEPS:]
        return max(DEFAULT_FLOOR_S, DEFAULT_FACTOR * statistics.median(timed)) if timed else DEFAULT_FLOOR_S

    def start(self) -> StepDeadline:
        self._progress = time.monotonic()
        if self.watchdog is not None:
            self.watchdog.defer_to(STARTED_KEY, self._joined.set)
        self._thread.start()
        return self

    def step_done(self, step: int, seconds: float) -> None:
        self.step = step
        self.step_seconds.append(seconds)
        self.note_progress()

    def note_progress(self) -> None:
        """Work between steps (an eval's batch) went on: the deadline counts from now."""
        self._progress = time.monotonic()
        self._paused = False

    def pause(self) -> None:
        """The watched work is left (the DeepSpeed door: the script's own code between calls into the engine): until
        the next note_progress or step_done the deadline counts only while the rank waits in a blocking collective
        (the script's own, e.g. the HF Trainer's gather of the step's token count). A verdict another rank started
        is still joined."""
        self._paused = True

    def waited_s(self) -> float:
        """Seconds the deadline has counted: since the last progress, or, paused, in the blocking collective."""
        now = time.monotonic()
        if not self._paused:
            return now - self._progress
        since = self.collectives.waiting_since
        return 0.0 if since is None else now - since

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            waited = self.waited_s()
            if self._joined.is_set() or waited > self.timeout_s:
                self._fire(waited)
                return

    def _fire(self, waited: float) -> None:
        _ending.set()
        if self.watchdog is not None:
            self.watchdog.disarm()  # this rank ends here, with EXIT_STUCK, whatever its peers do meanwhile
        log = get_logger()
        first = self._post_start()
        last = self.collectives.last()
        mine = {"step": self.step, "collectives": self.collectives.count, "last": last}
        path = self._dump(waited, mine)
        log.error(
            "stuck: no step finished for %.0f s (training.step_timeout_s %.0f s) after step %d%s; this rank's last "
            "collective: %s; stacks and collective log in %s",
            waited,
            self.timeout_s,
            self.step,
            "" if first is None or first == self.rank else f" (rank {first}'s deadline fired first)",
            _describe(last),
            path,
        )
        if self.store is not None:
            try:
                self.store.set(f"stuck/{self.rank}", json.dumps(mine))
                if self.rank == 0:
                    self.store.set("stuck/verdict", self._verdict())
                else:
                    self.store.wait(["stuck/verdict"], timedelta(seconds=2 * self.verdict_wait_s))
                log.error("stuck: %s", self.store.get("stuck/verdict").decode())
                if self.rank == 0:
                    self._wait_until_read()
                else:
                    self.store.set(f"stuck/read/{self.rank}", "1")
            except Exception as error:  # the store is gone: this rank's own dump is what remains
                log.error("stuck: no verdict from rank 0 (%s)", type(error).__name__)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_STUCK)

    def _post_start(self) -> int | None:
        """Post this rank as the verdict's first unless another rank was (the first post wins); the first rank."""
        if self.store is None:
            return None
        try:
            return int(self.store.compare_set(STARTED_KEY, "", str(self.rank)).decode())
        except Exception:  # the store is gone: the rank still dumps and exits EXIT_STUCK
            return None

    def _wait_until_read(self) -> None:
        """Rank 0 hosts the store when there is no launcher: it stays until every rank that posted has read the
        verdict (up to verdict_wait_s), so none of them finds the store gone."""
        deadline = time.monotonic() + self.verdict_wait_s
        posted = [rank for rank in range(1, self.world) if self.store.check([f"stuck/{rank}"])]
        keys = [f"stuck/read/{rank}" for rank in posted]
        while keys and time.monotonic() < deadline and not self.store.check(keys):
            time.sleep(0.1)

    def _verdict(self) -> str:
        """Rank 0: every rank's post (waited for up to verdict_wait_s), the ranks behind and where they differ."""
        deadline = time.monotonic() + self.verdict_wait_s
        keys = [f"stuck/{rank}" for rank in range(self.world)]
        while time.monotonic() < deadline and not self.store.check(keys):
            time.sleep(0.1)
        posts = {
            rank: json.loads(self.store.get(key).decode()) for rank, key in enumerate(keys) if self.store.check([key])
        }
        silent = sorted(set(range(self.world)) - set(posts))
        where = "; ".join(f"rank {rank}: step {p['step']}, {_describe(p['last'])}" for rank, p in sorted(posts.items()))
        silent_text = f"; rank(s) {_ranks(silent)} posted nothing (check their dumps)" if silent else ""
        positions = {rank: (p["step"], p["collectives"]) for rank, p in posts.items()}
        least = min(positions.values())
        behind = [rank for rank, position in positions.items() if position == least]
        steps_ahead = [rank for rank, position in positions.items() if position[0] > least[0]]
        if len(behind) == len(posts):
            verdict = (
                f"no rank is behind another: every rank is in collective #{least[1]} after step {least[0]} (a "
                "collective or device call that does not return)"
            )
        else:
            verdict = f"rank(s) {_ranks(behind)} behind: after step {least[0]}, at collective #{least[1]}"
            if steps_ahead:
                verdict += (
                    f"; rank(s) {_ranks(steps_ahead)} went on to a later step: they left out a collective the ranks "
                    "behind wait in"
                )
        names = {p["last"]["name"] if p["last"] else None for p in posts.values()}
        counts = {count for _, count in positions.values()}
        at = least[1] if len(counts) == 1 else least[1] + 1  # the first collective not every rank entered alike
        differ = f"; the ranks differ at collective #{at}" if len(names) > 1 or len(counts) > 1 else ""
        return f"{verdict}{differ}{silent_text}. Each rank's last collective: {where}"

    def _dump(self, waited: float, mine: dict[str, Any]) -> Path:
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        path = self.dump_dir / f"rank{self.rank}.txt"
        with path.open("w") as stream:
            stream.write(f"rank {self.rank}: no step finished for {waited:.0f} s after step {self.step}\n\n")
            stream.write("last collectives (oldest first):\n")
            for entry in self.collectives.entries:
                stream.write(f"  {_describe(entry)}\n")
            stream.write("\nPython stacks:\n")
            stream.flush()
            faulthandler.dump_traceback(stream, all_threads=True)
        faulthandler.dump_traceback(sys.stderr, all_threads=True)
        return path


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, sorted(ranks)))


def _describe(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "none yet"
    return f"#{entry['seq']} {entry['name']} on group {entry['group']} ({entry['state']})"
