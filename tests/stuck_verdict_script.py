"""One rank of a 2-rank job that is stuck from the start, with no launcher and no process group: the fast-failure
watchdog and the stuck-job deadline on a TCPStore hosted by rank 0, as runtime/dist.py sets them up.

    python stuck_verdict_script.py RANK PORT TIMEOUT_S OUT_DIR

Each rank's deadline has its own timeout, so the test decides whose fires first."""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from glm45v_fsdp.log import setup_logging
from glm45v_fsdp.runtime.stuck import CollectiveLog, StepDeadline
from glm45v_fsdp.runtime.watchdog import start_watchdog

rank, port, timeout_s, out = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), Path(sys.argv[4])
setup_logging(rank)
store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=rank == 0, timeout=timedelta(seconds=60))
client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
watchdog = start_watchdog(dist.PrefixStore("attempt0", client), rank, 2, peer_timeout_s=30.0)
StepDeadline(timeout_s, rank, 2, watchdog, out / "stuck", CollectiveLog()).start()
time.sleep(600)  # stuck: no step ever finishes
