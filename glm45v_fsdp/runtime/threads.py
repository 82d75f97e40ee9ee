"""Intra-op CPU threads per training process, chosen from the usable cores and the processes on this node.

torch's default is one thread per core in every process. With several ranks on a node that oversubscribes the cores,
and even a single process loses when anything else runs: OpenMP threads spin at every barrier while their peers wait
for a core (a single-process tiny-model step on a 2-core machine with one busy process beside it: 229-293 ms with 2
threads, 44-45 ms with 1; on a quiet machine 42-43 vs 44-45 ms). So unless OMP_NUM_THREADS says otherwise, each
process gets (usable cores - 1) // processes on this node threads, at least one: one core stays free for data
loading, the launcher and the system.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

THREADS_VAR = "OMP_NUM_THREADS"


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, which respects cgroup/Slurm CPU sets)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_threads(cores: int, local_world_size: int) -> int:
    return max(1, (cores - 1) // max(1, local_world_size))


def configure_cpu_threads(local_world_size: int, environ: Mapping[str, str] | None = None) -> str:
    """Set torch's intra-op threads unless OMP_NUM_THREADS is set; returns the log line saying what was chosen."""
    env = os.environ if environ is None else environ
    if env.get(THREADS_VAR):
        return f"CPU threads: {torch.get_num_threads()} per process ({THREADS_VAR}={env[THREADS_VAR]})"
    cores = usable_cores()
    threads = default_threads(cores, local_world_size)
    torch.set_num_threads(threads)
    return (
        f"CPU threads: {threads} per process ({cores} usable core(s), {local_world_size} process(es) on this node, "
        f"one core left for data loading and the system; set {THREADS_VAR} to choose)"
    )
