"""Several training runs in one launcher job: `torchrun --nproc_per_node N tests/multi_run.py RUNS.json`.

RUNS.json lists {"argv": [...], "log": path}; each run is `glm45v_fsdp.train.run(argv)` with its log (rank 0's
stdout) written to `log`. The runs share the job's process group (a finished run leaves it in place, as the
trainer's own exit does) and nothing else: every run builds its meshes, model, data and trainer anew and reseeds.
This saves the interpreter start-up, imports and rendezvous that dominate a short test run on 2 CPU cores.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

from glm45v_fsdp.train import end_process, run


def main(path: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    for item in json.loads(open(path).read()):
        # rank 0's stdout only: every rank opening the same file raced, and the last writer's text won
        with open(item["log"] if rank == 0 else os.devnull, "w") as log, contextlib.redirect_stdout(log):
            run(item["argv"])
    end_process(0)


if __name__ == "__main__":
    main(sys.argv[1])
