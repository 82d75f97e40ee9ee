"""DCP checkpoints: exact resume (1 and 2 ranks), resharding (2 -> 1 and 4 ranks), dropped optimizer / RNG state,
keep-last, unfinished saves and `latest`, background saves, HF weights at build time, and the path errors.

Runs are real processes (`python -m glm45v_fsdp.train`, torchrun over gloo) in fp32 on the synthetic data; each run
happens once per module and the tests compare their metrics.jsonl.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import python, train, train_many
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from glm45v_fsdp.checkpoint.dcp import TMP_SUFFIX, check_save_targets, find_checkpoint, resolve_load
from glm45v_fsdp.checkpoint.state import capture_rng, restore_rng, rng_file
from glm45v_fsdp.config import TrainingConfig
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.runtime import select_device

REPO = Path(__file__).resolve().parents[1]
BASE = [
    "training.train_iters=12",
    "training.log_interval=12",
    "training.progress_bar=false",
    "parallel.fsdp_plan.param_dtype=fp32",
    "parallel.fsdp_plan.reduce_dtype=fp32",
]
# Global batch 4 on 1, 2 and 4 ranks, one sample per micro batch: the "default" loss is then the same function of
# the global batch on every layout, so a resharded resume must continue the 2-rank curve.
LAYOUT = {
    1: ["training.micro_batch_size=1", "training.gradient_accumulation_steps=4"],
    2: ["training.micro_batch_size=1", "training.gradient_accumulation_steps=2"],
    4: ["training.micro_batch_size=1", "training.gradient_accumulation_steps=1"],
}
STEP6 = "step_00000006"


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def relative_errors(test: list[float], reference: list[float]) -> list[float]:
    assert len(test) == len(reference)
    return [abs(t - r) / (abs(r) + 1e-8) for t, r in zip(test, reference)]


def curve(records: list[dict], key: str, first: int = 7) -> list[float]:
    return [r[key] for r in records if r["step"] >= first]


class Run:
    def __init__(self, result: subprocess.CompletedProcess, output_dir: Path) -> None:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
        self.stdout = result.stdout
        self.output_dir = output_dir
        self.records = read_metrics(output_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> Run; each named run happens once per module. ROOT in an override is the module's directory."""
    root = tmp_path_factory.mktemp("ckpt")
    cache: dict[str, Run] = {}

    def get(name: str, nproc: int, overrides: list[str], output: str | None = None) -> Run:
        if name not in cache:
            output_dir = root / (output or name)
            resolved = [o.replace("ROOT", str(root)) for o in overrides]
            cache[name] = Run(train(output_dir, BASE + LAYOUT[nproc] + resolved, nproc), output_dir)
        return cache[name]

    get.root = root
    return get


def straight(runs, nproc: int) -> Run:
    """12 steps with a checkpoint at step 6 (and 12) into ROOT/save{nproc}; the final weights also go to
    ROOT/hf{nproc} as HF safetensors."""
    saves = [f"training.save=ROOT/save{nproc}", "training.save_interval=6", f"training.save_hf=ROOT/hf{nproc}"]
    return runs(f"straight{nproc}", nproc, saves)


# --------------------------------------------------------------------------------------------------------------
# Exact resume and resharding
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nproc", [1, 2])
def test_resume_continues_exactly(runs, nproc):
    reference = straight(runs, nproc)
    before = list(reference.records)
    # Same output_dir: metrics.jsonl keeps steps 1-6 of the first run and continues at 7.
    resumed = runs(f"resume{nproc}", nproc, [f"training.load=ROOT/save{nproc}/{STEP6}"], output=f"straight{nproc}")
    assert f"resumed from DCP checkpoint {runs.root}/save{nproc}/{STEP6}: step 6" in resumed.stdout
    assert [r["step"] for r in resumed.records] == list(range(1, 13))
    assert resumed.records[:6] == before[:6]
    assert len({round(r["loss"], 4) for r in before}) > 6  # the run trains: equal constant curves prove nothing
    for key in ("loss", "grad_norm", "lr"):
        assert max(relative_errors(curve(resumed.records, key), curve(before, key))) <= 1e-6, key


@pytest.mark.parametrize("nproc", [1, 4])
def test_two_rank_checkpoint_resumes_on_other_world_sizes(runs, nproc):
    reference = straight(runs, 2)
    resumed = runs(f"reshard{nproc}", nproc, [f"training.load=ROOT/save2/{STEP6}"])
    assert [r["step"] for r in resumed.records] == list(range(7, 13))
    assert "the checkpoint was saved by 2 rank(s), this run has" in resumed.stdout
    if nproc == 4:  # ranks 2 and 3 have no saved RNG state: one warning each, and the run goes on
        assert resumed.stdout.count("does not exist (the checkpoint was saved by fewer ranks)") == 2
    for key in ("loss", "grad_norm"):
        errors = relative_errors(curve(resumed.records, key), curve(reference.records, key))
        assert sum(errors) / len(errors) <= 1e-5, key


