"""The options and checks the training-run scenarios share (memory, ep, longest, matrix): where the runs go, how long
each may take, its threads, the user's overrides; and the command line a report records."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from glm45v_fsdp.errors import UserError

DEVICES = ("cpu", "cuda", "npu")


def add_run_options(parser: argparse.ArgumentParser, out: Path, threads_help: str) -> None:
    """--out, --run-timeout, --threads and the trailing overrides."""
    parser.add_argument("--out", type=Path, default=out, help="output directory")
    parser.add_argument("--run-timeout", type=float, default=None, help="seconds allowed per training run")
    parser.add_argument("--threads", type=int, default=None, help=threads_help)
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides for every run (applied last)")


def check_counts(bench: str, args: argparse.Namespace, keys: tuple[str, ...]) -> None:
    """Each of `keys` at least 1, and --warmup (where the scenario has one) in [0, --steps)."""
    for key in keys:
        if getattr(args, key) < 1:
            raise UserError(f"bench {bench}: --{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}.")
    if hasattr(args, "warmup") and not 0 <= args.warmup < args.steps:
        raise UserError(
            f"bench {bench}: --warmup must be in [0, --steps), got {args.warmup} with --steps {args.steps}."
        )


def settle(args: argparse.Namespace, argv: list[str], device: str) -> None:
    """Record the command line; one thread per rank on a CPU unless --threads says otherwise (on a shared CPU machine
    more threads turn other load into spin-waits that make a step's time random)."""
    args.argv = argv
    if args.threads is None and device == "cpu":
        args.threads = 1


def bench_command(argv: list[str]) -> list[str]:
    """The command that reproduces a report, as the report records it."""
    return [sys.executable, "-m", "glm45v_fsdp.tools.bench", *argv]


def announce_failures(bench: str, rows: list[dict[str, Any]]) -> None:
    failed = [row["label"] for row in rows if not row["pass"]]
    if failed:
        print(f"bench {bench}: below target: {', '.join(failed)}")
