"""DeepSpeed checkpoints in both directions (glm45v_fsdp/checkpoint/deepspeed.py and deepspeed_write.py).

The real DeepSpeed trains tests/ds_checkpoint_script.py for 10 steps on 2 gloo ranks and saves at ZeRO 0, 2 and 3,
then resumes itself for 10 more steps: the reference. The same script on `import ds_compat as deepspeed` resumes
those checkpoints on 1, 2 and 4 ranks and must continue with DeepSpeed's losses (mean relative error <= 1e-5), with
the client state round-tripped; our trainer resumes DeepSpeed's checkpoint of transformers' tiny GLM-4.5V. The other
way, `convert dcp-to-ds` turns our checkpoints into DeepSpeed's layout and DeepSpeed resumes them with our losses.
The reader runs without DeepSpeed importable, and a damaged checkpoint is a clear error naming the file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from conftest import REPO, clean_env, python, trainer

from glm45v_fsdp.checkpoint.dcp import read_model_tensors
from glm45v_fsdp.checkpoint.deepspeed import describe, locate, read_deepspeed
from glm45v_fsdp.checkpoint.layout import detect_expert_layout, model_to_hub_tensors
from glm45v_fsdp.errors import UserError

SCRIPT = str(REPO / "tests" / "ds_checkpoint_script.py")
STAGES = ("0", "1", "2", "3")


def run_script(nproc: int, backend: str, phase: str, save_dir: Path, out: Path, *extra: str) -> dict:
    env = {**clean_env(), "DS_ACCELERATOR": "cpu"}
    argv = [SCRIPT, f"--backend={backend}", "--phase", phase, "--save_dir", str(save_dir), *extra, "--out", str(out)]
    result = python(argv, nproc, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds_checkpoints")
    trained = run_script(2, "deepspeed", "train", root / "saves", root / "train.json")
    resumed = run_script(2, "deepspeed", "resume", root / "saves", root / "resume.json")
    return root / "saves", trained, resumed


def mean_rel_err(ours: list[float], reference: list[float]) -> float:
    return sum(abs(a - b) / abs(b) for a, b in zip(ours, reference)) / len(reference)


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_engine_resumes_deepspeed_checkpoints_on_any_world_size(deepspeed_runs, tmp_path, nproc):
    saves, trained, reference = deepspeed_runs
    ours = run_script(nproc, "ds_compat", "resume", saves, tmp_path / "resume.json")
    for stage in STAGES:
        assert reference[stage]["client_state_ok"] and reference[stage]["global_steps_loaded"] == 10
        assert ours[stage]["client_state_ok"], stage
        assert ours[stage]["global_steps_loaded"] == 10, stage
        assert ours[stage]["lr"] == pytest.approx(reference[stage]["lr"]), stage  # the schedule continued
        error = mean_rel_err(ours[stage]["losses"], reference[stage]["losses"])
        assert error <= 1e-5, (stage, nproc, error)
        assert reference[stage]["losses"][0] < trained[stage]["losses"][0]  # it resumed, it did not restart


def test_engine_resumes_deepspeed_bf16_checkpoints(tmp_path):
    """bf16 (DeepSpeed's bf16_zero_pp_rank_* files, a bf16 module, fp32 masters; at ZeRO 0 its unfused wrapper's
    fp32 copies): ZeRO 0-3 on 2 ranks resume with
    DeepSpeed's own resumed losses within bf16's rounding (measured 2e-5 to 5e-5; the two backends cast differently:
    DeepSpeed the whole model, FSDP2 per unit)."""
    bf16 = ("--zero", "0,1,2,3", "--dtype", "bf16")
    run_script(2, "deepspeed", "train", tmp_path / "saves", tmp_path / "train.json", *bf16)
    reference = run_script(2, "deepspeed", "resume", tmp_path / "saves", tmp_path / "ds.json", *bf16)
    ours = run_script(2, "ds_compat", "resume", tmp_path / "saves", tmp_path / "ours.json", *bf16)
    for stage in STAGES:
        assert ours[stage]["client_state_ok"] and ours[stage]["global_steps_loaded"] == 10, stage
        assert ours[stage]["losses"][0] == pytest.approx(reference[stage]["losses"][0], rel=1e-4), stage
        error = mean_rel_err(ours[stage]["losses"], reference[stage]["losses"])
        assert error <= 1e-3, (stage, error)


def test_reader_consolidates_every_stage_alike(deepspeed_runs):
    """ZeRO 2 and 3 partitions give back the model's weights (the module file holds them whole at stage 2) and
    moments of the right shapes; describe() says what wrote the checkpoint."""
    saves, _, _ = deepspeed_runs
    stage2 = read_deepspeed(saves / "zero2")
    module = torch.load(stage2.layout.tag_dir / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert set(stage2.weights) == set(module) and len(stage2.moments) == 29
    assert all(torch.equal(stage2.weights[name], module[name]) for name in module)
    assert all(stage2.moments[n]["exp_avg"].shape == module[n].shape for n in stage2.moments)
    assert stage2.step == 10.0 and stage2.global_steps == 10
    assert stage2.client_state()["note"] == "from the client"
    stage3 = read_deepspeed(saves / "zero3")
    assert set(stage3.weights) == set(module) and stage3.step == 10.0
    assert all(stage3.weights[n].shape == module[n].shape for n in module)
    info = describe(saves / "zero3")
    assert (info["zero_stage"], info["world_size"], info["dtype"], info["global_steps"]) == (3, 2, "float32", 10)
    assert info["parameters"] == 29 and len(info["files"]) == 4
    assert describe(saves / "zero0")["zero_stage"] == 0


def test_a_model_or_optimizer_that_does_not_fit_is_refused(deepspeed_runs):
    """Strict names (with the HF loader's prefix hint) and Adam moments only onto Adam: clear errors, nothing
    loaded."""
    from ds_checkpoint_script import OddLM

    from glm45v_fsdp.checkpoint.deepspeed import load_into

    saves, _, _ = deepspeed_runs
    state = read_deepspeed(saves / "zero2")
    wrapped = torch.nn.Module()
    wrapped.inner = OddLM()
    with pytest.raises(UserError, match="lack the prefix 'inner.'.*Nothing was loaded"):
        load_into(wrapped, None, state)
    model = OddLM()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(UserError, match="optimizer is torch.optim.SGD.*training.no_load_optim=true"):
        load_into(model, torch.optim.SGD(model.parameters(), lr=0.1), state)
    assert any(not torch.equal(before[n], t) for n, t in model.state_dict().items())  # the weights came first
    load_into(model, torch.optim.AdamW(model.parameters()), state)
    assert all(torch.equal(t, state.weights[n]) for n, t in model.state_dict().items())


def test_reader_needs_no_deepspeed(deepspeed_runs):
    saves, _, _ = deepspeed_runs
    code = (
        "import sys; sys.modules['deepspeed'] = None\n"
        "from glm45v_fsdp.checkpoint.deepspeed import read_deepspeed\n"
        f"state = read_deepspeed({str(saves / 'zero3')!r})\n"
        "print(len(state.weights), len(state.moments), state.step)"
    )
    result = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["29", "29", "10.0"]


def test_damaged_checkpoints_are_clear_errors(deepspeed_runs, tmp_path):
    saves, _, _ = deepspeed_runs
    broken = tmp_path / "zero2"
    subprocess.run(["cp", "-r", str(saves / "zero2"), str(broken)], check=True)
    tag = broken / "global_step10"
    optim = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    optim.write_bytes(optim.read_bytes()[:100])  # truncated
    with pytest.raises(UserError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt.*earlier tag"):
        read_deepspeed(broken)
    os.remove(optim)
    with pytest.raises(
        UserError, match=r"written by 2 ranks but lacks \['zero_pp_rank_1_mp_rank_00_optim_states.pt'\]"
    ):
        locate(broken)
    with pytest.raises(UserError, match="is not a DeepSpeed checkpoint"):
        locate(tmp_path)


def test_trainer_resumes_a_deepspeed_run_of_transformers_glm45v(tmp_path, capsys):
    """The real DeepSpeed trains transformers' tiny GLM-4.5V (ZeRO-2, 2 ranks, bench deepspeed's workload) for 4
    steps and saves; our trainer (`--deepspeed` with the same ds_config, training.load = DeepSpeed's save dir) takes
    the next step with the loss DeepSpeed's own resume gets; then the offline conversions of that checkpoint."""
    env = {**clean_env(), "DS_ACCELERATOR": "cpu"}
    worker = ["-m", "glm45v_fsdp.bench.deepspeed_api_worker", "--backend=deepspeed", "--zero=2"]

    def run(argv: list[str], nproc: int) -> None:
        result = python(argv, nproc, env=env, timeout=900)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]

    initial, saves = tmp_path / "initial", tmp_path / "saves"
    run([*worker, f"--save-initial={initial}"], 1)
    run([*worker, "--steps=4", f"--save={saves}", f"--out={tmp_path / 'train.json'}"], 2)
    resume = ["--steps=1", "--first-step=4", f"--resume={saves}", f"--out={tmp_path / 'resume.json'}"]
    run([*worker, *resume], 2)
    reference = json.loads((tmp_path / "resume.json").read_text())["losses"][0]
    overrides = [
        "model.config_overrides.text_config.num_hidden_layers=2",
        "data.synthetic_text_tokens=256",
        "data.synthetic_image_size=112",
        "data.synthetic_images_per_sample=1",
        "data.synthetic_video_every=0",  # the worker's data (bench/deepspeed_api.py workload_overrides)
        "data.synthetic_samples=24",
        "data.shuffle=false",
        "training.train_iters=5",
        f"training.load={saves}",
        f"training.output_dir={tmp_path / 'ours'}",
        "training.lr_scheduler=constant",
        "training.lr_warmup_ratio=0",
    ]
    result = trainer(["--deepspeed", str(initial / "ds_config.json"), *overrides], nproc=2, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "resume: DeepSpeed checkpoint" in result.stdout and "(ZeRO 2, 2 rank(s), global step 4)" in result.stdout
    records = [json.loads(line) for line in (tmp_path / "ours" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [5]
    assert abs(records[0]["loss"] - reference) <= 1e-5 * abs(reference), (records[0]["loss"], reference)
    check_convert(saves, tmp_path, capsys)


def check_convert(saves: Path, tmp_path: Path, capsys) -> None:
    """`convert inspect` describes the DeepSpeed checkpoint; `ds-to-hf` writes weights transformers loads, equal to
    DeepSpeed's fp32 masters; without the right --config the model does not fit and nothing is written."""
    from transformers import Glm4vMoeForConditionalGeneration

    from glm45v_fsdp.tools.convert import main as convert

    assert convert(["inspect", str(saves)]) == 0
    out = capsys.readouterr().out
    assert "ZeRO stage 2, written by 2 rank(s), float32" in out and "global step 4" in out
    assert "expert layout: stacked" in out
    config = tmp_path / "two_layers.yaml"
    config.write_text("model:\n  config_overrides:\n    text_config:\n      num_hidden_layers: 2\n")
    assert convert(["ds-to-hf", str(saves), str(tmp_path / "hf_default")]) == 2
    assert "Pass --config" in capsys.readouterr().err and not (tmp_path / "hf_default").exists()
    assert convert(["ds-to-hf", str(saves), str(tmp_path / "hf"), "--config", str(config)]) == 0
    exported = Glm4vMoeForConditionalGeneration.from_pretrained(tmp_path / "hf").state_dict()
    masters = read_deepspeed(saves, with_optimizer=False).weights
    assert set(exported) == set(masters)
    assert all(torch.equal(exported[name], masters[name]) for name in masters)
    assert convert(["ds-to-dcp", str(saves), str(tmp_path / "dcp"), "--config", str(config)]) == 0
    weights = read_model_tensors(tmp_path / "dcp")
    assert set(weights) == set(masters) and all(torch.equal(weights[n], masters[n]) for n in masters)
    # the same run as transformers 4.x would have saved it (experts per expert): mapped onto the stacked experts
    per_expert = per_expert_copy(saves, tmp_path / "per_expert")
    assert detect_expert_layout(read_deepspeed(per_expert).weights) == "per-expert"
    assert convert(["ds-to-hf", str(per_expert), str(tmp_path / "hf2"), "--config", str(config)]) == 0
    exported = Glm4vMoeForConditionalGeneration.from_pretrained(tmp_path / "hf2").state_dict()
    assert set(exported) == set(masters) and all(torch.equal(exported[n], masters[n]) for n in masters)


def per_expert_copy(saves: Path, out: Path) -> Path:
    """A copy of a stage-2 DeepSpeed checkpoint whose module and param_shapes name the routed experts one by one
    (in the flattening order of the stacked tensors, so the partitions stay valid)."""
    shutil.copytree(saves, out)
    path = locate(out).tag_dir / "mp_rank_00_model_states.pt"
    states = torch.load(path, weights_only=False)

    def split(mapping: dict) -> OrderedDict:
        result = OrderedDict()
        for name, value in mapping.items():
            tensor = value if isinstance(value, torch.Tensor) else torch.empty(value)
            for key, piece in model_to_hub_tensors(name, tensor):
                result[key] = piece.clone() if isinstance(value, torch.Tensor) else piece.shape
        return result

    states["module"] = split(states["module"])
    states["param_shapes"] = [split(group) for group in states["param_shapes"]]
    torch.save(states, path)
    return out


def test_deepspeed_resumes_our_checkpoints(tmp_path):
    """The other direction: the script trains 10 steps on `import ds_compat as deepspeed` and saves (our DCP
    layout); `convert dcp-to-ds` writes DeepSpeed's layout for ZeRO 0, 2 and 3 on 2 ranks; the real DeepSpeed resumes
    it with the losses our own resume gets, and the client state."""
    from glm45v_fsdp.tools.convert import main as convert

    saves, converted = tmp_path / "saves", tmp_path / "converted"
    run_script(2, "ds_compat", "train", saves, tmp_path / "train.json")
    for stage in STAGES:
        arguments = [str(saves / f"zero{stage}"), str(converted / f"zero{stage}")]
        assert convert(["dcp-to-ds", *arguments, "--zero-stage", stage, "--world-size", "2"]) == 0
    ours = run_script(2, "ds_compat", "resume", saves, tmp_path / "ours.json")
    theirs = run_script(2, "deepspeed", "resume", converted, tmp_path / "theirs.json")
    for stage in STAGES:
        assert theirs[stage]["client_state_ok"] and theirs[stage]["global_steps_loaded"] == 10, stage
        assert theirs[stage]["lr"] == pytest.approx(ours[stage]["lr"]), stage
        error = mean_rel_err(theirs[stage]["losses"], ours[stage]["losses"])
        assert error <= 1e-5, (stage, error)
