"""`deepspeed.utils.numa`: pin each rank of a node to its own CPU cores (and their NUMA memory) with numactl.

`get_numactl_cmd(bind_core_list, num_local_procs, local_rank)` splits the cores (the `--bind_core_list` ranges, else
every physical core) evenly over the node's ranks and returns `numactl [-m NODES | -p NODE] -C CORES`, as
deepspeed's launcher prefixes each rank with it under `--bind_cores_to_rank`: memory from the NUMA node holding all
of the rank's cores, its fake-NUMA siblings, or (flat HBM) the memory-only node paired with it.

ds-fsdp's torchrun ranks run through `python -m ds_compat.utils.numa [--bind_core_list L] -- COMMAND`, which binds
the rank from LOCAL_RANK / LOCAL_WORLD_SIZE, sets OMP_NUM_THREADS to its core count and execs numactl.
The topology is read from sysfs (what `numactl --hardware` prints), so no numactl is needed to compute it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from ds_compat._common import DeepSpeedAssertion

SYSFS_NODES = Path("/sys/devices/system/node")
SYSFS_CPUS = Path("/sys/devices/system/cpu")


def parse_range(rng: str) -> range:
    """'5' -> range(5, 6); '2-7' -> range(2, 8)."""
    first, dash, last = rng.strip().partition("-")
    bounds = (first, last) if dash else (first, first)
    if not all(bound.strip().isdigit() for bound in bounds):
        raise ValueError(f"'{rng}' is not a core number or a FIRST-LAST range of core numbers, e.g. 4 or 0-15")
    start, end = int(bounds[0]), int(bounds[1])
    if start > end:
        raise ValueError(f"'{rng}' runs backwards: write the lower core number first, e.g. {end}-{start}")
    return range(start, end + 1)


def parse_range_list(range_str: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]; the ranges must ascend without overlapping."""
    cores: list[int] = []
    for part in range_str.split(","):
        span = parse_range(part)
        if cores and span[0] <= cores[-1]:
            raise ValueError(
                f"'{range_str}': each range must start above the previous one's last core (ascending, no overlaps)"
            )
        cores.extend(span)
    return cores


def get_numa_cores() -> list[list[int]]:
    """The CPU ids of every NUMA node in node order ([] for a memory-only node such as HBM); [] without NUMA."""
    nodes = sorted(SYSFS_NODES.glob("node[0-9]*"), key=lambda path: int(path.name[4:]))
    lists = [(node / "cpulist").read_text().strip() if (node / "cpulist").is_file() else "" for node in nodes]
    return [parse_range_list(text) if text else [] for text in lists]


def physical_core_count() -> int:
    """Physical cores (hyper-threads of one core count once), as psutil.cpu_count(logical=False)."""
    cores = set()
    for topology in SYSFS_CPUS.glob("cpu[0-9]*/topology"):
        package, core = topology / "physical_package_id", topology / "core_id"
        if package.is_file() and core.is_file():
            cores.add((package.read_text().strip(), core.read_text().strip()))
    return len(cores) or os.cpu_count() or 1


def check_for_numactl_pkg() -> bool:
    if shutil.which("numactl") is None:
        print("please install the numactl package (apt/yum install numactl)")
        return False
    return True


def _memory_binding(cores: list[int], numa_cores: list[list[int]]) -> list[str]:
    """numactl's memory flags for a rank on `cores`: none when no node holds all of them."""
    home = next((node for node, cpus in enumerate(numa_cores) if cpus and set(cores) <= set(cpus)), None)
    if home is None:
        return []
    with_cpus = [node for node, cpus in enumerate(numa_cores) if cpus]
    memory_only = [node for node, cpus in enumerate(numa_cores) if not cpus]
    if memory_only and len(memory_only) == len(with_cpus):  # flat HBM: each CPU node has its memory-only twin
        return ["-p", str(memory_only[with_cpus.index(home)])]
    # fake NUMA splits one node into neighbours with the same CPUs: the memory of all of them
    first, last = home, home
    while first > 0 and numa_cores[first - 1] == numa_cores[home]:
        first -= 1
    while last + 1 < len(numa_cores) and numa_cores[last + 1] == numa_cores[home]:
        last += 1
    return ["-m", ",".join(map(str, range(first, last + 1)))]


def _compress(cores: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    spans: list[list[int]] = []
    for core in cores:
        if spans and core == spans[-1][1] + 1:
            spans[-1][1] = core
        else:
            spans.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def get_numactl_cmd(bind_core_list: str | None, num_local_procs: int, local_rank: int) -> tuple[int, list[str]]:
    """(cores per rank, the numactl command that binds rank `local_rank` of `num_local_procs` on this node)."""
    check_for_numactl_pkg()
    if "KMP_AFFINITY" in os.environ:
        raise ValueError(
            f"KMP_AFFINITY={os.environ['KMP_AFFINITY']} is set: OpenMP would pin threads itself and fight numactl's "
            "core binding. Unset KMP_AFFINITY before launching."
        )
    if not 0 <= local_rank < num_local_procs:
        raise ValueError(
            f"local rank {local_rank} is not one of the {num_local_procs} ranks of this node: pass 0 <= local_rank < "
            "num_local_procs."
        )
    cores = parse_range_list(bind_core_list) if bind_core_list is not None else list(range(physical_core_count()))
    per_rank = len(cores) // num_local_procs
    if per_rank < 1:
        raise DeepSpeedAssertion(
            f"At least one core needs to be assigned to each rank: {len(cores)} core(s) for {num_local_procs} ranks. "
            "Bind more cores (--bind_core_list) or start fewer ranks per node."
        )
    mine = cores[per_rank * local_rank : per_rank * (local_rank + 1)]
    return per_rank, ["numactl", *_memory_binding(mine, get_numa_cores()), "-C", _compress(mine)]


def main(argv: list[str] | None = None) -> int:
    """Bind this rank (LOCAL_RANK of LOCAL_WORLD_SIZE, as torchrun sets them) and exec COMMAND under numactl."""
    parser = argparse.ArgumentParser(prog="python -m ds_compat.utils.numa", description=main.__doc__)
    parser.add_argument("--bind_core_list", default=None, help="cores to split over the node's ranks, e.g. 0-15,32-47")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS ...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to bind: pass -- COMMAND [ARGS ...]")
    if shutil.which("numactl") is None:
        print("ds-fsdp: error: --bind_cores_to_rank needs numactl on each node: apt install numactl", file=sys.stderr)
        return 2
    if "LOCAL_RANK" not in os.environ or "LOCAL_WORLD_SIZE" not in os.environ:
        print("ds-fsdp: error: LOCAL_RANK / LOCAL_WORLD_SIZE are not set: run this under torchrun.", file=sys.stderr)
        return 2
    try:
        per_rank, numactl = get_numactl_cmd(
            args.bind_core_list, int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
        )
    except ValueError as error:
        print(f"ds-fsdp: error: {error}", file=sys.stderr)
        return 2
    os.environ["OMP_NUM_THREADS"] = str(per_rank)
    os.execvp(numactl[0], [*numactl, *command])


if __name__ == "__main__":
    sys.exit(main())
