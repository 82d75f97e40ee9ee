"""bench parity: the long run against DeepSpeed. Faked runs check its arithmetic and judgement; a short real run
checks that the DeepSpeed-API script reports the same figures (losses, grad norms) on DeepSpeed and on both doors."""

import contextlib
import io
import json
import statistics
from pathlib import Path

import pytest
from conftest import bench_runs_forked
from PIL import Image


def test_parity_bench_compares_each_door_with_deepspeed_and_judges_bf16(tmp_path, monkeypatch):
    from glm45v_fsdp.bench import runner as bench_runner
    from glm45v_fsdp.tools import bench

    order = []
    reference = [2.0, 1.8, 1.5, 1.2]
    doors = {"ds_compat": [2.0, 1.8, 1.5, 1.2], "trainer": [2.0, 1.9, 1.5, 1.25]}  # trainer: steps 2, 4 off
    ms = {"deepspeed": 50.0, "ds_compat": 40.0, "trainer": 55.0}

    def argument(command, name):
        return next(arg.split("=", 1)[1] for arg in command if arg.startswith(f"--{name}="))

    def fake_execute(name, command, output_dir, timeout, threads=None, bench="", records=True):
        output_dir.mkdir(parents=True, exist_ok=True)  # as the runner's execute does
        if any(arg.startswith("--save-initial=") for arg in command):
            Path(argument(command, "save-initial"), "ds_config.json").write_text('{"saved_by": "fake"}')
            return [], 1.0, 1.0
        if "glm45v_fsdp.train" in command:
            dtype = Path(command[command.index("--deepspeed") + 1]).parent.name.split("_")[1]
            order.append((dtype, "trainer"))
            assert "training.train_iters=4" in command and "data.shuffle=false" in command
            losses = doors["trainer"]
            rows = [
                {"ms_per_iter": ms["trainer"] + 7.0, "data_ms": 7.0, "loss": x, "grad_norm": 1.1 * x} for x in losses
            ]
            return [{**row, "mem_peak_max_gib": 0.0} for row in rows], 1.0, 1.0
        backend, dtype = argument(command, "backend"), argument(command, "dtype")
        order.append((dtype, backend))
        assert argument(command, "zero") == "3" and argument(command, "steps") == "4"
        losses = reference if backend == "deepspeed" else doors[backend]
        result = {"ms": [500.0] + [ms[backend]] * 3, "losses": losses, "grad_norms": [x for x in losses]}
        Path(argument(command, "out")).write_text(json.dumps(result))
        return [], 1.0, 1.0

    monkeypatch.setattr(bench_runner, "execute", fake_execute)
    argv = ["parity", "--steps", "4", "--warmup", "1", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    # bf16 first, DeepSpeed first; fp32 in the reverse order (a drift of machine speed hits both sides)
    assert order == [("bf16", "deepspeed"), ("bf16", "ds_compat"), ("bf16", "trainer"),
                     ("fp32", "trainer"), ("fp32", "ds_compat"), ("fp32", "deepspeed")]  # fmt: skip
    report = json.loads((tmp_path / "parity.json").read_text())
    engine, trainer = report["rows"]["bf16"]["ds_compat"], report["rows"]["bf16"]["trainer"]
    assert engine["loss_mean_rel_err"] == 0.0 and engine["throughput_ratio"] == pytest.approx(1.25)
    assert engine["verdict"] == "pass"
    errors = [abs(t - r) / (abs(r) + 1e-8) for t, r in zip(doors["trainer"], reference)]
    assert trainer["loss_mean_rel_err"] == pytest.approx(statistics.fmean(errors))
    assert trainer["loss_max_rel_err"] == pytest.approx(max(errors))
    grads = [abs(1.1 * t - r) / (abs(r) + 1e-8) for t, r in zip(doors["trainer"], reference)]
    assert trainer["grad_norm_mean_rel_err"] == pytest.approx(statistics.fmean(grads))  # from metrics.jsonl
    assert trainer["ms_per_step"] == pytest.approx([50.0, 55.0]) and trainer["throughput_ratio"] == pytest.approx(
        50 / 55
    )
    assert trainer["loss_mean_signed_diff"] == pytest.approx(-0.0375)
    assert trainer["verdict"] == "below: loss ≥ 2%, throughput < 1.0× DeepSpeed"  # mean error 2.43%
    assert report["rows"]["fp32"]["trainer"]["verdict"] == "reported"
    table = (tmp_path / "parity.md").read_text()
    assert "| bf16 | engine API (ds_compat) | 0.0000% | 0.0000% |" in table and "| 1.250× | pass |" in table
    for dtype in ("bf16", "fp32"):
        for door in ("ds_compat", "trainer"):
            with Image.open(tmp_path / "plots" / f"parity_{dtype}_{door}.png") as image:
                assert image.format == "PNG"
    assert bench.main(["parity", "--dtype", "fp8", "--out", str(tmp_path / "bad")]) == 2


def test_parity_bench_runs_the_script_on_deepspeed_and_both_doors(tmp_path):
    """A few real steps in fp32: DeepSpeed, the engine door and the trainer door train the same weights on the same
    batches, so their losses and grad norms agree to fp32 rounding. The bench runs in this process; DeepSpeed's run
    starts as the runner starts it (torchrun, a fresh interpreter per rank: the runner's real launch), the initial
    weights' and both doors' runs are forked by the suite's zygote (conftest.bench_runs_forked)."""
    from glm45v_fsdp.tools import bench

    argv = ["parity", "--steps", "3", "--warmup", "1", "--dtype", "fp32", "--out", str(tmp_path)]
    printed = io.StringIO()
    with bench_runs_forked(real=lambda command: "--backend=deepspeed" in command):
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            code = bench.main(argv)
    assert code == 0, printed.getvalue()[-3000:]
    report = json.loads((tmp_path / "parity.json").read_text())
    for door in ("ds_compat", "trainer"):
        row = report["rows"]["fp32"][door]
        assert row["steps"] == 3 and row["loss_mean_rel_err"] < 1e-5 and row["grad_norm_mean_rel_err"] < 1e-4
        assert row["verdict"] == "reported" and row["throughput_ratio"] > 0
    norms = report["grad_norms"]["fp32"]
    assert len(norms["deepspeed"]) == 3 and all(norm > 0 for norm in norms["deepspeed"])
