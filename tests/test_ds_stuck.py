"""A stuck job ends under the DeepSpeed door (ds_compat/step_watch.py): a DeepSpeed-API script and the HF Trainer,
launched by ds-fsdp on 2 ranks, where rank 1 stops after step 3 as a deadlocked loader would and rank 0 waits for it
in a collective (inside the engine for the API script, in the HF Trainer's own gather of the step's token count).
Every rank dumps its stacks and last collectives, rank 0 names rank 1 as behind, every rank exits 5, and the job is
over within the extension section's training.step_timeout_s + 30 s. A healthy pause of the script longer than the
timeout, outside the engine, ends nothing. The same under the multi-host launchers: tests/test_multinode.py."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from conftest import REPO, clean_env, free_port

SCRIPT = REPO / "tests" / "ds_stuck_script.py"
TIMEOUT_S = 5
BOUND_S = TIMEOUT_S + 30
JOBS = {"api": [], "hf": [], "api pause": ["--pause-s", str(3 * TIMEOUT_S)]}


@pytest.fixture(scope="module")
def ended(tmp_path_factory) -> dict[str, dict]:
    """The three jobs at once under ds-fsdp; per job: its log, its exit code and the seconds from the fault to its
    end (for the pause job: from its start)."""
    root = tmp_path_factory.mktemp("ds_stuck")
    env = {**clean_env(), "DS_ACCELERATOR": "cpu"}
    jobs = {}
    for name, extra in JOBS.items():
        out = root / name.replace(" ", "_")
        out.mkdir()
        launcher = [sys.executable, "-m", "ds_compat.launcher", "--num_gpus", "2", "--master_port", str(free_port())]
        command = [*launcher, str(SCRIPT), "--mode", name.split()[0], "--out", str(out), "--timeout", str(TIMEOUT_S)]
        command += extra
        log = out / "job.log"
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                   start_new_session=True)  # fmt: skip
        jobs[name] = (out, log, process, time.time())
    results = {}
    for name, (out, log, process, started) in jobs.items():
        code = process.wait(timeout=300)
        fired = out / "fired"
        results[name] = {
            "out": out,
            "log": log.read_text(),
            "code": code,
            "seconds": time.time() - (fired.stat().st_mtime if fired.exists() else started),
        }
    return results


@pytest.mark.parametrize("mode", ["api", "hf"])
def test_a_stuck_rank_ends_the_deepspeed_door_job_and_is_named(ended, mode):
    job = ended[mode]
    log = job["log"]
    assert job["seconds"] <= BOUND_S, (job["seconds"], log[-3000:])
    assert job["code"] != 0 and "exitcode  : 5" in log, (job["code"], log[-3000:])  # torchrun's report: stuck
    for rank in (0, 1):
        assert f"rank{rank}] stuck: no step finished for" in log, log[-3000:]
        assert f"rank{rank}] stuck: rank(s) 1 behind: after step 3" in log, log[-3000:]
        dump = (job["out"] / "stuck" / f"rank{rank}.txt").read_text()
        assert "last collectives (oldest first):" in dump and "Python stacks:" in dump
    assert "in stop_or_pause" in (job["out"] / "stuck" / "rank1.txt").read_text()  # where the stuck rank stopped


def test_a_pause_of_the_script_longer_than_the_timeout_ends_nothing(ended):
    job = ended["api pause"]
    assert job["code"] == 0, job["log"][-3000:]
    assert (job["out"] / "done").exists() and "stuck:" not in job["log"]
    assert not (job["out"] / "stuck").exists()
