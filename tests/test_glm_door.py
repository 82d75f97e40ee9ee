"""GLM-4.5V through the DeepSpeed engine door on the whole engine (ds_compat/glm_door.py, builders.adopt_model).

Each rank runs the script through `python -m ds_compat.run` (what ds-fsdp's single-node launch amounts to: torchrun
with `import deepspeed` switched to this backend; the ranks forked by the suite's zygote), fp32 on CPU ranks,
transformers' tiny GLM-4.5V saved as an HF directory:
- tests/glm_door_script.py (the DeepSpeed API: `engine(**batch).loss`) on 2 and 4 ranks with ZeRO 3,
  expert_parallel.autoep_size 2, activation_checkpointing and the extension's dynamic chunk loss and EP balance: the
  per-step losses equal our trainer's (`python -m glm45v_fsdp.train --deepspeed` with the same ds_config, weights and
  samples) and the same script's with every feature off; the consolidated save reloads in transformers with equal
  tensors; a resume from its checkpoint continues exactly;
- tests/glm_hf_trainer_script.py (HF Trainer, "auto" ds_config, gradient_checkpointing=True, HF-style collator
  without position_ids): the same, against the trainer door, with save_model and resume_from_checkpoint; and
  its evals every 2 steps on samples held out by data.validation_split equal the trainer door's on the same samples.
In process: the forward contract (transformers' loss as token mean and with num_items_in_batch, logits) on 1 rank,
the extension section's and AutoEP keys' errors, transformers' checkpointing switch, and a model that is not
GLM-4.5V keeping the generic path.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, clean_env, free_port, mean_relative_error, python, read_metrics, spawn, train
from safetensors.torch import load_file
from transformers import Glm4vMoeForConditionalGeneration

from ds_compat.config import translate
from ds_compat.glm_door import check_autoep_section, is_glm45v, model_fields
from glm45v_fsdp.config import ModelConfig
from glm45v_fsdp.errors import ConfigError, UserError
from glm45v_fsdp.model import load_hf_config
from glm45v_fsdp.model.hf_forward import Glm4vMoeForScripts
from glm45v_fsdp.plans import moe_layer_names

API_SCRIPT = REPO / "tests" / "glm_door_script.py"
TRAINER_SCRIPT = REPO / "tests" / "glm_hf_trainer_script.py"
STEPS, SAVE_AT = 6, 3
CP_NAMES = ("ulysses2", "ring2", "ulysses2_ep2", "ring2_ep2")  # tests/glm_door_script.py's CP_RUNS but the hybrids
LIMIT = 1e-5  # mean relative loss error, fp32
EVAL_LIMIT = 1e-6  # relative eval-loss error on the same weights, fp32


def launch(script: Path, nproc: int, out: Path, *args: str) -> str:
    """`torchrun --nproc_per_node N -m ds_compat.run SCRIPT ARGS` in `out`, DeepSpeed's CPU accelerator: the switch
    that makes `import deepspeed` this backend under launchers other than ds-fsdp, whose single-node launch is this
    torchrun with the switch on PYTHONPATH (ds-fsdp itself: tests/test_ds_launcher.py, test_hf_integration.py,
    test_lora_door.py). The ranks are forked by the suite's zygote (conftest.python): no interpreter start-ups."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**clean_env(), "DS_ACCELERATOR": "cpu"}
    argv = ["-m", "ds_compat.run", str(script), "--out", str(out), *args]
    result = python(argv, nproc, env, timeout=600, cwd=out, ranked=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout + result.stderr


def trainer_door(out: Path, ds_config: dict, hf_dir: Path, nproc: int, *overrides: str) -> tuple[list[float], str]:
    """Our trainer with the same ds_config, weights (training.load) and unshuffled samples: its per-step losses and
    its log."""
    path = out.parent / f"{out.name}.json"
    path.write_text(json.dumps(ds_config))
    args = ["--deepspeed", str(path), f"training.load={hf_dir}", "data.shuffle=false", f"training.train_iters={STEPS}"]
    result = train(out, [*args, *overrides], nproc=nproc)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [record["loss"] for record in read_metrics(out) if "loss" in record], result.stdout + result.stderr


def plan_lines(log: str) -> set[str]:
    """The headline of every plan applied: `[plan NAME] N pattern(s); what it did`."""
    return set(re.findall(r"\[plan [a-z_]+\][^\n]*", log))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    torch.manual_seed(3)
    out = tmp_path_factory.mktemp("glm_hf")
    Glm4vMoeForConditionalGeneration(load_hf_config(ModelConfig())).save_pretrained(out)
    return out


def api_run(root: Path, hf_dir: Path, nproc: int, runs: str) -> dict:
    """The DeepSpeed-API script's `runs` on `nproc` ranks and the trainer door beside it."""
    log = launch(API_SCRIPT, nproc, root / "door", "--hf_dir", str(hf_dir), "--steps", str(STEPS), "--runs", runs)
    sys.path.insert(0, str(REPO / "tests"))
    from glm_door_script import ON

    freeze = "model.freeze=[model.visual]"  # the script freezes the vision tower
    reference, reference_log = trainer_door(root / "trainer", ON, hf_dir, nproc, freeze)
    return {
        "root": root,
        "log": log,
        "result": json.loads((root / "door" / "result.json").read_text()),
        "ref": reference,
        "ref_log": reference_log,
    }


@pytest.fixture(scope="module")
def api2(tmp_path_factory, hf_dir) -> dict:
    return api_run(tmp_path_factory.mktemp("api2"), hf_dir, 2, "off,on,resumed")


@pytest.fixture(scope="module")
def api4(tmp_path_factory, hf_dir) -> dict:
    """4 ranks: EP 2 inside FSDP over 4 (each expert stack sharded over 2 efsdp ranks)."""
    return api_run(tmp_path_factory.mktemp("api4"), hf_dir, 4, "on")


@pytest.mark.parametrize("ranks", ["api2", "api4"])
def test_api_script_on_the_whole_engine_equals_the_trainer_door(ranks, request):
    run_ = request.getfixturevalue(ranks)
    result = run_["result"]
    assert result["backend"] == "ds_compat"
    assert len(result["on"]) == STEPS
    assert mean_relative_error(result["on"], run_["ref"], STEPS) <= LIMIT
    # every plan ran, and the log names each with what it matched
    assert {"moe", "ops", "recompute", "chunk_loss", "expert_parallel", "fsdp"} <= set(result["applied_plans"])
    for plan in ("moe", "recompute", "chunk_loss", "expert_parallel", "fsdp"):
        assert f"[plan {plan}]" in run_["log"]
    assert "GLM-4.5V recognised" in run_["log"] and "no logits" in run_["log"]
    assert "balance up to 1 replica(s)/rank" in run_["log"]
    # the same ds_config behind `train --deepspeed` applies the same plans (the log also holds the script's OFF run;
    # the script freezes the vision tower itself, the trainer door by its freeze plan)
    reference_plans = {line for line in plan_lines(run_["ref_log"]) if not line.startswith("[plan freeze]")}
    assert reference_plans <= plan_lines(run_["log"]) and "chunk_loss" in str(reference_plans)
    assert_reloads(run_["root"] / "door", "export")
    # save_16bit_model writes DeepSpeed's pytorch_model.bin alone; beside the model's config.json it loads too
    shutil.copy(run_["root"] / "door" / "export" / "config.json", run_["root"] / "door" / "16bit")
    assert_reloads(run_["root"] / "door", "16bit")


def assert_reloads(out: Path, directory: str) -> None:
    """The directory the script saved loads in transformers with the engine's consolidated tensors."""
    saved = load_file(out / "state.safetensors")
    reloaded = Glm4vMoeForConditionalGeneration.from_pretrained(out / directory, dtype=torch.float32).state_dict()
    assert set(reloaded) == set(saved)
    for key, value in saved.items():
        assert torch.equal(reloaded[key], value), key
    config = json.loads((out / directory / "config.json").read_text())
    assert config["architectures"] == ["Glm4vMoeForConditionalGeneration"]


def test_api_script_features_off_gives_the_same_losses(api2):
    assert mean_relative_error(api2["result"]["on"], api2["result"]["off"], STEPS) <= LIMIT


def test_api_script_resume_continues_exactly(api2):
    result = api2["result"]
    assert result["resumed"] == pytest.approx(result["on"][SAVE_AT:], rel=1e-9, abs=0.0)


@pytest.fixture(scope="module")
def cp4(tmp_path_factory, hf_dir) -> dict:
    """The DeepSpeed-API script's context-parallel runs on 4 ranks (2 data-parallel groups of 2: the samples of each
    step are those of the 2-rank "off" run), and the trainer door's Ulysses 2 run on the same ds_config."""
    root = tmp_path_factory.mktemp("cp4")
    sys.path.insert(0, str(REPO / "tests"))
    from glm_door_script import CP_RUNS

    assert tuple(CP_RUNS) == (*CP_NAMES, "hybrid", "hybrid_ep2")
    runs = ",".join(CP_RUNS)
    log = launch(API_SCRIPT, 4, root / "door", "--hf_dir", str(hf_dir), "--steps", str(STEPS), "--runs", runs)
    launch(API_SCRIPT, 1, root / "one", "--hf_dir", str(hf_dir), "--steps", str(STEPS), "--runs", "off")
    freeze = "model.freeze=[model.visual]"  # the script freezes the vision tower
    reference, reference_log = trainer_door(root / "trainer", CP_RUNS["ulysses2"], hf_dir, 4, freeze)
    hybrid, _ = trainer_door(root / "trainer_hybrid", CP_RUNS["hybrid"], hf_dir, 4, freeze)
    return {
        "log": log,
        "result": json.loads((root / "door" / "result.json").read_text()),
        "one_rank": json.loads((root / "one" / "result.json").read_text()),
        "ref": reference,
        "ref_log": reference_log,
        "ref_hybrid": hybrid,
    }


@pytest.mark.parametrize("name", CP_NAMES)
def test_api_script_context_parallel_equals_cp1_and_the_trainer_door(name, cp4, api2):
    """sequence_parallel_size (Ulysses), the extension's Ring size, and Ulysses with EP: each rank of a sequence
    group gets the whole micro batch from the script, the engine splits it, and the loss the script sees is the
    whole micro batch's."""
    result = cp4["result"]
    assert mean_relative_error(result[name], api2["result"]["off"], STEPS) <= LIMIT
    assert mean_relative_error(result[name], cp4["ref"], STEPS) <= LIMIT
    assert result[f"{name}_plans"]["context_parallel"] > 0
    groups = result[f"{name}_groups"]
    assert groups["sp_size"] == 2 and groups["sp_ranks"] == groups["cp_ranks"]
    assert groups["dp_size"] == groups["engine_dp_size"] == 2
    assert groups["train_batch_size"] == 2 * 2  # micro batch 2 x 2 data-parallel ranks (Ring takes ranks too)
    if name.endswith("ep2"):
        assert result[f"{name}_plans"]["expert_parallel"] > 0
        assert groups["ep_name"] == "ep_size_2" and groups["ep_ranks"] == groups["engine_ep_ranks"]


@pytest.mark.parametrize("name", ["hybrid", "hybrid_ep2"])
def test_api_script_hybrid_context_parallel_equals_cp1_and_the_trainer_door(name, cp4):
    """Ulysses 2 x Ring 2 on 4 ranks: one data-parallel rank, so the reference is the script on 1 rank."""
    result = cp4["result"]
    assert mean_relative_error(result[name], cp4["one_rank"]["off"], STEPS) <= LIMIT
    assert mean_relative_error(result[name], cp4["ref_hybrid"], STEPS) <= LIMIT
    groups = result[f"{name}_groups"]
    assert groups["sp_size"] == 4 and groups["sp_ranks"] == groups["cp_ranks"] == [0, 1, 2, 3]
    assert groups["dp_size"] == groups["engine_dp_size"] == 1 and groups["train_batch_size"] == 2
    if name.endswith("ep2"):
        assert result[f"{name}_plans"]["expert_parallel"] > 0 and groups["ep_name"] == "ep_size_2"


def hf_script_run(root: Path, script: Path, hf_dir: Path, *data: str, eval_split: float = 0.0) -> dict:
    """An HF Trainer-style script (tests/glm_door_hf_common.py) with its features on, resumed from checkpoint-3 in a
    fresh launch, with every feature off, and the trainer door beside it on the ds_config the script resolved.

    transformers' GLM-4.5V declares accepts_loss_kwargs=False: the Trainer (and TRL) average the micro batches' token
    means, as the trainer door's loss_type=default does. gradient_checkpointing=True is a TrainingArguments switch,
    not a ds_config key: the trainer door gets it as ours. `data`: the script's data overrides, for the trainer door
    too. `eval_split`: the scripts hold out that fraction (their --eval_split) and evaluate on it every 2 steps (but
    the resumed run), and so does the trainer door (data.validation_split, training.eval_interval=2)."""
    split = ["--eval_split", str(eval_split)] if eval_split else []
    log = launch(script, 2, root / "door", "--hf_dir", str(hf_dir), *split)
    launch(script, 2, root / "door", "--hf_dir", str(hf_dir), "--resume", *split)
    launch(script, 2, root / "off", "--hf_dir", str(hf_dir), "--features_off", *split)
    ds_config = json.loads((root / "door" / "ds_config.json").read_text())
    data = (*data, f"data.validation_split={eval_split}", "training.eval_interval=2") if eval_split else data
    reference, reference_log = trainer_door(
        root / "trainer", ds_config, hf_dir, 2, "features.recompute.enabled=true", *data
    )
    return {
        "root": root,
        "hf_dir": hf_dir,
        "log": log,
        "result": json.loads((root / "door" / "result.json").read_text()),
        "resumed": json.loads((root / "door" / "resumed.json").read_text()),
        "off": json.loads((root / "off" / "result.json").read_text()),
        "ref": reference,
        "ref_log": reference_log,
        "ref_evals": [record for record in read_metrics(root / "trainer") if "eval_loss" in record],
    }


EVAL_SPLIT = 0.02  # 6 of the 256 synthetic samples, none of them among the first 24 that the 6 steps train on


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory, hf_dir) -> dict:
    return hf_script_run(tmp_path_factory.mktemp("hf_trainer"), TRAINER_SCRIPT, hf_dir, eval_split=EVAL_SPLIT)


