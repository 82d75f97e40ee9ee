"""`deepspeed.launcher.runner` and `deepspeed.launcher.multinode_runner` under ds-fsdp against the real DeepSpeed
(issue 33). The runner's hostfile and filter functions are compared case by case in tests/test_ds_launcher.py
(test_resolution_matches_deepspeed runs deepspeed's call sequence on both modules); here: parse_args, the hostfile
and filter functions' return types and errors, encode_world_info, and every runner class: the command its get_cmd
returns is the one `ds-fsdp --dry_run` plans, it starts as many processes on the same hosts as deepspeed's runner's
command, and bad arguments raise deepspeed's error class."""

from __future__ import annotations

import collections
import importlib
import os
import shlex
import sys

import pytest

from ds_compat import launcher
from ds_compat.launchers import multinode_runner as ours
from ds_compat.launchers import runner as our_runner

HOSTS = {"worker-0": 4, "worker-1": 4}
ARGV = ["--master_addr", "worker-0", "--master_port", "6100", "train.py", "--lr", "1e-4", "--name", "a b"]


@pytest.fixture
def deepspeed(monkeypatch):
    """deepspeed.launcher.runner and .multinode_runner, imported for the CPU accelerator."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    return (
        importlib.import_module("deepspeed.launcher.runner"),
        importlib.import_module("deepspeed.launcher.multinode_runner"),
    )


@pytest.fixture
def env(monkeypatch, tmp_path):
    for name in list(os.environ):
        if name.startswith(("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL", "HCCL", "ASCEND", "AISC", "DS_FSDP", "PDSH")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{host} slots={n}\n" for host, n in HOSTS.items()))
    return hostfile


def test_parse_args_reads_deepspeeds_flags_alike(deepspeed):
    runner, _ = deepspeed
    argv = ["-H", "hf", "-e", "w0:1", "--num_nodes", "2", "--launcher", "SLURM", "--launcher_args", "-p x"]
    argv += ["--no_local_rank", "--module", "--ssh_port", "2222", "--venv_script", "v.sh", "pkg.main", "--k", "v"]
    for flags in (argv, ARGV, ["t.py"]):
        theirs, mine = vars(runner.parse_args(flags)), vars(our_runner.parse_args(flags))
        assert set(mine) - set(theirs) == {"backend", "dry_run"}  # ds-fsdp's own flags
        differ = {key for key in theirs if theirs[key] != mine[key]}
        assert differ <= {"enable_each_rank_log"}  # deepspeed's default is the string "None", ours None
        assert theirs["enable_each_rank_log"] == "None" and mine["enable_each_rank_log"] is None
    sys_argv = ["deepspeed", "--num_gpus", "2", "x.py"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", sys_argv)
        assert our_runner.parse_args().num_gpus == runner.parse_args().num_gpus == 2


def test_hostfile_and_filter_functions_return_deepspeeds_types(deepspeed, tmp_path):
    runner, _ = deepspeed
    path = tmp_path / "hostfile"
    path.write_text("b slots=2\na slots=3 # comment\n")
    for module in (runner, our_runner):
        pool = module.fetch_hostfile(str(path))
        assert pool == collections.OrderedDict([("b", 2), ("a", 3)]) and list(pool) == ["b", "a"]
        assert module.fetch_hostfile(str(tmp_path / "missing")) is None
        assert module._parse_hostfile(["x slots=1", "# c", ""]) == {"x": 1}
        active = module.parse_inclusion_exclusion(pool, "a:2,0@b", "")
        assert isinstance(active, collections.OrderedDict) and list(active.items()) == [("b", [0, 1]), ("a", [0, 2])]
        assert module.parse_resource_filter({"a": [0, 1, 2]}, exclude_str="a:1") == {"a": [0, 2]}
        assert module.apply_num_nodes_and_gpus(active, 1, 3) == {"b": [0, 1, 2]}
    world = {"worker-0": [0, 1], "worker-1": [2]}
    assert our_runner.encode_world_info(world) == runner.encode_world_info(world)


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m._parse_hostfile(["w slots=2", "w slots=2"]),
        lambda m: m._parse_hostfile(["w2 slots 4"]),
        lambda m: m._parse_hostfile(["# only a comment"]),
        lambda m: m.parse_resource_filter({"a": [0, 1]}, "a", "a"),
        lambda m: m.parse_resource_filter({"a": [0, 1]}, "b"),
        lambda m: m.parse_resource_filter({"a": [0, 1]}, "a:7"),
        lambda m: m.parse_resource_filter({"a": [0, 1]}, "", "a:x"),
        lambda m: m.parse_resource_filter({"a": [0, 1]}, "a:0:1"),
        lambda m: m.parse_inclusion_exclusion({"a": 2}, "", "b:0"),
    ],
)
def test_bad_hostfiles_and_filters_raise_valueerror_as_deepspeed(deepspeed, call):
    runner, _ = deepspeed
    with pytest.raises(ValueError):
        call(runner)
    with pytest.raises(ValueError, match=r"\. [A-Z]"):  # ours goes on with the fix
        call(our_runner)


RUNNERS = ["PDSHRunner", "OpenMPIRunner", "MPICHRunner", "IMPIRunner", "SlurmRunner", "MVAPICHRunner"]
LAUNCHER_OF = dict(zip(RUNNERS, ["pdsh", "openmpi", "mpich", "impi", "slurm", "mvapich"]))


def make(module, name, args, pool, world_info="e30="):
    cls = getattr(module, name)
    return cls(args, world_info) if name == "PDSHRunner" else cls(args, world_info, pool)


def processes_and_hosts(command: list[str]) -> tuple:
    """How many processes a launcher command starts, on which hosts (for the flags these launchers take)."""
    words = command
    count = words[words.index("-n") + 1] if "-n" in words else words[words.index("-np") + 1] if "-np" in words else None
    hosts = words[words.index("-w") + 1] if "-w" in words else None
    return words[0], count, words[words.index("-ppn") + 1] if "-ppn" in words else None, hosts


@pytest.mark.parametrize("name", RUNNERS)
def test_each_runners_command_is_the_one_ds_fsdp_runs(name, env, deepspeed):
    _, ds_multinode = deepspeed
    argv = ["-H", str(env), "--launcher", LAUNCHER_OF[name], *ARGV]
    plan = launcher.plan_launch(launcher.parse_args(argv), dict(os.environ))
    args = launcher.parse_args(argv)
    pool = our_runner.fetch_hostfile(args.hostfile)
    world = our_runner.parse_inclusion_exclusion(pool, "", "")
    runner = make(ours, name, args, pool)
    assert runner.name == LAUNCHER_OF[name] == make(ds_multinode, name, launcher.parse_args(argv), pool).name
    for key, value in plan.exports.items():
        runner.add_export(key, f" {value} ")
    environment: dict[str, str] = {}
    result = runner.get_cmd(environment, world)
    command = result[0] if name == "PDSHRunner" else result
    assert command == plan.command  # what `ds-fsdp --dry_run` shows and execs
    for key, value in plan.env.items():
        if key not in ("PYTHONPATH", "DS_FSDP_BACKEND"):  # ds-fsdp's switch, set around the runner
            assert environment[key] == value
    theirs = make(ds_multinode, name, launcher.parse_args(argv), pool)
    their_result = theirs.get_cmd({}, world)
    their_command = their_result[0] if name == "PDSHRunner" else their_result
    if name == "IMPIRunner":  # one `-n 1` block per rank, on both
        assert command.count(":") == their_command.count(":") == sum(HOSTS.values()) - 1
        assert command[command.index("-ppn") + 1] == their_command[their_command.index("-ppn") + 1] == "4"
    else:
        assert processes_and_hosts(command) == processes_and_hosts(their_command)
    if name == "PDSHRunner":
        kill, returned_env = result[1], result[2]
        assert kill[:6] == their_result[1][:6] == ["pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1"]
        assert "pkill -f" in kill[-1] and "torch.distributed.run" in kill[-1] and returned_env is environment
        assert environment["PDSH_RCMD_TYPE"] == "ssh"
        assert "--name 'a b'" in command[-1] or shlex.quote("a b") in command[-1]


@pytest.mark.parametrize("name", ["OpenMPIRunner", "MPICHRunner", "IMPIRunner", "MVAPICHRunner"])
@pytest.mark.parametrize("flags", [["-i", "worker-0"], ["-e", "worker-1:0"], ["--num_nodes", "1"], ["--num_gpus", "2"]])
def test_mpi_runners_refuse_filters_as_deepspeed(name, flags, env, deepspeed):
    _, ds_multinode = deepspeed
    argv = ["-H", str(env), "--launcher", LAUNCHER_OF[name], *flags, *ARGV]
    with pytest.raises(ValueError) as theirs:
        make(ds_multinode, name, launcher.parse_args(argv), HOSTS)
    with pytest.raises(ValueError) as mine:
        make(ours, name, launcher.parse_args(argv), HOSTS)
    assert str(theirs.value) in str(mine.value)


@pytest.mark.parametrize("world", [{"worker-0": [0, 2], "worker-1": [0, 1]}, {"worker-0": [0, 1, 2], "worker-1": [0]}])
def test_slurm_refuses_what_srun_cannot_place_as_deepspeed(world, env, deepspeed):
    _, ds_multinode = deepspeed
    with pytest.raises(ValueError) as theirs:
        ds_multinode.SlurmRunner.validate_active_resources(world)
    with pytest.raises(ValueError) as mine:
        ours.SlurmRunner.validate_active_resources(world)
    assert str(theirs.value) in str(mine.value)


def test_uneven_hosts_and_backend_checks(env, deepspeed, monkeypatch):
    _, ds_multinode = deepspeed
    uneven = {"worker-0": 4, "worker-1": 2}
    argv = ["-H", str(env), "--launcher", "mpich", *ARGV]
    for module in (ds_multinode, ours):
        runner = make(module, "MPICHRunner", launcher.parse_args(argv), uneven)
        with pytest.raises(ValueError, match="requires same number of devices per node"):
            runner.get_cmd({}, {host: list(range(n)) for host, n in uneven.items()})
    bin_dir = env.parent / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))  # no launcher programs at all
    runners = {
        name: make(ours, name, launcher.parse_args(["--launcher", LAUNCHER_OF[name], *ARGV]), HOSTS) for name in RUNNERS
    }
    assert not any(runner.backend_exists() for runner in runners.values())
    for program, says in [("pdsh", ""), ("ompi_info", ""), ("mpirun", ""), ("sinfo", ""), ("mpiname", "MPICH 4.1")]:
        (bin_dir / program).write_text(f"#!/bin/sh\necho '{says}'\n")
        (bin_dir / program).chmod(0o755)
    assert [runners[name].backend_exists() for name in RUNNERS] == [True, True, True, True, True, False]
    (bin_dir / "mpiname").write_text("#!/bin/sh\necho 'MVAPICH2-GDR 2.3.7 Mon Jan 1 2024 standard'\n")
    assert runners["MVAPICHRunner"].backend_exists()
