"""Count every collective of one training step: `torchrun --nproc_per_node N tests/comm_count_run.py RUNS.json OUT`.

RUNS.json lists {"name": ..., "argv": [...]}; each run is `glm45v_fsdp.train.run(argv)` (as tests/multi_run.py) with
`Trainer.train_step` of the run's second step under `CollectiveCounter`, so only what one optimizer step sends is
counted (start-up, data checks and the per-step figures' gather are outside it); the runs need three steps. The process
groups are named by the meshes the run built: OUT/<name>.rank<R>.json holds `collectives`: [{kind, families, ranks,
calls, bytes}] per (op kind, process group) and `micro_batches`: each micro batch's input_ids shape and image patches;
with "count_flops" in the run, `flops`: the step's matmul FLOPs by torch.utils.flop_counter (the CPU attention kernels
and the ring op are not counted).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from glm45v_fsdp import builders
from glm45v_fsdp.model.loss import with_video_frames
from glm45v_fsdp.runtime import mesh as mesh_module
from glm45v_fsdp.runtime.comm_count import CollectiveCounter
from glm45v_fsdp.train import end_process, run
from glm45v_fsdp.trainer import Trainer


def grouped_mm_flops(a_shape, b_shape, *args, **kwargs) -> int:
    """torch._grouped_mm (the experts' kernel, which the counter has no formula for): every row of `a` meets one
    group's [K, N] matrix, whether the groups split a's rows (2-D x 3-D, forward and input gradient) or its columns
    (2-D x 2-D, the weight gradient: [K, M] x [M, N] into [G, K, N])."""
    return 2 * math.prod(a_shape) * b_shape[-1]


GROUPED_MM = {torch.ops.aten._grouped_mm: grouped_mm_flops}
VIEWS = ("dp", "fsdp", "cp", "dp_replicate", "cp_ring", "cp_ulysses", "efsdp", "ep")
# The step counted: the second of a run of three, a step between the first (which also all-reduces its own valid
# tokens before its forward) and the last (which fetches no next step), as the planner models one.
COUNTED_STEP = 2


def group_families(meshes: mesh_module.ParallelMeshes) -> tuple[dict[str, list[str]], dict[tuple, list[str]]]:
    """({process group name: the mesh views (families) that use it}, {this rank's group ranks: views}): one group can
    serve several views, and a mesh sliced from another (HSDP's expert mesh) has groups of its own with a view's
    ranks."""
    by_name: dict[str, list[str]] = {}
    by_ranks: dict[tuple, list[str]] = {}
    for view in VIEWS:
        group = getattr(meshes, view).get_group()
        by_name.setdefault(group.group_name, []).append(view)
        by_ranks.setdefault(tuple(dist.get_process_group_ranks(group)), []).append(view)
    return by_name, by_ranks


def main(runs_path: str, out: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    built: list[mesh_module.ParallelMeshes] = []
    original_meshes = builders.ParallelMeshes

    def capture(*args, **kwargs):
        meshes = original_meshes(*args, **kwargs)
        built.append(meshes)
        return meshes

    builders.ParallelMeshes = capture
    counter = CollectiveCounter()
    shapes: list[dict] = []  # the counted step's micro batches as they reached train_step
    flops: list[int] = []
    count_flops = False
    original_step = Trainer.train_step

    def vision_items(batch) -> list[int]:
        """The patches of each item the vision tower encodes, in sequence order: each image and each temporal patch
        of a video (model/loss.py with_video_frames)."""
        merged = with_video_frames(batch)
        return merged["image_grid_thw"].prod(-1).tolist() if "image_grid_thw" in merged else []

    def counted_step(self, micro_batches, *args):
        if self.step != COUNTED_STEP - 1:
            return original_step(self, micro_batches, *args)
        shapes.extend(
            {"input_ids": list(batch["input_ids"].shape), "image_patches": vision_items(batch)}
            for batch in micro_batches
        )
        if not count_flops:
            with counter:
                return original_step(self, micro_batches, *args)
        with counter, FlopCounterMode(display=False, custom_mapping=GROUPED_MM) as flop_counter:
            result = original_step(self, micro_batches, *args)
        flops.append(flop_counter.get_total_flops())
        return result

    Trainer.train_step = counted_step
    for item in json.loads(Path(runs_path).read_text()):
        counter.tally.clear()
        built.clear()
        shapes.clear()
        flops.clear()
        count_flops = bool(item.get("count_flops"))
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            run(item["argv"])
        by_name, by_ranks = group_families(built[-1])
        rows = [
            {
                "kind": kind,
                "families": by_name.get(group) or by_ranks[counter.group_ranks[group]],
                "ranks": list(counter.group_ranks[group]),
                "calls": tally.calls,
                "bytes": tally.bytes,
            }
            for (kind, group), tally in counter.tally.items()
        ]
        result = {"collectives": rows, "micro_batches": shapes, "flops": flops[0] if flops else None}
        Path(out, f"{item['name']}.rank{rank}.json").write_text(json.dumps(result, indent=1))
    end_process(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
