"""What a launcher gives each rank: the rank's environment, written down, then the trainer in the same process.

`python tests/node_probe.py DIR [--local_rank=N] [TRAINER ARGS ...]` writes DIR/<host name>-<RANK>.json (the
environment) and then runs `python -m glm45v_fsdp.train [--local_rank=N] TRAINER ARGS` as this process. The launcher
tests of tests/test_multinode.py compare what each launcher put into the ranks of every node.
"""

from __future__ import annotations

import json
import os
import runpy
import socket
import sys
from pathlib import Path

local_rank = [arg for arg in sys.argv[1:] if arg.startswith("--local_rank")]  # DeepSpeed's launch puts it first
folder, *trainer_args = [arg for arg in sys.argv[1:] if arg not in local_rank]
Path(folder).mkdir(parents=True, exist_ok=True)
Path(folder, f"{socket.gethostname()}-{os.environ['RANK']}.json").write_text(json.dumps(dict(os.environ)))
sys.argv = ["glm45v_fsdp.train", *local_rank, *trainer_args]
runpy.run_module("glm45v_fsdp.train", run_name="__main__", alter_sys=True)
