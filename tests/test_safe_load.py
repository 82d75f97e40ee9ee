"""Loading a checkpoint never runs code: a canary pickle (its `__reduce__` would create a file) planted in every file
kind we read, loaded through every entry point, never creates its file; the run exits 2 with one paragraph naming
the file and the global it tried to load, and no traceback. The files we write still load (and bin-to-hf converts a
pickle checkpoint once, weights-only).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import REPO, python, train
from safetensors.torch import load_file
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from glm45v_fsdp.checkpoint.safe_load import UnsafeCheckpointFile, load_pt, metadata_of
from glm45v_fsdp.errors import UserError

STEP = "step_00000002"
CONVERT = ["-m", "glm45v_fsdp.tools.convert"]


class Canary:
    """Unpickling this calls os.system("touch PATH"): the file appears only if a reader runs what a pickle names."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def plant(path: Path, canary: Path, wrap: bool = True) -> None:
    """Replace `path` with a torch.save file (or, wrap=False, a plain pickle) whose only object is a Canary."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if wrap:
        torch.save({"state": Canary(canary)}, path)
    else:
        path.write_bytes(pickle.dumps(Canary(canary)))


def plant_in_bytes_item(checkpoint: Path, canary: Path) -> str:
    """Point one non-tensor DCP value (an optimizer hyper-parameter, a bytes item of the .distcp file) at a canary
    appended to its file; the metadata stays a clean pickle. -> the item's key."""
    metadata = metadata_of(checkpoint)
    key = next(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    index = next(i for i in metadata.storage_data if i.fqn == key)
    info = metadata.storage_data[index]
    blob = pickle.dumps(Canary(canary))
    data_file = checkpoint / info.relative_path
    offset = data_file.stat().st_size
    with data_file.open("ab") as stream:
        stream.write(blob)
    metadata.storage_data[index] = type(info)(info.relative_path, offset, len(blob), info.transform_descriptors)
    metadata.storage_meta = None
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    return key


def assert_refused(result: subprocess.CompletedProcess, canary: Path, *named: str) -> None:
    output = result.stdout + result.stderr
    assert not canary.exists(), "the canary ran: a reader unpickled the planted file"
    assert result.returncode == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert "nothing was executed" in result.stderr and "posix.system" in result.stderr, result.stderr[-2000:]
    for name in named:
        assert name in result.stderr, result.stderr[-2000:]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A 2-step run's DCP checkpoint (ROOT/save) and its final weights as HF safetensors (ROOT/hf)."""
    root = tmp_path_factory.mktemp("safe")
    overrides = ["training.train_iters=2", f"training.save={root / 'save'}", f"training.save_hf={root / 'hf'}"]
    result = train(root / "out", overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    return root


@pytest.fixture
def copy(saved, tmp_path):
    """A fresh copy of the saved checkpoint directory (training.save layout) to plant into, as a checkpoint from
    elsewhere: without our checksum manifests (with one, the checksum names a planted file first:
    tests/test_checkpoint_integrity.py), so the loaders' own defenses meet the planted files."""
    target = tmp_path / "save"
    shutil.copytree(saved / "save", target)
    for manifest in target.rglob("manifest.json"):
        manifest.unlink()
    return target


def test_the_canary_runs_when_unpickled_plainly(tmp_path):
    """The control: what every test below plants does create its file under plain pickle / weights_only=False."""
    canary = tmp_path / "canary"
    plant(tmp_path / "file.pt", canary)
    torch.load(tmp_path / "file.pt", weights_only=False)
    assert canary.exists()


# --------------------------------------------------------------------------------------------------------------
# Our own checkpoints: training.load, training.resume=auto, convert
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [".metadata", "trainer_state.pt", "rng/rank0.pt", "distcp bytes item"])
def test_training_load_refuses_a_planted_file(copy, tmp_path, kind):
    canary = tmp_path / "canary"
    if kind == "distcp bytes item":
        named = plant_in_bytes_item(copy / STEP, canary)
    else:
        plant(copy / STEP / kind, canary, wrap=kind != ".metadata")
        named = kind.split("/")[-1]
    result = train(tmp_path / "out", ["training.train_iters=3", f"training.load={copy}"])
    assert_refused(result, canary, named)


def test_resume_auto_refuses_a_planted_metadata(copy, tmp_path):
    canary = tmp_path / "canary"
    plant(copy / STEP / ".metadata", canary, wrap=False)
    result = train(tmp_path / "out", ["training.train_iters=3", f"training.save={copy}", "training.resume=auto"])
    assert_refused(result, canary, str(copy / STEP / ".metadata"))


@pytest.mark.parametrize("command", ["inspect", "dcp-to-hf"])
def test_convert_refuses_a_planted_metadata(copy, tmp_path, command):
    canary = tmp_path / "canary"
    plant(copy / STEP / ".metadata", canary, wrap=False)
    argv = [command, str(copy / STEP)] + ([str(tmp_path / "hf")] if command == "dcp-to-hf" else [])
    result = python([*CONVERT, *argv])
    assert_refused(result, canary, ".metadata")
    assert not (tmp_path / "hf").exists()


def test_dcp_to_ds_refuses_a_planted_bytes_item(copy, tmp_path):
    """dcp-to-ds reads every value of the checkpoint (dcp-to-hf reads only the model's tensors)."""
    canary = tmp_path / "canary"
    key = plant_in_bytes_item(copy / STEP, canary)
    argv = ["dcp-to-ds", str(copy / STEP), str(tmp_path / "ds"), "--zero-stage", "1", "--world-size", "1"]
    result = python([*CONVERT, *argv])
    assert_refused(result, canary, key)
    assert not (tmp_path / "ds").exists()


def test_the_checkpoints_we_write_load_through_the_safe_readers(saved):
    """Everything a run writes loads under the restricted readers (the resume tests show the figures carry on)."""
    checkpoint = saved / "save" / STEP
    metadata = metadata_of(checkpoint)
    assert any(key.startswith("model.") for key in metadata.state_dict_metadata)
    assert load_pt(checkpoint / "trainer_state.pt")["step"] == 2
    assert {"python", "numpy"} <= load_pt(checkpoint / "rng" / "rank0.pt").keys()
    result = python([*CONVERT, "inspect", str(checkpoint)])
    assert result.returncode == 0, result.stderr[-2000:]


# --------------------------------------------------------------------------------------------------------------
# DeepSpeed checkpoints and the engine's engine_state.pt
# --------------------------------------------------------------------------------------------------------------


def fake_deepspeed(root: Path, canary: Path, planted: str) -> Path:
    """A DeepSpeed save_dir (latest -> global_step1, ZeRO-1 layout of one rank) with a canary in its model or
    optimizer states file."""
    tag = root / "global_step1"
    tag.mkdir(parents=True)
    (root / "latest").write_text("global_step1")
    model = tag / "mp_rank_00_model_states.pt"
    optim = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"module": {}, "dp_world_size": 1, "param_shapes": [{"w": torch.Size([2])}]}, model)
    torch.save({"optimizer_state_dict": {}}, optim)
    plant(model if planted == "model" else optim, canary)
    return root


