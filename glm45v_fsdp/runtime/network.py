"""Which network interface the collectives bind to, chosen before the process group starts.

gloo, NCCL and HCCL each pick a socket interface of their own unless a variable names one. On a node whose host name
resolves to loopback, gloo advertises 127.0.0.1 to the other nodes ("connectFullMesh failed ... Connection refused,
remote=[127.0.0.1]"); on a node with several interfaces (management, storage, RoCE) any of them may be picked. So when
the user set none of the backend's variables, the interface whose address routes to MASTER_ADDR (the local address a
UDP socket connected to it gets: nothing is sent) is named in the backend's variable; loopback when MASTER_ADDR is
loopback. A variable the user set always wins, and the log line says whose choice each one is.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import MutableMapping
from dataclasses import dataclass

from glm45v_fsdp.errors import UserError

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


@dataclass(frozen=True)
class InterfaceVariable:
    """How one library is told its interface: by name (`=` exact-match prefix for NCCL) or by address (HCCL)."""

    name: str
    by_address: bool = False
    exact_prefix: str = ""

    def value(self, interface: str, address: str) -> str:
        return address if self.by_address else f"{self.exact_prefix}{interface}"


# Per backend, the variables that decide its interface, highest priority first (HCCL: HCCL_IF_IP, then
# HCCL_SOCKET_IFNAME, as CANN documents); the first is the one set when the user set none.
INTERFACE_VARIABLES: dict[str, tuple[InterfaceVariable, ...]] = {
    "gloo": (InterfaceVariable("GLOO_SOCKET_IFNAME"),),
    "nccl": (InterfaceVariable("NCCL_SOCKET_IFNAME", exact_prefix="="),),
    "hccl": (InterfaceVariable("HCCL_IF_IP", by_address=True), InterfaceVariable("HCCL_SOCKET_IFNAME")),
}


def interface_addresses() -> dict[str, str]:
    """{interface name: its IPv4 address} of this host's (network namespace's) interfaces that have one."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                request = struct.pack("256s", name.encode()[:15])
                found[name] = socket.inet_ntoa(fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)[20:24])
            except OSError:  # no IPv4 address
                continue
    return found


def resolve(master_addr: str) -> str:
    """MASTER_ADDR as an IPv4 address, or a UserError naming it."""
    try:
        return socket.getaddrinfo(master_addr, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, IndexError):
        raise UserError(
            f"MASTER_ADDR={master_addr!r} does not resolve to an IPv4 address on this node "
            f"({socket.gethostname()}). Set MASTER_ADDR to rank 0's address, or a host name every node resolves "
            f"(its /etc/hosts or DNS)."
        ) from None


def route_to(master_addr: str) -> tuple[str, str]:
    """(interface, local address) this node uses to reach MASTER_ADDR; ('lo', its address) for loopback."""
    target = resolve(master_addr)
    if ipaddress.ip_address(target).is_loopback:
        local = target
    else:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            try:
                sock.connect((target, 9))  # a UDP connect picks the route and the source address; sends nothing
            except OSError as error:
                raise UserError(
                    f"MASTER_ADDR={master_addr} ({target}) has no route from this node ({socket.gethostname()}): "
                    f"{error}. Set MASTER_ADDR to an address of rank 0's node that this node reaches."
                ) from None
            local = sock.getsockname()[0]
    by_address = {address: name for name, address in interface_addresses().items()}
    if local not in by_address:
        raise UserError(
            f"The route to MASTER_ADDR={master_addr} leaves from {local}, which no interface of this node holds "
            f"(interfaces: {interface_addresses()}). Set the backend's interface variable (GLOO_SOCKET_IFNAME, "
            f"NCCL_SOCKET_IFNAME, HCCL_IF_IP) by hand."
        )
    return by_address[local], local


def backends_of(backend: str) -> list[str]:
    """The collective libraries of a torch backend string ('gloo', 'nccl', 'cpu:gloo,npu:hccl')."""
    return [part.split(":")[-1].strip() for part in backend.split(",") if part.split(":")[-1].strip()]


def configure_interfaces(
    backend: str, master_addr: str, spans_nodes: bool, environ: MutableMapping[str, str] | None = None
) -> str:
    """Set each backend's interface variable the user left unset; returns the line for the log. `spans_nodes`: the
    job has ranks on other nodes, so an interface on loopback cannot work (an error before the group starts)."""
    env = os.environ if environ is None else environ
    libraries = [name for name in backends_of(backend) if name in INTERFACE_VARIABLES]
    if not libraries:
        return f"network: backend {backend}: no interface variable to set"
    interface, address = route_to(master_addr)
    said = []
    for library in libraries:
        variables = INTERFACE_VARIABLES[library]
        theirs = [variable for variable in variables if env.get(variable.name)]
        if theirs:
            said.append(", ".join(f"{v.name}={env[v.name]} (set by the user)" for v in theirs))
            _check_users_choice(library, theirs[0], env[theirs[0].name], master_addr, spans_nodes)
        else:
            chosen = variables[0]
            env[chosen.name] = chosen.value(interface, address)
            said.append(f"{chosen.name}={env[chosen.name]} (chosen)")
    return (
        f"network: MASTER_ADDR {master_addr} is reached through {interface} ({address}) on this node "
        f"({socket.gethostname()}); {'; '.join(said)}"
    )


def _check_users_choice(
    library: str, variable: InterfaceVariable, value: str, master_addr: str, spans_nodes: bool
) -> None:
    """A user's interface on loopback in a job that spans nodes: the other nodes cannot connect to it."""
    if not spans_nodes or ipaddress.ip_address(resolve(master_addr)).is_loopback:
        return
    addresses = interface_addresses()
    names = [part.lstrip("=^") for part in value.split(",")]
    if variable.by_address:
        loopback = ipaddress.ip_address(value).is_loopback if _is_ip(value) else False
    else:
        loopback = bool(names) and all(
            name in addresses and ipaddress.ip_address(addresses[name]).is_loopback for name in names
        )
    if loopback:
        interface, address = route_to(master_addr)
        raise UserError(
            f"{variable.name}={value} binds {library} to loopback, but the job has ranks on other nodes, which "
            f"cannot connect to this node's 127.0.0.1. Set {variable.name}="
            f"{variable.value(interface, address)} (the interface that reaches MASTER_ADDR={master_addr}), or unset "
            f"it and the runtime chooses it."
        )


def _is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True
