"""Check a run before it starts, with no accelerator and no process group.

`python -m glm45v_fsdp.tools.preflight --config C [--world-size N] [--deepspeed DS_CONFIG] [--device-memory-gib G]
[--json] [key=value ...]`

Loads the config, validates the layout for N ranks, builds the model on the meta device, applies every plan of the
registry (glm45v_fsdp/plans.py) as a dry run in build order and prints what each does and each pattern's match
count. A pattern that matches nothing, a missing required FSDP unit or an impossible layout is an error (exit 2, each
problem named). With --world-size it also prints each rank's memory: exact bytes of parameters, gradients and AdamW
states under FSDP2 sharding, and estimates of the transient unsharded copies and the activations
(glm45v_fsdp.memory.estimate; docs/tools.md), and the checkpoint's size, bytes per rank per save and modelled save,
verify and resume time at --fs-gbps / --fs-node-gbps (glm45v_fsdp/planner/checkpoint_time.py). With --deepspeed
the ds_config is translated onto the config as `python -m glm45v_fsdp.train --deepspeed` translates it for N ranks,
and everything above runs on the result.
"""

from __future__ import annotations

import argparse
import json
import sys

from glm45v_fsdp.errors import EXIT_USER_ERROR, UserError


def add_storage_arguments(parser: argparse.ArgumentParser) -> None:
    """--fs-gbps / --fs-node-gbps, the checkpoint storage (planner/checkpoint_time.storage); tools.plan has them too."""
    parser.add_argument(
        "--fs-gbps",
        type=float,
        default=None,
        help="checkpoint file system, aggregate GB/s (default 20: a mid-size Lustre / GPFS; docs/planning.md)",
    )
    parser.add_argument(
        "--fs-node-gbps", type=float, default=None, help="one node's link to that file system, GB/s (default 2.5)"
    )


def check_storage_arguments(args: argparse.Namespace) -> None:
    """A UserError naming the flag when --fs-gbps or --fs-node-gbps is not above 0."""
    for flag in ("fs_gbps", "fs_node_gbps"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise UserError(f"--{flag.replace('_', '-')} = {value} is invalid: pass a bandwidth in GB/s above 0.")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m glm45v_fsdp.tools.preflight",
        description="Check config, layout and plans on the meta device; with --world-size, per-rank memory.",
    )
    parser.add_argument("--config", default=None, help="YAML config (default: configs/glm45v_tiny.yaml)")
    parser.add_argument("--world-size", type=int, default=None, help="ranks of the run: validates the layout")
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="ranks per node (default: all on one): which collective families run inside a node and which across",
    )
    parser.add_argument("--device-memory-gib", type=float, default=64.0, help="memory of one accelerator (64)")
    parser.add_argument(
        "--images-per-sample",
        type=int,
        default=None,
        help="images per sample for the activation estimate (default: synthetic data's setting, else 1)",
    )
    parser.add_argument(
        "--image-size",
        type=int,
        default=None,
        help="square image side in pixels (default: synthetic data's setting, else the vision config's image_size)",
    )
    parser.add_argument(
        "--videos-per-sample",
        type=int,
        default=None,
        help="videos per sample (default: 1 when the synthetic data has videos, else 0)",
    )
    parser.add_argument(
        "--video-frames",
        type=int,
        default=None,
        help="sampled frames per video (default: data.synthetic_video_frames, else data.video_max_frames)",
    )
    parser.add_argument(
        "--deepspeed",
        default=None,
        metavar="DS_CONFIG",
        help="translate this ds_config onto the config for --world-size ranks, as `train --deepspeed` does",
    )
    add_storage_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides applied after the YAML file")
    args = parser.parse_args(argv)
    for flag in (
        "world_size",
        "nproc_per_node",
        "images_per_sample",
        "image_size",
        "videos_per_sample",
        "video_frames",
    ):
        value = getattr(args, flag)
        if value is not None and value < (0 if flag in ("images_per_sample", "videos_per_sample") else 1):
            raise UserError(f"--{flag.replace('_', '-')} = {value} is invalid: pass a positive integer.")
    if args.deepspeed and args.world_size is None:
        raise UserError("--deepspeed needs --world-size: the ds_config's batch and layout hold for one world size.")
    if args.device_memory_gib <= 0:
        raise UserError(f"--device-memory-gib = {args.device_memory_gib} is invalid: pass a positive number.")
    check_storage_arguments(args)
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)  # before the model code imports torch
        from glm45v_fsdp.tools.preflight_report import build_report, format_report

        report = build_report(args)
    except UserError as error:
        print(f"preflight: error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    for error in report["errors"]:
        print(f"preflight: error: {error}", file=sys.stderr)
    return EXIT_USER_ERROR if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
