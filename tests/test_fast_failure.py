"""One failing rank ends the whole job quickly, under every launcher installed here (docs/reliability.md).

A 2-rank job (the tiny model, 40 steps) whose rank 1 fails after step 2 (GLM45V_FAULT: a Python exception, and
SIGKILL where only the watchdog can end the job) under torchrun, the `deepspeed` launcher, `ds-fsdp`, `srun` (a real
single-node Slurm cluster, without --kill-on-bad-exit), Open MPI's `mpirun` and no launcher at all (two processes
started with the environment variables alone). Measured: the seconds from the fault (the knob's marker file) until
every process of the job is gone (its process group, and any process whose command line names the job's output
directory: srun's ranks run under slurmstepd), which must be at most 60; the job's exit status is non-zero. Without
a launcher that watches the ranks only the watchdog (glm45v_fsdp/runtime/watchdog.py) ends rank 0, and its log names
the rank that failed first. The jobs run concurrently to keep the suite short; `training.peer_timeout_s=5` as an
operator would shorten it for a drill.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, clean_env, free_port

LAUNCHERS = ("torchrun", "deepspeed", "ds-fsdp", "srun", "mpirun", "none")
# Launchers that do not end the job when one rank fails: the watchdog must (their log names the failed rank).
UNWATCHED = ("srun", "none")
KINDS = ("exception", "sigkill")
# A SIGKILLed rank under the launchers that watch their ranks is part of tests/test_multinode.py's node loss (every
# process of a node killed, per launcher, across two nodes); here it runs where only the watchdog can end the job.
CASES = [(launcher, kind) for launcher in LAUNCHERS for kind in KINDS if kind == "exception" or launcher in UNWATCHED]
LIMIT_S = 60.0


def job(launcher: str, kind: str, root: Path, slurm) -> dict:
    """Start the job (its own process group) and return what to wait for."""
    out = root / f"{launcher}_{kind}"
    out.mkdir(parents=True)
    marker = out / "fired"
    env = {**clean_env(), "DS_ACCELERATOR": "cpu", "GLM45V_FAULT": f"1:2:{kind}:{marker}"}
    train = ["training.train_iters=40", f"training.output_dir={out / 'run'}", "training.progress_bar=false"]
    train.append("training.peer_timeout_s=5")
    port = str(free_port())
    runners = {
        "torchrun": ["torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}", "-m"],
        "deepspeed": ["deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", port, "--module"],
        "ds-fsdp": ["ds_compat.launcher", "--num_gpus", "2", "--master_port", port, "--module"],
    }
    if launcher == "srun":  # MASTER_ADDR from SLURM_STEP_NODELIST; rank, size from SLURM_PROCID / SLURM_NTASKS
        env.update(slurm.env(), MASTER_PORT=port)
        srun = ["srun", "--nodes=1", "--ntasks=2", "--kill-on-bad-exit=0", f"--chdir={REPO}"]
        commands = [([*srun, sys.executable, "-m", "glm45v_fsdp.train", *train], env, out / "job.log")]
    elif launcher == "mpirun":  # rank, size from OMPI_COMM_WORLD_*; mpirun passes its environment to local ranks
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        mpirun = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", "2"]
        commands = [([*mpirun, sys.executable, "-m", "glm45v_fsdp.train", *train], env, out / "job.log")]
    elif launcher == "none":
        ranks = [
            {**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"} for r in range(2)
        ]
        for rank_env in ranks:
            rank_env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        commands = [
            ([sys.executable, "-m", "glm45v_fsdp.train", *train], e, out / f"rank{r}.log") for r, e in enumerate(ranks)
        ]
    else:
        commands = [([sys.executable, "-m", *runners[launcher], "glm45v_fsdp.train", *train], env, out / "job.log")]
    processes = [
        subprocess.Popen(
            command, cwd=REPO, env=e, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
        )
        for command, e, log in commands
    ]
    return {"launcher": launcher, "kind": kind, "out": out, "marker": marker, "processes": processes}


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def processes_naming(text: str) -> list[int]:
    """Pids of the processes whose command line contains `text` (a job's output directory)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:  # ended while we looked
            continue
    return pids


@pytest.fixture(scope="module")
def ended(tmp_path_factory, slurm) -> dict[tuple[str, str], dict]:
    if shutil.which("mpirun") is None:
        pytest.fail("Open MPI's mpirun is not installed: apt-get install -y openmpi-bin (.ci/system-packages does)")
    root = tmp_path_factory.mktemp("fast_failure")
    jobs = [job(launcher, kind, root, slurm) for launcher, kind in CASES]
    deadline = time.time() + 600
    results = {}
    while jobs and time.time() < deadline:
        for running in list(jobs):
            processes = running["processes"]
            if any(p.poll() is None for p in processes) or any(group_alive(p.pid) for p in processes):
                continue
            if processes_naming(str(running["out"] / "run")):
                continue
            jobs.remove(running)
            fired = running["marker"].stat().st_mtime if running["marker"].exists() else None
            log = "".join(path.read_text() for path in sorted(running["out"].glob("*.log")))
            results[(running["launcher"], running["kind"])] = {
                "codes": [p.returncode for p in processes],
                "after_fault_s": None if fired is None else time.time() - fired,
                "log": log,
            }
        time.sleep(0.2)
    for running in jobs:  # past the deadline: end them, and let the test fail
        for process in running["processes"]:
            os.killpg(process.pid, 9)
        for pid in processes_naming(str(running["out"] / "run")):
            os.kill(pid, 9)
        results[(running["launcher"], running["kind"])] = {"codes": [], "after_fault_s": None, "log": "hung"}
    print(json.dumps({f"{k[0]} {k[1]}": round(v["after_fault_s"] or -1, 1) for k, v in results.items()}))
    return results


@pytest.mark.parametrize("launcher, kind", CASES)
def test_a_failing_rank_ends_the_job_within_a_minute(ended, launcher, kind):
    result = ended[(launcher, kind)]
    assert result["after_fault_s"] is not None, result["log"][-3000:]  # the fault fired (step 2 was reached)
    assert result["after_fault_s"] <= LIMIT_S, (result["after_fault_s"], result["log"][-3000:])
    assert any(code != 0 for code in result["codes"]), result["codes"]
    if launcher in UNWATCHED:  # nothing but the watchdog (or gloo seeing the socket close) can end rank 0
        assert "rank 1" in result["log"] and ("failed first" in result["log"] or "Connection" in result["log"])


def test_rank0_posts_a_silent_rank_and_a_finished_one_is_not(monkeypatch):
    """The heartbeat path that NCCL / HCCL jobs rely on (gloo also notices a closed socket): two watchdogs on one
    store; rank 1 stops beating without finishing -> rank 0 posts it and both end; a finished rank is left alone."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from glm45v_fsdp.runtime.watchdog import Watchdog

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # start() chains it; restored afterwards
    ended: list[tuple[int, str]] = []

    class Recording(Watchdog):
        def _end(self, reason: str) -> None:
            if self._armed.is_set():
                ended.append((self.rank, reason))
                self._stop.set()

    def pair(port: int) -> tuple[Watchdog, Watchdog]:
        store = TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
        return tuple(Recording(store, rank, 2, peer_timeout_s=1.0, poll_s=0.05, heartbeat_s=0.1) for rank in (0, 1))

    zero, one = pair(free_port())
    zero.start(), one.start()
    time.sleep(0.5)
    one.finish()  # a normal end
    time.sleep(2.0)
    assert ended == []
    zero.finish()

    zero, one = pair(free_port())
    zero.start(), one.start()
    time.sleep(0.5)
    one._stop.set()  # silent, as after SIGKILL
    deadline = time.time() + 10
    while not any(rank == 0 for rank, _ in ended) and time.time() < deadline:
        time.sleep(0.05)
    (rank, reason), *_ = ended
    assert rank == 0 and f"another rank failed first: rank 1 on {socket.gethostname()}: no heartbeat for" in reason


def test_a_store_that_stops_answering_ends_the_rank(monkeypatch):
    """A node cut off from the store's host: a store call into the dead link blocks instead of failing, so the
    guard thread ends the rank once the store has been silent for peer_timeout_s."""
    import threading

    from glm45v_fsdp.runtime.watchdog import Watchdog

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    cut = threading.Event()
    ended: list[str] = []

    class Store:  # answers until the link goes down, then every call blocks
        def __init__(self) -> None:
            self.values: dict[str, bytes] = {}

        def _wait(self) -> None:
            while cut.is_set():
                time.sleep(0.05)

        def set(self, key: str, value: str) -> None:
            self._wait()
            self.values[key] = value.encode()

        def check(self, keys: list[str]) -> bool:
            self._wait()
            return all(key in self.values for key in keys)

        def get(self, key: str) -> bytes:
            self._wait()
            return self.values[key]

    class Recording(Watchdog):
        def _end(self, reason: str) -> None:
            if self._armed.is_set():
                ended.append(reason)
                self._stop.set()

    watchdog = Recording(Store(), 1, 2, peer_timeout_s=1.0, poll_s=0.05, heartbeat_s=0.1).start()
    time.sleep(1.5)
    assert ended == []  # answering: never ended, however long
    cut.set()
    deadline = time.time() + 10
    while not ended and time.time() < deadline:
        time.sleep(0.05)
    cut.clear()
    watchdog.finish()
    assert ended and re.search(r"the rendezvous store has not answered for \d+ s", ended[0]), ended
    assert f"this rank's node ({socket.gethostname()}) is cut off" in ended[0]
