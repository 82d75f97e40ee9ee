"""`deepspeed.launcher.multinode_runner`: deepspeed's runner classes, whose `get_cmd` returns the command ds-fsdp
would run for that launcher (ds_compat/launcher.py builds it: pdsh starting one torchrun per node, srun / mpirun
starting every rank), not deepspeed's own per-node launcher.

Tools that build a runner from parsed launcher arguments and call `get_cmd(environment, active_resources)` get a
command that starts the ranks under the FSDP2 backend; `exports` (add_export) reach every node or rank. The
arguments are checked as deepspeed checks them (ValueError for the filters an MPI backend cannot apply).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import sys
from abc import ABC, abstractmethod
from collections.abc import MutableMapping

from ds_compat.launcher import (
    Node,
    Resources,
    check_mpi_flags,
    check_slurm_world,
    is_mvapich,
    mpi_plan,
    pdsh_plan,
    slurm_plan,
)


def as_world(active_resources: Resources | dict[str, int]) -> Resources:
    """{host: slot ids}; a host given a slot count (DeepSpeed's resource pool, which its get_cmd takes too) has the
    slots 0 .. count-1."""
    return {host: list(range(n)) if isinstance(n, int) else list(n) for host, n in active_resources.items()}


class MultiNodeRunner(ABC):
    def __init__(self, args: argparse.Namespace, world_info_base64: str) -> None:
        self.args = args
        self.validate_args()
        self.user_arguments = self.parse_user_args()
        self.user_script = args.user_script
        self.world_info_base64 = world_info_base64
        self.exports: dict[str, str] = {}
        self._values: dict[str, str] = {}  # what add_export was given, before DeepSpeed's quoting

    @abstractmethod
    def backend_exists(self) -> bool:
        """Whether this launcher's program is installed."""

    @abstractmethod
    def get_cmd(self, environment: MutableMapping[str, str], active_resources: Resources) -> list[str]:
        """The command that starts the job on `active_resources`; may set launcher variables in `environment`."""

    def add_export(self, key: str, var: str) -> None:
        """`exports[key]` as DeepSpeed writes it (double-quoted when it holds a character a shell would read); the
        command is built from the value itself, quoted where the command needs it."""
        value = var.strip()
        self._values[key.strip()] = value
        self.exports[key.strip()] = f'"{value}"' if re.search(r"[^\w@%+=:,./-]", value) else value

    def command_exports(self) -> dict[str, str]:
        """The exports' values as given to add_export (an entry set in `exports` directly: as it stands)."""
        return {
            key: self._values[key] if key in self._values and self._as_added(key) else value
            for key, value in self.exports.items()
        }

    def _as_added(self, key: str) -> bool:
        value = self._values[key]
        return self.exports[key] in (value, f'"{value}"')

    def parse_user_args(self) -> list[str]:
        return self.args.user_args

    @property
    def name(self) -> str:
        return self.__class__.__name__

    def validate_args(self) -> None:  # noqa: B027 - overridden where a backend refuses arguments
        """Check the launcher arguments this backend cannot honour."""

    @classmethod  # noqa: B027 - overridden where a backend cannot express a filter
    def validate_active_resources(cls, active_resources: Resources) -> None:
        """Check a resolved --include/--exclude filter against what this backend can express."""

    def master_addr(self, active_resources: Resources | dict[str, int]) -> str:
        return self.args.master_addr or next(iter(active_resources))


class _NamedRunner(MultiNodeRunner):
    """A runner named by deepspeed's --launcher value, installed when its `program` is on PATH."""

    launcher = ""  # the --launcher value: the runner's name
    program = ""  # the program whose presence says the launcher is installed

    @property
    def name(self) -> str:
        return self.launcher

    def backend_exists(self) -> bool:
        return shutil.which(self.program) is not None


class PDSHRunner(_NamedRunner):
    launcher = program = "pdsh"

    def get_cmd(
        self, environment: MutableMapping[str, str], active_resources: Resources
    ) -> tuple[list[str], list[str], MutableMapping[str, str]]:
        """(pdsh command, the pdsh command that kills the nodes' torchruns, `environment` with pdsh's variables)."""
        world = as_world(active_resources)
        nodes = [Node(host, rank, slots) for rank, (host, slots) in enumerate(world.items())]
        command, pdsh_env = pdsh_plan(self.args, nodes, self.master_addr(world), self.command_exports(), environment)
        environment.update(pdsh_env)
        kill = [*command[:-1], f"pkill -f {shlex.quote(f'{sys.executable} -u -m torch.distributed.run')}"]
        return command, kill, environment


class _PooledRunner(_NamedRunner):
    """A runner that is also handed the hostfile's {host: slot count} (deepspeed's `resource_pool`)."""

    def __init__(self, args: argparse.Namespace, world_info_base64: str, resource_pool: dict[str, int]) -> None:
        super().__init__(args, world_info_base64)
        self.resource_pool = resource_pool


class SlurmRunner(_PooledRunner):
    launcher, program = "slurm", "sinfo"

    @classmethod
    def validate_active_resources(cls, active_resources: Resources) -> None:
        check_slurm_world(active_resources)

    def get_cmd(self, environment: MutableMapping[str, str], active_resources: Resources) -> list[str]:
        world = as_world(active_resources)
        self.validate_active_resources(world)
        command, slurm_env = slurm_plan(self.args, world, self.command_exports())
        environment.update(slurm_env)  # srun --export=ALL hands them to every rank
        return command


class _MPIRunner(_PooledRunner):
    """mpirun over the whole hostfile: no --include/--exclude, no --num_nodes/--num_gpus."""

    program = "mpirun"

    def validate_args(self) -> None:
        check_mpi_flags(self.args, self.name)

    def get_cmd(self, environment: MutableMapping[str, str], active_resources: Resources) -> list[str]:
        """mpirun's command; it names args.hostfile as DeepSpeed's does (the caller has read that file)."""
        addr = self.master_addr(active_resources)
        return mpi_plan(self.args, self.launcher, self.resource_pool, self.command_exports(), addr, hostfile=True)


class OpenMPIRunner(_MPIRunner):
    launcher, program = "openmpi", "ompi_info"

    def __init__(self, args: argparse.Namespace, world_info_base64: str, resource_pool: dict[str, int]) -> None:
        super().__init__(args, world_info_base64, resource_pool)
        self.add_export("UCX_TLS", "tcp")  # as DeepSpeed's, and ds-fsdp's collect_exports; a later export replaces it


class MPICHRunner(_MPIRunner):
    launcher = "mpich"


class IMPIRunner(_MPIRunner):
    launcher = "impi"


class MVAPICHRunner(_MPIRunner):
    launcher = "mvapich"

    def backend_exists(self) -> bool:
        return is_mvapich(dict(os.environ))
