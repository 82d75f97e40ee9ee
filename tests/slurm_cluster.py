"""A real Slurm cluster for the tests: munged, slurmctld and slurmd on this machine, or across the nodes of a
network-namespace cluster (tests/netns_cluster.py): slurmctld on node0, one slurmd per node, one munged whose socket
every node reaches through the shared filesystem (the shared munge key of a real cluster).

Everything lives in one directory the test owns (key, sockets, spool, state, logs, slurm.conf): nothing under /etc is
written, the daemons listen on free ports, and `stop()` ends exactly the daemons this cluster started (by their pid
files), so a Slurm or munge already running on the machine is left alone. Commands reach this cluster through
`SLURM_CONF` (see `env()`). Needs root and Debian's `slurm-wlm` and `munge` (`.ci/run` installs them);
`SlurmCluster.unavailable()` says what is missing, so a test fails with that reason instead of skipping.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
COMMANDS = ("munge", "sbatch", "srun", "scontrol", "sinfo")
# The node advertises more CPUs than the machine has (SlurmdParameters=config_overrides), so the tests' jobs of
# 2 tasks never queue behind each other on a 2-core machine.
NODE_CPUS = 16


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _tool(name: str) -> str | None:
    for folder in ("/usr/sbin", "/usr/bin", "/sbin", "/bin"):
        if Path(folder, name).is_file():
            return str(Path(folder, name))
    return shutil.which(name)


class SlurmCluster:
    """`start()` brings the cluster up (the node idle in `sinfo`), `stop()` ends its daemons."""

    def __init__(self, root: Path, nodes=None, slurmd_timeout_s: int | None = None):
        """`nodes`: a started NetnsCluster to spread over (its node names and addresses); None: this machine.
        `slurmd_timeout_s`: Slurm's SlurmdTimeout, how long a node may not answer before it is DOWN and its jobs
        are ended (Slurm's default 300 s)."""
        self.root = root
        self.nodes = nodes
        self.slurmd_timeout_s = slurmd_timeout_s
        self.hosts = list(nodes.names) if nodes else [socket.gethostname().split(".")[0]]
        self.host = self.hosts[0]
        self.conf = root / "slurm.conf"
        self.socket = root / "munge" / "munge.socket"
        self.pid_files = {
            "munged": root / "munge" / "munged.pid",
            "slurmctld": root / "slurmctld.pid",
            **{f"slurmd {host}": root / f"slurmd.{host}.pid" for host in self.hosts},
        }

    @staticmethod
    def unavailable() -> str | None:
        """Why a cluster cannot be started here, or None."""
        missing = [name for name in DAEMONS + COMMANDS if _tool(name) is None]
        if missing:
            return (
                f"Slurm/munge programs not found: {', '.join(missing)}. Install Debian's packages: "
                f"apt-get install -y slurm-wlm munge (.ci/run does)."
            )
        if os.geteuid() != 0:
            return "the single-node Slurm cluster runs its daemons as root (SlurmUser=root); run the tests as root"
        return None

    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def start(self, timeout_s: float = 30.0) -> None:
        for folder in ("munge", "spool", "state", "log"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o711)  # munged requires its socket's directories to be searchable by all
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        munge = self.root / "munge"
        self._run(
            _tool("munged"),
            "--force",  # as root, with the key and sockets in this directory
            f"--key-file={key}",
            f"--socket={self.socket}",
            f"--pid-file={self.pid_files['munged']}",
            f"--log-file={munge / 'munged.log'}",
            f"--seed-file={munge / 'munged.seed'}",
        )
        self.conf.write_text(self._slurm_conf())
        self._run(_tool("slurmctld"), "-f", str(self.conf), node=0)
        for index in range(len(self.hosts)):
            self.start_slurmd(index)
        self.wait_until_idle(timeout_s)

    def start_slurmd(self, index: int) -> None:
        """(Re)start node `index`'s slurmd (after a node's processes were all killed, say)."""
        host = self.hosts[index]
        (self.root / "spool" / host).mkdir(exist_ok=True)
        self._run(_tool("slurmd"), "-f", str(self.conf), "-N", host, node=index)

    def wait_until_idle(self, timeout_s: float = 60.0) -> None:
        deadline = time.time() + timeout_s
        state = ""
        while time.time() < deadline:
            state = self.command("sinfo", "--noheader", "--format=%T", check=False).stdout.strip()
            if state == "idle":  # every node (sinfo folds nodes of one state into one line)
                return
            time.sleep(0.5)
        raise RuntimeError(f"the Slurm nodes did not become idle in {timeout_s} s (sinfo: {state!r}):\n{self.logs()}")

    def _slurm_conf(self) -> str:
        memory_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 * 8 // 10
        root = self.root
        return "\n".join(
            [
                "ClusterName=glm45vtest",
                f"SlurmctldHost={self.host}" + (f"({self.nodes.addresses[0]})" if self.nodes else ""),
                f"SlurmctldPort={_free_port()}",
                f"SlurmdPort={_free_port()}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={self.socket}",
                f"StateSaveLocation={root / 'state'}",
                f"SlurmdSpoolDir={root / 'spool' / '%n'}",
                f"SlurmctldPidFile={self.pid_files['slurmctld']}",
                f"SlurmdPidFile={root / 'slurmd.%n.pid'}",
                f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
                f"SlurmdLogFile={root / 'log' / 'slurmd.%n.log'}",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "SlurmdParameters=config_overrides",
                "MpiDefault=none",
                "ReturnToService=2",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "MinJobAge=3600",
                *([f"SlurmdTimeout={self.slurmd_timeout_s}"] if self.slurmd_timeout_s else []),
                *(
                    f"NodeName={host}{self._node_address(index)} CPUs={NODE_CPUS} RealMemory={memory_mib} State=UNKNOWN"
                    for index, host in enumerate(self.hosts)
                ),
                f"PartitionName=debug Nodes={','.join(self.hosts)} Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )

    def _node_address(self, index: int) -> str:
        return f" NodeAddr={self.nodes.addresses[index]}" if self.nodes else ""

    def on_node(self, node: int, command: list[str]) -> list[str]:
        """`command` as it runs on node `node` (in its namespace under a NetnsCluster; as is on this machine)."""
        return self.nodes.command(node, command) if self.nodes else command

    def _run(self, *command: str, node: int | None = None) -> None:
        argv = list(command) if node is None else self.on_node(node, list(command))
        result = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **self.env()})
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr}\n{self.logs()}")

    def command(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster (from node0 under a NetnsCluster)."""
        argv = self.on_node(0, list(command))
        result = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **self.env()})
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr}")
        return result

    def job_fields(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as key -> value (JobState, ExitCode, ...)."""
        text = self.command("scontrol", "show", "job", "--oneliner", job_id).stdout
        return dict(item.split("=", 1) for item in text.split() if "=" in item)

    def wait_for_job(self, job_id: str, timeout_s: float) -> dict[str, str]:
        """The job's fields once it has ended (a state other than PENDING, RUNNING, COMPLETING, CONFIGURING)."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            fields = self.job_fields(job_id)
            if fields.get("JobState") not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING"):
                return fields
            time.sleep(1.0)
        self.command("scancel", job_id, check=False)
        raise TimeoutError(f"Slurm job {job_id} did not end within {timeout_s} s")

    def logs(self) -> str:
        return "\n".join(
            f"--- {path.name}\n{path.read_text(errors='replace')[-2000:]}"
            for path in sorted(self.root.glob("**/*.log"))
        )

    def stop(self) -> None:
        """SIGTERM every daemon at once (each takes 1-2 s to exit), SIGKILL those left after 3 s: nothing of a test's
        cluster outlives it (its state is in the test's directory), and after tests/test_multinode.py's node loss
        slurmctld did not end within 10 s of its SIGTERM."""
        pids = []
        for name in reversed(list(self.pid_files)):
            try:
                pid = int(self.pid_files[name].read_text().split()[0])
                os.kill(pid, signal.SIGTERM)
            except (OSError, ValueError, IndexError):
                continue
            pids.append(pid)
        deadline = time.time() + 3
        while pids and time.time() < deadline:
            time.sleep(0.1)
            pids = [pid for pid in pids if _alive(pid)]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