@pytest.mark.parametrize("planted", ["model", "optimizer"])
def test_deepspeed_checkpoints_refuse_a_planted_file(tmp_path, planted):
    canary = tmp_path / "canary"
    source = fake_deepspeed(tmp_path / "ds", canary, planted)
    named = "mp_rank_00_model_states.pt" if planted == "model" else "optim_states.pt"
    result = python([*CONVERT, "ds-to-hf", str(source), str(tmp_path / "hf")])
    assert_refused(result, canary, named)
    result = train(tmp_path / "out", ["training.train_iters=3", f"training.load={source}"])
    assert_refused(result, canary, named)


ENGINE_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import ds_compat as deepspeed
    from ds_api_script import TinyLM, ds_config

    phase, save_dir = sys.argv[1], sys.argv[2]
    model = TinyLM()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(1, 1, 2))
    if phase == "save":
        engine.save_checkpoint(save_dir, client_state={{"args": {namespace}, "note": "plain"}})
    elif phase == "save-object":
        engine.save_checkpoint(save_dir, client_state={{"sampler": object()}})
    else:
        path, client_state = engine.load_checkpoint(save_dir)
        print("loaded", path, client_state["note"], client_state["args"].lr)
    """
)


@pytest.fixture(scope="module")
def engine_script(tmp_path_factory) -> Path:
    script = tmp_path_factory.mktemp("engine") / "engine_checkpoint.py"
    namespace = "__import__('argparse').Namespace(lr=0.5)"
    script.write_text(ENGINE_SCRIPT.format(tests=str(REPO / "tests"), namespace=namespace))
    return script


def test_engine_checkpoint_round_trips_weights_only_and_refuses_a_planted_engine_state(engine_script, tmp_path):
    save_dir = tmp_path / "engine"
    result = python([str(engine_script), "save", str(save_dir)])
    assert result.returncode == 0, result.stderr[-3000:]
    state_file = save_dir / "global_step0" / "engine_state.pt"
    assert isinstance(load_pt(state_file)["client_state"]["args"], argparse.Namespace)  # plain: loads weights-only
    result = python([str(engine_script), "load", str(save_dir)])
    assert result.returncode == 0 and "loaded" in result.stdout and "plain 0.5" in result.stdout, result.stderr[-3000:]

    canary = tmp_path / "canary"
    plant(state_file, canary)
    # the engine's checkpoint carries checksums: the planted file is named by its checksum before anything is read
    result = python([str(engine_script), "load", str(save_dir)])
    assert result.returncode == 2 and "engine_state.pt has" in result.stderr and "the manifest says" in result.stderr
    assert not canary.exists() and result.stdout.count("loaded") == 0
    # as a checkpoint from elsewhere (no manifest), the weights-only load refuses it
    (save_dir / "global_step0" / "manifest.json").unlink()
    result = python([str(engine_script), "load", str(save_dir)])
    assert result.stdout.count("loaded") == 0
    assert_refused(result, canary, "engine_state.pt")
    assert result.stderr.startswith("ds_compat: error: ") or "\nds_compat: error: " in result.stderr


def test_engine_refuses_a_client_state_that_would_not_load_before_writing(engine_script, tmp_path):
    save_dir = tmp_path / "engine"
    result = python([str(engine_script), "save-object", str(save_dir)])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "builtins.object" in result.stderr and "Nothing was written" in result.stderr
    assert not (save_dir / "global_step0").exists()


# --------------------------------------------------------------------------------------------------------------
# Batch dumps and Hugging Face directories
# --------------------------------------------------------------------------------------------------------------


def test_compare_batches_refuses_a_planted_dump(tmp_path):
    canary = tmp_path / "canary"
    good = {"input_ids": torch.arange(6).reshape(1, 6)}
    for side in ("a", "b"):
        (tmp_path / side).mkdir()
        torch.save(good, tmp_path / side / "rank0_step1.pt")
    plant(tmp_path / "b" / "rank0_step1.pt", canary)
    result = python(["-m", "glm45v_fsdp.tools.compare-batches", str(tmp_path / "a"), str(tmp_path / "b")])
    assert_refused(result, canary, "rank0_step1.pt")


def pickle_hf(saved: Path, target: Path) -> dict[str, torch.Tensor]:
    """The run's HF export with its safetensors replaced by one pytorch_model.bin (as older HF checkpoints hold)."""
    shutil.copytree(saved / "hf", target)
    weights: dict[str, torch.Tensor] = {}
    for path in target.glob("*.safetensors"):
        weights.update(load_file(path))
        path.unlink()
    (target / "model.safetensors.index.json").unlink()
    (target / "manifest.json").unlink()  # an older HF checkpoint carries no manifest of ours
    torch.save(weights, target / "pytorch_model.bin")
    return weights


