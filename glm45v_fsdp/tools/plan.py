"""Plan a job's layout before renting the cluster: every layout that fits, ranked by a modelled step time.

  python -m glm45v_fsdp.tools.plan --config glm45v_106b_sft --nodes 16 --nproc-per-node 8 --device 910b \\
      --tokens 8192 --global-batch 128 [--top 10] [--json] [--explain LAYOUT] [--custom key=value,...]
  python -m glm45v_fsdp.tools.plan ... --deepspeed ds_config.json   (the layout that ds_config runs, and its place)
  python -m glm45v_fsdp.tools.plan --calibrate [--calibration FILE]     (measure this machine: the cpu preset)
  python -m glm45v_fsdp.tools.plan --validate [--calibration FILE]      (model vs measured on the tiny model here)

Layouts: expert, Ulysses, Ring and HSDP replicate sizes, recompute off/selective/full, chunk loss off/static/dynamic,
FSDP unit size, micro batch (accumulation keeps the global batch). Memory by preflight's estimator, step time by
glm45v_fsdp.planner (docs/planning.md: every term and assumption); the best layout's checkpoint sizes and save,
verify and resume times at --fs-gbps / --fs-node-gbps by glm45v_fsdp/planner/checkpoint_time.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from glm45v_fsdp.errors import EXIT_USER_ERROR, UserError
from glm45v_fsdp.tools.preflight import add_storage_arguments, check_storage_arguments

DEFAULT_CALIBRATION = Path("output/plan/cpu_calibration.json")
PRESET_NAMES = ("910b", "910b3", "a3", "h100", "h200", "cpu")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m glm45v_fsdp.tools.plan",
        description="Search the layouts of a job that fit the device memory and rank them by modelled ms/step.",
    )
    parser.add_argument("--config", default=None, help="YAML config (default: configs/glm45v_tiny.yaml)")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--nproc-per-node", type=int, default=None, help="ranks per node (default: the device's)")
    parser.add_argument("--device", default="910b", choices=PRESET_NAMES, help="device preset (docs/planning.md)")
    parser.add_argument("--custom", default="", help="preset fields to change: key=value,... (e.g. inter_gbps=50)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per sample (default: data.cutoff_len)")
    parser.add_argument("--global-batch", type=int, default=None, help="samples per step (default: the config's)")
    parser.add_argument("--images-per-sample", type=int, default=None)
    parser.add_argument("--image-size", type=int, default=None)
    parser.add_argument(
        "--videos-per-sample", type=int, default=None, help="videos per sample (default: see preflight)"
    )
    parser.add_argument("--video-frames", type=int, default=None, help="sampled frames per video")
    parser.add_argument("--top", type=int, default=10, help="layouts to print")
    add_storage_arguments(parser)
    parser.add_argument("--unit-mib", default="default,512", help="FSDP unit sizes to try (default = the device's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--explain", default=None, metavar="LAYOUT", help="every term of one layout (a printed name)")
    parser.add_argument(
        "--deepspeed",
        default=None,
        metavar="DS_CONFIG",
        help="explain the layout this ds_config runs (translated as `train --deepspeed` does) and place it",
    )
    parser.add_argument("--calibrate", action="store_true", help="measure this machine's rates (the cpu preset)")
    parser.add_argument("--validate", action="store_true", help="model vs measured ms/iter of tiny layouts here")
    parser.add_argument("--steps", type=int, default=20, help="--validate: steps per run")
    parser.add_argument("--repeats", type=int, default=2, help="--validate: runs per layout (alternating order)")
    parser.add_argument("--calibration", type=Path, default=DEFAULT_CALIBRATION, help="the cpu preset's file")
    parser.add_argument("--out", type=Path, default=Path("output/plan"), help="--validate: report directory")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides applied after the YAML file")
    args = parser.parse_args(argv)
    for flag in ("nodes", "nproc_per_node", "tokens", "global_batch", "top", "steps", "repeats", "video_frames"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserError(f"--{flag.replace('_', '-')} = {value} is invalid: pass a positive integer.")
    if args.videos_per_sample is not None and args.videos_per_sample < 0:
        raise UserError(f"--videos-per-sample = {args.videos_per_sample} is invalid: pass 0 or more.")
    check_storage_arguments(args)
    other = next((flag for flag in ("explain", "calibrate", "validate") if getattr(args, flag)), None)
    if args.deepspeed and other:
        raise UserError(f"--deepspeed and --{other} ask for different reports: pass one of them.")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)  # before the model code imports torch
        if args.calibrate:
            from glm45v_fsdp.planner.calibrate import calibrate

            device = calibrate(args.calibration)
            print(json.dumps({"calibration": str(args.calibration), "device": device.__dict__}, indent=1))
            return 0
        if args.validate:
            from glm45v_fsdp.bench.plan_validation import validate

            return validate(args)
        if args.deepspeed:
            from glm45v_fsdp.tools.plan_deepspeed import run_deepspeed_plan

            return run_deepspeed_plan(args)
        from glm45v_fsdp.tools.plan_report import run_plan

        return run_plan(args)
    except UserError as error:
        print(f"plan: error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
