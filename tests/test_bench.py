"""Benchmarks: the overhead bench runs both loops on the same model, weights and batch (equal first-step losses);
the memory bench writes its table, JSON and chart with figures derived from the runs' own metrics."""

import json
import os
import subprocess
import sys
from pathlib import Path

from PIL import Image

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


def test_memory_bench_writes_a_consistent_table(tmp_path):
    """Two switches sharing their OFF run (which runs once): table, JSON and chart written, figures derived from the
    runs' own metrics."""
    out = tmp_path / "memory"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "glm45v_fsdp.tools.bench",
            "memory",
            *("--steps", "3", "--warmup", "1", "--tokens", "256", "--vocab", "2048", "--images", "2"),
            *("--switches", "chunk_static,chunk_dynamic", "--out", str(out)),
            "features.chunk_loss.chunk_size=64",
        ],
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["chunk_dynamic", "chunk_static", "full_logits"]
    report = json.loads((out / "memory.json").read_text())
    assert [row["switch"] for row in report["rows"]] == ["chunk_static", "chunk_dynamic"]
    metrics = {
        name: [json.loads(line) for line in (out / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        for name in ("full_logits", "chunk_static", "chunk_dynamic")
    }
    off = metrics["full_logits"]
    assert [r["tokens"] for r in off] == [256] * 3
    for row in report["rows"]:
        on = metrics[row["on_run"]]
        assert row["off_run"] == "full_logits"
        errors = [abs(b["loss"] - a["loss"]) / (abs(a["loss"]) + 1e-8) for a, b in zip(off, on)]
        assert abs(row["loss_mean_rel_err_pct"] - 100 * sum(errors) / 3) < 1e-12
        assert row["loss_mean_rel_err_pct"] < 1e-3 and row["loss_max_abs_err"] < 1e-4
        peaks = [max(r["mem_peak_max_gib"] for r in records) for records in (off, on)]
        assert row["peak_max_gib"] == peaks and peaks[1] < peaks[0]
        assert abs(row["saving_max_pct"] - 100 * (1 - peaks[1] / peaks[0])) < 1e-9
        ms = [sorted(r["ms_per_iter"] for r in records[1:]) for records in (off, on)]
        assert row["ms_per_iter"] == [sum(m) / 2 for m in ms]  # median of steps 2-3
        assert abs(row["time_cost_pct"] - 100 * (row["ms_per_iter"][1] / row["ms_per_iter"][0] - 1)) < 1e-9
        assert row["result"] in ("pass", "FAIL: memory", "FAIL: time", "FAIL: memory, time")
        assert f"{row['saving_max_pct']:+.2f}%" in result.stdout
    table = (out / "memory.md").read_text()
    assert "| ChunkLoss off→static | full_logits → chunk_static | 1 |" in table
    assert "peak max GiB off→on" in table and "256 per rank per step" in table
    with Image.open(out / "memory.png") as image:
        assert image.format == "PNG" and image.width >= 640


def test_memory_bench_skips_offload_rows_without_the_feature(tmp_path, monkeypatch):
    """Without features.activation_offload in the schema the offload rows are skipped with the reason, not failed."""
    from glm45v_fsdp.tools import bench, bench_memory

    monkeypatch.setattr(bench_memory, "offload_available", lambda: False)
    ran = []

    def fake_execute(name, command, output_dir, timeout, threads=None):
        ran.append(name)
        record = {
            "step": 1,
            "loss": 2.0,
            "ms_per_iter": 10.0,
            "global_batch_size": 1,
            "tokens": 64,
            "mem_peak_per_rank_gib": [1.0 if name == "no_recompute" else 0.5],
        }
        return [record, {**record, "step": 2}], 1.0, 1.0

    monkeypatch.setattr(bench_memory, "execute", fake_execute)
    out = tmp_path / "out"
    assert (
        bench.main(
            [
                "memory",
                "--tokens",
                "64",
                "--steps",
                "2",
                "--warmup",
                "1",
                "--out",
                str(out),
                "--switches",
                "recompute,offload,combined",
            ]
        )
        == 0
    )
    assert ran == ["no_recompute", "recompute"]
    rows = json.loads((out / "memory.json").read_text())["rows"]
    assert rows[0]["saving_max_pct"] == 50.0 and rows[0]["time_cost_pct"] == 0.0 and rows[0]["pass"]
    assert [row.get("skipped", "")[:37] for row in rows[1:]] == ["features.activation_offload.enabled i"] * 2
    assert "skipped: features.activation_offload.enabled" in (out / "memory.md").read_text()
