"""Many hosts for real: the trainer across the nodes of a network-namespace cluster (tests/netns_cluster.py).

Two nodes x two ranks = 4 ranks of the tiny model, fp32; each launcher's losses equal the single-host 4-rank run
with the same global batch (mean relative error <= 1e-6), and metrics.jsonl holds every rank's figures. No test sets
GLOO_SOCKET_IFNAME: the machine's host name resolves to loopback, and the runtime must choose the node's eth0 itself
(runtime/network.py); a user's loopback choice is refused before the group starts.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PARITY, REPO, clean_env, mean_relative_error, read_metrics

NODES, PER_NODE = 2, 2
_ports = itertools.count(29600)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from netns_cluster import NetnsCluster

    reason = NetnsCluster.unavailable()
    if reason is not None:
        pytest.fail(f"cannot start the network-namespace cluster: {reason}")
    nodes = NetnsCluster(tmp_path_factory.mktemp("netns"), NODES)
    try:
        nodes.start()
        yield nodes
    finally:
        nodes.stop()


def node_env(cluster, **extra: str) -> dict[str, str]:
    env = cluster.env(clean_env())
    env.pop("GLOO_SOCKET_IFNAME", None)
    env.update(extra)
    return env


def on_every_node(cluster, argv_of, env: dict, timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """Start `argv_of(node)` on every node at once; wait for all (killing the rest on a timeout)."""
    processes = [
        cluster.popen(node, argv_of(node), env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for node in range(cluster.count)
    ]
    results = []
    for node, process in enumerate(processes):
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            out, err = process.communicate()
            raise AssertionError(f"node{node} did not finish in {timeout} s:\n{out[-3000:]}\n{err[-3000:]}") from None
        results.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    return results


def torchrun_on_node(node: int, rendezvous: list[str], out: Path, *overrides: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={NODES}", f"--nproc_per_node={PER_NODE}",
        *rendezvous, "-m", "glm45v_fsdp.train", f"training.output_dir={out}", "training.progress_bar=false",
        *PARITY, *overrides,
    ]  # fmt: skip


def assert_matches_one_host(results, out: Path, reference: list[dict]) -> str:
    for node, result in enumerate(results):
        assert result.returncode == 0, f"node{node}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    records = read_metrics(out)
    assert mean_relative_error([r["loss"] for r in records], [r["loss"] for r in reference]) <= 1e-6
    assert all(len(r["ms_per_iter_per_rank"]) == NODES * PER_NODE for r in records)  # every rank's figures
    return next(result.stdout for result in results if "summary steps" in result.stdout)


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_torchrun_across_nodes_equals_one_host(cluster, parity_off, tmp_path, rendezvous):
    port = next(_ports)
    out = tmp_path / "out"

    def argv(node: int) -> list[str]:
        if rendezvous == "static":
            flags = [f"--node_rank={node}", "--master_addr=node0", f"--master_port={port}"]
        else:
            flags = ["--rdzv_backend=c10d", f"--rdzv_endpoint=node0:{port}", "--rdzv_id=multinode"]
        return torchrun_on_node(node, flags, out)

    log = assert_matches_one_host(on_every_node(cluster, argv, node_env(cluster)), out, parity_off(4))
    # the host name resolves to loopback on no node here, but the machine's does: the runtime chose eth0 itself
    assert "is reached through eth0 (" in log and "GLOO_SOCKET_IFNAME=eth0 (chosen)" in log


def test_a_loopback_interface_across_nodes_stops_before_the_group(cluster, tmp_path):
    port = next(_ports)
    out = tmp_path / "out"
    flags = lambda node: [f"--node_rank={node}", "--master_addr=node0", f"--master_port={port}"]  # noqa: E731
    results = on_every_node(
        cluster, lambda node: torchrun_on_node(node, flags(node), out), node_env(cluster, GLOO_SOCKET_IFNAME="lo"),
        timeout=300,
    )  # fmt: skip
    assert all(result.returncode != 0 for result in results)
    stderr = "".join(result.stderr for result in results)
    assert "GLOO_SOCKET_IFNAME=lo binds gloo to loopback, but the job has ranks on other nodes" in stderr
    assert "Set GLOO_SOCKET_IFNAME=eth0" in stderr and "connectFullMesh" not in stderr


LAYOUTS = {
    "ep2": {"parallel.expert_parallel_size": 2},
    "ulysses2": {"parallel.ulysses_parallel_size": 2},
    "ring2": {"parallel.ring_attention_size": 2},
    "hsdp2x2": {"parallel.data_parallel_replicate_size": 2, "parallel.expert_parallel_size": 2},
}
# What must stay inside a node on 2 nodes x 2 ranks, and what runs across (HSDP: shard inside, replicate across).
INSIDE = {"ep2": {"ep"}, "ulysses2": {"cp_ulysses"}, "ring2": {"cp_ring"}, "hsdp2x2": {"fsdp", "ep"}}
ACROSS = {"hsdp2x2": {"dp_replicate"}}


def test_every_group_of_each_layout_against_the_node_of_each_rank(cluster, tmp_path):
    """One launch builds the meshes of EP 2, Ulysses 2, Ring 2 and HSDP 2 x 2; every rank reports its groups."""
    import json

    from glm45v_fsdp.config import load_config
    from glm45v_fsdp.runtime import build_parallel_dims
    from glm45v_fsdp.runtime.topology import group_ranks

    port = next(_ports)
    script = [str(REPO / "tests" / "multinode_groups.py"), str(tmp_path), json.dumps(LAYOUTS)]
    results = on_every_node(
        cluster,
        lambda node: [
            sys.executable, "-m", "torch.distributed.run", f"--nnodes={NODES}", f"--nproc_per_node={PER_NODE}",
            f"--node_rank={node}", "--master_addr=node0", f"--master_port={port}", *script,
        ],
        node_env(cluster),
        timeout=300,
    )  # fmt: skip
    assert all(r.returncode == 0 for r in results), "\n".join(r.stderr[-2000:] for r in results)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(NODES * PER_NODE)]
    host = [entry["host"] for entry in ranks]
    assert host == ["node0", "node0", "node1", "node1"]  # torchrun gives each node a block of adjacent ranks
    for name, overrides in LAYOUTS.items():
        dims = build_parallel_dims(load_config(None, [f"{k}={v}" for k, v in overrides.items()]).parallel, 4)
        expected = group_ranks(dims)
        for family in expected:
            held = {tuple(entry["layouts"][name]["groups"][family]) for entry in ranks}
            assert held == {tuple(group) for group in expected[family]}, (name, family)  # the model of the meshes
        for family in INSIDE[name]:
            assert all(len({host[r] for r in group}) == 1 for group in expected[family]), (name, family)
        for family in ACROSS.get(name, ()):
            assert all(len({host[r] for r in group}) == 2 for group in expected[family]), (name, family)
        topology = ranks[0]["layouts"][name]["topology"]
        assert "2 node(s) x 2 rank(s) (node0: ranks 0-1, node1: ranks 2-3)" in topology
        inside = topology.split("inside a node: ")[1].split("; across nodes")[0]
        assert all(family in inside for family in INSIDE[name]), topology