def test_hf_pickle_weights_are_refused_with_the_conversion_and_bin_to_hf_converts_them(saved, tmp_path):
    weights = pickle_hf(saved, tmp_path / "bin")
    result = train(tmp_path / "out", ["training.train_iters=1", f"training.load={tmp_path / 'bin'}"])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "pytorch_model.bin" in result.stderr and "bin-to-hf" in result.stderr
    result = train(tmp_path / "out", ["training.train_iters=1", f"model.name_or_path={tmp_path / 'bin'}"])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "'model.name_or_path'" in result.stderr and "bin-to-hf" in result.stderr

    result = python([*CONVERT, "bin-to-hf", str(tmp_path / "bin"), str(tmp_path / "converted")])
    assert result.returncode == 0, result.stderr[-3000:]
    converted = load_file(tmp_path / "converted" / "model.safetensors")
    assert converted.keys() == weights.keys()
    assert all(torch.equal(converted[key], weights[key]) for key in weights)
    assert (tmp_path / "converted" / "config.json").is_file() and not (
        tmp_path / "converted" / "pytorch_model.bin"
    ).exists()
    result = train(tmp_path / "out2", ["training.train_iters=1", f"training.load={tmp_path / 'converted'}"])
    assert result.returncode == 0, result.stderr[-3000:]


