"""The job templates in launch/: shell syntax, YAML, and what each one would start.

python, torchrun, srun and scontrol are replaced by stand-ins on PATH that print their arguments, so each script runs
for real up to the command it execs; the deepspeed hostfile template runs ds-fsdp with --dry_run.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ds_compat.hostfile import read_hostfile

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch"
SHELL_SCRIPTS = sorted(LAUNCH.glob("*.sh"))
YAML_FILES = sorted([*LAUNCH.glob("*.yaml"), *LAUNCH.glob("*.yml")])
SHOWN_ENV = ("MASTER_ADDR", "MASTER_PORT", "HCCL_CONNECT_TIMEOUT", "TASK_QUEUE_ENABLE", "PYTORCH_NPU_ALLOC_CONF")
STAND_IN = f"""#!{sys.executable}
import json, os, sys
shown = {{name: os.environ.get(name) for name in {SHOWN_ENV!r}}}
print(json.dumps({{"program": os.path.basename(sys.argv[0]), "argv": sys.argv[1:], "env": shown}}))
"""


def test_every_template_is_listed_and_documented():
    names = {path.name for path in LAUNCH.iterdir()}
    expected = {"torchrun_single_node.sh", "deepspeed_hostfile.sh", "hostfile", "slurm_sbatch.sh"}
    expected |= {"k8s_pytorchjob.yaml", "ascend_env.sh", "glm45v_106b_sft.sh", "README.md"}
    assert expected <= names
    readme = (LAUNCH / "README.md").read_text()
    assert all(f"`{name}`" in readme for name in names - {"README.md"})


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda path: path.name)
def test_shell_syntax(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert script.name == "ascend_env.sh" or os.access(script, os.X_OK)  # sourced, not run


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda path: path.name)
def test_yaml_parses(path):
    assert list(yaml.safe_load_all(path.read_text()))


@pytest.fixture
def stand_ins(tmp_path) -> dict[str, str]:
    """An environment whose PATH starts with the stand-ins, without any launcher's variables."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python", "torchrun"):
        (bin_dir / name).write_text(STAND_IN)
    (bin_dir / "srun").write_text('#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do shift; done\nexec "$@"\n')  # drop options
    # many hosts: a reader that stops after the first line must not kill the script (SIGPIPE under pipefail)
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'node-%s\\n' a b $(seq 1 20000)\n")
    for path in bin_dir.iterdir():
        path.chmod(0o755)
    prefixes = ("RANK", "LOCAL_", "WORLD_", "MASTER_", "SLURM_", "NODE_RANK", "NNODES", "HCCL", "ASCEND", "TASK_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    return env


def run(command: list[str], env: dict[str, str], **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, env={**env, **extra}, capture_output=True, text=True, timeout=60)


def started(command: list[str], env: dict[str, str], **extra: str) -> dict:
    result = run(command, env, **extra)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_single_node_template(stand_ins):
    seen = started([str(LAUNCH / "torchrun_single_node.sh"), "4", "--config", "c.yaml", "a=1"], stand_ins)
    assert seen["program"] == "torchrun"
    assert seen["argv"] == [
        "--standalone",
        "--nproc_per_node",
        "4",
        "-m",
        "glm45v_fsdp.train",
        "--config",
        "c.yaml",
        "a=1",
    ]
    assert started([str(LAUNCH / "torchrun_single_node.sh"), "x=1"], stand_ins)["argv"][2] == "2"


def test_template_hostfile_has_deepspeeds_format(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    runner = importlib.import_module("deepspeed.launcher.runner")
    ours = read_hostfile(str(LAUNCH / "hostfile"))
    assert ours == dict(runner.fetch_hostfile(str(LAUNCH / "hostfile"))) == {"worker-0": 8, "worker-1": 8}


def test_deepspeed_hostfile_template_dry_run(stand_ins):
    launcher = f"{sys.executable} -m ds_compat.launcher"
    env = {**stand_ins, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"}
    report = started(
        [str(LAUNCH / "deepspeed_hostfile.sh"), "training.train_iters=5"],
        env,
        LAUNCHER=launcher,
        LAUNCHER_FLAGS="--dry_run -i worker-0:0,1@worker-1",
        MASTER_PORT="29600",
    )
    assert report["mode"] == "pdsh" and report["master_addr"] == "worker-0" and report["master_port"] == 29600
    assert report["world_info"] == {"worker-0": [0, 1], "worker-1": list(range(8))} and report["world_size"] == 10
    for node in report["nodes"]:
        tail = ["--module", "glm45v_fsdp.train", "--local_rank=${local_rank}", "--config", "configs/glm45v_tiny.yaml"]
        assert node["command"][-6:] == [*tail, "training.train_iters=5"]
    assert report["command"][:6] == ["pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1"]
    assert f"cd {REPO};" in report["command"][-1]
    with_ds = started(
        [str(LAUNCH / "deepspeed_hostfile.sh")],
        env,
        LAUNCHER=launcher,
        LAUNCHER_FLAGS="--dry_run",
        DS_CONFIG="launch/ds_config_zero3_bf16.json",
    )
    assert with_ds["nodes"][0]["command"][-2:] == ["--deepspeed", "launch/ds_config_zero3_bf16.json"]


@pytest.mark.parametrize("world_size", [1, 8, 128])
def test_example_ds_config_translates_for_the_default_and_106b_configs(world_size):
    from ds_compat.config import translate
    from glm45v_fsdp.config import load_config

    for config in ("configs/glm45v_tiny.yaml", "configs/glm45v_106b_sft.yaml"):
        base = load_config(str(REPO / config))
        translation = translate(LAUNCH / "ds_config_zero3_bf16.json", world_size, base)
        assert translation.zero_stage == 3 and translation.precision == "bf16"
        assert translation.batch.micro_batch_size == base.training.micro_batch_size
        assert translation.scheduler.lr_at(base.training.train_iters) == pytest.approx(base.training.min_lr)


def test_slurm_template_runs_one_torchrun_per_node(stand_ins):
    slurm = {"SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_NNODES": "2", "SLURM_NODEID": "1"}
    seen = started(["bash", str(LAUNCH / "slurm_sbatch.sh"), "--config", "c.yaml", "x=a b"], stand_ins, **slurm)
    torchrun = "-m torch.distributed.run --nnodes 2 --node_rank 1 --nproc_per_node 8 --master_addr node-a"
    assert seen["argv"] == [*f"{torchrun} --master_port 29500 -m glm45v_fsdp.train --config c.yaml".split(), "x=a b"]
    ascend = started(["bash", str(LAUNCH / "slurm_sbatch.sh")], stand_ins, ENV_SCRIPT="launch/ascend_env.sh", **slurm)
    assert ascend["env"]["HCCL_CONNECT_TIMEOUT"] == "1200"


def test_106b_script(stand_ins):
    script = str(LAUNCH / "glm45v_106b_sft.sh")
    seen = started([script, "data.data_path=/d.jsonl"], stand_ins, NODE_RANK="3", MASTER_ADDR="n0")
    torchrun = "-m torch.distributed.run --nnodes 16 --node_rank 3 --nproc_per_node 8 --master_addr n0 --master_port"
    train = "29500 -m glm45v_fsdp.train --config configs/glm45v_106b_sft.yaml data.data_path=/d.jsonl"
    assert " ".join(seen["argv"]) == f"{torchrun} {train}"
    assert seen["env"]["TASK_QUEUE_ENABLE"] == "2"
    assert seen["env"]["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"
    under_srun = started([script], stand_ins, SLURM_NODEID="15", SLURM_NNODES="16", SLURM_JOB_NODELIST="node-[a-b]")
    assert under_srun["argv"][3:10:2] == ["16", "15", "8", "node-a"]
    missing = run([script], stand_ins, MASTER_ADDR="n0")
    assert missing.returncode != 0 and "set NODE_RANK" in missing.stderr
    assert (REPO / "configs" / "glm45v_106b_sft.yaml").is_file()


def operator_pods(job: dict, version: str) -> list[dict[str, str]]:
    """The environment the Kubeflow training operator gives each pod of `job` (its envvar.go, per version): MASTER_*
    from the Master's service and port, RANK = the pod's index; WORLD_SIZE = pods (up to v1.6) or pods x
    nprocPerNode with PET_NNODES / PET_NODE_RANK / PET_NPROC_PER_NODE (v1.7 on)."""
    specs = job["spec"]["pytorchReplicaSpecs"]
    pods = sum(spec["replicas"] for spec in specs.values())
    container = specs["Master"]["template"]["spec"]["containers"][0]
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "pytorchjob-port")
    nproc = job["spec"].get("nprocPerNode", "auto")
    per_pod = int(nproc) if str(nproc).isdigit() else 1  # the operator's getNprocPerNodeInt
    envs = []
    for index in range(pods):  # Master is index 0, Worker i is i + 1
        env = {"PYTHONUNBUFFERED": "0", "MASTER_ADDR": f"{job['metadata']['name']}-master-0", "MASTER_PORT": str(port)}
        if version == "v1.6":
            env.update(WORLD_SIZE=str(pods), RANK=str(index))
        else:
            env.update(WORLD_SIZE=str(pods * per_pod), RANK=str(index), PET_NPROC_PER_NODE=str(nproc))
            env.update(PET_NODE_RANK=str(index), PET_NNODES=str(pods))
        envs.append(env)
    return envs


@pytest.mark.parametrize("version", ["v1.6", "v1.7"])
def test_k8s_pytorchjob_pods_give_torchrun_and_the_trainer_the_right_world(stand_ins, monkeypatch, version):
    """Render every pod as the operator would, run its command up to torchrun (a stand-in), parse that command
    line with torchrun's own parser in the pod's environment (it reads PET_* too), and hand each rank the
    variables torchrun would give it to the trainer's launcher detection."""
    from torch.distributed.run import get_args_parser

    from glm45v_fsdp.runtime.dist import detect_dist_env

    job = yaml.safe_load((LAUNCH / "k8s_pytorchjob.yaml").read_text())
    assert job["kind"] == "PyTorchJob" and job["apiVersion"] == "kubeflow.org/v1"
    specs = job["spec"]["pytorchReplicaSpecs"]
    master, worker = (specs[role]["template"]["spec"]["containers"][0] for role in ("Master", "Worker"))
    assert master == worker and master["name"] == "pytorch" and master["ports"][0]["name"] == "pytorchjob-port"
    devices = int(master["resources"]["limits"]["huawei.com/Ascend910"])
    pods = operator_pods(job, version)
    assert len(pods) == 16 and devices == int(job["spec"]["nprocPerNode"]) == 8
    for index in (0, 1, len(pods) - 1):  # the Master, the first Worker, the last
        pod_env = pods[index]
        seen = started([*master["command"], *master["args"]], stand_ins, **pod_env)
        assert seen["argv"][:2] == ["-m", "torch.distributed.run"] and seen["env"]["HCCL_CONNECT_TIMEOUT"] == "1200"
        with monkeypatch.context() as patch:  # torchrun's parser takes PET_* defaults from the environment
            for name, value in pod_env.items():
                patch.setenv(name, value)
            args = get_args_parser().parse_args(seen["argv"][2:])
        assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("16", index, str(devices)), (version, index)
        assert (args.master_addr, args.master_port) == ("glm45v-sft-master-0", 23456)
        assert args.training_script == "glm45v_fsdp.train"
        assert "configs/glm45v_106b_sft.yaml" in args.training_script_args
        for local in (0, devices - 1):  # what torchrun sets for its ranks (static rendezvous: node-major ranks)
            rank_env = {**pod_env, "RANK": str(index * devices + local), "LOCAL_RANK": str(local),
                        "WORLD_SIZE": str(16 * devices), "LOCAL_WORLD_SIZE": str(devices),
                        "MASTER_ADDR": args.master_addr, "MASTER_PORT": str(args.master_port)}  # fmt: skip
            dist_env = detect_dist_env(rank_env)
            assert (dist_env.rank, dist_env.world_size) == (index * devices + local, 128)
            assert (dist_env.local_rank, dist_env.local_world_size) == (local, devices)
