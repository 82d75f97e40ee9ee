"""The key space of one start of a job's ranks on a rendezvous store that outlives them.

torchrun's agents keep one TCPStore across `--max-restarts` attempts, so keys a dead attempt left (gloo's peer
addresses, the watchdog's failure report) would be read by the next one: "connectFullMesh failed ... Connection
refused". The attempt cannot be named by TORCHELASTIC_RESTART_COUNT: when one node's torchrun is started again (the
node crashed, the scheduler or an operator restarted it), its agent counts from 0 while the others count on.

So rank 0 names each attempt with a fresh random token, and every other rank proves that the token it read is this
attempt's: it posts a nonce of its own under the token, and only the rank 0 that made the token echoes it back. A
token left by a dead attempt never echoes, and the rank reads the token again.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from torch.distributed import DistStoreError

TOKEN_KEY = "glm45v/attempt"
ECHO_WAIT = timedelta(seconds=2)  # how long a rank waits for rank 0 to echo its nonce before reading the token again


def attempt_prefix(store: Any, rank: int, world_size: int, timeout: timedelta) -> str:
    """The key prefix every rank of this attempt agrees on (a collective over `store`, before the process group)."""
    if rank == 0:
        token = uuid.uuid4().hex
        store.set(TOKEN_KEY, token)
        for peer in range(1, world_size):
            ready = f"glm45v/{token}/ready/{peer}"
            store.wait([ready], timeout)
            if store.get(TOKEN_KEY).decode() != token:  # a newer attempt started: this rank 0 is a leftover
                raise DistStoreError(f"rank 0: a newer attempt of this job took over the rendezvous store ({token})")
            store.set(f"glm45v/{token}/echo/{peer}", store.get(ready))
        return f"glm45v/{token}"
    nonce = uuid.uuid4().hex
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        store.wait([TOKEN_KEY], timeout)
        token = store.get(TOKEN_KEY).decode()
        store.set(f"glm45v/{token}/ready/{rank}", nonce)
        echo = f"glm45v/{token}/echo/{rank}"
        try:
            store.wait([echo], ECHO_WAIT)
            if store.get(echo).decode() == nonce:
                return f"glm45v/{token}"
            time.sleep(ECHO_WAIT.total_seconds())  # a dead attempt's echo: wait for this attempt's rank 0
        except DistStoreError:  # no echo yet: a dead attempt's token, or rank 0 is still serving the others
            pass
        if time.monotonic() > deadline:
            raise DistStoreError(
                f"rank {rank}: rank 0 did not answer on the rendezvous store within {timeout.total_seconds():.0f} s"
            )


def shared_store_restart_note(environ: Mapping[str, str], spans_nodes: bool) -> str | None:
    """A job torchrun may restart across nodes on the agents' shared store: with `--rdzv_backend c10d`, torch 2.13's
    agents cannot take a torchrun started again on a node into the next round (the new agent waits for the round's
    MASTER_ADDR, which the surviving agents never publish again); each agent's own store avoids it."""
    restarts = environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if not spans_nodes or not restarts.isdigit() or int(restarts) == 0:
        return None
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return (
        f"torchrun --max-restarts {restarts} across nodes on the agents' shared store: with --rdzv_backend c10d, a "
        "node whose torchrun is started again (a crashed or replaced node) cannot join the restarted round in torch "
        "2.13; export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node before torchrun (docs/multinode.md)"
    )
