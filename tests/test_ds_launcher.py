"""ds_compat.launcher (`ds-fsdp`): world resolution equals deepspeed's runner, dry-run commands for every backend,
.deepspeed_env propagation, and real torchrun runs on CPU (2 gloo ranks)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port

from ds_compat import launcher
from ds_compat.alias import SHIM_DIR
from ds_compat.hostfile import read_hostfile, resolve_world
from ds_compat.launcher import LOCAL_RANK_ARG, main, numa_node_count
from ds_compat.launchers import runner as our_runner
from glm45v_fsdp.errors import UserError

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
TEXT = {"capture_output": True, "text": True}
HOSTFILE = """\
# three workers
worker-0 slots=4

worker-1 slots=4   # trailing text is ignored
worker-2 slots=2
"""


@pytest.fixture(scope="module")
def ds_runner():
    """deepspeed.launcher.runner, the reference, imported for the CPU accelerator."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DS_ACCELERATOR", "cpu")
        return importlib.import_module("deepspeed.launcher.runner")


def deepspeed_world(runner, path: str, include: str, exclude: str, num_nodes: int, num_gpus: int):
    pool = runner.fetch_hostfile(path)
    if pool is None:
        return None
    if (num_nodes >= 0 or num_gpus >= 0) and (include or exclude):  # the check runner.main() makes first
        raise ValueError("Cannot specify num_nodes/gpus with include/exclude")
    active = runner.parse_inclusion_exclusion(pool, include, exclude)
    return dict(runner.apply_num_nodes_and_gpus(active, num_nodes, num_gpus))


def our_world(path: str, include: str, exclude: str, num_nodes: int, num_gpus: int):
    pool = read_hostfile(path)
    return None if pool is None else resolve_world(pool, include, exclude, num_nodes, num_gpus)


# (hostfile text or None for a missing file, include, exclude, num_nodes, num_gpus, deepspeed's error text is kept)
CASES = {
    "all": (HOSTFILE, "", "", -1, -1, True),
    "include_host": (HOSTFILE, "worker-1", "", -1, -1, True),
    "include_slots_and_host": (HOSTFILE, "worker-0:0,1@worker-1", "", -1, -1, True),
    "include_unsorted_duplicate_slots": (HOSTFILE, "worker-1:3,1,1", "", -1, -1, True),
    "include_host_then_slot_of_it": (HOSTFILE, "worker-0@worker-0:2", "", -1, -1, True),
    "include_keeps_hostfile_order": (HOSTFILE, "worker-2@worker-0:3", "", -1, -1, True),
    "exclude_slot": (HOSTFILE, "", "worker-1:0", -1, -1, True),
    "exclude_host": (HOSTFILE, "", "worker-2", -1, -1, True),
    "exclude_every_slot_of_a_host": (HOSTFILE, "", "worker-2:0,1", -1, -1, True),
    "exclude_everything": (HOSTFILE, "", "worker-0@worker-1@worker-2", -1, -1, True),
    "num_nodes": (HOSTFILE, "", "", 2, -1, True),
    "num_gpus": (HOSTFILE, "", "", -1, 2, True),
    "num_gpus_beyond_slots": (HOSTFILE, "", "", 1, 8, True),
    "num_nodes_beyond_hosts": (HOSTFILE, "", "", 9, -1, True),
    "zero_slots_host": ("a slots=2\nb slots=0\n", "", "", -1, -1, True),
    "missing_hostfile": (None, "", "", -1, -1, True),
    "err_unknown_host": (HOSTFILE, "worker-9", "", -1, -1, True),
    "err_unknown_host_with_slots": (HOSTFILE, "worker-9:0", "", -1, -1, True),
    "err_empty_host_name": (HOSTFILE, "worker-0@", "", -1, -1, True),
    "err_unknown_slot": (HOSTFILE, "worker-2:5", "", -1, -1, True),
    "err_exclude_unknown_slot": (HOSTFILE, "", "worker-0:4", -1, -1, True),
    "err_include_and_exclude": (HOSTFILE, "worker-0", "worker-1", -1, -1, True),
    "err_num_gpus_with_include": (HOSTFILE, "worker-0", "", -1, 1, True),
    "err_num_gpus_zero_with_exclude": (HOSTFILE, "", "worker-0", -1, 0, True),
    "err_num_nodes_with_exclude": (HOSTFILE, "", "worker-0", 1, -1, True),
    "err_bad_slot": (HOSTFILE, "", "worker-0:x", -1, -1, False),
    "err_empty_slot": (HOSTFILE, "worker-0:", "", -1, -1, False),
    "err_two_colons": (HOSTFILE, "worker-0:1:2", "", -1, -1, False),
    "err_hostfile_duplicate": ("w slots=2\nw slots=4\n", "", "", -1, -1, True),
    "err_hostfile_bad_line": ("w slots=2\nw2 slots 4\n", "", "", -1, -1, True),
    "err_hostfile_no_slots": ("w\n", "", "", -1, -1, True),
    "err_hostfile_only_comments": ("# nothing\n\n", "", "", -1, -1, True),
}


