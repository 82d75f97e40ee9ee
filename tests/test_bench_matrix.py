"""bench matrix end to end on a two-configuration subset (its tables' arithmetic checked against the runs' own
metrics files), its planning of the whole matrix, and the profiler window behind its communication share."""

import contextlib
import io
import json
import statistics
from pathlib import Path

import pytest
from conftest import bench_runs_forked
from PIL import Image

from glm45v_fsdp.config import load_config
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.runtime.profiling import communication_summary, union_ms


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def rel(test: float, ref: float) -> float:
    return abs(test - ref) / (abs(ref) + 1e-8)


def numpy_percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@pytest.fixture(scope="module")
def subset(tmp_path_factory):
    """`bench matrix` on the subset, in this process; its seven runs forked by the suite's zygote (the bench's own
    commands, conftest.bench_runs_forked)."""
    from glm45v_fsdp.tools import bench

    out = tmp_path_factory.mktemp("matrix")
    argv = ["matrix", "--preset", "cpu", "--groups", "F200", "--configs", "00_baseline,08_ep_balance"]
    argv += ["--steps", "6", "--out", str(out)]
    printed = io.StringIO()
    with bench_runs_forked(), contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        code = bench.main(argv)
    assert code == 0, printed.getvalue()[-3000:]
    return out, printed.getvalue(), json.loads((out / "matrix.json").read_text())


def test_matrix_subset_runs_each_kind_separately_from_one_checkpoint(subset):
    out, _, report = subset
    runs = sorted(path.name for path in (out / "runs").iterdir())
    kinds = ("memory", "probe", "timing")
    assert runs == sorted(["initial"] + [f"F200_{c}_{k}" for c in ("00_baseline", "08_ep_balance") for k in kinds])
    for run in [name for name in runs if name != "initial"]:
        log = (out / "runs" / run / "train.log").read_text()
        assert f"training.load={(out / 'initial').absolute()}" in log and "data.shuffle=false" in log
        assert "--nproc_per_node=2" in log and "parallel.expert_parallel_size=2" in log
    timing = records(out / "runs" / "F200_00_baseline_timing")
    memory = records(out / "runs" / "F200_00_baseline_memory")
    assert len(timing) == 6 and max(r["mem_peak_max_gib"] for r in timing) == 0  # no tracker in the timings
    assert len(memory) == 8 and min(r["mem_peak_max_gib"] for r in memory) > 0
    assert not (out / "runs" / "F200_00_baseline_timing" / "profile").exists()
    assert (out / "runs" / "F200_00_baseline_probe" / "profile" / "rank0.json").exists()
    # the same weights and data: step 1 differs only by what balance changes (nothing, in fp32, to 1e-5)
    balanced = records(out / "runs" / "F200_08_ep_balance_timing")
    assert rel(balanced[0]["loss"], timing[0]["loss"]) < 1e-5
    assert report["preset"] == "cpu" and report["ranks"] == 2 and report["dtype"] == "fp32"
    assert report["processes"] == 7


