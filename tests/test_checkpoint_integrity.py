"""Checkpoints that cannot lie, saves that survive a full disk: every file kind we write gets a checksum in a manifest
written before the checkpoint is published, and a flipped bit anywhere is found before anything is used; a save
that runs out of space or meets a read-only directory stops with one paragraph and leaves `latest` as it was."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import python, train

from glm45v_fsdp.checkpoint import conversions
from glm45v_fsdp.checkpoint.dcp import check_checkpoint_files
from glm45v_fsdp.checkpoint.deepspeed import locate
from glm45v_fsdp.checkpoint.hf import checkpoint_files
from glm45v_fsdp.checkpoint.integrity import MANIFEST_FILE
from glm45v_fsdp.errors import UserError

OFFSETS = (0.1, 0.5, 0.9)  # where in each file a bit is flipped


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """One 4-step run saving at steps 2 and 4 and exporting HF weights; its DCP checkpoint also converted to
    DeepSpeed's ZeRO-2 layout."""
    root = tmp_path_factory.mktemp("integrity")
    result = train(
        root / "out",
        ["training.train_iters=4", f"training.save={root / 'save'}", "training.save_interval=2",
         f"training.save_hf={root / 'hf'}"],
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    args = argparse.Namespace(checkpoint=str(root / "save"), out=str(root / "ds"), zero_stage=2, world_size=2)
    assert conversions.dcp_to_ds(args) == 0
    return root


def flipped(source: Path, target: Path, name: str, offset: float) -> Path:
    """A copy of directory `source` with one bit of file `name` flipped at `offset` of its length."""
    shutil.copytree(source, target)
    file = target / name
    data = bytearray(file.read_bytes())
    data[min(len(data) - 1, int(len(data) * offset))] ^= 0x10
    file.write_bytes(data)
    return target


def each_line_once(log: str) -> bool:
    """The log's lines without their time stamps are all different (the start-up log printed each line once)."""
    lines = [re.sub(r"^\[\d\d:\d\d:\d\d rank\d+\] ", "", line) for line in log.splitlines() if line.strip()]
    return len(lines) == len(set(lines))


def listed(directory: Path) -> list[str]:
    return sorted(json.loads((directory / MANIFEST_FILE).read_text())["files"])


def test_every_file_kind_has_a_checksum(run):
    assert listed(run / "save" / "step_00000004") == [
        ".metadata", "__0_0.distcp", "rng/rank0.pt", "trainer_state.pt"
    ]  # fmt: skip
    assert {"config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json"} <= set(
        listed(run / "hf")
    )
    tag = locate(run / "ds").tag_dir
    assert {"mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= set(listed(tag))


def test_a_flipped_bit_in_any_dcp_file_is_found_before_loading(run, tmp_path):
    checkpoint = run / "save" / "step_00000004"
    for name in listed(checkpoint):
        for offset in OFFSETS:
            save = tmp_path / f"{name.replace('/', '_')}_{offset}"
            shutil.copytree(run / "save", save)
            flipped(checkpoint, save / "flip", name, offset)
            shutil.rmtree(save / "step_00000004")
            (save / "flip").rename(save / "step_00000004")
            with pytest.raises(UserError) as error:
                check_checkpoint_files(save / "step_00000004")
            message = str(error.value)
            assert f"step_00000004/{name} does not match its checksum" in message, message
            assert f"training.load={save / 'step_00000002'}" in message  # the last intact checkpoint


def test_a_flipped_bit_in_an_hf_export_or_a_deepspeed_checkpoint_is_found(run, tmp_path):
    for name in listed(run / "hf"):
        for offset in OFFSETS:
            damaged = flipped(run / "hf", tmp_path / f"hf_{name}_{offset}", name, offset)
            with pytest.raises(UserError, match=f"{name} does not match its checksum"):
                checkpoint_files(damaged)
    tag = locate(run / "ds").tag_dir
    for name in listed(tag):
        damaged = flipped(run / "ds", tmp_path / f"ds_{name}", f"{tag.name}/{name}", 0.5)
        with pytest.raises(UserError, match=f"{name} does not match its checksum"):
            locate(damaged)


def test_resume_stops_on_a_damaged_file_naming_it_not_the_optimizer(run, tmp_path):
    """The flip of the issue's report: trainer_state.pt's zip header. Before checksums it read as an optimizer
    mismatch; now the run stops before anything is loaded, naming the file and the checkpoint to resume from."""
    save = tmp_path / "save"
    shutil.copytree(run / "save", save)
    state = save / "step_00000004" / "trainer_state.pt"
    data = bytearray(state.read_bytes())
    data[2] ^= 0x01
    state.write_bytes(data)
    result = train(tmp_path / "out", ["training.train_iters=6", f"training.save={save}", "training.resume=auto"])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "trainer_state.pt does not match its checksum" in result.stderr and "optimizer" not in result.stderr
    assert each_line_once(result.stdout + result.stderr)
    assert f"training.load={save / 'step_00000002'}" in result.stderr
    verify = python(["-m", "glm45v_fsdp.tools.convert", "verify", str(save)])
    assert verify.returncode == 1
    assert "step_00000002: intact (4 files" in verify.stdout and "step_00000004: DAMAGED" in verify.stdout
    assert python(["-m", "glm45v_fsdp.tools.convert", "verify", str(run / "hf")]).returncode == 0


def test_a_checkpoint_without_a_manifest_loads_and_says_so(run, tmp_path):
    save = tmp_path / "save"
    shutil.copytree(run / "save", save)
    (save / "step_00000004" / MANIFEST_FILE).unlink()
    result = train(tmp_path / "out", ["training.train_iters=5", f"training.save={save}", "training.resume=auto"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step_00000004: not verified, it has no manifest.json" in result.stdout + result.stderr
    assert each_line_once(result.stdout + result.stderr)


# ---------------------------------------------------------------------------------------------------------------
# Full disk, read-only directory
# ---------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A tmpfs mounted at `path` for the block (the tests run as root, as the multi-host tests do)."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.mark.parametrize(
    "size, async_save, first_good",
    [("1m", False, None), ("10m", False, "step_00000002"), ("10m", True, "step_00000002")],
    ids=["first_save_sync", "second_save_sync", "second_save_async"],
)
def test_a_full_disk_stops_the_run_with_latest_intact(tmp_path, size, async_save, first_good):
    """A checkpoint of the tiny model takes 6.6 MB: a 1 MiB tmpfs fails the first save, a 10 MiB one the second."""
    with tmpfs(tmp_path / "disk", f"size={size}") as disk:
        overrides = ["training.train_iters=6", f"training.save={disk / 'save'}", "training.save_interval=2",
                     f"training.async_save={str(async_save).lower()}"]  # fmt: skip
        result = train(tmp_path / "out", overrides)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
        message = result.stderr
        assert f"could not be written to '{disk / 'save'}' (training.save): no space left (ENOSPC" in message
        assert "bytes free" in message and "was removed" in message
        left = sorted(p.name for p in (disk / "save").iterdir())
        assert not [name for name in left if name.endswith(".tmp")], left
        if first_good is None:
            assert "No checkpoint of this run is complete yet" in message
            assert "latest" not in left
        else:
            assert f"The previous checkpoint {disk / 'save' / first_good} stays `latest`" in message
            assert (disk / "save" / "latest").read_text().strip() == first_good
            assert "the size of step_00000002" in message
            # warned before the save that failed: 10 MiB minus one checkpoint is less than one checkpoint
            assert "less than the last checkpoint (step_00000002" in result.stdout + result.stderr


def test_a_read_only_save_directory_stops_the_run_before_step_one(tmp_path):
    with tmpfs(tmp_path / "ro", "size=1m,ro") as disk:
        result = train(tmp_path / "out", ["training.train_iters=2", f"training.save={disk / 'save'}"])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"'{disk / 'save'}'" in result.stderr and "training.save" in result.stderr


def test_checkpoint_bench_reads_each_save_and_judges_the_share(tmp_path):
    """bench checkpoint: each save's line of rank 0's log -> its checksum share; the median against the 5 % goal."""
    from glm45v_fsdp.bench import checkpoint

    log = "\n".join(
        f"[06:00:0{i} rank0] checkpoint saved: /s/step_0000000{i} ({save} s; checksums of rank 0's 6,615,474 bytes "
        f"{hashed} s)"
        for i, (save, hashed) in enumerate([(1.0, 0.5), (0.2, 0.004), (0.25, 0.02), (0.3, 0.006)], start=1)
    )
    rows = checkpoint.saves(log)
    assert [row["checkpoint"] for row in rows] == [f"step_0000000{i}" for i in range(1, 5)]
    args = argparse.Namespace(warmup=1, argv=["checkpoint"], async_save=False, threads=1)
    result = checkpoint.report(args, rows)
    assert result["checksum_share_pct_median"] == pytest.approx(2.0) and result["pass"]  # 2 %, 8 %, 2 %
    assert result["checksum_gb_per_s"] == pytest.approx(3 * 6_615_474 / 0.03 / 1e9)
    assert not checkpoint.report(argparse.Namespace(**{**vars(args), "warmup": 0}), rows[:2])["pass"]  # 50 %, 2 %


def test_the_engine_door_reports_a_full_disk_in_one_paragraph(tmp_path):
    """deepspeed.initialize(...).save_checkpoint on a 256 KiB tmpfs (its checkpoint takes 586 KB): exit 2, the
    reason, no partial tag directory and no `latest`."""
    from test_safe_load import ENGINE_SCRIPT

    script = tmp_path / "engine_checkpoint.py"
    script.write_text(ENGINE_SCRIPT.format(tests=str(Path(__file__).parent), namespace="1"))
    with tmpfs(tmp_path / "disk", "size=256k") as disk:
        result = python([str(script), "save", str(disk / "ck")])
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert "save_checkpoint(" in result.stderr and "no space left (ENOSPC" in result.stderr
        assert "No checkpoint of this run is complete yet; the partial global_step0 was removed" in result.stderr
        assert sorted(p.name for p in (disk / "ck").iterdir()) == []


def test_write_time_checksums_are_the_read_back_ones(run):
    """The manifests of this run's save, HF export and DeepSpeed conversion, whose checksums were taken as the files
    were written (checkpoint/digest_on_write.py), list the same bytes and digests as reading every file back does
    (as bench checkpoint's read-back row finds too)."""
    from glm45v_fsdp.bench import checkpoint
    from glm45v_fsdp.checkpoint import integrity

    for directory in (run / "save" / "step_00000004", run / "hf", locate(run / "ds").tag_dir):
        files = json.loads((directory / MANIFEST_FILE).read_text())["files"]
        assert files == integrity.checksums(directory, [directory / name for name in files]), directory
    back = checkpoint.read_back(run / "save")
    assert back["checkpoint"] == "step_00000004" and back["same_as_manifest"] and back["bytes"] > 6_000_000


def test_checkpoint_model_matches_the_bytes_on_disk(run):
    """planner/checkpoint_time.py's sizes, from the tiny model's parameter specs (preflight's), against this run's
    1-rank save and HF export on disk: within 1 % (the model leaves out the persistent buffers and the manifest; the
    HF figure is the safetensors files')."""
    from glm45v_fsdp.config import load_config
    from glm45v_fsdp.model import build_meta_model, load_hf_config
    from glm45v_fsdp.planner.checkpoint_time import sizes
    from glm45v_fsdp.preflight import check_plans, planned_params
    from glm45v_fsdp.runtime import build_parallel_dims

    config = load_config(None, [])
    hf_config = load_hf_config(config.model)
    model = build_meta_model(hf_config)
    dims = build_parallel_dims(config.parallel, 1)
    matched, errors = check_plans(model, config, dims, hf_config)
    assert not errors
    planned = planned_params(model, config, dims, matched)
    modelled = sizes(planned.specs, planned.layout, 1)
    checkpoint = run / "save" / "step_00000004"
    on_disk = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file() and f.name != MANIFEST_FILE)
    safetensors = sum(f.stat().st_size for f in (run / "hf").glob("*.safetensors"))
    assert modelled.dcp == pytest.approx(on_disk, rel=0.01), (modelled.dcp, on_disk)
    assert modelled.hf == pytest.approx(safetensors, rel=0.01), (modelled.hf, safetensors)