def outcome(function, *args):
    try:
        return "ok", function(*args)
    except Exception as error:  # either implementation's outcome, compared below
        return "error", error


@pytest.mark.parametrize("name", list(CASES))
def test_resolution_matches_deepspeed(ds_runner, tmp_path, name):
    text, include, exclude, num_nodes, num_gpus, same_text = CASES[name]
    path = tmp_path / "hostfile"
    if text is not None:
        path.write_text(text)
    theirs = outcome(deepspeed_world, ds_runner, str(path), include, exclude, num_nodes, num_gpus)
    ours = outcome(our_world, str(path), include, exclude, num_nodes, num_gpus)
    assert ours[0] == theirs[0], (ours, theirs)
    # deepspeed.launcher.runner's functions under ds-fsdp (ds_compat/launchers/runner.py), called as deepspeed's
    through_runner = outcome(deepspeed_world, our_runner, str(path), include, exclude, num_nodes, num_gpus)
    assert through_runner[0] == theirs[0]
    if through_runner[0] == "ok":
        assert through_runner[1] == theirs[1]
    else:
        assert isinstance(through_runner[1], ValueError) and (
            not same_text or str(theirs[1]).rstrip(".") in str(through_runner[1])
        )
    if ours[0] == "ok":
        assert ours[1] == theirs[1]
        return
    assert isinstance(ours[1], UserError) and isinstance(theirs[1], ValueError), (ours, theirs)
    if same_text:
        assert str(theirs[1]).rstrip(".") in str(ours[1])