def test_hf_trainer_on_the_whole_engine_equals_the_trainer_door(trainer_run):
    result = trainer_run["result"]
    assert result["backend"] == "ds_compat.engine"
    assert mean_relative_error(result["losses"], trainer_run["ref"], STEPS) <= LIMIT
    # gradient_checkpointing=True became the recompute plan; transformers' own checkpointing is off
    assert result["applied_plans"]["recompute"] > 0 and result["transformers_checkpointing"] is False
    assert "features.recompute.enabled=true" in trainer_run["log"]
    # from_pretrained after TrainingArguments at ZeRO 3 built the model under zero.Init: its partitions were gathered
    assert "zero.Init partition(s) gathered" in trainer_run["log"]
    assert result["applied_plans"]["expert_parallel"] == 3 and "chunk_loss" in result["applied_plans"]
    # the same ds_config behind `train --deepspeed` applies the same plans to the same modules
    assert plan_lines(trainer_run["log"]) == plan_lines(trainer_run["ref_log"]) != set()


def test_hf_trainer_evals_equal_the_trainer_door_evals(trainer_run):
    """The HF Trainer's evals on the engine (ZeRO 3, EP 2, dynamic chunked loss, EP balance, recompute; and with the
    features off) against the trainer door's on the same ds_config, weights and held-out samples. After 2 steps the
    weights of the two doors still agree to float rounding (their step-3 losses to ~2e-8), so their evals must agree to
    the eval's own limit; later the training's divergence grows (~6e-6 in the step-6 loss) and dominates, and there
    the engine's evals with and without its features must agree."""
    result, off, door = trainer_run["result"], trainer_run["off"], trainer_run["ref_evals"]
    assert [r["step"] for r in door] == [step for step, _ in result["evals"]] == [step for step, _ in off["evals"]]
    assert [r["step"] for r in door] == [2, 4, 6] and door[0]["eval_samples"] == len(result["eval_samples"]) == 6
    # the held-out samples leave the trained ones (0-23) alone: the runs without a split (alst4) train on them too
    assert min(result["eval_samples"]) >= STEPS * 2 * 2
    for run in (result, off):
        assert abs(run["evals"][0][1] - door[0]["eval_loss"]) / door[0]["eval_loss"] <= EVAL_LIMIT
    assert mean_relative_error([e for _, e in result["evals"]], [e for _, e in off["evals"]], 3) <= EVAL_LIMIT


