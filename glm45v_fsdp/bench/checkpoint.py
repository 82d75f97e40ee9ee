"""`python -m glm45v_fsdp.tools.bench checkpoint`: what the checksums cost a save.

One training run saves a checkpoint at every step (sync or, with --async-save, in the background); rank 0's log
line of each save gives the save's seconds and the seconds rank 0 spent on its checksums after writing its files
(the digests are taken as the files are written, checkpoint/digest_on_write.py: what is left is the part file and
the files others wrote). The report: per save, the share of the save the checksums took, its median (goal: at most
5 %). Then the other way, as saves did before: the last checkpoint's files read back and hashed (while they are in
the page cache), timed here, and the digests compared with its manifest (they must be the same). The model is the
built-in tiny one unless the overrides say otherwise (e.g. model.config_overrides.text_config.hidden_size=512 for
larger files).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Any

from glm45v_fsdp.bench.options import add_run_options, check_counts, report_head, settle
from glm45v_fsdp.bench.runner import Run, Runner, md_report, write_report

HELP = "the checksums' share of a checkpoint save, and their throughput"
DESCRIPTION = "One training run saving at every step; rank 0's log gives each save's and its checksums' time."

GOAL_PCT = 5.0
_SAVED = re.compile(r"checkpoint saved: (\S+) \(([\d.]+) s(?:, background write)?; checksums of rank 0's ([\d,]+) "
                    r"bytes ([\d.]+) s\)")  # fmt: skip


def saves(log: str) -> list[dict[str, Any]]:
    """Each published checkpoint of a training log: its save and checksum seconds and the bytes hashed."""
    return [
        {"checkpoint": Path(path).name, "save_s": float(save), "bytes": int(size.replace(",", "")),
         "checksum_s": float(hashed)}
        for path, save, size, hashed in _SAVED.findall(log)
    ]  # fmt: skip


def read_back(save_dir: Path) -> dict[str, Any]:
    """The newest checkpoint's checksums taken by reading its files back (integrity.checksums without write-time
    digests), timed, and whether they equal its manifest's (taken as the files were written)."""
    import time

    from glm45v_fsdp.checkpoint import integrity
    from glm45v_fsdp.checkpoint.dcp import complete_checkpoints

    checkpoint = complete_checkpoints(save_dir)[-1]
    listed = json.loads((checkpoint / integrity.MANIFEST_FILE).read_text())["files"]
    started = time.perf_counter()
    hashed = integrity.checksums(checkpoint, [checkpoint / name for name in listed])
    seconds = time.perf_counter() - started
    size = sum(entry["bytes"] for entry in hashed.values())
    return {"checkpoint": checkpoint.name, "bytes": size, "s": seconds, "gb_per_s": size / max(seconds, 1e-9) / 1e9,
            "same_as_manifest": hashed == listed}  # fmt: skip


def report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    timed = rows[args.warmup :]
    shares = [100.0 * row["checksum_s"] / row["save_s"] for row in timed]
    throughput = sum(row["bytes"] for row in timed) / max(1e-9, sum(row["checksum_s"] for row in timed))
    share = statistics.median(shares)
    return {
        **report_head("checkpoint", args, "async_save"),
        "saves": rows,
        "checksum_share_pct_median": share,
        "checksum_gb_per_s": throughput / 1e9,
        "goal_pct": GOAL_PCT,
        "pass": share <= GOAL_PCT,
        "notes": [
            f"{len(timed)} saves after the first {args.warmup}; share = rank 0's checksum seconds / the save's "
            "seconds (both from rank 0's log line); throughput = bytes hashed / hashing seconds over those saves.",
            f"OMP_NUM_THREADS per rank: {args.threads}.",
        ],
    }


def markdown(result: dict[str, Any]) -> str:
    columns = ("checkpoint", "save s", "bytes hashed (rank 0)", "checksum s", "share")
    cells = [
        [row["checkpoint"], f"{row['save_s']:.3f}", f"{row['bytes']:,}", f"{row['checksum_s']:.4f}",
         f"{100.0 * row['checksum_s'] / row['save_s']:.2f}%"]
        for row in result["saves"]
    ]  # fmt: skip
    verdict = "pass" if result["pass"] else "FAIL"
    title = f"Checkpoint checksums: their share of a save ({'async' if result['async_save'] else 'sync'} saves)"
    share = (
        f"median share {result['checksum_share_pct_median']:.2f}% (goal <= {GOAL_PCT:g}%): {verdict}; "
        f"{result['checksum_gb_per_s']:.2f} GB/s of rank 0's files per second of its checksum time"
    )
    notes = [share, *result["notes"]]
    if "read_back" in result:
        back = result["read_back"]
        notes.append(
            f"read back (how saves took checksums before): {back['checkpoint']}'s {back['bytes']:,} bytes hashed in "
            f"{back['s']:.4f} s ({back['gb_per_s']:.2f} GB/s, page cache); the same digests as its manifest: "
            f"{'yes' if back['same_as_manifest'] else 'NO'}"
        )
    return "\n".join(md_report(title, columns, cells, notes)) + "\n"


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("checkpoint", help=HELP, description=DESCRIPTION)
    parser.add_argument("--steps", type=int, default=12, help="training steps, one save each")
    parser.add_argument("--warmup", type=int, default=2, help="first saves left out")
    parser.add_argument("--async-save", action="store_true", help="training.async_save=true")
    add_run_options(parser, Path("output/bench/checkpoint"), ranks=1)


def main_checkpoint(args: argparse.Namespace, argv: list[str]) -> int:
    check_counts("checkpoint", args, ("ranks", "steps"))
    settle(args, argv, "cpu")
    runner = Runner("bench checkpoint", args.out, args.ranks, args.threads, args.run_timeout)
    run_dir = runner.run_dir("saves")
    overrides = [
        f"training.output_dir={run_dir}",
        f"training.save={run_dir / 'save'}",
        f"training.train_iters={args.steps}",
        "training.save_interval=1",
        "training.save_keep_last=2",
        f"training.async_save={str(args.async_save).lower()}",
        "training.progress_bar=false",
        *args.overrides,
    ]
    runner.train(Run("saves", overrides), overrides, run_dir)
    rows = saves((run_dir / "train.log").read_text())
    result = report(args, rows)
    result["read_back"] = back = read_back(run_dir / "save")
    result["pass"] &= back["same_as_manifest"]
    write_report(args.out, "checkpoint", result, markdown(result))
    print(markdown(result))
    return 0