EP2 = "parallel.expert_parallel_size=2"


@pytest.fixture(scope="module")
def ep_resumes(runs) -> dict[str, tuple[list[dict], list[dict], str]]:
    """Resumes at another EP size and world size: name -> (resumed records, the saving run's records, log). The two
    4-rank resumes share one torchrun job."""
    ep1, ep2 = straight(runs, 2), straight_ep2(runs)
    load = f"training.load={runs.root}/{{}}/{STEP6}"
    four = train_many(
        runs.root / "ep_resumes",
        {
            "ep1_to_ep4": [*BASE, *LAYOUT[4], load.format("save2"), "parallel.expert_parallel_size=4"],
            "ep2_to_ep4": [*BASE, *LAYOUT[4], load.format("save2ep"), "parallel.expert_parallel_size=4"],
        },
        4,
    )
    one = runs("ep2_to_ep1", 1, [load.format("save2ep")])
    return {
        "ep2_to_ep1": (one.records, ep2.records, one.stdout),
        "ep1_to_ep4": (four["ep1_to_ep4"][1], ep1.records, four["ep1_to_ep4"][0]),
        "ep2_to_ep4": (four["ep2_to_ep4"][1], ep2.records, four["ep2_to_ep4"][0]),
    }


@pytest.mark.parametrize("name", ["ep2_to_ep1", "ep1_to_ep4", "ep2_to_ep4"])
def test_expert_parallel_checkpoints_resume_at_another_ep_size(ep_resumes, name):
    """DCP holds the experts EP-sharded under their global shapes, so a checkpoint of one EP size (and world size)
    resumes at another: the next step's loss and the rest of the curve follow the run that saved it."""
    resumed, saved, log = ep_resumes[name]
    assert [r["step"] for r in resumed] == list(range(7, 13))
    assert ("[plan expert_parallel]" in log) == name.endswith("ep4")
    for key in ("loss", "grad_norm"):
        errors = relative_errors(curve(resumed, key), curve(saved, key))
        assert errors[0] <= 1e-6 and sum(errors) / len(errors) <= 1e-5, (key, errors)


def straight_ep2(runs) -> Run:
    """straight(runs, 2) under EP2: checkpoints at steps 6 and 12 into ROOT/save2ep, HF export into ROOT/hf2ep."""
    saves = ["training.save=ROOT/save2ep", "training.save_interval=6", "training.save_hf=ROOT/hf2ep", EP2]
    return runs("straight2ep", 2, saves)


