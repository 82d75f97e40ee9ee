"""`python -m glm45v_fsdp.tools.bench checkpoint-scaling`: a DCP checkpoint's save, verify and load at 1, 2 and 4
ranks (CPU, gloo): seconds and bytes read and written per rank, beside the planner's model of the same checkpoint.

Each rank count is one torchrun job of `python -m glm45v_fsdp.bench.checkpoint_scaling` (no trainer): a stack of
bias-free square linears of about --mib MiB of checkpoint (weights + AdamW's two moments, fp32) under FSDP2, one
AdamW step, then
- save: the trainer's Checkpointer (DCP, checksums taken as written, manifest, publish), and the same files' checksums
  taken the old way, read back (integrity.checksums without the write-time digests: the digests must agree);
- verify: integrity.verify, collective (each file hashed once, by one rank, split by bytes);
- load: checkpoint.dcp.load_checkpoint (model and optimizer, strict).
Every phase starts after a barrier; a rank's seconds are its own (wall, which for verify includes waiting in the
verdict's collective for the slowest rank, and CPU: the process's user + system seconds, every thread's), its bytes
`/proc/self/io` rchar / wchar deltas (bytes through read(2) / write(2), page cache or not). With --cold each rank
drops the checkpoint's files from the page cache (posix_fadvise DONTNEED, no privileges needed) before verify and
load, so they read from the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from glm45v_fsdp.bench.options import add_documented_parser
from glm45v_fsdp.bench.runner import md_table, write_report

HELP = "a DCP checkpoint's save / verify / load seconds and bytes at 1, 2 and 4 ranks (CPU)"

RANKS = (1, 2, 4)


def io_counters() -> dict[str, int]:
    """This process's /proc/self/io rchar and wchar."""
    counters = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {"rchar": int(counters["rchar"]), "wchar": int(counters["wchar"])}


def _evict(directory: Path) -> None:
    """Drop `directory`'s files from the page cache (their pages are clean: DCP and our writers fsync)."""
    for file in directory.rglob("*"):
        if file.is_file():
            descriptor = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(descriptor)


def _phase(name: str, run: Any, figures: dict[str, Any]) -> Any:
    """`run()` after a barrier: its seconds and this rank's bytes read and written into figures[name]."""
    import torch.distributed as dist

    dist.barrier()
    before, started, cpu = io_counters(), time.perf_counter(), time.process_time()
    result = run()
    seconds, cpu, after = time.perf_counter() - started, time.process_time() - cpu, io_counters()
    read, written = after["rchar"] - before["rchar"], after["wchar"] - before["wchar"]
    figures[name] = {"s": seconds, "cpu_s": cpu, "read": read, "written": written}
    return result