def test_hf_trainer_features_off_gives_the_same_losses(trainer_run):
    off = trainer_run["off"]
    assert not any(off["applied_plans"].get(plan) for plan in ("recompute", "chunk_loss", "expert_parallel"))
    assert mean_relative_error(trainer_run["result"]["losses"], off["losses"], STEPS) <= LIMIT


def test_hf_trainer_save_model_reloads_and_resume_continues(trainer_run):
    assert_reloads(trainer_run["root"] / "door", "final")
    losses = trainer_run["result"]["losses"]
    assert trainer_run["resumed"]["losses"] == pytest.approx(losses[SAVE_AT:], rel=1e-9, abs=0.0)


# ----------------------------------------------------------------------------------------------------------------
# DeepSpeed's ALST names: parallelism_config (HF Trainer) and ParallelismConfig (accelerate) with sp_backend="deepspeed"
# ----------------------------------------------------------------------------------------------------------------
ACCELERATE_SCRIPT = REPO / "tests" / "glm_accelerate_sp_script.py"
ACCELERATE_RUNS = {"cp1_ep": (2, "--sp", "1", "--ep"), "sp2_ep": (4, "--sp", "2", "--ep"), "sp2": (4, "--sp", "2")}


@pytest.fixture(scope="module")
def alst4(tmp_path_factory, hf_dir) -> dict:
    """sp_size 2 on 4 ranks (2 data-parallel groups: each step trains the samples of the 2-rank CP1 runs): the HF
    Trainer script with its features (EP 2, chunked loss, recompute) and with them off (no EP), the accelerate loop
    with and without EP 2 and its CP1 run on 2 ranks, and the trainer door's Ulysses 2 run on the ds_config the HF
    Trainer resolved (sequence_parallel_size 2 from the ALST mpu)."""
    root = tmp_path_factory.mktemp("alst4")
    logs = {"hf": launch(TRAINER_SCRIPT, 4, root / "hf", "--hf_dir", str(hf_dir), "--sp", "2")}
    launch(TRAINER_SCRIPT, 4, root / "hf_off", "--hf_dir", str(hf_dir), "--sp", "2", "--features_off")
    for name, (nproc, *args) in ACCELERATE_RUNS.items():
        logs[name] = launch(ACCELERATE_SCRIPT, nproc, root / name, "--hf_dir", str(hf_dir), *args)
    ds_config = json.loads((root / "hf" / "ds_config.json").read_text())
    reference, _ = trainer_door(root / "trainer", ds_config, hf_dir, 4, "features.recompute.enabled=true")
    names = ["hf", "hf_off", *ACCELERATE_RUNS]
    results = {name: json.loads((root / name / "result.json").read_text()) for name in names}
    return {"logs": logs, "ds_config": ds_config, "ref": reference, **results}


