"""TRL's SFTTrainer on GLM-4.5V through the DeepSpeed engine door, on the whole engine (issue 40).

tests/glm_trl_script.py runs through ds_compat.run on 2 CPU ranks, fp32, on the tiny GLM-4.5V saved as an HF directory:
SFTConfig(deepspeed=...) with ZeRO 3, expert_parallel.autoep_size 2, gradient_checkpointing=True and the extension's
dynamic chunk loss and EP balance; TRL's own training loop and loss (its fused LM head, through
`maybe_gather_lm_head_ctx` at ZeRO-3); a save_model, then a second launch resuming from checkpoint-3.

The loss normalisation TRL computes, read from trl 1.16 / transformers 5.25 and checked on the run:
transformers' Glm4vMoeForConditionalGeneration declares accepts_loss_kwargs=False, so the Trainer passes no
num_items_in_batch; SFTTrainer's loss (loss_type "nll") is then the micro batch's token mean over its supervised
shifted labels, and the Trainer divides it by the accumulation steps and DeepSpeed averages the gradients over the
ranks: the trainer door's loss_type=default (mean over the accumulation and the ranks of per-micro-batch token
means), the reference's default.

The same with the ZeRO-3 bucket sizes "auto", as in HF's and TRL's ZeRO-3 templates: every planned module becomes
an FSDP2 unit of its own, as lm_head would at GLM-4.5V's real size with any bucket size (151552 x 4096). TRL's fused
head reads `lm_head.weight` without calling the module, so a unit of its own would never be gathered: TRL took the
sharded DTensor's `full_tensor()`, whose backward leaves on each rank only its own gradient of its shard, reduced over
no rank (losses off by 5.7e-4 from step 4). The door keeps lm_head in the root's unit when the script replaced the
model's forward (ds_compat/glm_door.py output_layer_in_root).

With SFTConfig(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2)) on 4 ranks (DeepSpeed's ALST
names, issue 41), with and without EP 2: the same losses and gradient norms as the 2-rank CP1 runs.
"""

from __future__ import annotations

import json

import pytest
from conftest import REPO, mean_relative_error
from test_glm_door import LIMIT, SAVE_AT, STEPS, assert_reloads, hf_dir, hf_script_run, launch, plan_lines

# TRL's SFTTrainer counts a sample's <|image|> tokens against image_grid_thw alone; GLM-4.5V's video tokens are
# <|image|> tokens too, so it refuses a video sample as truncated: the TRL runs train on image samples (as the script)
TRL_DATA = ("data.synthetic_video_every=0",)
__all__ = ["hf_dir"]  # the module fixture of tests/test_glm_door.py: the same tiny GLM-4.5V as an HF directory

TRL_SCRIPT = REPO / "tests" / "glm_trl_script.py"


@pytest.fixture(scope="module")
def trl_run(tmp_path_factory, hf_dir) -> dict:
    return hf_script_run(tmp_path_factory.mktemp("trl_sft"), TRL_SCRIPT, hf_dir, *TRL_DATA)


def test_trl_sft_on_the_whole_engine_equals_the_trainer_door(trl_run):
    result = trl_run["result"]
    assert result["backend"] == "ds_compat.engine"
    assert len(result["losses"]) == STEPS
    assert mean_relative_error(result["losses"], trl_run["ref"], steps=STEPS) <= LIMIT
    # TRL's loss: its fused LM head (the model's own forward is not what trains), no num_items_in_batch
    assert result["fused_lm_head"] and result["loss_type"] == "nll" and not result["aux_loss_enabled"]
    assert result["model_accepts_loss_kwargs"] is False
    assert result["num_items_in_batch"] == [None] * (STEPS * 2)  # every micro batch of 6 steps x 2 accumulated
    # at ZeRO-3 TRL gathers lm_head only when its ds_status says it is not available; inside the root's forward
    # FSDP2 holds it unsharded, so ds_compat answers AVAILABLE (forward and the chunked backward's recompute)
    assert result["lm_head_gathers"] and all(gather == [True, ["AVAILABLE"]] for gather in result["lm_head_gathers"])
    # gradient_checkpointing=True became the recompute plan; transformers' own checkpointing is off
    assert result["applied_plans"]["recompute"] > 0 and result["transformers_checkpointing"] is False
    assert "features.recompute.enabled=true" in trl_run["log"]
    # from_pretrained after SFTConfig at ZeRO 3 built the model under zero.Init: its partitions were gathered
    assert "zero.Init partition(s) gathered" in trl_run["log"]
    assert result["applied_plans"]["expert_parallel"] == 3 and result["applied_plans"]["moe"] == 3
    assert "balance up to 1 replica(s)/rank" in trl_run["log"]

    # the same ds_config behind `train --deepspeed` applies the same plans to the same modules, but lm_head: TRL
    # replaced the model's forward, so lm_head stays in the root's FSDP unit and the chunked loss does not run
    def without_fsdp(log: str) -> set[str]:
        return {line for line in plan_lines(log) if not line.startswith("[plan fsdp]")}

    assert without_fsdp(trl_run["log"]) == without_fsdp(trl_run["ref_log"]) != set()
    assert "lm_head stays in the root FSDP unit" in trl_run["log"] and "no logits" not in trl_run["log"]


