"""launch/slurm_sbatch.sh on a real single-node Slurm cluster (tests/slurm_cluster.py): `sbatch` with 2 CPU ranks
and the tiny model; the job must reach COMPLETED with exit code 0:0 and write every step's metrics on both ranks."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO, clean_env, free_port, read_metrics

STEPS = 4


def test_sbatch_runs_the_template_to_completion(slurm, tmp_path):
    run_dir = tmp_path / "run"
    env = {
        **clean_env(),
        **slurm.env(),
        "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",  # the template calls `python`
        "NPROC_PER_NODE": "2",
        "MASTER_PORT": str(free_port()),
    }
    command = [
        "sbatch",
        "--parsable",
        "--nodes=1",
        f"--output={tmp_path / 'slurm-%j.out'}",
        f"--chdir={REPO}",
        str(REPO / "launch" / "slurm_sbatch.sh"),
        f"training.train_iters={STEPS}",
        f"training.output_dir={run_dir}",
        "training.progress_bar=false",
    ]
    submitted = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    fields = slurm.wait_for_job(job_id, timeout_s=300)
    output = "".join(path.read_text() for path in tmp_path.glob("slurm-*.out"))
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), output[-3000:]
    records = read_metrics(run_dir)
    steps = [r for r in records if "step" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1)), records
    assert all(len(r["ms_per_iter_per_rank"]) == 2 for r in steps), steps  # both ranks reported every step
    assert "dp 2" in output, output[-2000:]