def test_hf_trainer_parallelism_config_runs_on_our_context_parallelism(alst4, trainer_run):
    """TrainingArguments(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2)): the Trainer's
    register_with_transformers, UlyssesSPDataLoaderAdapter and deepspeed_sp_compute_loss, on the Ulysses plan."""
    result, off = alst4["hf"], alst4["hf_off"]
    assert result["backend"] == "ds_compat.engine" and result["loader"] == "UlyssesSPDataLoaderAdapter"
    assert alst4["ds_config"]["sequence_parallel_size"] == 2  # from the mpu; the ds_config did not set it
    assert result["applied_plans"]["context_parallel"] > 0 and result["applied_plans"]["expert_parallel"] == 3
    assert off["applied_plans"]["context_parallel"] > 0 and not off["applied_plans"].get("expert_parallel")
    for run, cp1 in ((result, trainer_run["result"]), (off, trainer_run["off"])):  # CP1 with and without EP 2
        assert mean_relative_error(run["losses"], cp1["losses"], STEPS) <= LIMIT
        # Adam hardly sees a gradient's scale (the reduction over the group at ZeRO-3): the norms do
        assert mean_relative_error(run["grad_norms"], cp1["grad_norms"], STEPS) <= LIMIT
    for losses in (result["losses"], off["losses"]):
        assert mean_relative_error(losses, alst4["ref"], STEPS) <= LIMIT  # the trainer door's Ulysses 2
    assert "ALST register_with_transformers: GLM-4.5V, sequence_parallel_size 2" in alst4["logs"]["hf"]