def worker(out: Path, mib: float, cold: bool) -> None:
    """One rank of one job: save, verify, load; its figures into out/rank{R}.json."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from glm45v_fsdp.checkpoint import integrity
    from glm45v_fsdp.checkpoint.dcp import Checkpointer, checkpoint_name, load_checkpoint, own_files
    from glm45v_fsdp.config import TrainingConfig

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    width, layers = layer_shape(mib)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).square().mean().backward()
    optimizer.step()
    checkpointer = Checkpointer(TrainingConfig(save=str(out / "save")), rank)
    figures: dict[str, Any] = {"rank": rank}
    state = {"step": 1}
    _phase("save", lambda: checkpointer.save(1, model, optimizer, state, {"torch": torch.get_rng_state()}), figures)
    dist.barrier()  # rank 0 has published it
    checkpoint = out / "save" / checkpoint_name(1)
    manifest = json.loads((checkpoint / integrity.MANIFEST_FILE).read_text())["files"]
    mine = own_files(checkpoint, rank)
    read_back = _phase("read_back", lambda: integrity.checksums(checkpoint, mine), figures)
    assert all(manifest[name] == entry for name, entry in read_back.items()), "write-time and read-back digests"
    figures["own_bytes"] = sum(entry["bytes"] for entry in read_back.values())
    figures["checkpoint_bytes"] = sum(entry["bytes"] for entry in manifest.values())
    if cold:
        _evict(checkpoint)
    problem = _phase("verify", lambda: integrity.verify(checkpoint), figures)
    assert problem is None, problem
    if cold:
        _evict(checkpoint)
    _phase("load", lambda: load_checkpoint(model, optimizer, checkpoint, strict=True), figures)
    (out / f"rank{rank}.json").write_text(json.dumps(figures) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def layer_shape(mib: float) -> tuple[int, int]:
    """(width, layers) of the linears: 1024 wide, as many as make about `mib` MiB of weights + two moments (fp32)."""
    width = 1024
    return width, max(1, round(mib * 2**20 / (3 * 4 * width * width)))


def run_job(out: Path, ranks: int, mib: float, cold: bool, timeout: float) -> list[dict[str, Any]]:
    """One torchrun job of `ranks` processes; each rank's figures."""
    from glm45v_fsdp.bench.runner import child_env, torchrun_command

    out.mkdir(parents=True)
    arguments = ["--worker", "--out", str(out), "--mib", str(mib), *(["--cold"] if cold else [])]
    command = torchrun_command(ranks, "glm45v_fsdp.bench.checkpoint_scaling", arguments)
    result = subprocess.run(command, env=child_env(1), capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:  # the ranks' own lines ([rankR]: ...) say why, not torchrun's summary
        ranks_said = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("[rank")]
        detail = "\n".join(ranks_said)[-3000:] or result.stderr[-3000:]
        raise RuntimeError(f"bench checkpoint-scaling: {ranks} rank(s) failed ({result.returncode}):\n{detail}")
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(ranks)]


def modelled(mib: float, ranks: int) -> dict[str, Any]:
    """The planner's checkpoint model of the same stack (planner/checkpoint_time.py): its bytes per rank."""
    from glm45v_fsdp.memory.estimate import ParamSpec, ShardLayout
    from glm45v_fsdp.planner.checkpoint_time import sizes

    width, layers = layer_shape(mib)
    specs = [ParamSpec(f"{i}.weight", (width, width), 4, True, str(i)) for i in range(layers)]
    found = sizes(specs, ShardLayout(ranks, sharded=ranks > 1), ranks)
    return {"checkpoint_bytes": found.dcp, "max_rank_bytes": max(found.dcp_per_rank)}


def summarize(ranks: int, figures: list[dict[str, Any]], model: dict[str, Any]) -> dict[str, Any]:
    def worst(phase: str) -> float:
        return max(rank[phase]["s"] for rank in figures)

    def total(phase: str, what: str) -> int:
        return sum(rank[phase][what] for rank in figures)

    size = figures[0]["checkpoint_bytes"]
    return {
        "ranks": ranks,
        "checkpoint_bytes": size,
        "modelled_checkpoint_bytes": model["checkpoint_bytes"],
        "save_s": worst("save"),
        "save_written": total("save", "written"),
        "save_written_per_rank_max": max(rank["save"]["written"] for rank in figures),
        "read_back_s": max(rank["read_back"]["s"] for rank in figures),
        "verify_s_per_rank": worst("verify"),
        "verify_cpu_s_per_rank": max(rank["verify"]["cpu_s"] for rank in figures),
        "verify_read": total("verify", "read"),
        "verify_read_per_rank_max": max(rank["verify"]["read"] for rank in figures),
        "load_s": worst("load"),
        "load_read": total("load", "read"),
        "per_rank": figures,
    }