def test_matrix_tables_follow_from_the_metrics_files(subset):
    out, stdout, report = subset
    group = report["groups"]["F200"]
    assert (group["steps"], group["stats_from"]) == (6, 4)  # the reference's window share: 101-200 of 200
    off, on = records(out / "runs" / "F200_00_baseline_timing"), records(out / "runs" / "F200_08_ep_balance_timing")
    (pair,) = group["pairs"]
    assert (pair["off_run"], pair["on_run"], pair["label"]) == ("00_baseline", "08_ep_balance", "EP Balance off→on")
    errors = [rel(b["loss"], a["loss"]) for a, b in zip(off, on)]
    assert pair["loss_mean_rel_err"] == pytest.approx(statistics.fmean(errors), rel=1e-12, abs=1e-15)
    assert pair["loss_max_abs_err"] == pytest.approx(max(abs(b["loss"] - a["loss"]) for a, b in zip(off, on)))
    assert pair["parity_pass"] and pair["loss_mean_rel_err"] <= 1e-5
    window = [[r["ms_per_iter"] for r in rs if r["step"] >= 4] for rs in (off, on)]
    assert pair["ms_per_iter"] == pytest.approx([statistics.fmean(w) for w in window])
    samples = [2 * 1000 / statistics.fmean(w) for w in window]  # global batch 2 = 2 ranks x micro 1
    assert pair["samples_per_s"] == pytest.approx(samples)
    assert pair["throughput_change_pct"] == pytest.approx((samples[1] / samples[0] - 1) * 100)
    peaks = []
    for config in ("00_baseline", "08_ep_balance"):
        memory = records(out / "runs" / f"F200_{config}_memory")
        per_rank = [max(r["mem_peak_per_rank_gib"][i] for r in memory) for i in range(2)]
        peaks.append((max(per_rank), statistics.fmean(per_rank)))
        assert group["memory"][config]["per_rank"] == pytest.approx(per_rank)
    assert pair["peak_max_gib"] == pytest.approx([p[0] for p in peaks])
    assert pair["saving_max_pct"] == pytest.approx((peaks[0][0] - peaks[1][0]) / peaks[0][0] * 100)
    assert pair["saving_avg_pct"] == pytest.approx((peaks[0][1] - peaks[1][1]) / peaks[0][1] * 100)
    row = group["configs"]["08_ep_balance"]
    assert row["p95_ms"] == pytest.approx(numpy_percentile(window[1], 95))
    assert row["p99_ms"] == pytest.approx(numpy_percentile(window[1], 99))
    assert row["tokens_per_s"] == pytest.approx(
        statistics.fmean(r["tokens"] for r in on[3:]) * 1000 / row["ms_per_iter"]
    )
    grads = [rel(b["grad_norm"], a["grad_norm"]) for a, b in zip(off, on)]
    assert row["grad_norm_mean_rel_err"] == pytest.approx(statistics.fmean(grads), rel=1e-12, abs=1e-15)
    assert row["tokens_per_s_per_step"] == [r["tokens_per_s"] for r in on]
    assert group["configs"]["00_baseline"]["loss_mean_rel_err"] == 0.0
    # the EP probe: per-rank means and totals from the probe runs' records; balance evens the ranks
    probe = group["ep_probe"]
    probe_off, probe_on = (
        records(out / "runs" / "F200_00_baseline_probe"),
        records(out / "runs" / "F200_08_ep_balance_probe"),
    )
    assert probe["off"]["total"] == sum(sum(r["ep_load_per_rank_before"]) for r in probe_off)
    assert probe["on"]["total"] == sum(sum(r["ep_load_per_rank_after"]) for r in probe_on)
    assert probe["off"]["mean_per_rank"] == pytest.approx(
        [statistics.fmean(r["ep_load_per_rank_before"][i] for r in probe_off) for i in range(2)]
    )
    assert probe["conserved_within_step"] and probe["conserved_across_runs"]
    assert probe["on"]["cv"] < probe["off"]["cv"]
    profile = json.loads((out / "runs" / "F200_00_baseline_probe" / "profile" / "rank0.json").read_text())
    assert group["comm"]["00_baseline"] == profile and 0 < profile["comm_share"] < 1
    assert profile["window"] == [4, 6] and "gloo:all_to_all" in profile["collectives"]  # EP dispatch
    table = (out / "matrix.md").read_text()
    assert (
        f"| EP Balance off→on | 00_baseline → 08_ep_balance | {pair['loss_mean_rel_err'] * 100:.6f}% | "
        f"{pair['loss_max_abs_err']:.6f} | {pair['ms_per_iter'][0]:.1f} → {pair['ms_per_iter'][1]:.1f} |" in table
    )
    assert "Assignments conserved" in table and "yes" in table and "cpu preset, scaled" in table
    assert "matrix.md" in stdout
    for chart in ("F200_ms_per_iter.png", "F200_memory.png", "plots/F200_01_00_baseline_vs_08_ep_balance.png"):
        with Image.open(out / chart) as image:
            assert image.format == "PNG" and image.width >= 600


