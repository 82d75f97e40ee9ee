"""DeepSpeed's DistributedTest harness in miniature (tests/unit/common.py of DeepSpeed's repository), run with
`python -m ds_compat.run` by tests/test_ds_harness.py: a forkserver pool of 2 workers, each of which imports this
module (and with it what the harness imports at module level) before it can run its task, then
`deepspeed.init_distributed` on gloo through a file store with explicit rank and world size, a barrier and an
all-reduce. A module the workers cannot import loses the pool's task, and the harness waits forever: that was the hang
(git_version_info, pipe and moe existed nowhere but in stubs of the parent). Here the wait is bounded: a timeout
exits 1 instead."""

from __future__ import annotations

import json
import multiprocessing
import sys
import tempfile

import deepspeed
import deepspeed.comm as dist
import torch
import torch.multiprocessing as mp
from deepspeed.accelerator import get_accelerator
from deepspeed.git_version_info import torch_info
from deepspeed.moe.layer import MoE  # noqa: F401 - imported, as DeepSpeed's simple_model.py does
from deepspeed.ops.op_builder import FusedAdamBuilder
from deepspeed.pipe import LayerSpec, PipelineModule  # noqa: F401

BACKEND = get_accelerator().communication_backend_name()  # read when the class body runs, as the harness does


def rank_task(rank: int, world_size: int, init_method: str) -> list:
    deepspeed.init_distributed(dist_backend=BACKEND, init_method=init_method, rank=rank, world_size=world_size)
    dist.barrier()
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    compatible = deepspeed.ops.__compatible_ops__[FusedAdamBuilder.NAME]
    device = get_accelerator().device_name()
    return [deepspeed.__name__, total.item(), device, BACKEND, torch_info["version"], compatible]


def main() -> int:
    mp.set_start_method("forkserver", force=True)
    with tempfile.NamedTemporaryFile(suffix="_filestore") as store:
        pool = mp.Pool(processes=2)
        try:
            results = pool.starmap_async(rank_task, [(rank, 2, f"file://{store.name}") for rank in range(2)]).get(120)
        except multiprocessing.TimeoutError:
            print("the pool's tasks did not finish in 120 s (a worker could not run them)", file=sys.stderr)
            pool.terminate()
            return 1
        pool.close()
        pool.join()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
