"""`deepspeed.utils.groups` and `deepspeed.utils.numa` under ds-fsdp against the real DeepSpeed (issue 33), and
ds-fsdp's --bind_cores_to_rank, which binds each torchrun rank with numa's command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import free_port, spawn

from ds_compat.utils import numa as ours

REPO = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------------------------------------------
# groups: 2 gloo ranks, DeepSpeed's module and ours in the same process group
# --------------------------------------------------------------------------------------------------------------


def group_queries(module) -> list[str]:
    """Every query of our groups module (all exist in DeepSpeed's too)."""
    return sorted(n for n in dir(module) if n.startswith(("_get_", "get_")) and callable(getattr(module, n)))


def ask(module, name: str):
    """The query's answer (a group: its ranks), or the class of what it raised (an AssertionError: that class, which
    ours subclasses); queries about expert groups get DeepSpeed's group name."""
    function = getattr(module, name)
    args = ("ep_size_1",) * function.__code__.co_argcount
    try:
        answer = function(*args)
    except Exception as error:  # noqa: BLE001 - the class is what is compared
        return AssertionError if isinstance(error, AssertionError) else type(error)
    if isinstance(answer, (list, range)):
        return list(answer)
    if isinstance(answer, (int, str, type(None), dict)):
        return answer
    return ("group", dist.get_process_group_ranks(answer))


def _groups_worker(rank: int, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    os.environ.update(MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from deepspeed import comm as ds_comm
    from deepspeed.utils import groups as theirs

    import ds_compat
    from ds_compat.utils import groups as mine

    ds_comm.init_distributed(dist_backend="gloo")  # deepspeed.comm over the process group above
    queries = group_queries(mine)
    assert len(queries) >= 30 and all(hasattr(theirs, name) for name in queries)
    for name in queries:
        assert ask(mine, name) == ask(theirs, name), name
    assert ask(mine, "_get_data_parallel_world_size") == 2 and ask(mine, "_get_sequence_parallel_group") is KeyError
    assert ask(mine, "_get_expert_parallel_world_size") is AssertionError
    with pytest.raises(ValueError, match="not from an mpu or this call"):
        mine.initialize(ep_size=2)
    engine, *_ = ds_compat.initialize(
        model=torch.nn.Linear(4, 4), config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    )
    group = mine._get_data_parallel_group()
    assert group is engine.meshes.dp.get_group() and mine._get_data_parallel_world_size() == engine.dp_world_size
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total, group=group)
    assert total.item() == 3.0 and mine._get_data_parallel_rank() == rank
    mine.use_meshes(None)
    dist.destroy_process_group()


def test_groups_before_init_distributed_fail_as_deepspeeds(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.utils import groups as theirs

    from ds_compat.utils import groups as mine

    assert not dist.is_initialized()
    for name in group_queries(mine):
        assert ask(mine, name) == ask(theirs, name), name
    assert ask(mine, "_get_data_parallel_world_size") is AssertionError


def test_groups_answer_as_deepspeeds_and_follow_the_engine():
    spawn(_groups_worker, args=(free_port(),), nprocs=2)


# --------------------------------------------------------------------------------------------------------------
# numa: the same topologies fed to both (DeepSpeed reads `numactl --hardware`, ours sysfs)
# --------------------------------------------------------------------------------------------------------------

TOPOLOGIES = {
    "one_node": [[0, 1, 2, 3, 4, 5, 6, 7]],
    "two_nodes": [[0, 1, 2, 3], [4, 5, 6, 7]],
    "interleaved": [[0, 2, 4, 6], [1, 3, 5, 7]],
    "flat_hbm": [[0, 1, 2, 3], [4, 5, 6, 7], [], []],
    "fake_numa": [[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7], [4, 5, 6, 7]],
    "no_numa_info": [],
}
BINDINGS = [None, "0-3", "0,2,4-7", "1-2,5", "4-7", "0-7"]


def numactl_hardware(topology: list[list[int]]) -> bytes:
    lines = [f"available: {len(topology)} nodes ({'-'.join(map(str, [0, len(topology) - 1]))})"]
    lines += [f"node {n} cpus: {' '.join(map(str, cpus))}".rstrip() for n, cpus in enumerate(topology)]
    return ("\n".join(lines) + "\n").encode()


@pytest.fixture
def deepspeed_numa(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.utils import numa

    monkeypatch.setattr(numa, "check_for_numactl_pkg", lambda: True)
    monkeypatch.setattr(ours, "check_for_numactl_pkg", lambda: True)
    return numa


def feed(monkeypatch, theirs, topology: list[list[int]]) -> None:
    if topology:
        monkeypatch.setattr(theirs.subprocess, "check_output", lambda cmd: numactl_hardware(topology))
    else:
        monkeypatch.setattr(theirs.subprocess, "check_output", lambda cmd: (_ for _ in ()).throw(FileNotFoundError))
    monkeypatch.setattr(theirs.psutil, "cpu_count", lambda logical=True: 8)
    monkeypatch.setattr(ours, "get_numa_cores", lambda: [list(cpus) for cpus in topology])
    monkeypatch.setattr(ours, "physical_core_count", lambda: 8)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_numactl_commands_equal_deepspeeds(topology, deepspeed_numa, monkeypatch):
    theirs = deepspeed_numa
    feed(monkeypatch, theirs, TOPOLOGIES[topology])
    assert theirs.get_numa_cores() == ours.get_numa_cores() == TOPOLOGIES[topology]
    compared = 0
    for binding in BINDINGS:
        cores = 8 if binding is None else len(ours.parse_range_list(binding))
        for procs in range(1, cores + 2):
            for rank in range(procs):
                try:
                    expected = theirs.get_numactl_cmd(binding, procs, rank)
                except AssertionError:
                    with pytest.raises(AssertionError, match="At least one core"):
                        ours.get_numactl_cmd(binding, procs, rank)
                    continue
                assert ours.get_numactl_cmd(binding, procs, rank) == expected, (binding, procs, rank)
                compared += 1
    assert compared > 100


def test_memory_binding_where_ours_differs(deepspeed_numa, monkeypatch):
    """Fake NUMA on one socket only: DeepSpeed leaves a rank on the other socket's (unsplit) node without a memory
    binding; ours binds it to its node, as it does when no node is split."""
    mixed = [[0, 1], [0, 1], [2, 3]]
    feed(monkeypatch, deepspeed_numa, mixed)
    assert (
        deepspeed_numa.get_numactl_cmd("0-3", 2, 0)
        == ours.get_numactl_cmd("0-3", 2, 0)
        == (
            2,
            ["numactl", "-m", "0,1", "-C", "0-1"],
        )
    )
    assert deepspeed_numa.get_numactl_cmd("0-3", 2, 1) == (2, ["numactl", "-C", "2-3"])
    assert ours.get_numactl_cmd("0-3", 2, 1) == (2, ["numactl", "-m", "2", "-C", "2-3"])


@pytest.mark.parametrize("text", ["5", "0-3", "0-3,8,10-11", "3-2", "a", "1-2-3", "0-3,2-5", "4,1", "", "0,,1"])
def test_range_parsing_equals_deepspeeds(text, deepspeed_numa):
    try:
        expected = list(deepspeed_numa.parse_range_list(text))
    except ValueError:
        with pytest.raises(ValueError):
            ours.parse_range_list(text)
        return
    assert ours.parse_range_list(text) == expected


def test_kmp_affinity_and_this_machines_topology(deepspeed_numa, monkeypatch):
    monkeypatch.setenv("KMP_AFFINITY", "compact")
    for module in (deepspeed_numa, ours):
        with pytest.raises(ValueError, match="KMP_AFFINITY"):
            module.get_numactl_cmd(None, 1, 0)
    monkeypatch.delenv("KMP_AFFINITY")
    real = ours.get_numa_cores()  # sysfs: every online CPU of this machine, each in one node
    online = ours.parse_range_list(Path("/sys/devices/system/cpu/online").read_text().strip())
    assert sorted(cpu for cpus in real for cpu in cpus) == online
    for rank, ranks in [(2, 2), (-1, 2), (0, 0)]:
        with pytest.raises(ValueError, match="is not one of the"):
            ours.get_numactl_cmd("0-7", ranks, rank)


def test_bind_cores_to_rank_pins_each_torchrun_rank(tmp_path):
    """Two ranks (one on a one-core machine) share this process's cores: each gets its own share, bound by numactl,
    and OMP_NUM_THREADS to match."""
    script = tmp_path / "affinity.py"
    script.write_text(  # each rank writes a file of its own: the ranks' shared stdout can interleave lines
        "import os, sys\n"
        "cpus = sorted(os.sched_getaffinity(0))\n"
        "threads = os.environ['OMP_NUM_THREADS']\n"
        "open(os.path.join(sys.argv[-1], 'rank' + os.environ['RANK']), 'w').write(f'{cpus} {threads}')\n"
    )
    allowed = sorted(os.sched_getaffinity(0))
    ranks = min(2, len(allowed))
    per_rank = len(allowed) // ranks
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DS_FSDP", "KMP_"))}
    env["DS_ACCELERATOR"] = "cpu"
    launch = [sys.executable, "-m", "ds_compat.launcher", "--num_gpus", str(ranks), "--master_port", str(free_port())]
    cores = ",".join(map(str, allowed))
    result = subprocess.run(
        [*launch, "--bind_cores_to_rank", "--bind_core_list", cores, str(script), str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    seen = [(tmp_path / f"rank{r}").read_text() for r in range(ranks)]
    assert seen == [f"{allowed[r * per_rank : (r + 1) * per_rank]} {per_rank}" for r in range(ranks)]
    bad = subprocess.run([*launch, "--bind_core_list", "3-1", str(script)], cwd=REPO, env=env, capture_output=True)
    assert bad.returncode == 2 and b"--bind_core_list '3-1'" in bad.stderr
