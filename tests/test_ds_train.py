"""Our trainer behind DeepSpeed's doors: `python -m glm45v_fsdp.train --deepspeed ds_config.json`, run by itself, by
the real `deepspeed` launcher and by `ds-fsdp` (2 CPU ranks, ZeRO 3, bf16, WarmupCosineLR, sequence parallel 2)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PARITY, check_not_crashed, clean_env, free_port, read_metrics, train, trainer

from ds_compat.config import translate

REPO = Path(__file__).resolve().parents[1]
ZERO3_BF16_COSINE_SP2 = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 6, "warmup_num_steps": 2}},
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_prefetch_bucket_size": "auto"},
    "gradient_clipping": 1.0,
    "steps_per_print": 3,
    "sequence_parallel_size": 2,
}


def write_config(tmp_path: Path, config: dict, name: str = "ds_config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


def test_ds_config_drives_batch_optimizer_schedule_and_recompute(tmp_path):
    config = {
        "train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 2e-3, "weight_decay": 0.0, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_type": "linear"}},
        "activation_checkpointing": {"partition_activations": False},
        "gradient_clipping": 0.5,
        "steps_per_print": 2000,  # what HF Trainer ds_configs carry: must not silence our loss lines
    }
    path = write_config(tmp_path, config)
    overrides = ["training.train_iters=5", "training.log_interval=1"]  # steps_per_print no longer takes this key
    result = train(tmp_path / "run", ["--local_rank=0", "--deepspeed", str(path), *overrides])
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path / "run")
    schedule = translate(path, 1).scheduler
    assert [r["lr"] for r in records] == pytest.approx([schedule.lr_at(k) for k in range(5)], rel=1e-12)
    assert {r["global_batch_size"] for r in records} == {4}
    assert "[plan recompute]" in result.stdout and "DeepSpeed config translated" in result.stdout
    assert "schedule WarmupLR (ds_config)" in result.stdout
    assert all(f"step {k}/5 | loss" in result.stdout for k in range(1, 6))
    resolved = (tmp_path / "run" / "config.yaml").read_text()
    assert "micro_batch_size: 2" in resolved and "clip_grad: 0.5" in resolved
    assert json.loads((tmp_path / "run" / "ds_config.json").read_text())["train_batch_size"] == 4


def test_the_door_does_not_change_training(tmp_path):
    """A ds_config saying what our YAML says (AdamW, no scheduler, fp32) trains bit for bit like the plain run."""
    ours = [*PARITY, "training.train_iters=4", "training.lr=2e-3", "training.weight_decay=0.1"]
    plain = train(tmp_path / "plain", ours)
    assert plain.returncode == 0, plain.stderr[-3000:]
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": "auto"}},
        "gradient_clipping": "auto",
    }
    path = write_config(tmp_path, config)
    door = train(tmp_path / "door", ["--deepspeed_config", str(path), *ours])
    assert door.returncode == 0, door.stderr[-3000:]
    assert [r["loss"] for r in read_metrics(tmp_path / "door")] == [r["loss"] for r in read_metrics(tmp_path / "plain")]
    assert [r["lr"] for r in read_metrics(tmp_path / "door")] == [r["lr"] for r in read_metrics(tmp_path / "plain")]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--deepspeed"], "--deepspeed was given without a config file"),
        (["--deepspeed", "A.json", "--deepspeed_config", "B.json"], "Two DeepSpeed configs were given"),
        (["--deepspeed", "{cfg}", "training.micro_batch_size=3"], "micro_batch_size=3 on the command line"),
        (["--deepspeed", "missing.json"], "is neither an existing file nor base64-encoded JSON"),
    ],
)
def test_deepspeed_argument_errors_exit_2_without_traceback(tmp_path, argv, message):
    path = write_config(tmp_path, {"train_micro_batch_size_per_gpu": 2})
    argv = [arg.replace("{cfg}", str(path)) for arg in argv]
    result = trainer([*argv, f"training.output_dir={tmp_path / 'out'}"], timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def launcher_env() -> dict[str, str]:
    env = clean_env()
    env.update(DS_ACCELERATOR="cpu")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def test_real_deepspeed_launcher_and_ds_fsdp_run_the_trainer(tmp_path):
    """Both launchers start the same 2-rank job; same seed and config, so the same losses. The ds_config asks for
    sequence parallelism over both ranks: one data-parallel rank, each sample split by Ulysses CP."""
    pytest.importorskip("deepspeed")
    deepspeed = shutil.which("deepspeed")
    assert deepspeed is not None, "the deepspeed package is installed but its launcher script is not on PATH"
    path = write_config(tmp_path, ZERO3_BF16_COSINE_SP2)
    runs = {}
    for name, launcher in (
        ("deepspeed", [deepspeed]),
        ("ds-fsdp", [sys.executable, "-m", "ds_compat.launcher"]),
    ):
        out = tmp_path / name
        command = [
            *launcher,
            "--num_gpus",
            "2",
            "--master_port",
            str(free_port()),
            "--module",
            "glm45v_fsdp.train",
            "--deepspeed",
            str(path),
            "training.train_iters=6",
            f"training.output_dir={out}",
            "training.progress_bar=false",
        ]
        result = subprocess.run(command, cwd=REPO, env=launcher_env(), capture_output=True, text=True, timeout=600)
        check_not_crashed(result)
        assert result.returncode == 0, (name, result.stdout[-2000:], result.stderr[-3000:])
        runs[name] = read_metrics(out)
        assert [r["step"] for r in runs[name]] == list(range(1, 7))
        assert all(len(r["ms_per_iter_per_rank"]) == 2 for r in runs[name])
        resolved = (out / "config.yaml").read_text()
        assert "param_dtype: bf16" in resolved and "reshard_after_forward: true" in resolved
        assert "ulysses_parallel_size: 2" in resolved
        assert "Ulysses context parallelism over 2 ranks" in result.stdout + result.stderr
    schedule = translate(path, 2).scheduler
    assert [r["lr"] for r in runs["deepspeed"]] == pytest.approx([schedule.lr_at(k) for k in range(6)], rel=1e-12)
    assert [r["loss"] for r in runs["deepspeed"]] == [r["loss"] for r in runs["ds-fsdp"]]
    assert {r["global_batch_size"] for r in runs["deepspeed"]} == {2}  # micro 1 x accumulation 2 x dp 1
