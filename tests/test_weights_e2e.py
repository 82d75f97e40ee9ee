"""HF weights through the real training entry point: load, batch dump vs transformers' loss, strictness, export,
and the weights-only DCP start that `tools.convert hf-to-dcp` writes."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from conftest import read_metrics, train
from safetensors.torch import load_file, save_file
from transformers import Glm4vMoeForConditionalGeneration

from glm45v_fsdp.config import ModelConfig
from glm45v_fsdp.model import load_hf_config
from glm45v_fsdp.tools import convert

REPO = Path(__file__).resolve().parents[1]
FP32_ONE_MICRO_BATCH = [
    "parallel.fsdp_plan.param_dtype=fp32",
    "parallel.fsdp_plan.reduce_dtype=fp32",
    "training.micro_batch_size=2",
    "training.gradient_accumulation_steps=1",
    "training.dump_batches=1",
    "data.synthetic_video_every=0",  # transformers' forward takes the dump: it cannot take images and videos together
]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """transformers' own tiny GLM-4.5V, seeded, written by save_pretrained (sharded, with an index)."""
    torch.manual_seed(3)
    model = Glm4vMoeForConditionalGeneration(load_hf_config(ModelConfig()))
    out = tmp_path_factory.mktemp("hf")
    model.save_pretrained(out, max_shard_size="300KB")
    assert (out / "model.safetensors.index.json").is_file()
    return out


def transformers_loss(model_dir: Path, batch_file: Path) -> float:
    model = Glm4vMoeForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    batch = torch.load(batch_file, weights_only=True)
    with torch.no_grad():
        return float(model(**batch, use_cache=False).loss)


def step_one_loss(out: Path) -> float:
    return read_metrics(out)[0]["loss"]


def test_hf_load_matches_transformers_on_the_dumped_batch(tmp_path, hf_dir):
    """The checkpoint also carries an MTP layer past the last decoder layer: skipped (as transformers skips one at
    46), and the log says so."""
    with_mtp = tmp_path / "with_mtp"
    shutil.copytree(hf_dir, with_mtp)
    mtp = {f"model.language_model.layers.4.{name}.weight": torch.zeros(64) for name in ("enorm", "hnorm")}
    save_file(mtp, with_mtp / "mtp.safetensors", metadata={"format": "pt"})
    index = json.loads((with_mtp / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(mtp, "mtp.safetensors"))
    (with_mtp / "model.safetensors.index.json").write_text(json.dumps(index))
    out = tmp_path / "run"
    result = train(out, FP32_ONE_MICRO_BATCH + ["training.train_iters=1", f"training.load={with_mtp}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"weights: loaded from HF checkpoint {with_mtp}" in result.stdout
    assert "weights: 2 checkpoint tensor(s) skipped" in result.stdout
    assert "model.language_model.layers.4.* (2 tensors)" in result.stdout
    assert "initialised from scratch" not in result.stdout
    reference = transformers_loss(hf_dir, out / "batches" / "rank0_micro0.pt")
    assert abs(step_one_loss(out) - reference) <= 1e-6 * reference


def test_a_missing_key_stops_the_run_before_step_one(tmp_path, hf_dir):
    broken = tmp_path / "broken"
    broken.mkdir()
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    victim = "model.language_model.layers.1.mlp.experts.3.down_proj.weight"
    for name in {*index["weight_map"].values(), "model.safetensors.index.json", "config.json"}:
        (broken / name).write_bytes((hf_dir / name).read_bytes())
    shard = broken / index["weight_map"][victim]
    tensors = load_file(shard)
    del tensors[victim]
    save_file(tensors, shard, metadata={"format": "pt"})
    out = tmp_path / "run"
    result = train(out, FP32_ONE_MICRO_BATCH + ["training.train_iters=1", f"training.load={broken}"])
    assert result.returncode == 2
    assert victim in result.stderr and "Traceback" not in result.stderr
    assert not (out / "metrics.jsonl").exists()


def test_export_loads_in_transformers_and_weights_only_dcp_starts_the_same(tmp_path, hf_dir):
    trained, exported = tmp_path / "trained", tmp_path / "exported"
    result = train(trained, FP32_ONE_MICRO_BATCH + ["training.train_iters=2", f"training.save_hf={exported}"])
    assert result.returncode == 0, result.stderr[-3000:]
    _, info = Glm4vMoeForConditionalGeneration.from_pretrained(exported, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    umask = os.umask(0)
    os.umask(umask)
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in exported.iterdir()}
    assert set(modes.values()) == {0o666 & ~umask}, modes  # safetensors alone writes 0600: unreadable when shared

    # Start from the export: our step-1 loss equals transformers' on the same batch.
    from_export = tmp_path / "from_export"
    result = train(from_export, FP32_ONE_MICRO_BATCH + ["training.train_iters=1", f"training.load={exported}"])
    assert result.returncode == 0, result.stderr[-3000:]
    reference = transformers_loss(exported, from_export / "batches" / "rank0_micro0.pt")
    assert abs(step_one_loss(from_export) - reference) <= 1e-6 * reference

    # model.name_or_path alone (config, tokenizer, processor and safetensors there; training.load unset): its
    # weights are the start, not a random initialisation.
    from_model_dir = tmp_path / "from_model_dir"
    result = train(from_model_dir, FP32_ONE_MICRO_BATCH + ["training.train_iters=1", f"model.name_or_path={exported}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"training.load={exported}" in result.stdout and "initialised from scratch" not in result.stdout
    assert step_one_loss(from_model_dir) == pytest.approx(step_one_loss(from_export), rel=1e-6)

    # hf-to-dcp, then start from the DCP copy: same step-1 loss as from the HF directory.
    dcp_dir = tmp_path / "dcp"
    assert convert.main(["hf-to-dcp", str(exported), str(dcp_dir)]) == 0  # in process, as test_hf_weights runs it
    from_dcp = tmp_path / "from_dcp"
    result = train(from_dcp, FP32_ONE_MICRO_BATCH + ["training.train_iters=1", f"training.load={dcp_dir}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "weights-only DCP checkpoint" in result.stdout
    assert step_one_loss(from_dcp) == pytest.approx(step_one_loss(from_export), rel=1e-6)