@pytest.fixture
def env(monkeypatch, tmp_path):
    """A clean launch environment: CPU accelerator, a HOME and a working directory of our own, nothing exported."""
    for name in list(os.environ):
        if name.startswith(("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL", "HCCL", "ASCEND", "AISC", "DS_", "PDSH")):
            monkeypatch.delenv(name)
    for name in ("CUDA_VISIBLE_DEVICES", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setattr(launcher, "DLTS_HOSTFILE", str(tmp_path / "no_hostfile"))  # even where /job/hostfile exists
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    (tmp_path / "hostfile").write_text("worker-0 slots=4\nworker-1 slots=4\n")
    return tmp_path


def dry_run(capsys, *argv: str) -> dict:
    assert main(["--dry_run", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def user_error(capsys, *argv: str) -> str:
    assert main(["--dry_run", *argv]) == 2
    return capsys.readouterr().err


def torchrun(nnodes, rank, nproc, addr, *tail, port=29500) -> list[str]:
    head = [PY, "-u", "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node_rank", str(rank)]
    return head + ["--nproc_per_node", str(nproc), "--master_addr", addr, "--master_port", str(port), *tail]


def test_local_dry_run_is_one_torchrun(env, capsys, monkeypatch):
    report = dry_run(capsys, "--num_gpus", "2", "--module", "glm45v_fsdp.train", "training.train_iters=3")
    assert report["mode"] == "local" and report["world_info"] == {"localhost": [0, 1]} and report["world_size"] == 2
    assert report["command"] == torchrun(
        1, 0, 2, "127.0.0.1", "--module", "glm45v_fsdp.train", LOCAL_RANK_ARG, "training.train_iters=3"
    )
    devices = dict.fromkeys(["CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES"], "0,1")
    switch = {"PYTHONPATH": str(SHIM_DIR), "DS_FSDP_BACKEND": "fsdp"}  # import deepspeed -> ds_compat in the ranks
    assert report["env"] == {**devices, "CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_SIZE": "2", **switch}
    assert report["exports"] == {} and report["unset"] == []
    # DS_ACCELERATOR=cpu without --num_gpus: one process per NUMA node (or LOCAL_SIZE), as deepspeed counts CPUs
    assert dry_run(capsys, "train.py")["world_info"] == {"localhost": list(range(numa_node_count()))}
    monkeypatch.setenv("LOCAL_SIZE", "3")
    plain = dry_run(capsys, "--no_python", "--no_local_rank", "--master_addr", "10.0.0.1", "./run.sh", "-x")
    assert plain["command"] == torchrun(1, 0, 3, "10.0.0.1", "--no-python", "./run.sh", "-x")
    logs = dry_run(capsys, "--num_gpus", "1", "--enable_each_rank_log", "logs", "t.py")["command"]
    assert logs[14:19] == ["--log-dir", "logs", "--redirects", "3", "t.py"]


def test_visible_devices_become_the_include_filter(env, capsys, monkeypatch):
    monkeypatch.setenv("LOCAL_SIZE", "4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    report = dry_run(capsys, "train.py")
    assert report["world_info"] == {"localhost": [1, 3]} and report["unset"] == ["CUDA_VISIBLE_DEVICES"]
    assert report["env"]["CUDA_VISIBLE_DEVICES"] == "1,3" and report["command"][9] == "2"
    assert dry_run(capsys, "--num_gpus", "1", "train.py")["world_info"] == {"localhost": [0]}  # ignored, as deepspeed


def test_pdsh_dry_run_runs_each_nodes_torchrun(env, capsys):
    hostfile = str(env / "hostfile")
    report = dry_run(capsys, "-H", hostfile, "--launcher_args", "-R ssh", "train.py", "--lr", "1e-4")
    assert report["mode"] == "pdsh" and report["master_addr"] == "worker-0" and report["world_size"] == 8
    assert report["command"][:-1] == ["pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1", "-R", "ssh"]
    pythonpath = f"{SHIM_DIR}:{env / 'work'}"
    keepalive = "-o ServerAliveInterval=10 -o ServerAliveCountMax=3"
    assert report["env"] == {
        "PYTHONPATH": pythonpath,
        "DS_FSDP_BACKEND": "fsdp",
        "PDSH_RCMD_TYPE": "ssh",
        "PDSH_SSH_ARGS_APPEND": keepalive,
    }
    assert [node["command"] for node in report["nodes"]] == [
        torchrun(2, rank, 4, "worker-0", "train.py", LOCAL_RANK_ARG, "--lr", "1e-4") for rank in (0, 1)
    ]
    assert report["nodes"][1]["env"]["CROSS_RANK"] == "1" and report["nodes"][1]["env"]["LOCAL_SIZE"] == "4"
    forced = dry_run(capsys, "--force_multi", "--num_gpus", "2", "--master_port", "1234", "--ssh_port", "2222", "x.py")
    assert forced["mode"] == "pdsh" and forced["command"][5] == "localhost" and forced["master_addr"] == "127.0.0.1"
    assert forced["env"]["PDSH_SSH_ARGS_APPEND"] == f"{keepalive} -p 2222"
    bound = dry_run(capsys, "-H", hostfile, "--bind_cores_to_rank", "--bind_core_list", "0-7", "--module", "pkg.m", "x")
    binder = ["--no-python", PY, "-m", "ds_compat.utils.numa", "--bind_core_list", "0-7", "--"]
    assert bound["nodes"][1]["command"] == torchrun(
        2, 1, 4, "worker-0", *binder, PY, "-u", "-m", "pkg.m", LOCAL_RANK_ARG, "x"
    )


def run_remote_script(report: dict, host: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run pdsh's remote command the way one host would, with python replaced by a dump of argv and environment."""
    dump = tmp_path / "dump"
    dump.write_text(
        f"#!{PY}\nimport json, os, sys\n"
        "seen = {'argv': sys.argv[1:], 'cwd': os.getcwd(), 'env': dict(os.environ)}\n"
        f"json.dump(seen, open({str(tmp_path / 'out')!r}, 'w'))\n"
    )
    dump.chmod(0o755)
    script = report["command"][-1].replace("%h", host).replace(f"exec {PY} ", f"exec {dump} ")
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, cwd="/")


def test_pdsh_remote_command_quotes_and_selects_each_hosts_slots(env, capsys, monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    hostfile = str(env / "hostfile")
    args = ["-H", hostfile, "-i", "worker-0:1,2@worker-1", "--module", "pkg.train", "a b", "it's", "$HOME"]
    report = dry_run(capsys, *args)
    assert report["world_info"] == {"worker-0": [1, 2], "worker-1": [0, 1, 2, 3]}
    for node in report["nodes"]:
        assert run_remote_script(report, node["host"], env).returncode == 0
        seen = json.loads((env / "out").read_text())
        assert seen["argv"] == node["command"][1:] and seen["cwd"] == str(env / "work")
        assert {k: seen["env"][k] for k in node["env"]} == node["env"]
        assert seen["env"]["NCCL_DEBUG"] == "INFO" and seen["env"]["PYTHONPATH"] == f"{SHIM_DIR}:{env / 'work'}"
    assert report["nodes"][0]["command"][7:10] == ["0", "--nproc_per_node", "2"]
    unknown = run_remote_script(report, "worker-7", env)
    assert unknown.returncode == 1 and "worker-7 is not in the world info" in unknown.stderr


def test_without_pdsh_each_node_gets_the_same_remote_command_over_ssh(env, capsys, monkeypatch):
    """pdsh missing: one `ssh HOST '<the command pdsh would run there>'` per node, with the keepalive options;
    tests/test_multinode.py runs it across two nodes for real."""
    monkeypatch.setenv("PATH", str(env / "home"))  # neither pdsh nor anything else
    report = dry_run(capsys, "-H", str(env / "hostfile"), "--ssh_port", "2222", "train.py")
    keepalive = ["-o", "ServerAliveInterval=10", "-o", "ServerAliveCountMax=3", "-p", "2222"]
    assert [command[:-1] for command in report["ssh_commands"]] == [
        ["ssh", *keepalive, "worker-0"],
        ["ssh", *keepalive, "worker-1"],
    ]
    for command, host in zip(report["ssh_commands"], ("worker-0", "worker-1")):
        assert command[-1] == report["command"][-1].replace("%h", host) and "%h" not in command[-1]


def test_no_ssh_runs_this_nodes_part(env, capsys):
    hostfile = str(env / "hostfile")
    report = dry_run(capsys, "-H", hostfile, "--no_ssh", "--node_rank", "1", "train.py")
    assert report["mode"] == "no_ssh" and report["exports"] == {}
    assert report["command"] == torchrun(2, 1, 4, "worker-0", "train.py", LOCAL_RANK_ARG)
    assert "--node_rank is not set correctly: got -1" in user_error(capsys, "-H", hostfile, "--no_ssh", "train.py")


def test_slurm_dry_run(env, capsys):
    hostfile = str(env / "hostfile")
    report = dry_run(capsys, "-H", hostfile, "--launcher", "SLURM", "--launcher_args", "-p gpu", "train.py", "x")
    srun = "srun -n 8 --ntasks-per-node 4 --kill-on-bad-exit=1 -p gpu --export=ALL"
    assert " ".join(report["command"]) == f"{srun} {PY} -u train.py x"
    pythonpath = f"{SHIM_DIR}:{env / 'work'}"
    assert report["env"] == {"PYTHONPATH": pythonpath, "DS_FSDP_BACKEND": "fsdp", "MASTER_PORT": "29500"}
    assert report["nodes"] == []
    assert report["master_addr"] is None  # the trainer takes the step's first node
    flags = ["--launcher", "slurm", "--force_multi", "--num_nodes", "1", "--num_gpus", "2", "--master_addr", "n0"]
    limited = dry_run(capsys, "-H", hostfile, *flags, "--module", "m")
    assert limited["command"][:6] == ["srun", "-n", "2", "--ntasks-per-node", "2", "--kill-on-bad-exit=1"]
    assert limited["command"][6:] == ["--nodes", "1", "--gpus-per-node", "2", "--export=ALL", PY, "-u", "-m", "m"]
    assert limited["env"]["MASTER_ADDR"] == "n0"
    filtered = dry_run(capsys, "-H", hostfile, "--launcher", "slurm", "--force_multi", "-e", "worker-0", "t.py")
    assert filtered["command"][6:10] == ["--nodelist", "worker-1", "--nodes", "1"]
    error = user_error(capsys, "-H", hostfile, "--launcher", "slurm", "-i", "worker-0:1", "t.py")
    assert "slurm backend cannot select specific device ids, got [1] on worker-0" in error


def test_mpi_dry_runs(env, capsys):
    hostfile = str(env / "hostfile")
    base = ["-H", hostfile, "--master_addr", "n0", "--master_port", "6000"]
    openmpi = dry_run(capsys, *base, "--launcher", "openmpi", "train.py")["command"]
    assert " ".join(openmpi) == (
        f"mpirun -n 8 -hostfile {hostfile} --mca btl ^openib --mca btl_tcp_if_include eth0 -x UCX_TLS=tcp "
        f"-x PYTHONPATH={SHIM_DIR}:{env / 'work'} -x DS_FSDP_BACKEND=fsdp -x MASTER_ADDR=n0 -x MASTER_PORT=6000 "
        f"{PY} -u train.py"
    )
    tcp = dry_run(capsys, *base, "--launcher", "openmpi", "--launcher_args", "--mca btl_tcp_if_include ib0", "t.py")
    assert tcp["command"][8:11] == ["--mca", "btl_tcp_if_include", "ib0"] and "eth0" not in tcp["command"]
    genv = f"-genv PYTHONPATH {SHIM_DIR}:{env / 'work'} -genv DS_FSDP_BACKEND fsdp -genv MASTER_ADDR n0 "
    genv += "-genv MASTER_PORT 6000 -genv WORLD_SIZE 8 -genv LOCAL_SIZE 4"
    mpich = dry_run(capsys, *base, "--launcher", "mpich", "--module", "pkg.train", "x")["command"]
    assert " ".join(mpich[:23]) == f"mpirun -n 8 -ppn 4 {genv}"
    assert mpich[23:27] == ["-hosts", "worker-0,worker-1", "sh", "-c"]
    assert mpich[28:] == ["ds-fsdp-rank", PY, "-u", "-m", "pkg.train", "x"]
    rank_env = {"PMI_RANK": "5", "MPI_LOCALRANKID": "1"}
    shim = subprocess.run(["sh", "-c", mpich[27], "x", "sh", "-c", "echo $RANK $LOCAL_RANK"], env=rank_env, **TEXT)
    assert shim.stdout == "5 1\n"
    impi = dry_run(capsys, *base, "--launcher", "impi", "--no_python", "./run.sh")["command"]
    assert " ".join(impi[:21]) == f"mpirun -ppn 4 {genv}"
    assert impi[21:26] == ["-genv", "I_MPI_PIN", "0", "-hosts", "worker-0,worker-1"]
    blocks = " ".join(impi[23:]).split(" : ")
    assert len(blocks) == 8 and blocks[5] == "-n 1 -env RANK 5 -env LOCAL_RANK 1 ./run.sh"
    # MVAPICH2's mpirun is MPICH's Hydra: MPICH's command with deepspeed's MV2_* settings (no MV2_USE_CUDA on CPU)
    mvapich = dry_run(capsys, *base, "--launcher", "mvapich", "--module", "pkg.train", "x")["command"]
    mv2 = " ".join(f"-genv {name} {value}" for name, value in launcher.MVAPICH_EXPORTS.items())
    assert " ".join(mvapich[:41]) == f"mpirun -n 8 -ppn 4 {genv} {mv2}" and "MV2_USE_CUDA" not in mvapich
    assert mvapich[41:] == mpich[23:]
    rank_env = {"PMI_RANK": "6", "MV2_COMM_WORLD_LOCAL_RANK": "2"}
    shim = subprocess.run(["sh", "-c", mvapich[45], "x", "sh", "-c", "echo $RANK $LOCAL_RANK"], env=rank_env, **TEXT)
    assert shim.stdout == "6 2\n"


def test_mpi_limits_and_flag_errors(env, capsys):
    hostfile = str(env / "hostfile")
    errors = {
        ("--launcher", "openmpi", "-e", "worker-0:0"): "openmpi backend does not support worker include/exclusion",
        ("--launcher", "mpich", "--num_gpus", "2"): "mpich backend does not support limiting num nodes/gpus",
        ("--launcher", "mvapich", "-e", "worker-1:2"): "mvapich backend does not support worker include/exclusion",
        ("--launcher", "lsf"): "Unknown launcher lsf",
        ("--module", "--no_python"): "Don't use both the '--no_python' flag and the '--module' flag",
        ("--save_pid",): "--save_pid is a deepspeed launcher flag ds-fsdp does not support",
        ("--bind_cores_to_rank", "--launcher", "slurm"): "--bind_cores_to_rank binds the ranks torchrun starts",
        ("--bind_core_list", "2,1"): "--bind_core_list '2,1': '2,1': each range must start above",
        ("--bind_cores_to_rank", "--bind_core_list", "0-2"): "give 3 core(s) for 4 ranks per node",
        ("-i", "worker-0", "-e", "worker-1"): "include_str and exclude_str are mutually exclusive",
    }
    for flags, message in errors.items():
        assert message in user_error(capsys, "-H", hostfile, *flags, "t.py")
    (env / "uneven").write_text("a slots=4\nb slots=2\n")
    assert "MPICH requires same number of devices per node" in user_error(
        capsys, "-H", str(env / "uneven"), "--launcher", "mpich", "t.py"
    )
    assert "Num nodes is >1 but no extra nodes" in user_error(capsys, "--num_nodes", "2", "t.py")
    assert "No slots are left" in user_error(capsys, "-H", hostfile, "-e", "worker-0@worker-1", "t.py")
    assert "Hostfile contains a bad entry: w x" in user_error(capsys, "-H", str(hostfile_with(env, "w x")), "t.py")


def hostfile_with(env: Path, text: str) -> Path:
    path = env / "custom_hostfile"
    path.write_text(text + "\n")
    return path


def test_deepspeed_env_files_and_exported_variables(env, capsys, monkeypatch):
    (env / "home" / ".deepspeed_env").write_text("A=home\nB=home\n")
    (env / "work" / ".deepspeed_env").write_text("B=cwd\n\n# a comment\nC = x y \nD=k=v\n")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth1")
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "1200")
    monkeypatch.setenv("PATH_NOT", "no")  # PATH prefixes only travel with a sourced CANN toolkit
    hostfile = str(env / "hostfile")
    report = dry_run(capsys, "-H", hostfile, "train.py")
    expected = {
        "NCCL_SOCKET_IFNAME": "eth1",
        "HCCL_CONNECT_TIMEOUT": "1200",
        "PYTHONPATH": f"{SHIM_DIR}:{env / 'work'}",
        "A": "home",
        "B": "cwd",
        "C": "x y",
        "D": "k=v",
        "DS_FSDP_BACKEND": "fsdp",
    }
    assert report["exports"] == expected
    assert "export NCCL_SOCKET_IFNAME=eth1 HCCL_CONNECT_TIMEOUT=1200" in report["command"][-1]
    assert "A=home B=cwd C='x y' D=k=v" in report["command"][-1]
    openmpi = dry_run(capsys, "-H", hostfile, "--launcher", "openmpi", "t.py")["command"]
    assert ["-x", "C=x y"] == openmpi[openmpi.index("C=x y") - 1 : openmpi.index("C=x y") + 1]
    slurm = dry_run(capsys, "-H", hostfile, "--launcher", "slurm", "t.py")
    assert slurm["env"]["C"] == "x y" and slurm["command"][5] == "--kill-on-bad-exit=1"
    assert dry_run(capsys, "--num_gpus", "1", "t.py")["exports"] == {}  # one node: the environment is inherited

    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", "/usr/local/Ascend/ascend-toolkit/latest")
    monkeypatch.setenv("AISC_JOB_NAME", "job")
    monkeypatch.setenv("NCCL_IB_HCA", "mlx5_0")
    monkeypatch.setenv("DS_ENV_FILE", "cluster.env")
    (env / "work" / "cluster.env").write_text("E=1\n")
    exports = dry_run(capsys, "-H", hostfile, "t.py")["exports"]
    assert exports["PATH_NOT"] == "no" and exports["PATH"] == os.environ["PATH"] and exports["E"] == "1"
    assert "NCCL_IB_HCA" not in exports and "A" not in exports
    (env / "work" / "cluster.env").write_text("E=1\nexport F=2\n")
    assert "cluster.env line 2: 'export F=2' is not NAME=VALUE" in user_error(capsys, "-H", hostfile, "t.py")


def launch(*argv: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_", "WORLD_", "MASTER_", "SLURM_"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    command = [PY, "-m", "ds_compat.launcher", "--master_port", str(free_port()), *argv]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_failing_rank_fails_the_job(tmp_path):
    script = tmp_path / "fail_on_rank1.py"
    script.write_text(
        "import json, os, pathlib, sys, time\n"
        f"json.dump(sys.argv[1:], open({str(tmp_path)!r} + f'/argv{{os.environ[\"LOCAL_RANK\"]}}.json', 'w'))\n"
        "if os.environ['LOCAL_RANK'] == '1':\n"  # fail once rank 0 has written: torchrun then ends it at once
        f"    while not pathlib.Path({str(tmp_path)!r}, 'argv0.json').exists(): time.sleep(0.05)\n"
        "    sys.exit(7)\n"
    )
    result = launch("--num_gpus", "2", str(script), "--lr", "0.1")
    assert result.returncode == 1 and "exitcode  : 7" in result.stderr  # torchrun's code; the rank's is in its report
    for rank in (0, 1):  # deepspeed's convention: --local_rank=N first, then the script's own arguments
        assert json.loads((tmp_path / f"argv{rank}.json").read_text()) == [f"--local_rank={rank}", "--lr", "0.1"]
    shell = launch("--num_gpus", "2", "--no_python", "--no_local_rank", "sh", "-c", "exit 7")
    assert shell.returncode == 1 and "exitcode  : 7" in shell.stderr
    bad = launch("-H", str(hostfile_with(tmp_path, "worker-0 slots=2\nworker-0 slots=2")), "t.py")
    assert bad.returncode == 2 and "Hostfile contains multiple entries for worker-0" in bad.stderr
    assert "ds-fsdp: error: Hostfile" in bad.stderr


def test_backend_switch_in_the_ranks_environment(env, capsys, monkeypatch):
    """fsdp (default): ds_compat/shim first on PYTHONPATH, so `import deepspeed` is this backend in the ranks;
    deepspeed (flag or DS_FSDP_BACKEND): the shim is taken out again, and the real package must exist."""
    monkeypatch.setenv("PYTHONPATH", f"{SHIM_DIR}:/mine")
    fsdp = dry_run(capsys, "--num_gpus", "1", "train.py")["env"]
    assert fsdp["PYTHONPATH"] == f"{SHIM_DIR}:/mine" and fsdp["DS_FSDP_BACKEND"] == "fsdp"
    real = dry_run(capsys, "--num_gpus", "1", "--backend", "deepspeed", "train.py")["env"]
    assert real["PYTHONPATH"] == "/mine" and real["DS_FSDP_BACKEND"] == "deepspeed"
    monkeypatch.setenv("DS_FSDP_BACKEND", "deepspeed")
    assert dry_run(capsys, "--num_gpus", "1", "train.py")["env"]["DS_FSDP_BACKEND"] == "deepspeed"
    monkeypatch.setenv("DS_FSDP_BACKEND", "fast")
    assert "DS_FSDP_BACKEND='fast' is not a backend" in user_error(capsys, "train.py")
    monkeypatch.setattr(launcher.importlib.util, "find_spec", lambda name: None)  # DeepSpeed not installed
    error = user_error(capsys, "--backend", "deepspeed", "train.py")
    assert "--backend deepspeed runs the real DeepSpeed, which is not installed here" in error
