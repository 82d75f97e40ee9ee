"""A stuck job ends (runtime/stuck.py): a rank stuck in its data loader, and a rank that leaves out one collective,
under torchrun and with no launcher; every rank dumps its stacks and last collectives, rank 0 names the rank(s)
behind, the job ends within training.step_timeout_s + 30 s, and training.resume=auto continues."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from statistics import median

import pytest
from conftest import REPO, clean_env, free_port, read_metrics, train

from glm45v_fsdp.runtime.stuck import DEFAULT_FACTOR, DEFAULT_FLOOR_S, CollectiveLog, StepDeadline

TIMEOUT_S = 5
BOUND_S = TIMEOUT_S + 30


def start(launcher: str, fault: str, out: Path) -> tuple[list[subprocess.Popen], list[Path]]:
    """The 2-rank job (its own session), a checkpoint every 2 steps, its fault after step 3."""
    env = {**clean_env(), "GLM45V_FAULT": f"1:3:{fault}:{out / 'fired'}"}
    argv = [
        "training.train_iters=8",
        f"training.output_dir={out / 'run'}",
        "training.progress_bar=false",
        f"training.step_timeout_s={TIMEOUT_S}",
        f"training.save={out / 'save'}",
        "training.save_interval=2",
    ]
    port = str(free_port())
    out.mkdir(parents=True)
    if launcher == "torchrun":
        commands = [([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
                      "-m", "glm45v_fsdp.train", *argv], env, out / "job.log")]  # fmt: skip
    else:
        commands = [
            ([sys.executable, "-m", "glm45v_fsdp.train", *argv],
             {**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
             out / f"rank{r}.log")
            for r in range(2)
        ]  # fmt: skip
    processes = [
        subprocess.Popen(command, cwd=REPO, env=e, stdout=log.open("w"), stderr=subprocess.STDOUT,
                         start_new_session=True)
        for command, e, log in commands
    ]  # fmt: skip
    return processes, [log for _, _, log in commands]


@pytest.fixture(scope="module")
def ended(tmp_path_factory) -> dict[tuple[str, str], dict]:
    """All four jobs at once (each keeps about half a core busy); per job: its logs, the seconds from the fault to
    the last process's end, the exit codes."""
    root = tmp_path_factory.mktemp("stuck")
    jobs = {}
    for launcher in ("torchrun", "none"):
        for fault in ("hang", "skip_collective"):
            out = root / f"{launcher}_{fault}"
            jobs[launcher, fault] = (out, *start(launcher, fault, out))
    results = {}
    deadline = time.monotonic() + 300
    for key, (out, processes, logs) in jobs.items():
        while (out / "fired").exists() is False and time.monotonic() < deadline:
            time.sleep(0.2)
        fired = (out / "fired").stat().st_mtime
        codes = [process.wait(timeout=max(1, deadline - time.monotonic())) for process in processes]
        results[key] = {
            "out": out,
            "log": "\n".join(log.read_text() for log in logs),
            "seconds": time.time() - fired,  # an upper bound: the jobs end in turn
            "codes": codes,
        }
    return results


@pytest.mark.parametrize("launcher", ["torchrun", "none"])
@pytest.mark.parametrize("fault", ["hang", "skip_collective"])
def test_a_stuck_rank_ends_the_job_and_is_named(ended, launcher, fault):
    job = ended[launcher, fault]
    log = job["log"]
    assert job["seconds"] <= BOUND_S, job["seconds"]
    if launcher == "none":
        assert job["codes"] == [5, 5], job["codes"]  # each rank's own exit code: stuck
    else:
        assert job["codes"] != [0], log[-3000:]
        assert "exitcode  : 5" in log  # torchrun's report of its failed workers
    for rank in (0, 1):
        assert f"rank{rank}] stuck: no step finished for" in log
        dump = (job["out"] / "run" / "stuck" / f"rank{rank}.txt").read_text()
        assert "last collectives (oldest first):" in dump and "Python stacks:" in dump
    verdict = next(
        line for line in log.splitlines() if "rank0] stuck: rank(s)" in line or "rank0] stuck: no rank" in line
    )
    if fault == "hang":
        assert "rank(s) 1 behind: after step 3" in verdict, verdict
        assert "_next_micro_batches" in (job["out"] / "run" / "stuck" / "rank1.txt").read_text()
    else:
        assert "rank(s) 1 went on to a later step: they left out a collective" in verdict, verdict
        assert "the ranks differ at collective #" in verdict


def test_resume_auto_continues_after_a_stuck_job(ended, tmp_path):
    job = ended["torchrun", "hang"]
    result = train(job["out"] / "run", ["training.train_iters=8", f"training.save={job['out'] / 'save'}",
                                        "training.resume=auto", "training.step_timeout_s=5"], nproc=2)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "continuing from" in result.stdout + result.stderr
    assert [record["step"] for record in read_metrics(job["out"] / "run")][-1] == 8


def test_the_default_timeout_follows_the_measured_steps(tmp_path):
    deadline = StepDeadline(None, 0, 1, None, tmp_path, CollectiveLog())
    assert deadline.timeout_s == DEFAULT_FLOOR_S  # before any step
    for step, seconds in enumerate([90.0, 5.0, 5.0, 40.0, 41.0, 39.0], start=1):
        deadline.step_done(step, seconds)
    assert deadline.timeout_s == DEFAULT_FACTOR * median([40.0, 41.0, 39.0])  # 800 s: the first 3 left out
    assert StepDeadline(7.0, 0, 1, None, tmp_path, CollectiveLog()).timeout_s == 7.0


@pytest.mark.parametrize("first", [0, 1])
def test_every_rank_joins_the_verdict_whichever_deadline_fires_first(tmp_path, first):
    """The other rank's deadline is far away: it joins the verdict the first rank started and exits 5, instead of
    being ended by its watchdog (exit 4) when rank 0 exits and takes the store with it."""
    port = free_port()
    processes, logs = [], []
    for rank in (0, 1):
        logs.append(tmp_path / f"rank{rank}.log")
        command = [sys.executable, str(REPO / "tests" / "stuck_verdict_script.py"), str(rank), str(port),
                   "2" if rank == first else "300", str(tmp_path)]  # fmt: skip
        processes.append(subprocess.Popen(command, cwd=REPO, env=clean_env(), stdout=logs[-1].open("w"),
                                          stderr=subprocess.STDOUT, start_new_session=True))  # fmt: skip
    codes = [process.wait(timeout=120) for process in processes]
    log = "\n".join(path.read_text() for path in logs)
    assert codes == [5, 5], (codes, log[-3000:])
    assert "ending this rank" not in log
    assert f"rank{1 - first}] stuck: no step finished for" in log
    assert f"(rank {first}'s deadline fired first)" in log
    for rank in (0, 1):
        assert f"rank{rank}] stuck: no rank is behind another" in log, log[-3000:]