def test_bin_to_hf_refuses_a_planted_bin(saved, tmp_path):
    pickle_hf(saved, tmp_path / "bin")
    canary = tmp_path / "canary"
    plant(tmp_path / "bin" / "pytorch_model.bin", canary)
    result = python([*CONVERT, "bin-to-hf", str(tmp_path / "bin"), str(tmp_path / "converted")])
    assert_refused(result, canary, "pytorch_model.bin")
    assert not (tmp_path / "converted").exists()


def test_remote_code_in_config_json_is_ignored_and_logged(saved, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(saved / "hf", model_dir)
    (model_dir / "manifest.json").unlink()  # a hub directory: no manifest of ours
    config = json.loads((model_dir / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "modeling_evil.EvilModel"}
    (model_dir / "config.json").write_text(json.dumps(config))
    canary = tmp_path / "canary"
    (model_dir / "modeling_evil.py").write_text(f"open({str(canary)!r}, 'w').close()\nclass EvilModel: pass\n")
    result = train(tmp_path / "out", ["training.train_iters=1", f"model.name_or_path={model_dir}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert not canary.exists()
    assert (
        "names remote code (auto_map" in result.stdout + result.stderr
        and "it is ignored" in result.stdout + result.stderr
    )


# --------------------------------------------------------------------------------------------------------------
# The readers themselves
# --------------------------------------------------------------------------------------------------------------


def test_load_pt_names_the_global_and_tells_a_damaged_file_apart(tmp_path):
    canary = tmp_path / "canary"
    plant(tmp_path / "evil.pt", canary)
    with pytest.raises(UnsafeCheckpointFile, match=r"evil\.pt.*the global posix\.system"):
        load_pt(tmp_path / "evil.pt")
    assert isinstance(UnsafeCheckpointFile("x"), UserError)
    # torch's legacy (pre-zip) format holds several pickles: the one naming the global is found after the header's
    torch.save({"state": Canary(canary)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(UnsafeCheckpointFile, match=r"legacy\.pt.*the global posix\.system"):
        load_pt(tmp_path / "legacy.pt")
    (tmp_path / "damaged.pt").write_bytes(b"\x80\x02 not a pickle")
    with pytest.raises(pickle.UnpicklingError):
        load_pt(tmp_path / "damaged.pt")
    assert not canary.exists()
