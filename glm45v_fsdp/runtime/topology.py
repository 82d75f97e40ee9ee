"""Which node each rank runs on, and which of the layout's process groups stay inside a node.

The meshes (runtime/mesh.py) lay the world out as dp_replicate x dp_shard x cp_ring x cp_ulysses, innermost last, and
the expert view as dp_replicate x efsdp x ep: a Ulysses group, a ring group and an EP group are blocks of adjacent
ranks, and every launcher gives a node a block of adjacent ranks (torchrun, deepspeed, srun and mpirun by node). So
those groups stay inside a node whenever their ranks fit in one, and HSDP's replicate dim, outermost, runs across
nodes. `group_ranks` computes every group from the sizes alone (preflight uses it without a process group; a test
checks it against the meshes' own groups on a 2-node cluster); `NodeLayout` is where the ranks actually run.
"""

from __future__ import annotations

import math
import os
import re
import socket
from dataclasses import dataclass

import torch

from glm45v_fsdp.runtime.mesh import ParallelDims

# The collective families of a layout: what each group carries, for the log and preflight.
FAMILIES = {
    "cp_ulysses": "Ulysses all-to-all",
    "cp_ring": "ring attention P2P",
    "ep": "EP dispatch/combine all-to-all (or all-gather)",
    "efsdp": "expert FSDP all-gather/reduce-scatter",
    "fsdp": "FSDP all-gather/reduce-scatter",
    "dp_replicate": "HSDP replica all-reduce",
    "dp": "data-parallel loss and metrics reductions",
}


def group_ranks(dims: ParallelDims) -> dict[str, list[list[int]]]:
    """Every group of each family that has more than one rank: {family: [[ranks], ...]}."""
    grid = torch.arange(dims.world_size).reshape(dims.dp_replicate, dims.dp_shard, dims.cp_ring, dims.cp_ulysses)

    def along(*axes: int) -> list[list[int]]:  # one group per position of the other axes, over `axes` flattened
        rest = [axis for axis in range(grid.dim()) if axis not in axes]
        size = math.prod(grid.shape[axis] for axis in axes)
        return grid.permute(*rest, *axes).reshape(-1, size).tolist()

    groups = {
        "cp_ulysses": along(3),
        "cp_ring": along(2),
        "fsdp": along(1, 2, 3),
        "dp_replicate": along(0),
        "dp": along(0, 1),
    }
    # The expert view splits each replica's fsdp ranks (in order) into efsdp x ep, ep innermost.
    groups["ep"] = [fsdp[e * dims.ep : (e + 1) * dims.ep] for fsdp in groups["fsdp"] for e in range(dims.efsdp)]
    if dims.ep_enabled:  # without EP the expert groups are the fsdp groups
        groups["efsdp"] = [fsdp[p :: dims.ep] for fsdp in groups["fsdp"] for p in range(dims.ep)]
    return {family: [sorted(g) for g in found] for family, found in groups.items() if len(found[0]) > 1}


@dataclass(frozen=True)
class NodeLayout:
    """`node_of[rank]`: the index (into `hosts`) of the node rank runs on; nodes numbered by their first rank."""

    hosts: tuple[str, ...]
    node_of: tuple[int, ...]

    @classmethod
    def from_hosts(cls, host_of_rank: list[str]) -> NodeLayout:
        hosts = tuple(dict.fromkeys(host_of_rank))
        return cls(hosts, tuple(hosts.index(host) for host in host_of_rank))

    @classmethod
    def contiguous(cls, world_size: int, per_node: int) -> NodeLayout:
        """The layout launchers give `per_node` ranks per node (preflight's assumption)."""
        return cls.from_hosts([f"node{rank // per_node}" for rank in range(world_size)])

    @property
    def node_count(self) -> int:
        return len(self.hosts)

    def ranks_on(self, node: int) -> list[int]:
        return [rank for rank, where in enumerate(self.node_of) if where == node]

    def crosses(self, group: list[int]) -> bool:
        return len({self.node_of[rank] for rank in group}) > 1

    def describe(self) -> str:
        per_node = sorted({len(self.ranks_on(node)) for node in range(self.node_count)})
        nodes = ", ".join(f"{host}: ranks {_ranges(self.ranks_on(i))}" for i, host in enumerate(self.hosts))
        return f"{self.node_count} node(s) x {'/'.join(map(str, per_node))} rank(s) ({nodes})"


def placement(dims: ParallelDims, layout: NodeLayout) -> dict[str, str]:
    """{family: 'inside a node' | 'across nodes (...)'} for the families the layout runs."""
    biggest = max(len(layout.ranks_on(node)) for node in range(layout.node_count))
    found = {}
    for family, groups in group_ranks(dims).items():
        crossing = [group for group in groups if layout.crosses(group)]
        if not crossing:
            found[family] = "inside a node"
            continue
        found[family] = f"across nodes ({len(groups[0])} ranks per group)"
        misplaced = [group for group in crossing if group[-1] - group[0] < biggest]
        if misplaced:  # adjacent ranks that fit in a node but were not placed on one: the launcher's order
            found[family] += f", although group {misplaced[0]} would fit in one node: ranks were not placed by node"
    return found


def describe_placement(dims: ParallelDims, layout: NodeLayout) -> str:
    where = placement(dims, layout)
    inside = [f"{family} ({FAMILIES[family]})" for family, text in where.items() if text == "inside a node"]
    across = [f"{family} ({FAMILIES[family]}) {text[len('across nodes ') :]}" for family, text in where.items()
              if text != "inside a node"]  # fmt: skip
    parts = [f"inside a node: {', '.join(inside) or '-'}", f"across nodes: {', '.join(across) or '-'}"]
    return f"topology: {layout.describe()}; " + "; ".join(parts)


_IPV4 = re.compile(r"(?<![\d.])(\d{1,3}(?:\.\d{1,3}){3})(?![\d.])")
# a node's address (the one its ranks reach MASTER_ADDR from) -> (host, ranks)
_peers: dict[str, tuple[str, list[int]]] = {}


def detect_layout() -> NodeLayout:
    """Every rank's host name and address gathered (collective): where the ranks really run; the addresses let a
    lost connection be named by node (`lost_peer`)."""
    from glm45v_fsdp.runtime.dist import gather_objects
    from glm45v_fsdp.runtime.network import route_to

    master = os.environ.get("MASTER_ADDR")
    address = route_to(master)[1] if master else None
    seen = gather_objects((socket.gethostname(), address))
    layout = NodeLayout.from_hosts([str(host) for host, _ in seen])
    _peers.clear()
    for rank, (host, where) in enumerate(seen):
        if where is not None:
            _peers.setdefault(where, (host, []))[1].append(rank)
    return layout


def lost_peer(message: str) -> str | None:
    """For a failed collective's message that names a peer's address (gloo: `Read error [10.0.0.12]:57984:
    Connection reset by peer`): which node and ranks that is, for the log. None when it names no other node."""
    here = socket.gethostname()
    for address in _IPV4.findall(message):
        if address in _peers and _peers[address][0] != here:
            host, ranks = _peers[address]
            return (
                f"lost the connection to {host} ({address}, rank(s) {_ranges(ranks)}): that node's processes died "
                f"or its network went down"
            )
    return None


def _ranges(ranks: list[int]) -> str:
    spans, start = [], None
    for index, rank in enumerate(ranks):
        if start is None:
            start = rank
        if index + 1 == len(ranks) or ranks[index + 1] != rank + 1:
            spans.append(f"{start}" if start == rank else f"{start}-{rank}")
            start = None
    return ",".join(spans)
