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


class MultiNodeRunner(ABC):
    def __init__(self, args: argparse.Namespace, world_info_base64: str) -> None:
        self.args = args
        self.validate_args()
        self.user_arguments = self.parse_user_args()
        self.user_script = args.user_script
        self.world_info_base64 = world_info_base64
        self.exports: dict[str, str] = {}

    @abstractmethod
    def backend_exists(self) -> bool:
        """Whether this launcher's program is installed."""

    @abstractmethod
    def get_cmd(self, environment: MutableMapping[str, str], active_resources: Resources) -> list[str]:
        """The command that starts the job on `active_resources`; may set launcher variables in `environment`."""

    def add_export(self, key: str, var: str) -> None:
        self.exports[key.strip()] = var.strip()  # quoted where the command is built

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

    def master_addr(self, active_resources: Resources) -> str:
        return self.args.master_addr or next(iter(active_resources))


class PDSHRunner(MultiNodeRunner):
    @property
    def name(self) -> str:
        return "pdsh"

    def backend_exists(self) -> bool:
        return shutil.which("pdsh") is not None

    def get_cmd(
        self, environment: MutableMapping[str, str], active_resources: Resources
    ) -> tuple[list[str], list[str], MutableMapping[str, str]]:
        """(pdsh command, the pdsh command that kills the nodes' torchruns, `environment` with pdsh's variables)."""
        nodes = [Node(host, rank, list(slots)) for rank, (host, slots) in enumerate(active_resources.items())]
        command, pdsh_env = pdsh_plan(self.args, nodes, self.master_addr(active_resources), self.exports, environment)
        environment.update(pdsh_env)
        kill = [*command[:-1], f"pkill -f {shlex.quote(f'{sys.executable} -u -m torch.distributed.run')}"]
        return command, kill, environment


class _PooledRunner(MultiNodeRunner):
    """A runner that is also handed the hostfile's {host: slot count} (deepspeed's `resource_pool`)."""

    def __init__(self, args: argparse.Namespace, world_info_base64: str, resource_pool: dict[str, int]) -> None:
        super().__init__(args, world_info_base64)
        self.resource_pool = resource_pool


class SlurmRunner(_PooledRunner):
    @property
    def name(self) -> str:
        return "slurm"

    def backend_exists(self) -> bool:
        return shutil.which("sinfo") is not None

    @classmethod
    def validate_active_resources(cls, active_resources: Resources) -> None:
        check_slurm_world(active_resources)

    def get_cmd(self, environment: MutableMapping[str, str], active_resources: Resources) -> list[str]:
        self.validate_active_resources(active_resources)
        command, slurm_env = slurm_plan(self.args, active_resources, self.exports)
        environment.update(slurm_env)  # srun --export=ALL hands them to every rank
        return command


class _MPIRunner(_PooledRunner):
    """mpirun over the whole hostfile: no --include/--exclude, no --num_nodes/--num_gpus."""

    launcher = ""

    @property
    def name(self) -> str:
        return self.launcher

    def validate_args(self) -> None:
        check_mpi_flags(self.args, self.name)

    def backend_exists(self) -> bool:
        return shutil.which("mpirun") is not None

    def get_cmd(self, environment: MutableMapping[str, str], active_resources: Resources) -> list[str]:
        addr = self.master_addr(active_resources)
        hostfile = os.path.isfile(self.args.hostfile)
        return mpi_plan(self.args, self.launcher, self.resource_pool, self.exports, addr, hostfile)


class OpenMPIRunner(_MPIRunner):
    launcher = "openmpi"

    def backend_exists(self) -> bool:
        return shutil.which("ompi_info") is not None


class MPICHRunner(_MPIRunner):
    launcher = "mpich"


class IMPIRunner(_MPIRunner):
    launcher = "impi"


class MVAPICHRunner(_MPIRunner):
    launcher = "mvapich"

    def backend_exists(self) -> bool:
        return is_mvapich(dict(os.environ))
