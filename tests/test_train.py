"""End-to-end runs of `python -m glm45v_fsdp.train` as real processes (1 rank, torchrun 2 and 4 ranks over gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PARITY, clean_env, free_port, mean_relative_error, read_metrics, train

REPO = Path(__file__).resolve().parents[1]
METRIC_KEYS = {
    "step",
    "loss",
    "grad_norm",
    "lr",
    "ms_per_iter",
    "samples_per_s",
    "tokens_per_s",
    "mem_peak_max_gib",
    "mem_peak_avg_gib",
}


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_default_training_runs_and_learns(tmp_path, nproc):
    result = train(tmp_path / "run", ["training.train_iters=12", "training.log_interval=4"], nproc=nproc)
    assert result.returncode == 0, result.stderr[-4000:]
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, 13))
    assert all(METRIC_KEYS <= set(r) for r in records)
    assert all(len(r["ms_per_iter_per_rank"]) == len(r["data_ms_per_rank"]) == nproc for r in records)
    assert all(0 < r["data_ms"] < r["ms_per_iter"] and r["data_ms"] == max(r["data_ms_per_rank"]) for r in records)
    reports = [r for r in records if "router/worst_load_max_over_mean" in r]  # every log interval
    assert [r["step"] for r in reports] == [4, 8, 12] and all(
        r["router/worst_load_max_over_mean"] >= 1.0 for r in reports
    )
    losses = [r["loss"] for r in records]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
    assert "step 12/12 | loss" in result.stdout
    assert "summary steps" in result.stdout and "P95" in result.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    window = [r["ms_per_iter"] for r in records if r["step"] >= summary["window"][0]]
    assert summary["steps"] == len(window) and summary["window"][1] == 12
    assert max(window) >= summary["ms_per_iter_p99"] >= summary["ms_per_iter_p95"] >= min(window)
    assert summary["ms_per_iter_mean"] == pytest.approx(sum(window) / len(window))
    resolved = (tmp_path / "run" / "config.yaml").read_text()
    assert "train_iters: 12" in resolved


# --------------------------------------------------------------------------------------------------------------
# Parity: the same global batches give the same losses whatever the split into ranks x micro x accumulation.
# --------------------------------------------------------------------------------------------------------------
LAYOUTS = {
    "1rank_micro1_acc8": (1, ["training.micro_batch_size=1", "training.gradient_accumulation_steps=8"]),
    "4rank_hsdp2_micro1_acc2": (
        4,
        [
            "training.micro_batch_size=1",
            "training.gradient_accumulation_steps=2",
            "parallel.data_parallel_replicate_size=2",
        ],
    ),
    "1rank_micro2_acc2": (1, ["training.micro_batch_size=2", "training.gradient_accumulation_steps=2"]),
    "2rank_micro2_acc1": (2, ["training.micro_batch_size=2", "training.gradient_accumulation_steps=1"]),
    "1rank_micro1_acc4": (1, ["training.micro_batch_size=1", "training.gradient_accumulation_steps=4"]),
    "4rank_micro1_acc1": (4, ["training.micro_batch_size=1", "training.gradient_accumulation_steps=1"]),
}


@pytest.fixture(scope="module")
def parity_run(tmp_path_factory):
    """(losses, pre-clip grad norms) of one layout; each layout runs once per module."""
    cache: dict[tuple[str, str], tuple[list[float], list[float]]] = {}

    def get(layout: str, loss_type: str) -> tuple[list[float], list[float]]:
        if (layout, loss_type) not in cache:
            nproc, overrides = LAYOUTS[layout]
            out = tmp_path_factory.mktemp(f"{layout}_{loss_type}")
            result = train(out, PARITY + overrides + [f"training.loss_type={loss_type}"], nproc=nproc)
            assert result.returncode == 0, result.stderr[-4000:]
            records = read_metrics(out)
            cache[layout, loss_type] = ([r["loss"] for r in records], [r["grad_norm"] for r in records])
        return cache[layout, loss_type]

    return get


def assert_parity(test: tuple[list[float], list[float]], reference: tuple[list[float], list[float]]) -> None:
    """Losses and pre-clip grad norms agree. The grad norm catches a wrong gradient scale, which clipping and
    Adam would hide from the loss curve."""
    assert reference[0][0] != reference[0][-1]  # the run trains: a parity of constant curves would prove nothing
    assert mean_relative_error(test[0], reference[0]) <= 1e-5
    assert mean_relative_error(test[1], reference[1]) <= 1e-5


@pytest.mark.parametrize(
    "reference, test",
    [
        ("1rank_micro2_acc2", "2rank_micro2_acc1"),
        ("1rank_micro1_acc4", "4rank_micro1_acc1"),
        ("1rank_micro1_acc8", "4rank_hsdp2_micro1_acc2"),
    ],
)
def test_default_loss_parity_across_layouts(parity_run, reference, test):
    assert_parity(parity_run(test, "default"), parity_run(reference, "default"))


@pytest.mark.parametrize("test", ["2rank_micro2_acc1", "1rank_micro1_acc4", "4rank_micro1_acc1"])
def test_per_token_loss_parity_all_layouts(parity_run, test):
    assert_parity(parity_run(test, "per_token"), parity_run("1rank_micro2_acc2", "per_token"))


def test_per_token_differs_from_default_when_lengths_differ(parity_run):
    # The two normalisations weight tokens differently; equal curves would mean the switch does nothing.
    per_token, default = parity_run("1rank_micro2_acc2", "per_token"), parity_run("1rank_micro2_acc2", "default")
    assert mean_relative_error(per_token[0], default[0]) > 1e-5  # above the parity tolerance


# --------------------------------------------------------------------------------------------------------------
# User errors: non-zero exit, a message naming the key, no traceback, nothing written.
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["training.micro_batch_size=0"], "training.micro_batch_size"),
        (["training.gradient_acumulation_steps=2"], "Did you mean 'training.gradient_accumulation_steps'"),
        (["parallel.fsdp_plan.apply_modules=[model.language_model.layerz.{*}]"], "model.language_model.layerz"),
        (["parallel.fsdp_plan.apply_modules=[model.language_model.layers.{*}]"], "does not select ['model.visual']"),
        (["training.tensorboard=true", "training.output_dir=/proc/forbidden"], "training.output_dir"),
        (["model.config_overrides.text_config.hidden_sise=8"], "hidden_size"),
        (["training.device=cuda"], "training.device"),
    ],
)
def test_bad_config_exits_with_named_key(tmp_path, overrides, needle):
    result = train(tmp_path / "run", overrides)
    assert result.returncode == 2
    assert needle in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_start_up_log_names_data_and_threads_and_a_rerun_warns(tmp_path):
    """Started from another directory with the default training.output_dir: the log names where results went."""
    env = {k: v for k, v in clean_env().items() if k != "OMP_NUM_THREADS"}
    command = [sys.executable, "-m", "glm45v_fsdp.train", "training.train_iters=2", "training.progress_bar=false"]
    first = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    output_dir = tmp_path / "output" / "glm45v_tiny"  # the default, relative to the working directory
    assert f"outputs: {output_dir} (config.yaml, metrics.jsonl, summary.json)" in first.stdout
    assert first.stdout.splitlines()[-1].endswith(f"| results in {output_dir}")  # the summary line
    assert "data: built-in synthetic image-text set (data.dataset=synthetic, no file), 256 samples" in first.stdout
    cores = len(os.sched_getaffinity(0))
    assert f"CPU threads: {max(1, cores - 1)} per process ({cores} usable core(s), 1 process(es)" in first.stdout
    assert "| mem off | loss" in first.stdout  # the summary, like the step lines, says memory was not tracked
    assert "holds an earlier run" not in first.stdout + first.stderr
    assert first.stdout.index("[plan moe]") < first.stdout.index("[plan fsdp]")  # the registry's order
    assert (
        first.stdout.count("[plan fsdp]") == 1
        and "[plan fsdp] 5 pattern(s); not sharded: the FSDP mesh" in first.stdout
    )
    assert "experts=grouped_mm" in first.stdout
    router = read_metrics(output_dir)[-1]  # the router figures of the last log interval (model/router_health.py)
    assert router["router/worst_load_max_over_mean"] >= 1.0 and 0.0 <= router["router/dead_fraction"] <= 1.0
    again = train(output_dir, ["training.train_iters=3"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "CPU threads: 1 per process (OMP_NUM_THREADS=1)" in again.stdout
    assert "holds an earlier run (metrics.jsonl of 2 step(s), finished (summary.json present))" in again.stdout
    assert [r["step"] for r in read_metrics(output_dir)] == [1, 2, 3]


@pytest.mark.parametrize("problem", ["missing", "unreadable"])
def test_json_data_errors_come_before_the_model_is_built(tmp_path, problem):
    data = tmp_path / "data.jsonl"
    if problem == "unreadable":
        data.write_bytes(b"\xff\xfe not utf-8")
    result = train(tmp_path / "run", ["data.dataset=json", f"data.data_path={data}"])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert str(data) in result.stderr and "data.data_path" in result.stderr
    assert "[plan fsdp]" not in result.stdout and "Glm4vMoeForTraining:" not in result.stdout


def test_a_config_error_is_printed_once_per_job(tmp_path):
    result = train(tmp_path / "run", ["parallel.data_parallel_replicate_size=3"], nproc=2)
    assert result.returncode != 0
    assert result.stderr.count("glm45v-train: error: Config key 'parallel.data_parallel_replicate_size'") == 1


def test_impossible_layout_fails_before_the_process_group(tmp_path):
    env = clean_env()
    env.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="4",
        LOCAL_WORLD_SIZE="4",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    result = train(tmp_path / "run", ["parallel.data_parallel_replicate_size=3"], env=env)
    assert result.returncode == 2
    assert "parallel.data_parallel_replicate_size" in result.stderr and "Traceback" not in result.stderr


def test_nonfinite_policy_skip_then_stop(tmp_path):
    common = ["training.train_iters=6", "training.lr=1e30", "training.lr_warmup_ratio=0", "training.clip_grad=0"]
    stop = train(tmp_path / "stop", common + ["training.on_nonfinite=stop"])
    assert stop.returncode == 3, stop.stderr[-2000:]
    assert "non-finite" in stop.stderr and "training.on_nonfinite=stop" in stop.stderr
    skip = train(tmp_path / "skip", common + ["training.on_nonfinite=skip", "training.max_skipped_steps=100"])
    assert skip.returncode == 0, skip.stderr[-2000:]
    records = read_metrics(tmp_path / "skip")
    assert records[0]["skipped"] is False
    assert any(r["skipped"] for r in records) and records[-1]["skipped_steps_total"] == sum(
        r["skipped"] for r in records
    )


def test_json_data_with_packing_workers_memory_tensorboard_and_freeze(tmp_path):
    from PIL import Image

    (tmp_path / "imgs").mkdir()
    records = []
    for i in range(6):
        Image.new("RGB", (56 + 14 * (i % 3), 56), (40 * i, 120, 200)).save(tmp_path / "imgs" / f"{i}.png")
        records.append(
            {
                "image": f"imgs/{i}.png",
                "conversations": [
                    {"from": "human", "value": "<image>\nWhat colour is this?"},
                    {"from": "gpt", "value": f"It is colour number {i}."},
                ],
            }
        )
    (tmp_path / "data.json").write_text(json.dumps(records))
    out = tmp_path / "run"
    result = train(
        out,
        [
            "data.dataset=json",
            f"data.data_path={tmp_path / 'data.json'}",
            "data.packing=true",
            "data.num_workers=1",
            "training.train_iters=3",
            "training.track_memory=true",
            "training.tensorboard=true",
            "model.freeze=[model.visual.blocks.{*}]",
        ],
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"data: JSON file '{tmp_path / 'data.json'}' (data.dataset=json), 6 records with 6 image(s)" in result.stdout
    assert "model.visual.blocks.{*}: 2 module(s)" in result.stdout
    assert "frozen 0.00M" not in result.stdout and "memory figure: tracked-tensors" in result.stdout
    records = read_metrics(out)
    assert len(records) == 3 and all(r["mem_peak_max_gib"] > 0 for r in records)
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


def write_mixed_json(folder: Path) -> Path:
    """Records with and without images, alternating, so ranks get micro batches of both kinds at once."""
    from PIL import Image

    records = []
    for i in range(8):
        question = "What colour is this?" if i % 2 else "Say a number."
        record = {"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": f"Number {i}."}]}
        if i % 2:
            Image.new("RGB", (56, 56), (30 * i, 90, 160)).save(folder / f"{i}.png")
            record["image"] = f"{i}.png"
            record["conversations"][0]["value"] = "<image>\n" + question
        records.append(record)
    path = folder / "mixed.json"
    path.write_text(json.dumps(records))
    return path


def test_text_only_and_image_micro_batches_mix_across_ranks_with_and_without_offload(tmp_path):
    """A rank without images still runs the vision tower's collectives; CPU offload changes nothing numerically."""
    data = write_mixed_json(tmp_path)
    common = PARITY[1:4] + [
        "training.train_iters=6",
        "data.dataset=json",
        f"data.data_path={data}",
        "data.shuffle=false",
        "training.micro_batch_size=1",
    ]
    runs = {
        "1rank": (1, ["training.gradient_accumulation_steps=2"]),
        "2rank": (2, []),
        "2rank_offload": (2, ["parallel.fsdp_plan.cpu_offload=true"]),
    }
    curves = {}
    for name, (nproc, extra) in runs.items():
        result = train(tmp_path / name, common + extra, nproc=nproc)
        assert result.returncode == 0, result.stderr[-4000:]
        records = read_metrics(tmp_path / name)
        curves[name] = [r["loss"] for r in records], [r["grad_norm"] for r in records]
    for name in ("2rank", "2rank_offload"):
        for test, reference in zip(curves[name], curves["1rank"]):
            assert sum(abs(t - r) / r for t, r in zip(test, reference)) / len(reference) <= 1e-5, name