def markdown(result: dict[str, Any]) -> str:
    mb = 1e6
    columns = ("ranks", "checkpoint MB (model)", "save s", "written MB (max rank)", "read-back checksums s",
               "verify s (CPU s) per rank", "verify read MB (max rank)", "load s", "load read MB")  # fmt: skip
    cells = [
        [row["ranks"], f"{row['checkpoint_bytes'] / mb:.1f} ({row['modelled_checkpoint_bytes'] / mb:.1f})",
         f"{row['save_s']:.3f}", f"{row['save_written'] / mb:.1f} ({row['save_written_per_rank_max'] / mb:.1f})",
         f"{row['read_back_s']:.3f}", f"{row['verify_s_per_rank']:.3f} ({row['verify_cpu_s_per_rank']:.3f})",
         f"{row['verify_read'] / mb:.1f} ({row['verify_read_per_rank_max'] / mb:.1f})", f"{row['load_s']:.3f}",
         f"{row['load_read'] / mb:.1f}"]
        for row in result["rows"]
    ]  # fmt: skip
    falls, cpu_falls = result["verify_per_rank_falls"], result["verify_cpu_per_rank_falls"]
    cache = "cold page cache (posix_fadvise DONTNEED before verify and load)" if result["cold"] else "warm page cache"
    lines = [
        "# Checkpoint save / verify / load by rank count (CPU, gloo)",
        "",
        *md_table(columns, cells),
        "",
        f"- as ranks grow, verify's wall seconds per rank fall: {'yes' if falls else 'NO'}; its CPU seconds per rank "
        f"fall: {'yes' if cpu_falls else 'NO'}; the bytes each rank reads to verify fall as 1 / ranks (each file "
        "hashed once, by one rank). Wall seconds include the verdict's collective and, with more ranks than cores, "
        "the ranks' turns on the cores.",
        f"- {cache}; seconds are the slowest rank's; bytes are /proc/self/io rchar / wchar deltas summed over the "
        "ranks.",
        "- read-back checksums: the save's checksums the old way (each rank reads its files back and hashes them), "
        "which the write-time digests replace; both give the same manifest (asserted).",
        f"- {result['cpus']} CPUs, load average {', '.join(f'{v:.2f}' for v in result['load_average'])} at the end.",
        f"- command: {' '.join(result['command'])}",
    ]
    return "\n".join(lines) + "\n"


def add_parser(sub: Any) -> None:
    parser = add_documented_parser(sub, "checkpoint-scaling", HELP, __doc__)
    parser.add_argument("--ranks", default="1,2,4", help="rank counts, comma-separated")
    parser.add_argument("--mib", type=float, default=192.0, help="about this many MiB of checkpoint (default 192)")
    parser.add_argument("--cold", action="store_true", help="drop the files from the page cache before verify/load")
    parser.add_argument("--out", type=Path, default=Path("output/bench/checkpoint_scaling"), help="a new directory")
    parser.add_argument("--run-timeout", type=float, default=600.0, help="seconds allowed per job")


def main_checkpoint_scaling(args: argparse.Namespace, argv: list[str]) -> int:
    from glm45v_fsdp.bench.options import bench_command

    ranks = [int(part) for part in args.ranks.split(",") if part.strip()]
    rows = []
    for count in ranks:
        figures = run_job(args.out / f"ranks{count}", count, args.mib, args.cold, args.run_timeout)
        rows.append(summarize(count, figures, modelled(args.mib, count)))

    def falls(key: str) -> bool:
        values = [row[key] for row in rows]
        return all(later < earlier for earlier, later in zip(values, values[1:]))

    result = {
        "benchmark": "checkpoint-scaling",
        "command": bench_command(argv),
        "cold": args.cold,
        "mib": args.mib,
        "rows": rows,
        "verify_per_rank_falls": falls("verify_s_per_rank"),
        "verify_cpu_per_rank_falls": falls("verify_cpu_s_per_rank"),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
    }
    write_report(args.out, "checkpoint_scaling", result, markdown(result))
    return 0


if __name__ == "__main__":  # a rank of one job (run_job starts it under torchrun)
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mib", type=float, required=True)
    parser.add_argument("--cold", action="store_true")
    options = parser.parse_args(sys.argv[1:])
    worker(options.out, options.mib, options.cold)
