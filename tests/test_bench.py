"""Benchmarks: the overhead bench runs both loops on the same model, weights and batch (equal first-step losses);
the memory bench writes its table, JSON and chart with figures derived from the runs' own metrics."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import clean_env
from PIL import Image

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def benches(tmp_path_factory):
    """The real runs of the overhead, memory and ops benches below, started at once (each is one process, or 1-rank
    runs one after another: about one core of two busy). `benches(name)` waits for one: (the folder the benches
    write to, the finished process)."""
    root = tmp_path_factory.mktemp("benches")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))}
    commands = {
        "overhead": (
            ["overhead", "--steps", "4", "--warmup", "1", "--blocks", "2", "--output", str(root / "overhead.json")],
            {**env, "PYTHONPATH": str(REPO)},
        ),
        "memory": (
            [
                "memory",
                *("--steps", "3", "--warmup", "1", "--tokens", "256", "--vocab", "2048", "--images", "2"),
                *("--switches", "chunk_static,chunk_dynamic", "--out", str(root / "memory")),
                "features.chunk_loss.chunk_size=64",
            ],
            clean_env(),
        ),
        "ops": (
            ["ops", "--tokens", "32", "--repeats", "1", "--steps", "2", "--out", str(root / "ops")],
            clean_env(),
        ),
    }
    started = {}
    for name, (argv, child_env) in commands.items():
        with (root / f"{name}.stdout").open("w") as stdout, (root / f"{name}.stderr").open("w") as stderr:
            command = [sys.executable, "-m", "glm45v_fsdp.tools.bench", *argv]
            started[name] = subprocess.Popen(command, cwd=REPO, env=child_env, stdout=stdout, stderr=stderr)

    def finished(name: str) -> tuple[Path, subprocess.CompletedProcess]:
        process = started[name]
        process.wait(timeout=600)
        output = [(root / f"{name}.{stream}").read_text() for stream in ("stdout", "stderr")]
        return root, subprocess.CompletedProcess(process.args, process.returncode, *output)

    yield finished
    for process in started.values():
        if process.poll() is None:
            process.kill()


def test_overhead_bench_compares_like_with_like(benches):
    root, result = benches("overhead")
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads((root / "overhead.json").read_text())
    assert (
        abs(figures["first_step_loss_ours"] - figures["first_step_loss_bare"]) <= 1e-6 * figures["first_step_loss_bare"]
    )
    assert figures["steps_each"] == 4 and figures["ratio_median"] > 0
    assert f"ratio {figures['ratio_median']:.3f}x" in result.stdout


def test_memory_bench_writes_a_consistent_table(benches):
    """Two switches sharing their OFF run (which runs once): table, JSON and chart written, figures derived from the
    runs' own metrics."""
    root, result = benches("memory")
    out = root / "memory"
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


def test_memory_bench_on_cuda_judges_offload_and_runs_every_process_on_the_device(tmp_path, monkeypatch):
    """The prepared GPU script (--device cuda): every run trains on cuda with the allocator peak, and the offload row
    is judged against its target there (on cpu it is parity only). The runs are faked: no GPU here."""
    from glm45v_fsdp.bench import runner as bench_runner
    from glm45v_fsdp.tools import bench

    peaks = {"recompute": 1.0, "recompute_offload": 0.7}
    commands = {}

    def fake_execute(name, command, output_dir, timeout, threads=None, bench="bench memory", records=True):
        commands[name] = command
        record = {
            "step": 1,
            "loss": 2.0,
            "ms_per_iter": 10.0 if name == "recompute" else 10.3,
            "global_batch_size": 1,
            "tokens": 64,
            "mem_peak_per_rank_gib": [peaks[name]],
        }
        return [record, {**record, "step": 2}], 1.0, 1.0

    monkeypatch.setattr(bench_runner, "execute", fake_execute)
    out = tmp_path / "out"
    argv = ["memory", "--device", "cuda", "--tokens", "64", "--steps", "2", "--warmup", "1", "--out", str(out)]
    assert bench.main([*argv, "--switches", "offload"]) == 0
    assert sorted(commands) == ["recompute", "recompute_offload"]
    assert all("training.device=cuda" in command for command in commands.values())
    assert "features.activation_offload.enabled=true" in commands["recompute_offload"]
    (row,) = json.loads((out / "memory.json").read_text())["rows"]
    assert row["saving_max_pct"] == pytest.approx(30.0) and row["time_cost_pct"] == pytest.approx(3.0)
    assert row["pass"] and "allocator peak" in (out / "memory.md").read_text()
    assert "no separate device memory" not in (out / "memory.md").read_text()  # the cpu caveat
    peaks["recompute_offload"] = 0.8  # a 20% saving misses the 25% target: the row says so
    assert bench.main([*argv, "--switches", "offload"]) == 0
    (row,) = json.loads((out / "memory.json").read_text())["rows"]
    assert not row["pass"] and "| FAIL: memory |" in (out / "memory.md").read_text()