def test_accelerate_parallelism_config_runs_on_our_context_parallelism(alst4):
    """accelerate's own loop with ParallelismConfig(sp_backend="deepspeed", sp_size=2) and the guide's loss (each
    rank's slice loss, weighted over the group by a differentiable all_gather; ZeRO-3 averages over the group as
    DeepSpeed 0.19.8 does)."""
    cp1 = alst4["cp1_ep"]
    for name in ("sp2_ep", "sp2"):
        result = alst4[name]
        assert result["loader"] == "UlyssesSPDataLoaderAdapter" and result["sp_size"] == 2
        # len(dl) x sp as DeepSpeed's adapter: the loader over 4 ranks is half the CP1 one's over 2
        assert result["loader_length"] == cp1["loader_length"]
        assert result["train_batch_size"] == cp1["train_batch_size"] == 4  # micro 1 x accumulation 2 x 2 groups
        assert result["applied_plans"]["context_parallel"] > 0
        assert mean_relative_error(result["losses"], cp1["losses"], STEPS) <= LIMIT
        assert mean_relative_error(result["grad_norms"], cp1["grad_norms"], STEPS) <= LIMIT
        assert mean_relative_error(result["losses"], alst4["ref"], STEPS) <= LIMIT
        # the batch the script sees: inputs whole, labels replaced by this rank's slice of shift_labels
        shapes = result["shapes"][0]
        assert "labels" not in shapes and "position_ids" not in shapes
        length = shapes["input_ids"][1]
        assert shapes["shift_labels"] == [1, (length + length % 2) // 2]
    assert alst4["sp2_ep"]["applied_plans"]["expert_parallel"] == 3
    assert "expert_parallel" not in alst4["sp2"]["applied_plans"]


# ----------------------------------------------------------------------------------------------------------------
# In process
# ----------------------------------------------------------------------------------------------------------------


def _forward_contract_worker(rank: int, port: int, chunked: bool) -> None:
    """1 rank: the door's forward against transformers' own model on the same weights and batch."""
    import os

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import ds_compat as deepspeed
    from glm45v_fsdp.builders import build_training_data
    from glm45v_fsdp.config import load_config
    from glm45v_fsdp.data.collate import collate

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(5)
    model = Glm4vMoeForConditionalGeneration(load_hf_config(ModelConfig()))
    reference = copy.deepcopy(model)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if chunked:
        config["glm45v_fsdp"] = {"features": {"chunk_loss": {"mode": "static", "chunk_size": 16}}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    data = build_training_data(load_config(None, ["data.shuffle=false"]), model.config)
    batch = collate([data.dataset[0], data.dataset[1]], data.tokenizer.pad_token_id)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "labels", "pixel_values", "image_grid_thw")}
    inputs["mm_token_type_ids"] = batch["mm_token_type_ids"]
    with torch.no_grad():
        ours, theirs = engine(**inputs), reference(**inputs)
        torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-5, atol=0)
        count = torch.tensor(37)
        ours_n, theirs_n = engine(**inputs, num_items_in_batch=count), reference(**inputs, num_items_in_batch=count)
        torch.testing.assert_close(ours_n.loss, theirs_n.loss, rtol=1e-5, atol=0)
        assert not torch.allclose(ours_n.loss, ours.loss)  # the count changes the normalisation
        if chunked:
            assert ours.logits is None
        else:
            torch.testing.assert_close(ours.logits, theirs.logits.float(), rtol=1e-4, atol=1e-5)
        unlabeled = {key: value for key, value in inputs.items() if key != "labels"}
        assert engine(**unlabeled).loss is None and engine(**unlabeled).logits.shape[:2] == batch["input_ids"].shape
        # inputs_embeds (ms-swift's template merges the images into them) with the collator's mRoPE positions
        positions, _ = reference.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"], None, inputs["attention_mask"]
        )
        embedded = {
            "inputs_embeds": reference.model.language_model.embed_tokens(inputs["input_ids"]),
            "attention_mask": inputs["attention_mask"],
            "labels": inputs["labels"],
            "position_ids": positions,
        }
        torch.testing.assert_close(engine(**embedded).loss, reference(**embedded).loss, rtol=1e-5, atol=0)
    for refused, words in (
        ({**inputs, "inputs_embeds": torch.zeros(1)}, "input_ids and inputs_embeds together"),
        ({k: v for k, v in embedded.items() if k != "position_ids"}, "mRoPE position_ids"),
    ):
        try:
            engine(**refused)
        except Exception as error:  # noqa: BLE001 - the refusal must name what is missing and the fix
            assert words in str(error) and "pass" in str(error), error
        else:
            raise AssertionError(f"accepted: {sorted(refused)}")