def test_expert_parallel_saves_global_expert_tensors_and_exports_unchanged(runs, tmp_path):
    ep1, ep2 = straight(runs, 2), straight_ep2(runs)
    for key in ("loss", "grad_norm"):
        assert sum(relative_errors(curve(ep2.records, key, 1), curve(ep1.records, key, 1))) / 12 <= 1e-5, key
    step12 = "step_00000012"
    tensors = {
        tag: _dcp_tensors(runs.root / save / step12, tmp_path / f"{tag}.pt")
        for tag, save in (("ep1", "save2"), ("ep2", "save2ep"))
    }
    assert tensors["ep1"].keys() == tensors["ep2"].keys()
    experts = [k for k in tensors["ep2"] if k.endswith("mlp.experts.gate_up_proj")]
    assert experts and all(tensors["ep2"][k].shape == tensors["ep1"][k].shape for k in tensors["ep1"])
    converted = tmp_path / "converted"
    result = python(
        ["-m", "glm45v_fsdp.tools.convert", "dcp-to-hf", str(runs.root / "save2ep" / step12), str(converted)],
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    exported = {k: v for f in sorted((runs.root / "hf2ep").glob("*.safetensors")) for k, v in load_file(f).items()}
    offline = {k: v for f in sorted(converted.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert exported.keys() == offline.keys() and all(torch.equal(exported[k], offline[k]) for k in exported)


def test_no_load_optim_and_no_load_rng(runs):
    reference = straight(runs, 1)
    resumed = runs(
        "fresh_optim",
        1,
        [f"training.load=ROOT/save1/{STEP6}", "training.no_load_optim=true", "training.no_load_rng=true"],
    )
    assert "optimizer not restored (training.no_load_optim=true)" in resumed.stdout
    assert "rng not restored (training.no_load_rng=true)" in resumed.stdout
    errors = relative_errors(curve(resumed.records, "loss"), curve(reference.records, "loss"))
    assert errors[0] <= 1e-6  # step 7 runs on the restored weights, before the optimizer takes a step
    assert min(errors[1:]) > 1e-5  # then fresh Adam moments change every step
    assert curve(resumed.records, "lr") == curve(reference.records, "lr")  # the scheduler is still restored


def test_async_save_writes_the_same_checkpoint(runs):
    reference = straight(runs, 2)
    saves = ["training.save=ROOT/async2", "training.save_interval=6", "training.async_save=true"]
    background = runs("async2", 2, saves)
    assert "writing in the background; step loop blocked" in background.stdout
    assert [r["loss"] for r in background.records] == [r["loss"] for r in reference.records]
    for step in (STEP6, "step_00000012"):
        sync, bg = runs.root / "save2" / step, runs.root / "async2" / step
        tensors = [_dcp_tensors(path, runs.root / f"{path.parent.name}_{step}.pt") for path in (sync, bg)]
        assert tensors[0].keys() == tensors[1].keys() and any(k.startswith("optim.") for k in tensors[0])
        assert all(torch.equal(tensors[0][k], tensors[1][k]) for k in tensors[0])
        states = [torch.load(path / "trainer_state.pt", weights_only=True) for path in (sync, bg)]
        assert {k: v for k, v in states[0].items() if k != "config"} == {
            k: v for k, v in states[1].items() if k != "config"
        }
        assert sorted(p.name for p in (bg / "rng").iterdir()) == ["rank0.pt", "rank1.pt"]
    resumed = runs("resume_async2", 2, [f"training.load=ROOT/async2/{STEP6}"])
    assert max(relative_errors(curve(resumed.records, "loss"), curve(reference.records, "loss"))) <= 1e-6


def _dcp_tensors(checkpoint: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, flattened to dotted keys."""
    dcp_to_torch_save(checkpoint, scratch)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, torch.Tensor):
            flat[prefix] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)

    walk("", torch.load(scratch, weights_only=False))
    return flat


# --------------------------------------------------------------------------------------------------------------
# Save directory: keep-last, unfinished saves, latest
# --------------------------------------------------------------------------------------------------------------


def _interrupted_save(save_dir: Path, step: int) -> Path:
    """A `.tmp` directory with junk where a save died half-way (even its metadata looks present)."""
    tmp = save_dir / f"step_{step:08d}{TMP_SUFFIX}"
    (tmp / "rng").mkdir(parents=True)
    for name in (".metadata", "trainer_state.pt", "__0_0.distcp"):
        (tmp / name).write_bytes(b"junk from an interrupted save")
    return tmp


def _listing(save_dir: Path) -> list[str]:
    return sorted(path.name for path in save_dir.iterdir())


def test_keep_last_unfinished_saves_and_latest(tmp_path):
    save = tmp_path / "save"
    common = ["training.progress_bar=false", f"training.save={save}", "training.save_keep_last=2"]
    junk = _interrupted_save(save, 9)
    first = train(tmp_path / "out", [*common, "training.train_iters=4", "training.save_interval=1"])
    assert first.returncode == 0, first.stderr[-4000:]
    assert _listing(save) == ["latest", "step_00000003", "step_00000004"]  # the junk went with the first save
    assert (save / "latest").read_text().strip() == "step_00000004"

    junk = _interrupted_save(save, 9)
    (save / "latest").unlink()  # resume must then pick the highest complete step on its own
    second = train(tmp_path / "out", [*common, "training.train_iters=5", f"training.load={save}"])
    assert second.returncode == 0, second.stderr[-4000:]
    assert f"resumed from DCP checkpoint {save}/step_00000004: step 4" in second.stdout
    assert not junk.exists()
    assert _listing(save) == ["latest", "step_00000004", "step_00000005"]
    assert (save / "latest").read_text().strip() == "step_00000005"
    assert [r["step"] for r in read_metrics(tmp_path / "out")] == [1, 2, 3, 4, 5]


def _fake_checkpoint(save_dir: Path, step: int) -> Path:
    """A small but intact checkpoint (find_checkpoint checks the files of the one it picks)."""
    import torch.distributed.checkpoint as dcp

    path = save_dir / f"step_{step:08d}"
    path.mkdir(parents=True)
    dcp.save({"x": torch.zeros(2)}, checkpoint_id=path, no_dist=True)
    torch.save({"step": step}, path / "trainer_state.pt")
    return path


def test_find_checkpoint_prefers_latest_then_highest_complete_step(tmp_path):
    old, new = _fake_checkpoint(tmp_path, 8), _fake_checkpoint(tmp_path, 12)
    _interrupted_save(tmp_path, 20)
    (tmp_path / "step_00000030").mkdir()  # no metadata: incomplete
    assert find_checkpoint(tmp_path) == new
    (tmp_path / "latest").write_text("step_00000008\n")  # a run resumed from step 8 into this directory
    assert find_checkpoint(tmp_path) == old
    (tmp_path / "latest").write_text("step_00000020.tmp\n")
    assert find_checkpoint(tmp_path) == new
    assert find_checkpoint(old) == old
    only_tmp = tmp_path / "only_tmp"
    _interrupted_save(only_tmp, 20)
    with pytest.raises(UserError, match=r"^checkpoint = '.*only_tmp'.*only unfinished saves \(step_00000020\.tmp\)"):
        find_checkpoint(only_tmp, "checkpoint")


# --------------------------------------------------------------------------------------------------------------
# RNG state
# --------------------------------------------------------------------------------------------------------------


def _draw() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_rng_states_round_trip_and_a_missing_rank_keeps_its_state(tmp_path):
    device = select_device("cpu")
    rng_file(tmp_path, 0).parent.mkdir()
    torch.save(capture_rng(device), rng_file(tmp_path, 0))
    expected = _draw()
    assert restore_rng(tmp_path, 0, device)
    assert _draw() == expected
    python_state, torch_state = random.getstate(), torch.get_rng_state()
    assert not restore_rng(tmp_path, 1, device)  # no rng/rank1.pt: warns, changes nothing
    assert random.getstate() == python_state and torch.equal(torch.get_rng_state(), torch_state)


# --------------------------------------------------------------------------------------------------------------
# HF weights at build time, and the errors
# --------------------------------------------------------------------------------------------------------------


def test_save_hf_exports_weights_that_load_at_build_time(runs, tmp_path):
    reference = straight(runs, 1)
    assert f"exported the final weights as HF safetensors to {runs.root}/hf1" in reference.stdout
    result = train(tmp_path / "out", [*BASE, *LAYOUT[1], "training.train_iters=1", f"training.load={runs.root}/hf1"])
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"weights: loaded from HF checkpoint {runs.root}/hf1" in result.stdout
    assert "initialised from scratch" not in result.stdout
    # Step 1 sees the first batch again, now with the trained weights.
    assert read_metrics(tmp_path / "out")[0]["loss"] < reference.records[0]["loss"] - 0.3


@pytest.mark.parametrize("case", ["missing", "empty"])
def test_load_path_errors_exit_2_naming_the_key(tmp_path, case):
    (tmp_path / "empty").mkdir()
    result = train(tmp_path / "out", [f"training.load={tmp_path / case}", "training.load_format=dcp"])
    assert result.returncode == 2, result.stderr[-4000:]
    problem = "does not exist" if case == "missing" else "holds no complete DCP checkpoint"
    assert f"error: Config key 'training.load' = '{tmp_path / case}' {problem}" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()  # stopped before the runtime and the trainer


def test_load_and_save_paths_are_checked_before_any_collective(tmp_path):
    _interrupted_save(tmp_path / "only_tmp", 9)
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(UserError, match=r"'training\.load' = '.*only_tmp'.*only unfinished saves \(step_00000009"):
        resolve_load(TrainingConfig(load=str(tmp_path / "only_tmp")))
    with pytest.raises(UserError, match=r"'training\.save' = '.*file' is an existing file"):
        check_save_targets(TrainingConfig(save=str(tmp_path / "file")))
    with pytest.raises(UserError, match=r"'training\.save_hf' = '.*file' is an existing file"):
        check_save_targets(TrainingConfig(save_hf=str(tmp_path / "file")))
    check_save_targets(TrainingConfig(save=str(tmp_path / "new" / "save")))  # created later, by the first save
    assert not (tmp_path / "new").exists()


def test_checkpoint_of_another_architecture_stops_before_step_one(runs, tmp_path):
    straight(runs, 1)
    result = train(
        tmp_path / "out",
        [
            *BASE,
            f"training.load={runs.root}/save1",
            "model.config_overrides={text_config: {num_hidden_layers: 3}}",
        ],
    )
    assert result.returncode == 2, result.stderr[-4000:]
    assert f"'training.load' = '{runs.root}/save1/step_00000012' does not fit the model: 16 unexpected keys" in (
        result.stderr
    )
    assert "model.language_model.layers.3.self_attn.q_proj.weight" in result.stderr
    assert "Traceback" not in result.stderr and "step 1/" not in result.stdout
