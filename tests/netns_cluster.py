"""A real multi-node cluster for the tests: N Linux network namespaces on one machine, each a host.

Each node is a network namespace with its own loopback and an `eth0` (a veth pair) on a bridge of this cluster's
own, with an address on a private /24 that exists only on that bridge (no route out of it, no NAT). The nodes share
the filesystem, as cluster nodes share their storage. Every node resolves `node0`, `node1`, ... through its own
`/etc/netns/NAME/hosts` (bound over /etc/hosts in each process's mount namespace, as `ip netns exec` does), and
every process this cluster starts on a node runs in a UTS namespace with the node's host name, so `hostname` says
`nodeK` as on a cluster. Each node runs an sshd on its own address only (host key, config and the root key in this
cluster's directory), so `ssh nodeK` and pdsh reach it; the `ssh` on `env()`'s PATH carries the cluster's ssh
config. tests/slurm_cluster.py spreads a Slurm cluster over these nodes.

`stop()` removes exactly what `start()` made (its namespaces, bridge, veths, /etc/netns entries; the processes in its
namespaces, by pid), never anything else. Needs root, iproute2, unshare, openssh-server and pdsh (.ci/system-packages
installs them); `NetnsCluster.unavailable()` says what is missing, so a test fails with that reason, never skips.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

PROGRAMS = ("ip", "nsenter", "unshare", "mount", "hostname", "sshd", "ssh", "ssh-keygen", "pdsh")
SUBNETS = [ipaddress.ip_network(f"10.214.{third}.0/24") for third in range(16, 240)]


def _tool(name: str) -> str | None:
    for folder in ("/usr/sbin", "/usr/bin", "/sbin", "/bin"):
        if Path(folder, name).is_file():
            return str(Path(folder, name))
    return shutil.which(name)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _subnets_in_use() -> set[ipaddress.IPv4Network]:
    text = _ip("-4", "-o", "addr", "show").stdout
    return {ipaddress.ip_interface(part.split()[3]).network for part in text.splitlines() if len(part.split()) > 3}


class NetnsCluster:
    """`start()` brings up `nodes` nodes (sshd on each), `stop()` tears them down."""

    def __init__(self, root: Path, nodes: int = 2, sysctls: dict[str, str] | None = None):
        """`sysctls`: per-node kernel settings of the nodes' network stacks (each namespace has its own), e.g.
        {"net.ipv4.tcp_retries2": "5"}, as a cluster's operators set them."""
        assert nodes >= 2, "a cluster has at least two nodes"
        self.root = root
        self.sysctls = dict(sysctls or {})
        self.count = nodes
        token = f"{os.getpid() % 100000:05d}"
        self.bridge = f"g45b{token}"
        self.namespaces = [f"glm45v-{token}-node{i}" for i in range(nodes)]
        self.host_veths = [f"g45v{token}n{i}" for i in range(nodes)]
        self.names = [f"node{i}" for i in range(nodes)]
        self.subnet = next(net for net in SUBNETS if net not in _subnets_in_use())
        hosts = list(self.subnet.hosts())
        self.addresses = [str(hosts[10 + i]) for i in range(nodes)]
        self.ssh_dir = root / "ssh"
        self.bin_dir = root / "bin"
        self.started = False

    @staticmethod
    def unavailable() -> str | None:
        """Why a cluster cannot be started here, or None."""
        missing = [name for name in PROGRAMS if _tool(name) is None]
        if missing:
            return (
                f"programs of the test cluster not found: {', '.join(missing)}. Install Debian's packages: "
                f"apt-get install -y iproute2 util-linux openssh-server openssh-client pdsh (.ci/system-packages does)."
            )
        if os.geteuid() != 0:
            return "the network-namespace cluster needs root (ip netns, veth, a bridge); run the tests as root"
        return None

    # ---------------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.started = True
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{address} {name}\n" for address, name in zip(self.addresses, self.names)
        )
        for ns, veth, address in zip(self.namespaces, self.host_veths, self.addresses):
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            for key, value in self.sysctls.items():
                setting = "/proc/sys/" + key.replace(".", "/")  # the namespace's own, through its /proc/sys
                _ip("netns", "exec", ns, "/bin/sh", "-c", f"echo {value} > {setting}")
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file)
        self._start_sshd()

    def _start_sshd(self) -> None:
        self.ssh_dir.mkdir(parents=True, exist_ok=True)
        self.ssh_dir.chmod(0o700)
        for key in ("host_key", "id"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.ssh_dir / key)], check=True)
        shutil.copy(self.ssh_dir / "id.pub", self.ssh_dir / "authorized_keys")
        (self.ssh_dir / "ssh_config").write_text(
            "Host *\n"
            f"  IdentityFile {self.ssh_dir / 'id'}\n"
            f"  UserKnownHostsFile {self.ssh_dir / 'known_hosts'}\n"
            "  StrictHostKeyChecking no\n  BatchMode yes\n  LogLevel ERROR\n  ConnectTimeout 5\n"
        )
        self.bin_dir.mkdir(parents=True, exist_ok=True)
        wrapper = self.bin_dir / "ssh"  # what pdsh, DeepSpeed's runner and mpirun call: the cluster's config
        wrapper.write_text(f'#!/bin/sh\nexec {_tool("ssh")} -F {self.ssh_dir / "ssh_config"} "$@"\n')
        wrapper.chmod(0o755)
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
        for index, address in enumerate(self.addresses):
            config = self.ssh_dir / f"sshd_{index}.conf"
            config.write_text(
                f"ListenAddress {address}\nPort 22\nHostKey {self.ssh_dir / 'host_key'}\n"
                f"PidFile {self.ssh_dir / f'sshd_{index}.pid'}\nAuthorizedKeysFile {self.ssh_dir / 'authorized_keys'}\n"
                "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                "UsePAM no\nStrictModes no\nAcceptEnv *\nMaxStartups 100\nMaxSessions 100\n"
            )
            result = self.run(index, [_tool("sshd"), "-f", str(config), "-E", str(self.ssh_dir / f"sshd_{index}.log")])
            if result.returncode != 0:
                raise RuntimeError(f"sshd on {self.names[index]} failed: {result.stderr}")
        for index in range(self.count):  # every node reaches every other over ssh, by name
            for other in self.names:
                probe = self.run(index, ["ssh", other, "hostname"], env=self.env(), timeout=30)
                if probe.stdout.strip() != other:
                    raise RuntimeError(f"ssh {self.names[index]} -> {other}: {probe.stdout!r} {probe.stderr!r}")

    # ---------------------------------------------------------------------------------------------------------
    def command(self, node: int, argv: list[str]) -> list[str]:
        """`argv` as it runs on `node`: in its network namespace, with its host name and its /etc/hosts.

        Like `ip netns exec`, but without remounting /sys (that would hide /sys/fs/cgroup, which slurmd needs):
        nsenter joins the network namespace, and a mount namespace of its own binds the node's hosts file."""
        hosts = Path("/etc/netns") / self.namespaces[node] / "hosts"
        setup = f"{_tool('mount')} --bind {hosts} /etc/hosts && {_tool('hostname')} {self.names[node]}"
        return [  # absolute programs: `argv` may run with a PATH of its own
            _tool("nsenter"), f"--net=/run/netns/{self.namespaces[node]}", _tool("unshare"), "--mount", "--uts",
            "/bin/sh", "-c", f'{setup} && exec "$@"', "sh", *argv,
        ]  # fmt: skip

    def run(self, node: int, argv: list[str], env: dict | None = None, timeout: float = 60, **kwargs):
        return subprocess.run(
            self.command(node, argv), env=env, capture_output=True, text=True, timeout=timeout, **kwargs
        )

    def popen(self, node: int, argv: list[str], env: dict | None = None, **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(node, argv), env=env, text=True, **kwargs)

    def env(self, base: dict | None = None) -> dict[str, str]:
        """An environment whose `ssh` is the cluster's (PATH starts with its wrapper)."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = f"{self.bin_dir}:{env.get('PATH', '/usr/bin:/bin')}"
        return env

    def pids(self, node: int) -> list[int]:
        result = _ip("netns", "pids", self.namespaces[node], check=False)
        return [int(pid) for pid in result.stdout.split()]

    def sshd_pid(self, node: int) -> int | None:
        try:
            return int((self.ssh_dir / f"sshd_{node}.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def kill_node_processes(self, node: int) -> list[int]:
        """SIGKILL every process on `node` but its sshd (a node whose job processes all died); returns the pids."""
        victims = [pid for pid in self.pids(node) if pid != self.sshd_pid(node)]
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return victims

    def link(self, node: int, up: bool) -> None:
        """Take `node`'s link to the bridge down (the node drops off the network) or back up."""
        _ip("link", "set", self.host_veths[node], "up" if up else "down")

    def stop(self) -> None:
        if not self.started:
            return
        for index in range(self.count):
            for pid in self.pids(index):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.time() + 10
        while time.time() < deadline and any(self.pids(index) for index in range(self.count)):
            time.sleep(0.1)
        for ns, veth in zip(self.namespaces, self.host_veths):
            _ip("link", "del", veth, check=False)
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        _ip("link", "del", self.bridge, check=False)
        self.started = False