def test_memory_bench_ulysses_row_needs_even_ranks(tmp_path, monkeypatch):
    """The CP row runs CP 2 with twice the accumulation on the same ranks; faked runs (no processes)."""
    from glm45v_fsdp.bench import memory as bench_memory
    from glm45v_fsdp.bench import runner as bench_runner
    from glm45v_fsdp.tools import bench

    commands = {}

    def fake_execute(name, command, output_dir, timeout, threads=None, bench="bench memory", records=True):
        commands[name] = command
        ranks = next(int(arg.split("=")[1]) for arg in command if arg.startswith("--nproc_per_node="))
        record = {"step": 1, "loss": 2.0, "ms_per_iter": 10.0, "global_batch_size": ranks, "tokens": 64 * ranks}
        record["mem_peak_per_rank_gib"] = [1.0 if name == "recompute" else 0.3 * (4 // ranks)] * ranks
        return [record, {**record, "step": 2}], 1.0, 1.0

    monkeypatch.setattr(bench_runner, "execute", fake_execute)
    argv = ["memory", "--tokens", "64", "--steps", "2", "--warmup", "1", "--out", str(tmp_path / "out")]
    assert bench.main([*argv, "--switches", "ulysses"]) == 2  # one rank cannot hold a CP group of 2
    assert commands == {}
    assert "ulysses" not in bench_memory.runnable_switches(1) and "ulysses" in bench_memory.runnable_switches(2)
    assert bench.main([*argv, "--ranks", "2", "--switches", "ulysses"]) == 0
    assert "--nproc_per_node=2" in commands["recompute_ulysses_cp2"]
    assert "parallel.ulysses_parallel_size=2" in commands["recompute_ulysses_cp2"]
    assert "training.gradient_accumulation_steps=2" in commands["recompute_ulysses_cp2"]
    (row,) = json.loads((tmp_path / "out" / "memory.json").read_text())["rows"]
    assert row["saving_max_pct"] == pytest.approx(40.0) and row["pass"]
    # Ring CP 2 the same way; hybrid Ulysses 2 x Ring 2 is CP 4: 4 ranks, 4 x the accumulation
    assert "ring" in bench_memory.runnable_switches(2) and "hybrid" not in bench_memory.runnable_switches(2)
    assert bench.main([*argv, "--ranks", "2", "--switches", "hybrid"]) == 2
    assert bench.main([*argv, "--ranks", "4", "--switches", "ring,hybrid"]) == 0
    assert "parallel.ring_attention_size=2" in commands["recompute_ring_cp2"]
    hybrid = commands["recompute_hybrid_cp4"]
    assert "parallel.ring_attention_size=2" in hybrid and "parallel.ulysses_parallel_size=2" in hybrid
    assert "training.gradient_accumulation_steps=4" in hybrid and "--nproc_per_node=4" in hybrid


def test_ep_bench_runs_each_configuration_and_judges_the_rows(tmp_path, monkeypatch):
    """EP1 vs EP2, both dispatchers, balance under skewed and natural routing: the commands each run gets, and the
    figures and judgements the table derives from their records. The runs are faked (no processes)."""
    from glm45v_fsdp.bench import runner as bench_runner
    from glm45v_fsdp.tools import bench

    ms = {"ep1": 300.0, "ep2": 200.0, "ep2_allgather": 190.0, "skew": 320.0, "skew_balance": 240.0, "balance": 201.0}
    after = {"skew_balance": 1.04}
    commands = {}

    def fake_execute(name, command, output_dir, timeout, threads=None, bench="bench ep", records=True):
        commands[name] = command
        record = {
            "step": 1,
            "loss": 3.0,
            "ms_per_iter": ms[name],
            "global_batch_size": 2,
            "tokens": 2048,
            "mem_peak_per_rank_gib": [1.0, 0.9] if name == "ep1" else [0.8, 0.7],
        }
        if name != "ep1" and "allgather" not in name:
            before = 1.6 if name.startswith("skew") else 1.05
            record |= {
                "ep_load_max_over_mean_before": before,
                "ep_load_max_over_mean_after": after.get(name, before),
                "ep_load_cv_before": before - 1,
                "ep_load_cv_after": after.get(name, before) - 1,
                "ep_load_per_rank_before": [1.0, 1.0],
                "ep_replicas": 6.0 if name == "skew_balance" else 0.0,
                "ep_replica_mib": 9.0 if name == "skew_balance" else 0.0,
            }
        return [record, {**record, "step": 2}, {**record, "step": 3}], 1.0, 2.0

    monkeypatch.setattr(bench_runner, "execute", fake_execute)
    out = tmp_path / "ep"
    argv = ["ep", "--steps", "3", "--warmup", "1", "--repeats", "1", "--out", str(out)]
    assert bench.main(argv) == 0
    assert sorted(commands) == sorted(ms)
    assert not any("expert_parallel_size" in item for item in commands["ep1"])
    assert "parallel.expert_parallel_size=2" in commands["ep2"] and "--nproc_per_node=2" in commands["ep2"]
    assert "parallel.ep_plan.dispatcher=allgather" in commands["ep2_allgather"]
    assert "model.router_skew=0.2" in commands["skew"] and "features.ep_balance.enabled=false" not in commands["skew"]
    assert "features.ep_balance.max_dup_experts_num=4" in commands["skew_balance"]
    rows = {row["on_run"]: row for row in json.loads((out / "ep.json").read_text())["rows"]}
    assert rows["ep2"]["throughput_change_pct"] == pytest.approx(50.0) and rows["ep2"]["pass"]
    assert rows["ep2"]["expert_weights_mib"] == [48.0, 24.0]  # 32 experts of 3 x 256 x 512 fp32, then 16
    assert rows["skew_balance"]["load_max_over_mean"] == [1.6, 1.04] and rows["skew_balance"]["pass"]
    assert rows["skew_balance"]["replica_mib_per_step"] == 9.0
    assert rows["balance"]["pass"]  # +0.5% time is within the no-cost tolerance
    assert (out / "ep.md").read_text().count("| pass |") == 4
    with Image.open(out / "ep.png") as image:
        assert image.format == "PNG"
    after["skew_balance"], ms["balance"] = 1.3, 220.0  # uneven after balance, and a cost on natural routing
    assert bench.main(argv) == 0
    rows = {row["on_run"]: row for row in json.loads((out / "ep.json").read_text())["rows"]}
    assert rows["skew_balance"]["result"] == "FAIL: rank load" and rows["balance"]["result"] == "FAIL: time"


def test_longest_bench_doubles_until_the_budget_and_judges_the_ratio(tmp_path):
    """The doubling search with a faked measurement (peak grows with the tokens each rank holds)."""
    from glm45v_fsdp.bench import longest as bench_longest
    from glm45v_fsdp.tools import bench

    tried = []

    def measure(layout, tokens):
        tried.append((layout, tokens))
        return 10.0 + tokens / bench_longest.LAYOUTS[layout].cp / 100.0  # MiB per rank

    parser = argparse.ArgumentParser()
    bench_longest.add_parser(parser.add_subparsers())
    argv = ["longest", "--budget-mib", "50", "--start", "1024", "--out", str(tmp_path)]
    args = parser.parse_args(argv)
    assert bench_longest.main_longest(args, argv, measure=measure) == 0
    result = json.loads((tmp_path / "longest.json").read_text())
    longest = {row["layout"]: row["longest_tokens"] for row in result["rows"]}
    assert longest == {"cp1": 2048, "ulysses2": 4096, "ring2": 4096}  # 10 + 4096/100 > 50; 10 + 4096/200 <= 50
    assert [row["pass"] for row in result["rows"]] == [True, True, True]
    assert ("cp1", 4096) in tried and ("cp1", 8192) not in tried  # stops at the first length over the budget
    assert "| ring2 | 2 | 4096 | 2.00 |" in (tmp_path / "longest.md").read_text()
    assert bench.main(["longest", "--ranks", "3", "--out", str(tmp_path)]) == 2  # not a multiple of cp 2
    assert bench.main(["longest", "--layouts", "ring2", "--out", str(tmp_path)]) == 2  # cp1 is the reference


def test_deepspeed_bench_interleaves_backends_and_judges_the_ratio(tmp_path, monkeypatch):
    """Faked runs (no processes): the order rotates per round, each door's ratio is DeepSpeed ms / door ms per round,
    ZeRO-3 is judged against 1.6x and the others against 1.0x and 0.8 of the bare loop's rate, the trainer door gets
    the worker's initial weights and ds_config, and the loss parity is reported per door; torch DDP's share of the
    bare rate is reported beside it."""
    from glm45v_fsdp.bench import runner as bench_runner
    from glm45v_fsdp.tools import bench

    order, trainer_commands = [], []
    speed = {"deepspeed": {1: 50.0, 3: 120.0}, "ds_compat": {1: 40.0, 3: 80.0}, "trainer": {1: 50.0, 3: 70.0}}

    def argument(command, name):
        return next(arg.split("=", 1)[1] for arg in command if arg.startswith(f"--{name}="))

    def fake_execute(name, command, output_dir, timeout, threads=None, bench="", records=True):
        output_dir.mkdir(parents=True, exist_ok=True)  # as the runner's execute does
        losses = [2.0, 1.9, 1.8 * (1 + 1.5e-5)]
        if "glm45v_fsdp.train" in command:
            config = Path(command[command.index("--deepspeed") + 1])
            assert json.loads(config.read_text())["saved_by"] == "fake"
            zero = int(config.parent.name[len("zero")])
            if "training.track_memory=true" not in command:
                order.append((zero, "trainer"))
                trainer_commands.append(command)
            ms = [999.0] + [speed["trainer"][zero]] * 5
            records = [
                {"ms_per_iter": m + 5, "data_ms": 5.0, "loss": x, "grad_norm": 1.0, "mem_peak_max_gib": 0.5}
                for m, x in zip(ms, losses * 2)
            ]
            return records, 1, 1
        if any(arg.startswith("--save-initial=") for arg in command):
            Path(argument(command, "save-initial"), "ds_config.json").write_text('{"saved_by": "fake"}')
            return [], 1.0, 1.0
        backend, zero = argument(command, "backend"), int(argument(command, "zero"))
        order.append((zero, backend))
        if backend == "alternate":
            assert command[:3] == [sys.executable, "-m", "glm45v_fsdp.bench.deepspeed_api_worker"]  # one process
            alone = {"ms": [999.0] + [36.0] * 5, "bare_ms": [999.0] + [40.0] * 5, "losses": losses}
            Path(argument(command, "out")).write_text(json.dumps({**alone, "bare_losses": [2.0, 1.9, 1.8]}))
            return [], 1.0, 1.0
        ms = {"bare": 38.0, "ddp": 47.5}.get(backend) or speed[backend][zero]
        losses = [2.0, 1.9, 1.8] if backend == "deepspeed" else losses
        result = {"ms": [999.0] + [ms] * 5, "losses": losses, "peak_bytes_max": 2.0**20}
        Path(argument(command, "out")).write_text(json.dumps(result))
        return [], 1.0, 1.0

    monkeypatch.setattr(bench_runner, "execute", fake_execute)
    argv = ["deepspeed", "--zero", "1,3", "--steps", "6", "--warmup", "1", "--rounds", "2", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    first, second = [(2, "alternate"), (0, "bare"), (0, "ddp"), (1, "deepspeed"), (1, "ds_compat"), (1, "trainer")], [
        (2, "alternate"), (0, "bare"), (0, "ddp"), (1, "ds_compat"), (1, "trainer"), (1, "deepspeed")
    ]  # fmt: skip
    assert order[:6] == first and order[9:15] == second
    assert "data.shuffle=false" in trainer_commands[0] and "training.lr_scheduler=constant" in trainer_commands[0]
    rows = {r["zero"]: r for r in json.loads((tmp_path / "deepspeed.json").read_text())["rows"]}
    assert rows[1]["throughput_ratio"] == pytest.approx({"ds_compat": 1.25, "trainer": 1.0})
    assert rows[1]["ratio_per_round"]["ds_compat"] == [1.25, 1.25]
    assert rows[1]["bare_rate_ratio"] == pytest.approx({"deepspeed": 0.76, "ds_compat": 0.95, "trainer": 0.76})
    assert rows[1]["ddp_bare_rate_ratio"] == pytest.approx(0.8)  # DDP's share: the yardstick beside the goal
    assert rows[1]["pass"] == {"ds_compat": True, "trainer": False}  # the trainer is below 0.8 of the bare rate
    assert rows[1]["below"] == {"ds_compat": [], "trainer": ["0.8 bare"]}  # at 1.0x DeepSpeed: that goal is met
    assert rows[3]["throughput_ratio"]["ds_compat"] == pytest.approx(1.5)
    assert rows[3]["pass"] == {"ds_compat": False, "trainer": True}  # ZeRO-3: 1.5x < 1.6x, 1.71x; no bare goal
    assert rows[3]["below"]["ds_compat"] == ["1.6× DeepSpeed"]
    assert rows[1]["loss_mean_rel_err"]["trainer"] == pytest.approx(5e-6, rel=1e-3)
    assert rows[1]["peak_mib"]["trainer"] == pytest.approx(512.0)
    assert (
        "| 3 | fp32 | 120.0 · 80.0 · 70.0 [75.0] (38.0) | 1.50× (1.50, 1.50) | 1.71× (1.71, 1.71) |"
        in (tmp_path / "deepspeed.md").read_text()
    )
    assert "| pass | below 0.8 bare |" in (tmp_path / "deepspeed.md").read_text()  # ZeRO-1: each door's verdict
    alone = json.loads((tmp_path / "deepspeed.json").read_text())["alone"]
    assert len(alone) == 1 and alone[0]["dtype"] == "fp32"
    assert alone[0]["engine_over_bare_ms"] == pytest.approx(0.9) and alone[0]["per_round"] == pytest.approx([0.9, 0.9])
    assert alone[0]["loss_mean_rel_err"] == pytest.approx(5e-6)
    assert "| fp32 | 0.90 (0.90, 0.90) | 5.0e-06 |" in (tmp_path / "deepspeed.md").read_text()
    assert (tmp_path / "deepspeed.png").stat().st_size > 0
    assert bench.main(["deepspeed", "--dtype", "fp8", "--out", str(tmp_path)]) == 2


def test_ops_bench_measures_each_fast_kernel_and_the_training_pair(benches):
    """CPU: only the experts leave the reference (torch._grouped_mm), so that row has figures and the others say
    why; the training pair ran with both settings and compared their losses."""
    root, result = benches("ops")
    out = root / "ops"
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "ops.json").read_text())
    rows = {row["op"]: row for row in report["ops"]}
    assert set(rows) == {"rms_norm", "rotary", "vision rotary", "attention", "experts", "permute", "swiglu"}
    experts = rows["experts"]
    assert experts["kernel"] == "torch._grouped_mm" and experts["output_error"] < 1e-5 and experts["speedup"] > 0
    assert all("note" in row for op, row in rows.items() if op != "experts")
    auto, reference = report["training"]
    assert (auto["ops"], reference["ops"]) == ("auto", "reference") and len(auto["losses"]) == 2
    assert auto["loss_error"] < 1e-3 and "experts: torch._grouped_mm" in auto["log"]
    assert "| experts | torch._grouped_mm |" in (out / "ops.md").read_text()


def test_deepspeed_bench_alternate_runs_the_bare_loop_and_the_engine_on_equal_terms(tmp_path):
    """bench deepspeed's 'apart from communication' run: both steps on their own copy of the same weights and the
    same batches, alternated in one process at 1 rank, so the engine's losses are the bare loop's (fp32)."""
    from conftest import python

    out = tmp_path / "alternate.json"
    worker = ["-m", "glm45v_fsdp.bench.deepspeed_api_worker", "--backend=alternate", "--zero=2", "--steps=3"]
    result = python([*worker, f"--out={out}"], timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    found = json.loads(out.read_text())
    assert len(found["ms"]) == len(found["bare_ms"]) == 3 and min(found["ms"] + found["bare_ms"]) > 0
    assert found["losses"] == pytest.approx(found["bare_losses"], rel=1e-5)
    assert found["losses"][0] != found["losses"][2]  # both trained: the loss moved


def test_door_bench_runs_both_doors_per_case_with_the_case_keys(tmp_path, monkeypatch):
    """Faked runs (no processes): each case's ds_config keys reach the engine door's script (--ds-extra) and the
    trainer door's ds_config (written by the script's --save-initial with the same keys); the doors alternate per
    round; the ratio is engine ms / trainer ms, judged against 1.05; the chunked loss's saving is per door."""
    from glm45v_fsdp.bench import runner as bench_runner
    from glm45v_fsdp.tools import bench

    order, extras = [], {}
    engine_ms = {"full_logits": 50.0, "chunk_dynamic": 52.0, "ep": 60.0}
    peak_mib = {"full_logits": 20.0, "chunk_dynamic": 18.0, "ep": 19.0}
    context_peak_mib = {"cp1": 100.0, "ulysses2": 52.0, "ring2": 61.0}
    context = {}

    def argument(command, name):
        return next(arg.split("=", 1)[1] for arg in command if arg.startswith(f"--{name}="))

    def fake_execute(name, command, output_dir, timeout, threads=None, bench="", records=True):
        output_dir.mkdir(parents=True, exist_ok=True)
        if "glm45v_fsdp.train" in command:
            config = Path(command[command.index("--deepspeed") + 1])
            case = config.parent.name
            assert json.loads(config.read_text()) == {"extra": extras[case]}  # the case's keys, as the engine got
            if "training.track_memory=true" not in command:
                order.append((case, "trainer"))
            # the trainer holds out the engine's validation samples and evals after its last step, idle before
            assert {"data.validation_split=0.05", "training.eval_interval=0", "training.eval_iters=1"} <= set(command)
            records = [
                {"ms_per_iter": 55.0, "data_ms": 5.0, "loss": 2.0, "grad_norm": 1.0, "mem_peak_max_gib": 0.01}
                for _ in range(4)
            ]
            if case == "chunk_dynamic":
                for record in records:
                    record["mem_peak_max_gib"] = 0.009
            return records, 1, 1
        extra = json.loads(argument(command, "ds-extra"))
        if any(arg.startswith("--save-initial=") for arg in command):
            directory = Path(argument(command, "save-initial"))
            extras[directory.name] = extra
            (directory / "ds_config.json").write_text(json.dumps({"extra": extra}))
            return [], 1.0, 1.0
        run_dir = Path(argument(command, "out")).parent.name
        if run_dir.startswith("context_"):  # the context-parallel rows: the engine door alone, a long sample
            case = run_dir.removeprefix("context_")
            context[case] = extra, [argument(command, name) for name in ("text-tokens", "cutoff-len", "micro")]
            result = {"ms": [1.0] * 2, "losses": [2.0] * 2, "peak_bytes_max": context_peak_mib[case] * 2**20}
            Path(argument(command, "out")).write_text(json.dumps(result))
            return [], 1.0, 1.0
        case = run_dir.split("_ds_compat_")[0]
        assert extra == extras[case] and argument(command, "zero") == "3"
        assert argument(command, "eval-split") == "0.05"  # the engine's batches skip the same held-out samples
        order.append((case, "ds_compat"))
        result = {"ms": [999.0] + [engine_ms[case]] * 3, "losses": [2.0] * 4, "peak_bytes_max": peak_mib[case] * 2**20}
        Path(argument(command, "out")).write_text(json.dumps(result))
        return [], 1.0, 1.0

    monkeypatch.setattr(bench_runner, "execute", fake_execute)
    argv = ["door", "--steps", "4", "--warmup", "1", "--rounds", "2", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    assert extras["ep"]["expert_parallel"] == {"enabled": True, "autoep_size": 2}
    assert extras["chunk_dynamic"]["glm45v_fsdp"]["features"]["chunk_loss"]["mode"] == "dynamic"
    assert extras["full_logits"]["glm45v_fsdp"]["features"]["chunk_loss"]["mode"] == "off"
    rounds = [("full_logits", "ds_compat"), ("full_logits", "trainer"), ("full_logits", "trainer")]
    assert order[:4] == [*rounds, ("full_logits", "ds_compat")]  # the order rotates per round
    report = json.loads((tmp_path / "door.json").read_text())
    rows = {r["case"]: r for r in report["rows"]}
    assert rows["full_logits"]["engine_over_trainer_ms"] == pytest.approx(1.0) and rows["full_logits"]["pass"]
    assert rows["ep"]["engine_over_trainer_ms"] == pytest.approx(1.2) and not rows["ep"]["pass"]
    assert rows["ep"]["trainer_over_engine_ms"] == pytest.approx(50 / 60) and rows["ep"]["trainer_pass"]
    assert rows["chunk_dynamic"]["trainer_over_engine_ms"] == pytest.approx(50 / 52)
    assert rows["chunk_dynamic"]["loss_mean_rel_err"] == 0.0
    saving = report["chunk_saving"]
    assert saving["ds_compat"] == pytest.approx({"mib": 2.0, "pct": 10.0})
    assert saving["trainer"]["mib"] == pytest.approx(0.001 * 1024) and saving["trainer"]["pct"] == pytest.approx(10.0)
    assert "| ep | 60.0 · 50.0 | 1.200 (1.200, 1.200) |" in (tmp_path / "door.md").read_text()
    assert (tmp_path / "door.png").stat().st_size > 0
    # the context-parallel rows: 8192-token samples, one per micro batch; a CP case passes at <= 0.6 x CP1's peak
    assert context["ulysses2"][0]["sequence_parallel_size"] == 2 and "sequence_parallel_size" not in context["cp1"][0]
    assert context["ring2"][0]["glm45v_fsdp"]["parallel"] == {"ring_attention_size": 2}
    assert all(arguments == ["8192", "8192", "1"] for _, arguments in context.values())
    verdicts = {r["case"]: (round(r["over_cp1"], 2), r["pass"]) for r in report["context_rows"]}
    assert verdicts == {"cp1": (1.0, True), "ulysses2": (0.52, True), "ring2": (0.61, False)}
    assert bench.main(["door", "--ranks", "3", "--ep", "2", "--out", str(tmp_path)]) == 2


def test_lora_bench_runs_both_configurations_alternating_and_counts_the_optimizer(tmp_path, monkeypatch):
    """Full fine-tuning and LoRA rounds (ABBA), the commands each gets, and the figures: the trainable parameters are
    counted on the model the plans build (LoRA: the adapters only). The runs are faked (no processes)."""
    from glm45v_fsdp.bench import runner as bench_runner
    from glm45v_fsdp.tools import bench

    order, commands = [], {}

    def fake_execute(name, command, output_dir, timeout, threads=None, bench="bench lora", records=True):
        order.append(name)
        commands[name] = command
        if not records:  # a DeepSpeed-API worker run (door vs DeepSpeed): its result.json
            ms = {"deepspeed": 100.0, "ds_compat": 25.0, "ddp": 20.0}[name.split()[0]]
            result = {"ms": [500.0] + [ms] * 3, "losses": [3.0, 2.9, 2.8, 2.7], "peak_bytes_max": 2.0**20}
            output_dir.mkdir(parents=True, exist_ok=True)
            (output_dir / "result.json").write_text(json.dumps(result))
            return [], 1.0, 2.0
        ms, peaks = (300.0, [1.0, 0.8]) if name == "full" else (200.0, [0.5, 0.4])
        record = {"step": 1, "loss": 3.0, "ms_per_iter": ms, "global_batch_size": 2, "tokens": 512,
                  "mem_peak_per_rank_gib": peaks}  # fmt: skip
        return [record, {**record, "step": 2}, {**record, "step": 3}], 1.0, 2.0

    monkeypatch.setattr(bench_runner, "execute", fake_execute)
    out = tmp_path / "lora"
    argv = ["lora", "--steps", "3", "--warmup", "1", "--repeats", "2", "--hidden", "128", "--out", str(out)]
    assert bench.main([*argv, "--ds-rounds", "2", "--ds-steps", "4"]) == 0
    assert order == ["full", "lora", "lora", "full", "ds_compat lora 0", "deepspeed lora 0", "ddp lora 0",
                     "ddp lora 1", "deepspeed lora 1", "ds_compat lora 1"]  # fmt: skip
    for side in ("ds_compat", "deepspeed", "ddp"):  # one script, one ds_config: PEFT's LoRA, ZeRO 3, autoep over all
        command = " ".join(commands[f"{side} lora 0"])
        assert f"--backend={side}" in command and "--zero=3" in command and "--lora=8" in command
        assert '"autoep_size": 2' in command
    assert "model.lora.rank=8" in commands["lora"] and "model.lora.experts=true" in commands["lora"]
    assert not any(item.startswith("model.lora") for item in commands["full"])
    assert all("parallel.expert_parallel_size=2" in commands[name] for name in ("full", "lora"))
    result = json.loads((out / "lora.json").read_text())
    full, lora = result["runs"]["full"], result["runs"]["lora"]
    assert full["trainable_params"] == full["total_params"] and lora["trainable_params"] < full["total_params"] / 5
    assert lora["total_params"] > full["total_params"]  # the adapters come on top of the frozen base
    assert result["optimizer_ratio"] == pytest.approx(lora["trainable_params"] / full["trainable_params"])
    assert result["saving_max_pct"] == pytest.approx(50.0) and result["speedup"] == pytest.approx(1.5)
    versus = result["vs_deepspeed"]
    assert versus["speed_ratio"] == pytest.approx(4.0) and versus["pass"] and versus["loss_mean_rel_err"] == 0.0
    assert versus["ddp_speed_ratio"] == pytest.approx(5.0) and versus["ms_per_step"]["ddp"] == pytest.approx(20.0)
    assert "DeepSpeed ms / torch DDP ms: 5.00" in (out / "lora.md").read_text()
    assert not any("ds_compat.utils.numa" in commands[f"{side} lora 0"] for side in ("ds_compat", "deepspeed", "ddp"))

    # --bind-cores: every side's ranks start under numactl, as DeepSpeed's launcher starts them
    assert bench.main([*argv, "--ds-rounds", "2", "--ds-steps", "4", "--bind-cores"]) == 0
    for side in ("ds_compat", "deepspeed", "ddp"):
        command = commands[f"{side} lora 0"]
        binder = ["--no-python", sys.executable, "-m", "ds_compat.utils.numa", "--", sys.executable, "-m"]
        start = command.index("--no-python")
        assert command[start : start + len(binder)] == binder, command
        assert command[start + len(binder)] == "glm45v_fsdp.bench.deepspeed_api_worker"
    assert "pinned to their share of the cores" in (out / "lora.md").read_text()


def test_router_bench_compares_balancing_against_none_from_the_router_figures(tmp_path, monkeypatch):
    """The three runs and their commands, the start / end figures read from the router reports, and the verdict
    (the bias run must end below no balancing and below its own start). The runs are faked (no processes)."""
    from glm45v_fsdp.bench import runner as bench_runner
    from glm45v_fsdp.tools import bench

    commands = {}
    worst = {"off": [4.0, 5.0, 6.0, 7.0], "bias": [4.0, 3.0, 2.0, 1.5], "aux": [4.0, 4.5, 5.0, 6.0]}

    def fake_execute(name, command, output_dir, timeout, threads=None, bench="bench router", records=True):
        commands[name] = command
        reports = []
        for index, figure in enumerate(worst[name]):
            record = {"step": 10 * (index + 1), "loss": 5.0 - index, "router/worst_load_max_over_mean": figure,
                      "router/dead_fraction": 0.5 / (index + 1), "router/layer1/entropy": 0.9,
                      "router/layer2/entropy": 0.8 + index / 100}  # fmt: skip
            if name == "bias":
                record["router/bias_max_abs"] = 0.01 * (index + 1)
            reports.append(record)
        return reports, 1.0, 2.0

    monkeypatch.setattr(bench_runner, "execute", fake_execute)
    argv = ["router", "--steps", "40", "--interval", "10", "--tail-intervals", "2", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    assert list(commands) == ["off", "bias", "aux"]
    assert "features.router.bias_update_rate=0.001" in commands["bias"] and "model.router_skew=0.1" in commands["off"]
    assert "features.router.aux_loss_coef=0.01" in commands["aux"]
    assert not any(item.startswith("features.router") for item in commands["off"])
    runs = json.loads((tmp_path / "router.json").read_text())["runs"]
    assert runs["off"]["max_over_mean"] == [4.0, 6.5] and runs["bias"]["max_over_mean"] == [4.0, 1.75]
    assert runs["bias"]["entropy_min"][0] == 0.8 and runs["bias"]["bias_max_abs"] == 0.04
    assert runs["bias"]["pass"] and runs["bias"]["result"].startswith("pass: 73% below off")
    assert runs["aux"]["result"] == "reported (0.85x off)"  # below off, but above its own start
    assert "| bias | 4.000 → 1.750 |" in (tmp_path / "router.md").read_text()
