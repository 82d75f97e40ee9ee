"""Launcher environments -> one `DistEnv`, and the process group built from it.

Precedence when several launchers' variables are present: RANK/WORLD_SIZE (torchrun, deepspeed) > Slurm > Open MPI
> none (a single process). docs/runtime.md lists which variable each field comes from.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from glm45v_fsdp.errors import UserError
from glm45v_fsdp.runtime.attempt import attempt_prefix, shared_store_restart_note
from glm45v_fsdp.runtime.device import DeviceLayer
from glm45v_fsdp.runtime.network import configure_interfaces
from glm45v_fsdp.runtime.watchdog import PEER_TIMEOUT_S, current_watchdog, start_watchdog

DEFAULT_MASTER_PORT = 29500
RENDEZVOUS_WAIT_S = 300.0  # how long ranks other than 0 wait for rank 0's rendezvous store to accept connections
_SINGLE_PROCESS_ADDR = "127.0.0.1"


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job. `master_port` 0 means "pick a free port" (single process only)."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "deepspeed" | "slurm" | "openmpi" | "none"


def _int_var(env: Mapping[str, str], name: str, launcher: str) -> int:
    if name not in env:
        raise UserError(
            f"Environment variable {name} is not set, but the {launcher} launcher's variables are present. Start "
            f"the job through the launcher itself (it sets {name}) or export {name} with the other variables."
        )
    try:
        return int(env[name])
    except ValueError:
        raise UserError(
            f"Environment variable {name}={env[name]!r} is not an integer. Unset it or fix the launcher command "
            f"that sets it."
        ) from None


def _master(
    env: Mapping[str, str],
    world_size: int,
    launcher: str,
    default_addr: str | None = None,
    default_port: int | None = None,
) -> tuple[str, int]:
    """MASTER_ADDR / MASTER_PORT, else the launcher's defaults; one process falls back to 127.0.0.1 and port 0."""
    addr = env.get("MASTER_ADDR") or None
    port = _int_var(env, "MASTER_PORT", launcher) if "MASTER_PORT" in env else None
    if world_size == 1:
        return addr or _SINGLE_PROCESS_ADDR, port or 0
    addr = addr or default_addr
    port = port if port is not None else default_port
    if addr is None or port is None:
        missing = " and ".join(name for name, value in (("MASTER_ADDR", addr), ("MASTER_PORT", port)) if value is None)
        raise UserError(
            f"{missing} must be set for a {world_size}-process {launcher} job: rank 0's host and a free TCP port "
            f"for the rendezvous. Export them before launching, e.g. MASTER_ADDR=<first node> MASTER_PORT=29500."
        )
    return addr, port


def _from_torch_env(env: Mapping[str, str], local_rank_arg: int | None) -> tuple[DistEnv, dict[str, str]]:
    """torchrun / torch.distributed.run, the deepspeed launcher, or RANK/WORLD_SIZE exported by hand."""
    if "TORCHELASTIC_RUN_ID" in env:
        launcher = "torchrun"
    elif local_rank_arg is not None or "LOCAL_SIZE" in env or "CROSS_RANK" in env:
        launcher = "deepspeed"
    else:
        launcher = "torchrun"
    rank = _int_var(env, "RANK", launcher)
    world_size = _int_var(env, "WORLD_SIZE", launcher)
    if "LOCAL_RANK" in env or local_rank_arg is None:
        local_rank = _int_var(env, "LOCAL_RANK", launcher)
    else:
        local_rank = local_rank_arg
    local_size_var = "LOCAL_WORLD_SIZE" if "LOCAL_WORLD_SIZE" in env else "LOCAL_SIZE"  # deepspeed sets LOCAL_SIZE
    if local_size_var in env or world_size != 1:
        local_world_size = _int_var(env, local_size_var, launcher)
    else:
        local_world_size = 1
    addr, port = _master(env, world_size, launcher)
    names = {"rank": "RANK", "local_rank": "LOCAL_RANK", "world_size": "WORLD_SIZE", "local_world_size": local_size_var}
    return DistEnv(rank, local_rank, world_size, local_world_size, addr, port, launcher), names


