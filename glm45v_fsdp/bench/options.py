"""The options and checks the benches share: the counts most take (--device, --ranks, --steps, --warmup,
--repeats), the model-shape knobs of the training-run scenarios, where the runs go, how long each may take, its
threads, the user's overrides; the command line a report records and the head of a report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from glm45v_fsdp.errors import UserError

DEVICES = ("cpu", "cuda", "npu")

# each shared option: (type, the help it gives unless a bench says more); a bench names those it takes
SHARED_OPTIONS: dict[str, tuple[Any, str]] = {
    "device": (str, "device of every run"),
    "ranks": (int, "processes per run (torchrun when > 1)"),
    "steps": (int, "training steps per run"),
    "warmup": (int, "first steps left out of the step time"),
    "repeats": (int, "runs per configuration, round-robin"),
    "micro": (int, "micro batch per rank"),
    "tokens": (int, "tokens of each rank's micro batch (one sample)"),
    "images": (int, "synthetic 56 px images per sample"),
    "hidden": (int, "text hidden size (heads of 32 dims)"),
    "text_layers": (int, "text decoder layers (the first is dense)"),
    "experts": (int, "routed experts per MoE layer"),
    "top_k": (int, "experts per token"),
    "moe_intermediate": (int, "each expert's intermediate size"),
    "out": (Path, "output directory"),
    "run_timeout": (float, "seconds allowed per training run"),
    "threads": (int, "OMP_NUM_THREADS per rank"),
}


def add_documented_parser(sub: Any, name: str, help: str, module_doc: str | None) -> argparse.ArgumentParser:
    """A bench's subcommand whose --help prints its module's docstring as written (line breaks and tables kept)."""
    return sub.add_parser(name, help=help, description=module_doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_options(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """The shared options `defaults` names, in its order, each with this bench's default (None: decided later, by
    `settle` or a preset). A bench that means more by one of them adds it itself, with its own help."""
    for name, default in defaults.items():
        kind, text = SHARED_OPTIONS[name]
        if name == "threads" and default is None:
            text += " (default: 1 on cpu)"
        typed = {"choices": DEVICES} if name == "device" else {"type": kind}
        parser.add_argument(f"--{name.replace('_', '-')}", default=default, help=text, **typed)


def add_run_options(parser: argparse.ArgumentParser, out: Path, **defaults: Any) -> None:
    """The options of a bench of training runs: the shared ones `defaults` names (see `add_options`), --out,
    --run-timeout, --threads (1 on a CPU unless set) and the trailing overrides."""
    add_options(parser, **defaults, out=out, run_timeout=None, threads=None)
    add_overrides(parser)


def add_overrides(
    parser: argparse.ArgumentParser, help: str = "key.path=value overrides for every run (applied last)"
) -> None:
    parser.add_argument("overrides", nargs="*", help=help)


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


def report_head(bench: str, args: argparse.Namespace, *keys: str) -> dict[str, Any]:
    """The first keys of a bench's JSON report: its name, the options `keys` names, the command that reproduces it."""
    return {"benchmark": bench, **{key: getattr(args, key) for key in keys}, "command": bench_command(args.argv)}


def announce_failures(bench: str, rows: list[dict[str, Any]]) -> None:
    failed = [row["label"] for row in rows if not row["pass"]]
    if failed:
        print(f"bench {bench}: below target: {', '.join(failed)}")