@pytest.mark.parametrize("chunked", [False, True], ids=["full_logits", "chunked"])
def test_forward_returns_transformers_loss_token_mean_and_num_items(chunked):
    spawn(_forward_contract_worker, (free_port(), chunked), nprocs=1)


def _meta_glm() -> Glm4vMoeForConditionalGeneration:
    with torch.device("meta"):
        return Glm4vMoeForConditionalGeneration(load_hf_config(ModelConfig()))


class _SplitInTwo:
    """A sequence layout splitting over 2 ranks, as far as the forward asks before computing anything."""

    size = 2

    def describe(self) -> str:
        return "Ulysses 2"


def test_forward_without_labels_under_context_parallelism_is_refused():
    model = _meta_glm()
    model.__class__ = Glm4vMoeForScripts
    model.sequence_layout = _SplitInTwo()
    with pytest.raises(UserError, match="without labels under context parallelism \\(Ulysses 2\\)"):
        model(input_ids=torch.zeros(1, 8, dtype=torch.long, device="meta"))


def test_transformers_checkpointing_becomes_the_recompute_plan_and_is_switched_off():
    model = _meta_glm()
    assert model_fields(model) == {"model.attn_implementation": "sdpa"}
    model.activation_checkpointing_enable()
    assert model_fields(model) == {"model.attn_implementation": "sdpa", "features.recompute.enabled": True}
    assert not model.is_activation_checkpointing  # transformers' own no longer runs
    model.activation_checkpointing_enable(every_n_layers=2)  # the same layers by name
    fields = model_fields(model)
    assert list(fields)[-1] == "features.recompute.apply_modules"
    assert fields["features.recompute.apply_modules"][0] == "model.visual.blocks.0"


