"""A rank that finishes by returning (the DeepSpeed engine API) ends with the interpreter's teardown. The watchdog's
threads must be out of the store by then: a thread still inside the TCPStore client while the process tears the
client down aborted the rank ("terminate called without an active exception", exit -6) in the multinode "ds-fsdp
api" job, and with a 2 ms poll in 5 of 8 four-rank runs of tests/ds_api_script.py (0 of 8 once `finish` joins)."""

from __future__ import annotations

import sys
import threading
import time

from glm45v_fsdp.runtime.watchdog import Watchdog


class SlowStore:
    """Every call takes `delay` s; records the calls in flight when `finish` marks the rank done."""

    def __init__(self, delay: float) -> None:
        self.delay, self.values, self.in_flight = delay, {}, 0
        self.lock = threading.Lock()
        self.in_flight_at_done: int | None = None

    def _call(self) -> None:
        with self.lock:
            self.in_flight += 1
        time.sleep(self.delay)
        with self.lock:
            self.in_flight -= 1

    def set(self, key: str, value: str) -> None:
        if key.startswith("watchdog/done/"):
            with self.lock:
                self.in_flight_at_done = self.in_flight
        self._call()
        self.values[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        self._call()
        return all(key in self.values for key in keys)

    def get(self, key: str) -> bytes:
        self._call()
        return self.values[key]

    def compare_set(self, key: str, expected: str, value: str) -> None:
        self._call()
        self.values.setdefault(key, value.encode())


def test_finish_returns_with_no_thread_inside_the_store(monkeypatch):
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # start() chains it; restored afterwards
    store = SlowStore(delay=0.2)
    watchdog = Watchdog(store, rank=0, world=1, peer_timeout_s=30.0, poll_s=0.01, heartbeat_s=0.01).start()
    time.sleep(0.35)  # the threads are busy in the store
    assert store.in_flight > 0
    watchdog.finish()
    assert not watchdog._thread.is_alive() and not watchdog._guard.is_alive()
    assert store.in_flight_at_done == 0 and store.values["watchdog/done/0"] == b"1"
