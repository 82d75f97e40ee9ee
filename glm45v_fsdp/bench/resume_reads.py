"""The bytes a resume reads, against the size of the checkpoint it resumes (issue 54: each file verified once per job).

Method: a seed run saves a DCP checkpoint at step 2 (size S: the sum of its files). Then two runs that each train
one step and save once: a fresh one (from scratch) and a resume (training.resume=auto from the seed's step 2).
Every rank runs the trainer under `python -m glm45v_fsdp.bench.resume_reads ...`, which writes the process's
`/proc/self/io` rchar (bytes read through read(2) and kin, page cache or not) when the run ends. The resume's reads
are the resume run's sum over its ranks minus the fresh run's: the checksums, the DCP load, the trainer state and
RNG files. The figure is that difference / S: reading each file once to verify and once to load makes about 2.

    python -m glm45v_fsdp.tools.bench resume-reads --ranks 4 --out output/bench/resume_reads [overrides...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from glm45v_fsdp.bench.options import add_documented_parser

HELP = "the bytes a DCP resume reads over its checkpoint's size (each file verified once per job)"

READS_DIR_ENV = "GLM45V_READS_DIR"  # where each rank leaves reads-rank{R}.json
Launch = Callable[[list[str], int, dict[str, str]], subprocess.CompletedProcess]


def rchar() -> int:
    """Bytes this process has read (/proc/self/io rchar: every thread's, the finished ones' too)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == "rchar":
            return int(value)
    raise RuntimeError("/proc/self/io has no rchar line")


def worker(argv: list[str]) -> None:
    """Rank's side: the trainer's run with `argv`, then this process's rchar into $GLM45V_READS_DIR."""
    from glm45v_fsdp.train import end_process, run

    run(argv)
    reads = Path(os.environ[READS_DIR_ENV]) / f"reads-rank{os.environ.get('RANK', '0')}.json"
    reads.write_text(json.dumps({"rchar": rchar()}) + "\n")
    end_process(0)


def checkpoint_bytes(checkpoint: Path) -> int:
    return sum(file.stat().st_size for file in checkpoint.rglob("*") if file.is_file())


def _run(launch: Launch, root: Path, name: str, nproc: int, overrides: list[str]) -> int:
    """One run's bytes read, summed over its ranks."""
    reads_dir = root / f"{name}-reads"
    reads_dir.mkdir(parents=True)
    argv = [f"training.output_dir={root / name}", "training.progress_bar=false", *overrides]
    result = launch(["-m", "glm45v_fsdp.bench.resume_reads", *argv], nproc, {READS_DIR_ENV: str(reads_dir)})
    if result.returncode != 0:
        raise RuntimeError(f"bench resume_reads: run {name} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    files = sorted(reads_dir.glob("reads-rank*.json"))
    assert len(files) == nproc, f"{name}: {len(files)} of {nproc} ranks reported their reads"
    return sum(json.loads(file.read_text())["rchar"] for file in files)


def measure(root: Path, nproc: int, launch: Launch, overrides: list[str] = ()) -> dict:
    """Seed, fresh and resume runs under `root` at `nproc` ranks -> the figures (see the module's docstring)."""
    save = root / "save"
    _run(launch, root, "seed", nproc, ["training.train_iters=2", f"training.save={save}", *overrides])
    size = checkpoint_bytes(save / "step_00000002")
    one_step = ["training.save_interval=1", *overrides]
    fresh = _run(launch, root, "fresh", nproc, ["training.train_iters=1", f"training.save={root / 'fresh_save'}",
                                                 *one_step])  # fmt: skip
    resumed = _run(launch, root, "resume", nproc, ["training.train_iters=3", f"training.save={save}",
                                                   "training.resume=auto", *one_step])  # fmt: skip
    return {"ranks": nproc, "checkpoint_bytes": size, "fresh_rchar": fresh, "resume_rchar": resumed,
            "resume_reads_over_checkpoint": (resumed - fresh) / size}  # fmt: skip


def torchrun_launch(argv: list[str], nproc: int, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`python ARGV` as one process, or under torchrun on `nproc` local ranks."""
    from glm45v_fsdp.bench.runner import child_env, torchrun_command

    command = [sys.executable, *argv] if nproc == 1 else torchrun_command(nproc, argv[1], argv[2:])
    return subprocess.run(command, env={**child_env(1), **env}, capture_output=True, text=True)


def add_parser(sub: Any) -> None:
    parser = add_documented_parser(sub, "resume-reads", HELP, __doc__)
    parser.add_argument("--ranks", type=int, default=4, help="processes of each run (torchrun when > 1)")
    parser.add_argument("--out", type=Path, required=True, help="a new directory for the runs")
    parser.add_argument("overrides", nargs="*", help="training overrides, e.g. a larger model")


def main_resume_reads(args: argparse.Namespace, argv: list[str]) -> int:
    result = measure(args.out, args.ranks, torchrun_launch, args.overrides)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":  # a rank of one of the measured runs (measure sets READS_DIR_ENV)
    assert os.environ.get(READS_DIR_ENV), "run the benchmark as: python -m glm45v_fsdp.tools.bench resume-reads"
    worker(sys.argv[1:])