def test_matrix_plans_every_group_and_refuses_what_cannot_run(tmp_path, monkeypatch):
    """The whole cpu matrix as planned (no runs): 11 configurations over three groups, CP configurations at twice
    the accumulation, P32K's CP pair at its smaller micro batch; bad --ranks/--configs/--groups are user errors."""
    import argparse

    from glm45v_fsdp.bench import matrix as bench_matrix
    from glm45v_fsdp.tools import bench

    args = argparse.Namespace(groups=list(bench_matrix.GROUPS), configs=None)
    jobs = bench_matrix.plan(args)
    timing = [job for job in jobs if job.kind == "timing"]
    assert len(timing) == 9 + 4 + 5 and len([job for job in jobs if job.kind == "memory"]) == 18
    assert {job.config for job in jobs} >= set(list(bench_matrix.CONFIGS)[:11])  # 00_baseline ... 10_full_ulysses
    args = argparse.Namespace(
        preset_values=bench_matrix.PRESETS["cpu"], ranks=2, initial=tmp_path, steps=None, overrides=["x.y=1"]
    )
    ring = bench_matrix.job_overrides(bench_matrix.Job("F500", "09_full_ring", "timing"), args, tmp_path / "r")
    assert "parallel.ring_attention_size=2" in ring and "training.gradient_accumulation_steps=2" in ring
    assert "features.activation_offload.enabled=true" in ring and "features.ep_balance.enabled=true" in ring
    assert "training.train_iters=500" in ring and "training.stats_start_step=101" in ring and ring[-1] == "x.y=1"
    ep1 = bench_matrix.job_overrides(bench_matrix.Job("F200", "03_ep1", "probe"), args, tmp_path / "e")
    assert ep1.index("parallel.expert_parallel_size=1") > ep1.index("parallel.expert_parallel_size=2")
    assert "training.profile_steps=[4,6]" in ep1 and "training.train_iters=6" in ep1
    cp = bench_matrix.job_overrides(bench_matrix.Job("P32K", "p32k_ulysses_cp2", "memory"), args, tmp_path / "c")
    assert "training.micro_batch_size=1" in cp and "data.cutoff_len=4096" in cp and "training.track_memory=true" in cp
    base = bench_matrix.job_overrides(bench_matrix.Job("P32K", "p32k_base", "timing"), args, tmp_path / "b")
    assert "training.micro_batch_size=2" in base and "features.recompute.enabled=false" in base
    assert bench_matrix.GROUPS["P32K"].baseline_of("p32k_ulysses_cp2") == "p32k_cp1"
    for bad in (["--ranks", "3"], ["--ranks", "16"], ["--configs", "11_nothing"], ["--groups", "F300"]):
        assert bench.main(["matrix", *bad, "--out", str(tmp_path / "bad")]) == 2
    assert not (tmp_path / "bad").exists()  # refused before any run


def test_profile_steps_are_validated_and_the_communication_union_counts_overlap_once():
    assert load_config(None, ["training.train_iters=8", "training.profile_steps=[2,4]"]).training.profile_steps == [
        2,
        4,
    ]
    for bad in ("[0,2]", "[3,2]", "[2,9]", "[2]"):
        with pytest.raises(UserError, match="training.profile_steps"):
            load_config(None, ["training.train_iters=8", f"training.profile_steps={bad}"])
    assert union_ms([(0, 1000), (500, 1500), (3000, 3500)]) == pytest.approx(2.0)

    class Event:
        def __init__(self, name, start, end):
            self.name = name
            self.time_range = type("Range", (), {"start": start, "end": end})()

    events = [Event("gloo:all_reduce", 0, 2000), Event("gloo:all_to_all", 1000, 4000), Event("aten::mm", 0, 9000)]
    summary = communication_summary(events, window_ms=10.0, steps=2)
    assert summary["comm_ms"] == pytest.approx(2.0) and summary["comm_share"] == pytest.approx(0.4)
    assert summary["step_ms"] == pytest.approx(5.0) and set(summary["collectives"]) == {
        "gloo:all_reduce",
        "gloo:all_to_all",
    }
    assert summary["collectives"]["gloo:all_to_all"] == {"calls": 1, "ms": pytest.approx(3.0)}