def test_trl_sft_features_off_gives_the_same_losses(trl_run):
    off = trl_run["off"]
    assert not any(off["applied_plans"].get(plan) for plan in ("recompute", "chunk_loss", "expert_parallel"))
    assert mean_relative_error(trl_run["result"]["losses"], off["losses"], steps=STEPS) <= LIMIT


def test_trl_save_model_reloads_and_resume_continues(trl_run):
    assert_reloads(trl_run["root"] / "door", "final")
    losses = trl_run["result"]["losses"]
    assert trl_run["resumed"]["losses"] == pytest.approx(losses[SAVE_AT:], rel=1e-9, abs=0.0)


def test_trl_sft_with_auto_buckets_keeps_lm_head_in_the_root_unit_and_equals_the_trainer_door(trl_run, tmp_path):
    """HF's "auto" bucket sizes: every other planned module is an FSDP2 unit of its own, lm_head stays in the root's.
    The reference is the default layout's run: the trainer door's losses do not depend on the units (they change
    only how parameters are grouped for collectives)."""
    assert trl_run["result"]["lm_head_unit"] is False
    launch(TRL_SCRIPT, 2, tmp_path, "--hf_dir", str(trl_run["hf_dir"]), "--auto_buckets")
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["lm_head_unit"] is False and result["applied_plans"]["fsdp"] > 1
    assert mean_relative_error(result["losses"], trl_run["ref"], steps=STEPS) <= LIMIT


@pytest.fixture(scope="module")
def trl_alst4(tmp_path_factory, hf_dir) -> dict:
    """SFTConfig(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2)) on 4 ranks (2 data-parallel
    groups: each step trains the samples of the 2-rank CP1 run), with the features (EP 2) and without (no EP)."""
    root = tmp_path_factory.mktemp("trl_alst4")
    log = launch(TRL_SCRIPT, 4, root / "on", "--hf_dir", str(hf_dir), "--sp", "2")
    launch(TRL_SCRIPT, 4, root / "off", "--hf_dir", str(hf_dir), "--sp", "2", "--features_off")
    results = {name: json.loads((root / name / "result.json").read_text()) for name in ("on", "off")}
    return {"log": log, **results}


def test_trl_sft_parallelism_config_runs_on_our_context_parallelism(trl_alst4, trl_run):
    """TRL's fused LM head calls the backbone itself: under the Ulysses plan the backbone returns this rank's slice of
    the last hidden state (padded to the group's multiple), which TRL scores against the adapter's slice of
    shift_labels; transformers' deepspeed_sp_compute_loss averages the slices' losses over the group."""
    for name, cp1 in (("on", trl_run["result"]), ("off", trl_run["off"])):
        result = trl_alst4[name]
        assert result["fused_lm_head"] and result["applied_plans"]["context_parallel"] > 0
        assert mean_relative_error(result["losses"], cp1["losses"], steps=STEPS) <= LIMIT
        assert mean_relative_error(result["grad_norms"], cp1["grad_norms"], steps=STEPS) <= LIMIT
        assert mean_relative_error(result["losses"], trl_run["ref"], steps=STEPS) <= LIMIT  # the trainer door
    assert trl_alst4["on"]["applied_plans"]["expert_parallel"] == 3
    assert not trl_alst4["off"]["applied_plans"].get("expert_parallel")
    assert "ALST register_with_transformers: GLM-4.5V, sequence_parallel_size 2" in trl_alst4["log"]
