"""The overhead benchmark runs both loops on the same model, weights and batch (equal first-step losses)."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_overhead_bench_compares_like_with_like(tmp_path):
    out = tmp_path / "overhead.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "glm45v_fsdp.tools.bench",
            "overhead",
            "--steps",
            "4",
            "--warmup",
            "1",
            "--blocks",
            "2",
            "--output",
            str(out),
        ],
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert (
        abs(figures["first_step_loss_ours"] - figures["first_step_loss_bare"]) <= 1e-6 * figures["first_step_loss_bare"]
    )
    assert figures["steps_each"] == 4 and figures["ratio_median"] > 0
    assert f"ratio {figures['ratio_median']:.3f}x" in result.stdout