_BRACKET = re.compile(r"\[([^\[\]]*)\]")
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_slurm_nodelist(nodelist: str, key: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Expand Slurm's compressed host list, e.g. "node[01-02,07],gpu5" -> node01, node02, node07, gpu5."""
    items, depth, start = [], 0, 0
    for index, char in enumerate(nodelist + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            break
        if char == "," and depth == 0:
            items.append(nodelist[start:index].strip())
            start = index + 1
    if depth != 0 or not any(items):
        raise UserError(
            f"Environment variable {key}={nodelist!r} is not a Slurm host list (like 'node[01-04,07],gpu5'). "
            f"Set MASTER_ADDR to rank 0's host to skip parsing it."
        )
    return [host for item in items if item for host in _expand_item(item, nodelist, key)]


def _expand_item(item: str, nodelist: str, key: str) -> list[str]:
    found = _BRACKET.search(item)
    if found is None:
        if "[" in item or "]" in item:
            raise UserError(
                f"Environment variable {key}={nodelist!r} has unbalanced brackets in {item!r}. "
                f"Set MASTER_ADDR to rank 0's host to skip parsing it."
            )
        return [item]
    head, tail = item[: found.start()], item[found.end() :]
    hosts = []
    for part in found.group(1).split(","):
        bounds = _RANGE.match(part.strip())
        if bounds is None or (bounds.group(2) is not None and int(bounds.group(2)) < int(bounds.group(1))):
            raise UserError(
                f"Environment variable {key}={nodelist!r} has the malformed range {part!r}. Set MASTER_ADDR to "
                f"rank 0's host to skip parsing it."
            )
        low, high = bounds.group(1), bounds.group(2) or bounds.group(1)
        for number in range(int(low), int(high) + 1):
            hosts.extend(_expand_item(f"{head}{number:0{len(low)}d}{tail}", nodelist, key))
    return hosts


def _tasks_on_this_node(env: Mapping[str, str]) -> tuple[int, str]:
    """This node's task count from SLURM_NTASKS_PER_NODE, else SLURM_TASKS_PER_NODE ("4(x2),3") at SLURM_NODEID."""
    if "SLURM_NTASKS_PER_NODE" in env:
        return _int_var(env, "SLURM_NTASKS_PER_NODE", "slurm"), "SLURM_NTASKS_PER_NODE"
    text = env.get("SLURM_TASKS_PER_NODE")
    if text is None:
        raise UserError(
            "Neither SLURM_NTASKS_PER_NODE nor SLURM_TASKS_PER_NODE is set, so the number of processes on this node "
            "is unknown. Launch the job steps with srun (it sets SLURM_TASKS_PER_NODE) or pass --ntasks-per-node."
        )
    counts: list[int] = []
    for part in text.split(","):
        found = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if found is None:
            raise UserError(
                f"Environment variable SLURM_TASKS_PER_NODE={text!r} is not like '4(x2),3'. Launch with "
                f"srun --ntasks-per-node=N so SLURM_NTASKS_PER_NODE is set."
            )
        counts.extend([int(found.group(1))] * int(found.group(2) or 1))
    node = _int_var(env, "SLURM_NODEID", "slurm") if len(counts) > 1 else 0
    if node >= len(counts):
        raise UserError(
            f"SLURM_NODEID={node} is outside SLURM_TASKS_PER_NODE={text!r} ({len(counts)} nodes). "
            f"Launch the job step with srun so both describe the same step."
        )
    return counts[node], "SLURM_TASKS_PER_NODE"


def _from_slurm(env: Mapping[str, str]) -> tuple[DistEnv, dict[str, str]]:
    rank = _int_var(env, "SLURM_PROCID", "slurm")
    local_rank = _int_var(env, "SLURM_LOCALID", "slurm")
    world_size = _int_var(env, "SLURM_NTASKS", "slurm")
    local_world_size, local_size_var = _tasks_on_this_node(env)
    first_host = None
    if "MASTER_ADDR" not in env and world_size > 1:
        for key in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
            if env.get(key):
                first_host = expand_slurm_nodelist(env[key], key)[0]
                break
    addr, port = _master(env, world_size, "slurm", first_host, DEFAULT_MASTER_PORT)
    names = {
        "rank": "SLURM_PROCID",
        "local_rank": "SLURM_LOCALID",
        "world_size": "SLURM_NTASKS",
        "local_world_size": local_size_var,
    }
    return DistEnv(rank, local_rank, world_size, local_world_size, addr, port, "slurm"), names


def _from_openmpi(env: Mapping[str, str]) -> tuple[DistEnv, dict[str, str]]:
    names = {
        "rank": "OMPI_COMM_WORLD_RANK",
        "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK",
        "world_size": "OMPI_COMM_WORLD_SIZE",
        "local_world_size": "OMPI_COMM_WORLD_LOCAL_SIZE",
    }
    values = {field: _int_var(env, name, "openmpi") for field, name in names.items()}
    addr, port = _master(env, values["world_size"], "openmpi")
    return DistEnv(master_addr=addr, master_port=port, launcher="openmpi", **values), names


def _check(result: DistEnv, names: dict[str, str], local_rank_arg: int | None) -> None:
    rank, local_rank, world, local_world = result.rank, result.local_rank, result.world_size, result.local_world_size
    problems = [
        (world < 1, "world_size", f"{world} is not a positive process count"),
        (not 0 <= rank < world, "rank", f"{rank} is outside [0, {names['world_size']}={world})"),
        (
            local_world < 1 or local_world > world,
            "local_world_size",
            f"{local_world} is not between 1 and {names['world_size']}={world}",
        ),
        (
            not 0 <= local_rank < local_world,
            "local_rank",
            f"{local_rank} is outside [0, {names['local_world_size']}={local_world})",
        ),
    ]
    for bad, field, what in problems:
        if bad:
            raise UserError(
                f"Inconsistent {result.launcher} environment: {names[field]}={what}. The launcher variables of "
                f"another job may have leaked into this one; start the processes with the launcher and unset stale "
                f"variables."
            )
    if not 0 <= result.master_port <= 65535 or (result.master_port == 0 and world > 1):
        raise UserError(f"MASTER_PORT={result.master_port} is not a TCP port in 1-65535. Export a free port.")
    if local_rank_arg is not None and local_rank_arg != local_rank:
        raise UserError(
            f"The command-line argument --local_rank={local_rank_arg} disagrees with "
            f"{names['local_rank']}={local_rank} from the {result.launcher} environment. Pass neither or the same "
            f"value (the deepspeed launcher sets both itself)."
        )


def detect_dist_env(environ: Mapping[str, str] | None = None, local_rank_arg: int | None = None) -> DistEnv:
    """Read the launcher variables (default: `os.environ`); `local_rank_arg` is a `--local_rank` argument."""
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        result, names = _from_torch_env(env, local_rank_arg)
    elif "SLURM_PROCID" in env:
        result, names = _from_slurm(env)
    elif "OMPI_COMM_WORLD_RANK" in env:
        result, names = _from_openmpi(env)
    else:
        result = DistEnv(0, 0, 1, 1, _SINGLE_PROCESS_ADDR, 0, "none")
        names = {
            "rank": "RANK",
            "local_rank": "LOCAL_RANK",
            "world_size": "WORLD_SIZE",
            "local_world_size": "LOCAL_WORLD_SIZE",
        }
    _check(result, names, local_rank_arg)
    return result


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (for a rendezvous this process starts)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_for_rendezvous(env: DistEnv, port: int, network: str, wait_s: float = RENDEZVOUS_WAIT_S) -> None:
    """Rank 0 hosts the rendezvous store at MASTER_ADDR:MASTER_PORT: the others connect within `wait_s` (rank 0
    may start later) or stop with one paragraph, not the process group's 30-minute timeout."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with socket.create_connection((env.master_addr, port), timeout=5.0):
                return
        except OSError as error:
            if time.monotonic() > deadline:
                raise UserError(
                    f"Rank {env.rank} ({socket.gethostname()}) could not reach the rendezvous at MASTER_ADDR="
                    f"{env.master_addr} MASTER_PORT={port} for {wait_s:.0f} s ({error}). {network}. Check that rank 0 "
                    f"is running and that MASTER_ADDR is its node's address on a network this node shares (not a "
                    f"host name that resolves to loopback), and that the port is free and not blocked."
                ) from None
            time.sleep(0.5)


_REMOTE = re.compile(r"remote=\[?([^\]\s,]+)\]?:(\d+)")


def unreachable_peer(error: BaseException) -> str | None:
    """'127.0.0.1:41235 (another rank)' when the error says a connection to a peer failed, else None."""
    text = str(error)
    if not any(sign in text for sign in ("connectFullMesh", "Connection refused", "No route to host", "timed out")):
        return None
    found = _REMOTE.search(text)
    return f"{found.group(1)}:{found.group(2)} (another rank)" if found else "another rank"


def init_distributed(
    env: DistEnv, device: DeviceLayer, timeout_minutes: int = 30, peer_timeout_s: float = PEER_TIMEOUT_S
) -> str:
    """Choose the network interface (runtime/network.py), export the torchrun-style variables, bind the device and
    create the default process group (also for one process: FSDP2 and DeviceMesh need a group), then start the
    fast-failure watchdog (runtime/watchdog.py) with `peer_timeout_s` (0: none). Returns the network line for the
    log. A no-op when a group already exists."""
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (env.rank, env.world_size):
            raise RuntimeError(
                f"A process group already exists as rank {dist.get_rank()} of {dist.get_world_size()}, "
                f"but the launcher says rank {env.rank} of {env.world_size}."
            )
        return "network: the process group already existed"
    port = env.master_port or free_port(env.master_addr)
    os.environ.update(
        RANK=str(env.rank),
        LOCAL_RANK=str(env.local_rank),
        WORLD_SIZE=str(env.world_size),
        LOCAL_WORLD_SIZE=str(env.local_world_size),
        MASTER_ADDR=env.master_addr,
        MASTER_PORT=str(port),
    )
    network = configure_interfaces(device.backend, env.master_addr, spans_nodes=env.local_world_size < env.world_size)
    device.set_device(env.local_rank)
    timeout = timedelta(minutes=timeout_minutes)
    if env.rank != 0:
        wait_for_rendezvous(env, port, network)
    try:
        store, _, _ = next(dist.rendezvous("env://", rank=env.rank, world_size=env.world_size, timeout=timeout))
        # one key space per attempt: torchrun's store outlives a restarted job's ranks (runtime/attempt.py)
        attempt = attempt_prefix(store, env.rank, env.world_size, timeout)
        store = dist.PrefixStore(attempt, store)
        dist.init_process_group(
            backend=device.backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout
        )
    except RuntimeError as error:  # DistBackendError, DistStoreError, gloo's enforce failures
        unreachable = unreachable_peer(error)
        if unreachable is None:
            raise
        raise UserError(
            f"Rank {env.rank} ({socket.gethostname()}) could not connect to {unreachable} while the process group "
            f"started ({str(error).splitlines()[0][:200]}). {network}. The address the peer advertised must be one "
            f"this node reaches: set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME / HCCL_IF_IP on every node to the "
            f"interface of the network the nodes share (docs/multinode.md), and check that no firewall blocks it."
        ) from None
    if env.world_size > 1 and peer_timeout_s > 0:
        # the watchdog thread gets a client connection of its own: the group's store object is the main thread's
        client = dist.TCPStore(env.master_addr, port, is_master=False, timeout=timeout)
        start_watchdog(dist.PrefixStore(attempt, client), env.rank, env.world_size, peer_timeout_s)
    note = shared_store_restart_note(os.environ, spans_nodes=env.local_world_size < env.world_size)
    return network if note is None else f"{network}; {note}"


def shutdown(finished: bool = False) -> None:
    """Destroy the default process group; a no-op when none exists.

    `finished=True` (every rank got here after the same work, and the caller ends the process next, as
    `glm45v_fsdp.train.main` does with os._exit): wait for all ranks and leave the group to the process exit. On
    gloo the C++ teardown of a finished job occasionally aborted a rank ("terminate called without an active
    exception", seen in about 1 of 30 multi-rank runs, after all outputs were written); ending the process without
    that teardown cannot. On error paths a barrier could wait for a rank that is gone, so there is none, and
    `main` ends those with os._exit too (the same abort once turned a user error's exit 2 into -6).
    """
    watchdog = current_watchdog()
    if finished and watchdog is not None:
        watchdog.finish()  # before the last barrier: the store's host may exit first
    if not dist.is_initialized():
        return
    if finished:
        dist.barrier()
        return
    dist.destroy_process_group()


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) when there is none."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_objects(value: object) -> list[object]:
    """Every rank's `value` (picklable), in rank order; [value] without a process group. Collective."""
    rank, world = rank_and_world()
    if world == 1:
        return [value]
    gathered: list[object] = [None] * world
    dist.all_gather_object(gathered, value)
    return gathered
