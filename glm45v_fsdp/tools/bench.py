"""Benchmarks. `python -m glm45v_fsdp.tools.bench SUBCOMMAND [options] [overrides]`, SUBCOMMAND one of
overhead|memory|ep|longest|deepspeed|door|parity|matrix|ops|checkpoint|checkpoint-scaling|resume-reads|lora|router;
every one but overhead runs through bench/runner.py.

overhead: our 1-rank training step (the Trainer's step with its metrics, built by the same builders as a real run;
on one rank the FSDP plan is matched but not applied, see docs/training.md) against a bare PyTorch loop over the
same transformers model, weights, batch and optimizer, timed side by side in one process (alternating blocks, so
drift in machine speed hits both). Prints the ratio ours/bare and writes it as JSON.

memory: OFF/ON training runs per memory switch (chunk loss, recompute, offload, combined), each in its own process;
a table in the reference report's form as markdown and JSON, and a PNG bar chart (bench/memory.py).

ep: expert parallelism: EP1 vs EP n, alltoall vs allgather, EP balance under skewed and natural routing, each side a
real training run; the same markdown / JSON / PNG outputs (bench/ep.py).

longest: the longest sequence each context-parallel layout (CP1, Ulysses 2, Ring 2, hybrid 4) trains within a
per-rank memory budget, found by doubling (bench/longest.py).

deepspeed: one DeepSpeed-API script on transformers' tiny GLM-4.5V, the real DeepSpeed against ds_compat, per ZeRO
stage and dtype, interleaved rounds (bench/deepspeed_api.py).

door: the DeepSpeed engine door on GLM-4.5V (a DeepSpeed-API script handed transformers' model) beside the trainer
door on one ds_config per case: full logits, the dynamic chunked loss, EP; step-time ratio (goal: engine at most 5%
slower), chunked-loss memory saving at each door, loss error between the doors (bench/door.py).

parity: the DeepSpeed-API script for 2000 steps on the real DeepSpeed and on this backend's two doors, bf16 and fp32:
loss and grad-norm errors, throughput ratio, loss-comparison plots (bench/parity.py).

matrix: the reference report's switch matrix, 00_baseline ... 10_full_ulysses in the F200 / F500 / P32K groups, with
presets for this CPU machine and for one 8-device NPU or GPU node (bench/matrix.py).

ops: each accelerator op's fast kernel against its reference (error, speed-up), then a training run with
model.ops=auto against model.ops=reference (bench/ops.py).

checkpoint: a run that saves at every step: the share of each save its checksums took, and their throughput; then
the last checkpoint's checksums taken the old way, read back, against the ones taken as it was written
(bench/checkpoint.py).

checkpoint-scaling: a DCP checkpoint's save, verify and load at 1, 2 and 4 ranks: seconds and bytes read and written
per rank, verify's seconds per rank falling as ranks grow, beside the planner's modelled size
(bench/checkpoint_scaling.py).

resume-reads: the bytes all processes read to resume a DCP checkpoint (/proc/self/io rchar, a resume run minus a
fresh run of the same step) over the checkpoint's size (bench/resume_reads.py).

lora: LoRA (attention + routed experts) against full fine-tuning on the same layout: peak memory per rank, optimizer
state, ms/step, alternating rounds (bench/lora.py).

router: MoE router balancing under a skewed router, 200 steps each: no balancing, the aux-loss-free bias update and
the auxiliary loss; the worst layer's expert load max/mean and dead experts at the start and the end (bench/router.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glm45v_fsdp.bench import (
    checkpoint,
    checkpoint_scaling,
    deepspeed_api,
    door,
    ep,
    longest,
    lora,
    matrix,
    memory,
    parity,
    resume_reads,
    router,
)
from glm45v_fsdp.bench.options import add_options, add_overrides
from glm45v_fsdp.errors import UserError


def add_overhead_parser(sub: Any) -> None:
    """bench overhead's options (here: bench/overhead.py imports torch, which --help must not wait for)."""
    parser = sub.add_parser("overhead", help="our 1-rank step vs a bare PyTorch loop, side by side")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per side")
    add_options(parser, warmup=5)
    parser.add_argument("--blocks", type=int, default=4, help="alternating timing blocks")
    parser.add_argument("--output", type=Path, default=Path("output/bench/overhead.json"))
    add_overrides(parser, "key.path=value config overrides")


def run_overhead(args: argparse.Namespace, argv: list[str]) -> int:
    from glm45v_fsdp.bench.overhead import run_overhead

    run_overhead(args.steps, args.warmup, args.blocks, args.overrides, args.output)
    return 0


OPS_HELP = "each op's fast kernel vs its reference (error, speed-up), and a training run auto vs reference"
OPS_DESCRIPTION = "Accelerator ops: kernel against reference per op, then model.ops=auto against reference."


def add_ops_parser(sub: Any) -> None:
    """bench ops' options (here: bench/ops.py imports torch, which --help must not wait for)."""
    parser = sub.add_parser("ops", help=OPS_HELP, description=OPS_DESCRIPTION)
    parser.add_argument(
        "--dtype", choices=("fp32", "bf16", "fp16"), default=None, help="default: bf16 on accelerators, fp32 on cpu"
    )
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per op call (attention: one packed row)")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per kernel (median)")
    parser.add_argument("--steps", type=int, default=20, help="training steps per run (0: skip the training part)")
    add_options(parser, device="cpu", out=Path("output/bench/ops"), run_timeout=600.0)
    add_overrides(parser, "key.path=value overrides for both training runs")


def run_ops(args: argparse.Namespace, argv: list[str]) -> int:
    from glm45v_fsdp.bench.ops import main_ops

    return main_ops(args, argv)


@dataclass(frozen=True)
class Subcommand:
    """A benchmark: `add_parser(subparsers)` adds its options under its name; `main(args, argv)` runs it (exit code)."""

    add_parser: Callable[[Any], None]
    main: Callable[[argparse.Namespace, list[str]], int]


# every subcommand by name, in the order --help lists them
SUBCOMMANDS = {
    "overhead": Subcommand(add_overhead_parser, run_overhead),
    "memory": Subcommand(memory.add_parser, memory.main_memory),
    "ep": Subcommand(ep.add_parser, ep.main_ep),
    "longest": Subcommand(longest.add_parser, longest.main_longest),
    "deepspeed": Subcommand(deepspeed_api.add_parser, deepspeed_api.main_deepspeed),
    "door": Subcommand(door.add_parser, door.main_door),
    "matrix": Subcommand(matrix.add_parser, matrix.main_matrix),
    "parity": Subcommand(parity.add_parser, parity.main_parity),
    "checkpoint": Subcommand(checkpoint.add_parser, checkpoint.main_checkpoint),
    "checkpoint-scaling": Subcommand(checkpoint_scaling.add_parser, checkpoint_scaling.main_checkpoint_scaling),
    "resume-reads": Subcommand(resume_reads.add_parser, resume_reads.main_resume_reads),
    "lora": Subcommand(lora.add_parser, lora.main_lora),
    "router": Subcommand(router.add_parser, router.main_router),
    "ops": Subcommand(add_ops_parser, run_ops),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m glm45v_fsdp.tools.bench")
    sub = parser.add_subparsers(dest="benchmark", required=True)
    for subcommand in SUBCOMMANDS.values():
        subcommand.add_parser(sub)
    assert list(sub.choices) == list(SUBCOMMANDS), "each subcommand adds its parser under its name in SUBCOMMANDS"
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    try:
        return SUBCOMMANDS[args.benchmark].main(args, argv)
    except UserError as error:
        print(f"bench: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