def test_autoep_keys_must_describe_glm45v():
    model = _meta_glm()
    layers = moe_layer_names(model.config)
    good = {
        "enabled": True,
        "autoep_size": 2,
        "preset_model": "glm4v_moe",
        "moe_layer_pattern": r"model\.language_model\.layers\.\d+\.mlp",
    }
    good.update(router_pattern="gate", expert_pattern="experts")

    def translated(section: dict):  # the section as the translation hands it to the engine
        return translate({"train_micro_batch_size_per_gpu": 1, "expert_parallel": section}, 2).expert_parallel

    check_autoep_section(translated(good), model, layers)  # the layer 0 `mlp` is dense: not matched
    bad = {
        "preset_model": ("mixtral", "not GLM-4.5V's preset"),
        "moe_layer_pattern": (r"model\.layers\.\d+\.mlp", "matches 0 module(s)"),
        "router_pattern": ("router", "names no child"),
        "expert_pattern": ("mlp", "names no child"),
    }
    for key, (value, problem) in bad.items():
        with pytest.raises(ConfigError, match=f"expert_parallel.{key}.*{re.escape(problem)}"):
            check_autoep_section(translated({**good, key: value}), model, layers)


def test_extension_section_is_validated_like_overrides():
    base = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    ok = translate(
        {**base, "glm45v_fsdp": {"features": {"chunk_loss": {"mode": "dynamic"}}, "model": {"ops": "reference"}}}, 2
    )
    assert "features.chunk_loss.mode=dynamic" in ok.overrides and "model.ops=reference" in ok.overrides
    cases = {
        "features": ({"chunk_los": {"mode": "dynamic"}}, "Did you mean 'features.chunk_loss'"),
        "parallel": ({"expert_parallel_size": 2}, "decided by DeepSpeed's own key 'expert_parallel.autoep_size'"),
        "training": ({"lr": 1.0}, "cannot be set here"),
        "model": ({"name_or_path": "x"}, "cannot be set here"),
    }
    for section, (value, message) in cases.items():
        with pytest.raises(ConfigError, match=message) as error:
            translate({**base, "glm45v_fsdp": {section: value}}, 2)
        assert "glm45v_fsdp" in str(error.value)
    # EP balance is validated together with the EP size the DeepSpeed key gives
    with pytest.raises(ConfigError, match="ep_balance"):
        translate({**base, "glm45v_fsdp": {"features": {"ep_balance": {"enabled": True}}}}, 2)
    ep = {**base, "expert_parallel": {"enabled": True, "autoep_size": 2}}
    assert (
        "features.ep_balance.enabled=true"
        in translate({**ep, "glm45v_fsdp": {"features": {"ep_balance": {"enabled": True}}}}, 2).overrides
    )


def test_other_models_keep_the_generic_path():
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        llama = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64))
    assert not is_glm45v(llama) and is_glm45v(_meta_glm())

    class OwnForward(Glm4vMoeForConditionalGeneration):
        def forward(self, **kwargs):
            return super().forward(**kwargs)

    with torch.device("meta"):
        assert not is_glm45v(OwnForward(load_hf_config(ModelConfig())))
