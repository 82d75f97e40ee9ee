"""`ds-fsdp` = `python -m ds_compat.launcher`: the deepspeed launcher's command line, handed off by exec.

The hostfile and the filter flags resolve to deepspeed's world info (`ds_compat.hostfile`). This process then
*becomes* torchrun (one node, or this node under `--no_ssh`), pdsh (one torchrun per node), srun or mpirun (one task
per rank), so their exit status is the job's. Without pdsh it starts one ssh per node and waits for them, as pdsh
would. Nothing here spawns or watches ranks. See docs/launcher.md.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from ds_compat.alias import BACKENDS, ENV_BACKEND, SHIM_DIR, backend_from_env
from ds_compat.hostfile import Resources, check_filter_flags, read_hostfile, resolve_world
from ds_compat.utils.numa import parse_range_list, physical_core_count
from glm45v_fsdp.errors import EXIT_USER_ERROR, UserError

log = logging.getLogger("ds-fsdp")

DLTS_HOSTFILE = "/job/hostfile"
DEFAULT_MASTER_PORT = 29500
LAUNCHERS = ("pdsh", "openmpi", "slurm", "mpich", "impi", "mvapich")
PDSH_MAX_FAN_OUT = 1024
# Each node's ssh session notices a node that dropped off the network within ~30 s (without it: TCP's own timeout,
# hours, and pdsh waits that long for the lost node); PDSH_SSH_ARGS_APPEND with ServerAlive* of your own wins.
SSH_KEEPALIVE = "-o ServerAliveInterval=10 -o ServerAliveCountMax=3"
LOCAL_RANK_ARG = "--local_rank=${local_rank}"  # torchrun's agent substitutes ${local_rank} in every worker argument
VISIBLE_DEVICES = ("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES")
EXPORT_PREFIXES = ("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL", "HCCL", "ASCEND")
CANN_PREFIXES = ("LD_LIBRARY", "PATH")  # deepspeed exports them on NPU; here when CANN's set_env.sh is sourced
CANN_MARKERS = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
AISC_EXCLUDED = ("NCCL_IB_HCA", "UCX_NET_DEVICES")  # per-node values on AISC (AISC_JOB_NAME set): never copied
MPI_RANK_SHIM = (  # MPICH / MVAPICH / PALS name the ranks PMI_RANK / PMIX_RANK; torch and our trainer read RANK
    'export RANK="${PMIX_RANK:-${PMI_RANK:?is not set by mpirun}}" '
    'LOCAL_RANK="${PALS_LOCAL_RANKID:-${MPI_LOCALRANKID:-${MV2_COMM_WORLD_LOCAL_RANK:?is not set by mpirun}}}"; '
    'exec "$@"'
)
# What deepspeed's MVAPICH runner exports (MV2_USE_CUDA=1 is added on CUDA): shared-memory transfers without the CMA
# kernel module, backtraces on failure, the deep-learning-framework support, no CPU affinity of its own.
MVAPICH_EXPORTS = {
    "MV2_SMP_USE_CMA": "0",
    "MV2_DEBUG_SHOW_BACKTRACE": "1",
    "MV2_SUPPORT_DL": "1",
    "MV2_ENABLE_AFFINITY": "0",
    "MV2_INTER_ALLGATHER_TUNING": "5",
    "MV2_CUDA_USE_NAIVE": "0",
}
UNSUPPORTED = {
    "autotuning": "run the DeepSpeed autotuner with the real `deepspeed` launcher",
    "save_pid": "ds-fsdp execs the launcher, so its own pid is the launcher's",
}
DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"  # deepspeed.launcher.runner's name; DS_ENV_FILE overrides it
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class Shell(str):
    """A word put into a remote shell command as is (a variable reference), not quoted."""


@dataclass(frozen=True)
class Node:
    """One node of the world info: its host, its rank among the nodes, its slots (device ids)."""

    host: str
    rank: int
    slots: list[int]


@dataclass
class Plan:
    """What ds-fsdp would exec: `command` with `env` set and `unset` removed; `--dry_run` prints `report()`."""

    mode: str  # "local" | "no_ssh" | one of LAUNCHERS
    world: Resources
    master_addr: str | None  # None: chosen at run time (srun: the step's first node)
    master_port: int
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    unset: list[str] = field(default_factory=list)
    exports: dict[str, str] = field(default_factory=dict)  # sent to every node (pdsh) or rank (srun, mpirun)
    nodes: list[dict] = field(default_factory=list)  # the torchrun command of each node (local, no_ssh, pdsh)

    def report(self) -> dict:
        return {
            "mode": self.mode,
            "world_info": self.world,
            "world_size": sum(len(slots) for slots in self.world.values()),
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "exports": self.exports,
            "nodes": self.nodes,
            "env": self.env,
            "unset": self.unset,
            "command": self.command,
            "command_line": shlex.join(self.command),
        }


def parse_args(args: list[str] | None = None) -> argparse.Namespace:
    """deepspeed.launcher.runner.parse_args: the deepspeed launcher's flags (of sys.argv when `args` is None), plus
    ds-fsdp's --backend and --dry_run."""
    parser = argparse.ArgumentParser(
        prog="ds-fsdp",
        description="The deepspeed launcher's flags, handed to torchrun / pdsh / srun / mpirun (docs/launcher.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("-H", "--hostfile", default=DLTS_HOSTFILE, help="'HOST slots=N' lines (no such file: this node only)")
    add("-i", "--include", default="", help="resources to use: NAME[:SLOT[,SLOT ...]][@NAME...], e.g. w0:0,1@w1")
    add("-e", "--exclude", default="", help="resources not to use, same format as --include")
    add("--num_nodes", type=int, default=-1, help="use the first N hosts of the hostfile")
    add("--num_gpus", "--num_accelerators", type=int, default=-1, help="processes (device ids 0..N-1) per node")
    add("--master_port", type=int, default=DEFAULT_MASTER_PORT, help="rendezvous TCP port on the master")
    add("--master_addr", default="", help="rendezvous host (default: 127.0.0.1 on one node, else the first host)")
    add("--node_rank", type=int, default=-1, help="this node's rank in [0, nodes); only with --no_ssh")
    add("--launcher", default="pdsh", help=f"multi-node backend: {', '.join(LAUNCHERS)}")
    add("--launcher_args", default="", help="extra arguments for pdsh / srun / mpirun, as one quoted string")
    add("--module", action="store_true", help="run the script as a module (python -m)")
    add("--no_python", action="store_true", help="run the script as an executable, without python")
    add("--no_local_rank", action="store_true", help="do not append --local_rank=N to the script's arguments")
    add("--no_ssh", action="store_true", help="run this node's part only (start ds-fsdp on every node)")
    add("--no_ssh_check", action="store_true", help="skip the passwordless-ssh check of the first host (pdsh)")
    add("--force_multi", action="store_true", help="use the multi-node backend even for a single host")
    add("--ssh_port", type=int, default=None, help="ssh port for pdsh")
    add("--venv_script", default=None, help="script each node sources before starting (pdsh)")
    add("--log_level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    add("-q", "--quiet", action="store_true", help="same as --log_level error")
    add("--dry_run", action="store_true", help="print the world info and the commands as JSON; run nothing")
    add("--autotuning", default="", choices=["", "tune", "run"], help="not supported")
    add("--bind_cores_to_rank", action="store_true", help="pin each rank to its share of the cores (numactl)")
    add("--bind_core_list", default=None, help="cores to share out with --bind_cores_to_rank, e.g. 0-15,32-47")
    add("--save_pid", action="store_true", help="not supported")
    add("--enable_each_rank_log", default=None, help="directory for per-rank logs (torchrun --log-dir)")
    add(
        "--backend",
        choices=BACKENDS,
        default=None,
        help=f"what `import deepspeed` runs in the ranks: fsdp (this backend) or deepspeed (the real one); default "
        f"${ENV_BACKEND}, else fsdp",
    )
    add("user_script", help="training script (or module with --module, executable with --no_python)")
    add("user_args", nargs=argparse.REMAINDER, help="the script's arguments")
    return parser.parse_args(args)


def check_flags(args: argparse.Namespace) -> None:
    for name, instead in UNSUPPORTED.items():
        if getattr(args, name):
            raise UserError(f"--{name} is a deepspeed launcher flag ds-fsdp does not support: {instead}.")
    if args.module and args.no_python:
        raise UserError("Don't use both the '--no_python' flag and the '--module' flag at the same time.")
    if args.launcher.lower() not in LAUNCHERS:
        raise UserError(f"Unknown launcher {args.launcher}. ds-fsdp supports --launcher {', '.join(LAUNCHERS)}.")
    if args.bind_core_list is not None:
        try:
            parse_range_list(args.bind_core_list)
        except ValueError as error:
            raise UserError(f"--bind_core_list {args.bind_core_list!r}: {error}. Write e.g. 0-15,32-47.") from None


def numa_node_count() -> int:
    """NUMA nodes that have CPUs (consecutive nodes with the same CPU list count once), at least 1."""
    files = sorted(Path("/sys/devices/system/node").glob("node[0-9]*/cpulist"), key=lambda p: int(p.parent.name[4:]))
    cpus = [file.read_text().strip() for file in files]
    return max(1, sum(1 for i, listed in enumerate(cpus) if listed and (i == 0 or listed != cpus[i - 1])))


def local_device_count(environ: MutableMapping[str, str]) -> int:
    """This machine's devices as deepspeed counts them: NPUs, else GPUs; on CPU LOCAL_SIZE, else the NUMA nodes."""
    if environ.get("DS_ACCELERATOR") != "cpu":
        import torch

        from glm45v_fsdp.runtime.device import select_device

        for name in VISIBLE_DEVICES:  # the probe must count what the children will see
            if name not in environ:
                os.environ.pop(name, None)
        kind = select_device("auto").type
        if kind != "cpu":
            return getattr(torch, kind).device_count()
    local_size = environ.get("LOCAL_SIZE", "")
    return int(local_size) if local_size.isdigit() and int(local_size) > 0 else numa_node_count()


def take_visible_devices(args: argparse.Namespace, environ: MutableMapping[str, str]) -> list[str]:
    """Single node, no hostfile: a set *_VISIBLE_DEVICES becomes `--include localhost:<ids>` unless filters are
    given; either way it is removed (each node's torchrun gets its slots). Returns the removed variable."""
    name = next((var for var in reversed(VISIBLE_DEVICES) if environ.get(var)), None)
    if name is None:
        return []
    detected = f"Detected {name}={environ[name]}"
    if args.include or args.exclude or args.num_nodes > 1 or args.num_gpus > 0:
        log.warning("%s but ignoring it because one of --include/--exclude/--num_gpus/--num_nodes is given.", detected)
    else:
        args.include = f"localhost:{environ[name]}"
        log.info("%s: setting --include=%s", detected, args.include)
    del environ[name]
    return [name]


def read_env_file(path: Path) -> dict[str, str]:
    """NAME=VALUE lines (values literal, surrounding blanks stripped); blank lines and # comments skipped."""
    values = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, equals, value = line.partition("=")
        if not equals or not _ENV_NAME.fullmatch(name.strip()):
            raise UserError(
                f"{path} line {number}: {line!r} is not NAME=VALUE. Each line of a .deepspeed_env file sets one "
                f"environment variable for every node, e.g. NCCL_IB_HCA=mlx5_0; blank lines and # comments are skipped."
            )
        values[name.strip()] = value.strip()
    return values


def collect_exports(environ: MutableMapping[str, str], launcher: str) -> dict[str, str]:
    """What every node gets: deepspeed's variable prefixes from this environment, then ~/ and ./.deepspeed_env."""
    exports = {"UCX_TLS": "tcp"} if launcher == "openmpi" else {}
    prefixes = EXPORT_PREFIXES + (CANN_PREFIXES if any(marker in environ for marker in CANN_MARKERS) else ())
    skipped = AISC_EXCLUDED if "AISC_JOB_NAME" in environ else ()
    exports.update((k, v) for k, v in environ.items() if k.startswith(prefixes) and k not in skipped)
    name = environ.get("DS_ENV_FILE", DEEPSPEED_ENVIRONMENT_NAME)
    for path in dict.fromkeys([(Path.home() / name).resolve(), (Path.cwd() / name).resolve()]):
        if path.is_file():
            log.info("deepspeed_env file = %s", path)
            exports.update(read_env_file(path))
    return exports


def python_exec(args: argparse.Namespace) -> list[str]:
    return [] if args.no_python else [sys.executable, "-u", *(["-m"] if args.module else [])]


def torchrun_command(args: argparse.Namespace, nnodes: int, node_rank: str, nproc: str, addr: str) -> list[str]:
    command = [sys.executable, "-u", "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node_rank", node_rank]
    command += ["--nproc_per_node", nproc, "--master_addr", addr, "--master_port", str(args.master_port)]
    if args.enable_each_rank_log:  # torchrun writes DIR/<run id>/attempt_0/<local rank>/{stdout,stderr}.log
        command += ["--log-dir", args.enable_each_rank_log, "--redirects", "3"]
    if args.bind_cores_to_rank:  # each rank execs numactl from its LOCAL_RANK (ds_compat/utils/numa.py)
        binder = [sys.executable, "-m", "ds_compat.utils.numa"]
        binder += ["--bind_core_list", args.bind_core_list] if args.bind_core_list else []
        command += ["--no-python", *binder, "--", *python_exec(args), args.user_script]
    else:
        command += ["--module"] * args.module + ["--no-python"] * args.no_python + [args.user_script]
    return command + ([] if args.no_local_rank else [LOCAL_RANK_ARG]) + args.user_args


def node_env(nnodes: int, node_rank: str, devices: str, nproc: str) -> dict[str, str]:
    """A node's variables, as deepspeed's per-node launch sets them (torchrun sets RANK, LOCAL_RANK, WORLD_SIZE)."""
    env = dict.fromkeys(VISIBLE_DEVICES, devices)
    return {**env, "CROSS_RANK": node_rank, "CROSS_SIZE": str(nnodes), "LOCAL_SIZE": nproc}


def node_launches(args: argparse.Namespace, nodes: list[Node], addr: str) -> list[dict]:
    return [
        {
            "host": node.host,
            "node_rank": node.rank,
            "env": node_env(len(nodes), str(node.rank), ",".join(map(str, node.slots)), str(len(node.slots))),
            "command": torchrun_command(args, len(nodes), str(node.rank), str(len(node.slots)), addr),
        }
        for node in nodes
    ]


def _sh(words: list[str]) -> str:
    return " ".join(word if isinstance(word, Shell) else shlex.quote(word) for word in words)


def pdsh_plan(
    args: argparse.Namespace, nodes: list[Node], addr: str, exports: dict[str, str], environ: MutableMapping[str, str]
) -> tuple[list[str], dict[str, str]]:
    """One pdsh command; each host looks itself up (pdsh puts the host name at %h) and execs its torchrun."""
    rows = [(shlex.quote(n.host), n.rank, len(n.slots), ",".join(map(str, n.slots))) for n in nodes]
    table = " ".join(f"{host}) R={rank} N={nproc} D={devices};;" for host, rank, nproc, devices in rows)
    steps = [f'case %h in {table} *) echo "ds-fsdp: %h is not in the world info" >&2; exit 1;; esac']
    steps.append(f"cd {shlex.quote(os.getcwd())}")
    if args.venv_script:
        steps.append(f". {shlex.quote(args.venv_script)}")
    variables = {**exports, **node_env(len(nodes), Shell("$R"), Shell("$D"), Shell("$N"))}
    steps.append("export " + " ".join(f"{name}={_sh([value])}" for name, value in variables.items()))
    steps.append("exec " + _sh(torchrun_command(args, len(nodes), Shell("$R"), Shell("$N"), addr)))
    hosts = ",".join(node.host for node in nodes)
    command = ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", hosts, *shlex.split(args.launcher_args)]
    command.append("; ".join(steps))
    append = environ.get("PDSH_SSH_ARGS_APPEND", "")
    if "ServerAlive" not in append:  # yours wins
        append = f"{append} {SSH_KEEPALIVE}".strip()
    if args.ssh_port is not None:
        append = f"{append} -p {args.ssh_port}"
    return command, {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": append}


def ssh_commands(plan: Plan, args: argparse.Namespace) -> list[list[str]]:
    """Without pdsh: one `ssh HOST '<pdsh's remote command, %h = HOST>'` per node (the same remote command)."""
    remote, options = plan.command[-1], shlex.split(plan.env["PDSH_SSH_ARGS_APPEND"])
    return [["ssh", *options, host, remote.replace("%h", shlex.quote(host))] for host in plan.world]


def run_over_ssh(commands: list[list[str]], environ: dict[str, str]) -> int:
    """Start every node's ssh at once and wait; the first node that fails ends the others' ssh sessions (their
    ranks end through the job's own failure handling). The exit status is the largest, as `pdsh -S` gives."""
    processes = [subprocess.Popen(command, env=environ) for command in commands]
    forward = lambda signum, _frame: [p.send_signal(signum) for p in processes if p.poll() is None]  # noqa: E731
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, forward)
    codes: dict[int, int] = {}
    while len(codes) < len(processes):
        for index, process in enumerate(processes):
            if index not in codes and process.poll() is not None:
                codes[index] = process.returncode
                if process.returncode != 0:
                    log.error(
                        "%s exited with %d: ending the other nodes' ssh sessions",
                        commands[index][-2],
                        process.returncode,
                    )
                    forward(signal.SIGTERM, None)
        time.sleep(0.2)
    return max(abs(code) for code in codes.values())


def check_slurm_world(world: Resources) -> None:
    """srun places tasks by count: no device ids, and the same count on every host."""
    for host, slots in world.items():
        if slots != list(range(len(slots))):
            raise UserError(
                f"slurm backend cannot select specific device ids, got {slots} on {host}. Filter whole hosts, or "
                f"keep the first N slots on every host."
            )
    counts = {host: len(slots) for host, slots in world.items()}
    if len(set(counts.values())) > 1:
        raise UserError(f"slurm backend needs the same slot count on every host, got {counts}.")


def slurm_plan(args: argparse.Namespace, world: Resources, exports: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    per_node = len(next(iter(world.values())))
    command = ["srun", "-n", str(per_node * len(world)), "--ntasks-per-node", str(per_node), "--kill-on-bad-exit=1"]
    command += shlex.split(args.launcher_args)
    if args.include or args.exclude:
        command += ["--nodelist", ",".join(world), "--nodes", str(len(world))]
    if args.num_nodes > 0:
        command += ["--nodes", str(args.num_nodes)]
    if args.num_gpus > 0:
        command += ["--gpus-per-node", str(args.num_gpus)]
    command += ["--export=ALL", *python_exec(args), args.user_script, *args.user_args]
    env = {**exports, "MASTER_PORT": str(args.master_port)}  # MASTER_ADDR: the step's first node (docs/runtime.md)
    if args.master_addr:
        env["MASTER_ADDR"] = args.master_addr
    return command, env


def check_core_binding(args: argparse.Namespace, world: Resources, multi_node: bool) -> None:
    """Every rank of a node gets at least one core: of --bind_core_list, or (this node only) of its physical cores."""
    if args.bind_core_list is None and multi_node:
        return  # the other nodes' core counts are theirs to know; each rank checks its own
    cores = len(parse_range_list(args.bind_core_list)) if args.bind_core_list else physical_core_count()
    ranks = max(len(slots) for slots in world.values())
    if cores < ranks:
        source = f"--bind_core_list {args.bind_core_list!r}" if args.bind_core_list else "this node's physical cores"
        raise UserError(
            f"--bind_cores_to_rank: {source} give {cores} core(s) for {ranks} ranks per node, and every rank needs at "
            "least one. Bind more cores or start fewer ranks per node (--num_gpus)."
        )


def check_mpi_flags(args: argparse.Namespace, launcher: str) -> None:
    if args.include or args.exclude:
        raise UserError(f"{launcher} backend does not support worker include/exclusion. Edit the hostfile instead.")
    if args.num_nodes != -1 or args.num_gpus != -1:
        raise UserError(f"{launcher} backend does not support limiting num nodes/gpus. Edit the hostfile instead.")


def slots_per_node(pool: dict[str, int], title: str) -> int:
    if len(set(pool.values())) != 1:
        raise UserError(f"{title} requires same number of devices per node, got {pool}. Make the slots equal.")
    return next(iter(pool.values()))


def mpi_plan(
    args: argparse.Namespace, launcher: str, pool: dict[str, int], exports: dict[str, str], addr: str, hostfile: bool
) -> list[str]:
    """mpirun starts every rank from the whole hostfile; Open MPI names the ranks OMPI_COMM_WORLD_* (our trainer
    reads them), MPICH PMI_RANK (mapped to RANK by a sh shim), Intel MPI gets RANK per MPMD block."""
    check_mpi_flags(args, launcher)
    total, script = sum(pool.values()), [*python_exec(args), args.user_script, *args.user_args]
    extra = shlex.split(args.launcher_args)
    if launcher == "openmpi":
        if not hostfile:
            raise UserError("--launcher openmpi needs a hostfile (-H/--hostfile): mpirun places the ranks from it.")
        tcp_given = any(a in ("-mca", "--mca") and b == "btl_tcp_if_include" for a, b in zip(extra, extra[1:]))
        command = ["mpirun", "-n", str(total), "-hostfile", args.hostfile, "--mca", "btl", "^openib"]
        command += ([] if tcp_given else ["--mca", "btl_tcp_if_include", "eth0"]) + extra
        for name, value in {**exports, "MASTER_ADDR": addr, "MASTER_PORT": str(args.master_port)}.items():
            command += ["-x", f"{name}={value}"]
        return command + script
    per_node = slots_per_node(pool, {"mpich": "MPICH", "impi": "Intel MPI", "mvapich": "mvapich"}[launcher])
    variables = {**exports, "MASTER_ADDR": addr, "MASTER_PORT": str(args.master_port)}
    variables.update(WORLD_SIZE=str(total), LOCAL_SIZE=str(per_node))
    if launcher == "impi":
        variables["I_MPI_PIN"] = "0"
    if launcher == "mvapich":
        from ds_compat.comm import device_layer  # the accelerator deepspeed would find (imports torch)

        variables.update(MVAPICH_EXPORTS, **({"MV2_USE_CUDA": "1"} if device_layer().type == "cuda" else {}))
    hydra = launcher in ("mpich", "mvapich")  # MVAPICH2's mpirun is MPICH's Hydra: the same flags and rank names
    command = ["mpirun", *(["-n", str(total)] if hydra else []), "-ppn", str(per_node), *extra]
    for name, value in variables.items():
        command += ["-genv", name, value]
    command += ["-hosts", ",".join(pool)]
    if hydra:
        return command + ["sh", "-c", MPI_RANK_SHIM, "ds-fsdp-rank", *script]
    for rank in range(total):  # Intel MPI: one MPMD block per rank with its RANK / LOCAL_RANK, as deepspeed does
        rank_env = ["-env", "RANK", str(rank), "-env", "LOCAL_RANK", str(rank % per_node)]
        command += [":"] * (rank > 0) + ["-n", "1", *rank_env, *script]
    return command


def local_pool(args: argparse.Namespace, environ: MutableMapping[str, str]) -> dict[str, int]:
    """No hostfile: this machine, with as many slots as it has devices (or --num_gpus)."""
    check_filter_flags(args.include, args.exclude, args.num_nodes, args.num_gpus)
    count = args.num_gpus if args.num_gpus > 0 else local_device_count(environ)
    if count == 0:
        raise UserError("Unable to proceed, no GPU resources available. Pass a hostfile (-H) or --num_gpus N.")
    if args.num_nodes > 1:
        raise UserError("Num nodes is >1 but no extra nodes available via hostfile. Pass one with -H/--hostfile.")
    return {"localhost": count}


def choose_backend(args: argparse.Namespace, environ: MutableMapping[str, str]) -> str:
    """What `import deepspeed` runs in the ranks: PYTHONPATH gets ds_compat/shim first (fsdp) or loses it (deepspeed,
    which must then be installed); DS_FSDP_BACKEND is set for the ranks either way."""
    backend = args.backend or backend_from_env(environ)
    entries = [e for e in environ.get("PYTHONPATH", "").split(os.pathsep) if e and e != str(SHIM_DIR)]
    if backend == "fsdp":
        entries.insert(0, str(SHIM_DIR))
    elif importlib.util.find_spec("deepspeed") is None or "ds_compat" in str(importlib.util.find_spec("deepspeed")):
        raise UserError(
            "--backend deepspeed runs the real DeepSpeed, which is not installed here. Install it "
            "(`DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed`), or use --backend fsdp (this backend)."
        )
    if entries:
        environ["PYTHONPATH"] = os.pathsep.join(entries)
    else:
        environ.pop("PYTHONPATH", None)
    environ[ENV_BACKEND] = backend
    return backend


def plan_launch(args: argparse.Namespace, environ: MutableMapping[str, str]) -> Plan:
    """Resolve the world and build the command, checking in the order deepspeed's runner does.

    `environ` (a copy of os.environ) becomes the command's environment: a *_VISIBLE_DEVICES variable is taken out,
    PYTHONPATH starts with ds_compat/shim for the fsdp backend (`import deepspeed` -> ds_compat), and for a
    multi-node launch PYTHONPATH holds the working directory too.
    """
    check_flags(args)
    backend = choose_backend(args, environ)
    switch = {"PYTHONPATH": environ.get("PYTHONPATH", ""), ENV_BACKEND: backend}
    launcher, explicit_hostfile = args.launcher.lower(), args.hostfile != DLTS_HOSTFILE
    pool, unset = read_hostfile(args.hostfile), []
    from_hostfile = pool is not None
    if pool is None:
        message = "Unable to find hostfile %s, will proceed with training with local resources only."
        (log.warning if explicit_hostfile else log.info)(message, args.hostfile)
        unset = take_visible_devices(args, environ)
        pool = local_pool(args, environ)
    world = resolve_world(pool, args.include, args.exclude, args.num_nodes, args.num_gpus)
    if not world:
        raise UserError(f"No slots are left after --include {args.include!r} / --exclude {args.exclude!r}.")
    empty = [host for host, slots in world.items() if not slots]
    if empty:
        raise UserError(f"Host {empty[0]} has slots=0 in {args.hostfile}. Give it slots or remove it.")
    if launcher == "slurm":
        check_slurm_world(world)
    if args.no_ssh and not 0 <= args.node_rank < len(world):
        raise UserError(
            f"Launching training without ssh, but --node_rank is not set correctly: got {args.node_rank}, the world "
            f"info has {len(world)} node(s). Pass --node_rank N with 0 <= N < {len(world)} on each node."
        )
    multi_node = (args.force_multi or len(world) > 1) and not args.no_ssh
    if args.bind_cores_to_rank:
        check_core_binding(args, world, multi_node)
        if multi_node and launcher != "pdsh":
            raise UserError(
                f"--bind_cores_to_rank binds the ranks torchrun starts (one node, --no_ssh, pdsh); --launcher "
                f"{launcher} starts them itself. Use its own binding instead (srun --cpu-bind=cores, mpirun --bind-to "
                "core or -bind-to core), or --launcher pdsh."
            )
    nodes = [Node(host, rank, slots) for rank, (host, slots) in enumerate(world.items())]
    default_addr = nodes[0].host if from_hostfile and (multi_node or len(nodes) > 1) else "127.0.0.1"
    addr = args.master_addr or default_addr
    if not multi_node:
        if args.launcher_args:
            log.warning("--launcher_args is ignored: a single-node run is started with torchrun.")
        launches = node_launches(args, nodes, addr)
        mine = launches[args.node_rank if args.no_ssh else 0]
        mode = "no_ssh" if args.no_ssh else "local"
        env = {**mine["env"], **switch}
        return Plan(mode, world, addr, args.master_port, mine["command"], env, unset, nodes=launches)
    cwd = os.path.abspath(".")
    shim = [str(SHIM_DIR)] if backend == "fsdp" else []
    rest = [e for e in environ.get("PYTHONPATH", "").split(os.pathsep) if e and e != str(SHIM_DIR)]
    environ["PYTHONPATH"] = os.pathsep.join([*shim, cwd, *rest])
    exports = collect_exports(environ, launcher)
    exports[ENV_BACKEND] = backend
    env = {"PYTHONPATH": environ["PYTHONPATH"], ENV_BACKEND: backend}
    plan = Plan(launcher, world, addr, args.master_port, [], env, unset, exports)
    if launcher == "pdsh":
        plan.nodes = node_launches(args, nodes, addr)
        plan.command, env = pdsh_plan(args, nodes, addr, exports, environ)
    elif launcher == "slurm":
        plan.command, env = slurm_plan(args, world, exports)
        plan.master_addr = args.master_addr or None
    else:
        plan.command, env = mpi_plan(args, launcher, pool, exports, addr, from_hostfile), {}
    plan.env.update(env)
    return plan


def over_ssh(plan: Plan, environ: dict[str, str]) -> bool:
    """A pdsh launch where pdsh is not on the child's PATH: one ssh per node instead."""
    return plan.mode == "pdsh" and shutil.which("pdsh", path=environ.get("PATH")) is None


def is_mvapich(environ: dict[str, str]) -> bool:
    mpiname = shutil.which("mpiname", path=environ.get("PATH"))
    if mpiname is None:
        return False
    result = subprocess.run([mpiname], capture_output=True, text=True, env=environ)
    return "MVAPICH" in result.stdout.upper()


def check_backend(plan: Plan, args: argparse.Namespace, environ: dict[str, str]) -> None:
    """The program to exec exists (pdsh may fall back to ssh); for pdsh, passwordless ssh to the first host works
    (unless --no_ssh_check)."""
    program = "ssh" if over_ssh(plan, environ) else plan.command[0]
    if shutil.which(program, path=environ.get("PATH")) is None:
        needs = "pdsh or ssh" if plan.mode == "pdsh" else f"`{program}`"
        raise UserError(f"launcher '{plan.mode}' not installed: {needs} is not on PATH.")
    if plan.mode == "mvapich" and not is_mvapich(environ):
        raise UserError(
            "launcher 'mvapich' not installed: `mpiname` (MVAPICH2's) is not on PATH or does not report MVAPICH, so "
            "`mpirun` is another MPI's. Put MVAPICH2's bin directory first on PATH, or use --launcher mpich/openmpi."
        )
    if plan.mode != "pdsh" or args.no_ssh_check:
        return
    first = next(iter(plan.world))
    port = ["-p", str(args.ssh_port)] if args.ssh_port is not None else []
    check = ["ssh", "-o", "PasswordAuthentication=no", *port, first, "hostname"]
    if subprocess.run(check, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode != 0:
        raise UserError(
            f"Using hostfile at {args.hostfile} but host={first} was not reachable via ssh. If you are running with "
            f"a single node please remove {args.hostfile} or setup passwordless ssh."
        )


def main(argv: list[str] | None = None) -> int:
    """The `ds-fsdp` command: a user error is printed as one paragraph (exit status 2)."""
    try:
        return launch(sys.argv[1:] if argv is None else argv)
    except UserError as error:
        print(f"ds-fsdp: error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR


def launch(argv: list[str]) -> int:
    """Plan the launch of `argv` (the deepspeed launcher's flags), then print it (--dry_run) or run it; a user error
    raises UserError (a ValueError, the class DeepSpeed's launcher raises)."""
    args = parse_args(argv)
    level = "error" if args.quiet else args.log_level
    logging.basicConfig(level=level.upper(), format="[ds-fsdp] %(levelname)s: %(message)s")
    environ = dict(os.environ)
    plan = plan_launch(args, environ)
    child_env = {**environ, **plan.env}
    if args.dry_run:
        report = plan.report()
        if over_ssh(plan, child_env):
            report["ssh_commands"] = ssh_commands(plan, args)  # what runs instead of pdsh
        print(json.dumps(report, indent=2))
        return 0
    check_backend(plan, args, child_env)
    log.info(
        "backend = %s (%s)",
        plan.env[ENV_BACKEND],
        "import deepspeed -> ds_compat, the FSDP2 backend" if plan.env[ENV_BACKEND] == "fsdp" else "the real DeepSpeed",
    )
    if over_ssh(plan, child_env):
        commands = ssh_commands(plan, args)
        log.warning("pdsh is not installed: starting one ssh per node (%s) and waiting for them", ", ".join(plan.world))
        for command in commands:
            log.info("cmd = %s", shlex.join(command))
        return run_over_ssh(commands, child_env)
    log.info("cmd = %s", shlex.join(plan.command))
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(plan.command[0], plan.command, child_env)
    except OSError as error:
        print(f"ds-fsdp: error: cannot run {plan.command[0]}: {error}", file=sys.stderr)
        return 127


def __getattr__(name: str) -> ModuleType:
    """`deepspeed.launcher.runner` / `.multinode_runner` where the attribute `deepspeed.launcher` is this module."""
    if name in ("runner", "multinode_runner"):
        return importlib.import_module(f"ds_compat.launchers.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    sys.exit(main())
