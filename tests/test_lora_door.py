"""LoRA through the DeepSpeed door: a DeepSpeed-API script hands `deepspeed.initialize` a PEFT LoRA model of
transformers' GLM-4.5V (attention, dense and shared-expert MLPs, the vision tower's linears, the routed experts via
target_parameters) and gets the whole engine: through ds_compat.run it equals PEFT on transformers in one process, step
by step and in a final eval, with EP 2 + recompute + the dynamic chunk loss, with Ulysses 2 and with Ring 2; it resumes
exactly; the adapter PEFT's save_pretrained writes from the engine's consolidated state dict reloads in PEFT with the
run's eval loss; and the trainer door with model.lora equals it on the same data.

The real clients' patterns, each one script run on the real DeepSpeed and on this backend, equal step by step:
ms-swift's GLM-4.5V template (a forward pre-hook that embeds the tokens and runs the vision tower with the model's own
modules, then passes inputs_embeds), full fine-tuning and LoRA; the HF Trainer with a PeftModel; TRL's SFTTrainer with
a peft_config. Every script runs on 2 ranks forked by the suite's zygote (`on_backend`); the `deepspeed` and `ds-fsdp`
launchers with the HF Trainer and accelerate are test_hf_integration's."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, clean_env, mean_relative_error, python, read_metrics, train
from peft_common import ALPHA, OUR_TARGETS, RANK, load_peft, make_adapter, reference_run
from test_glm_door import launch
from transformers import Glm4vMoeForConditionalGeneration

from glm45v_fsdp.config import ModelConfig
from glm45v_fsdp.model import load_hf_config

sys.path.insert(0, str(REPO / "tests"))
SCRIPT = REPO / "tests" / "peft_door_script.py"
REFERENCE_RUNNER = REPO / "tests" / "ds_reference_runner.py"
STEPS, SAVE_AT = 4, 2
LIMIT = 1e-5  # mean relative loss error, fp32
RUN_PLANS = {
    "ep": {"lora", "expert_parallel", "recompute", "chunk_loss", "fsdp"},
    "ulysses2": {"lora", "context_parallel", "fsdp"},
    "ring2": {"lora", "context_parallel", "fsdp"},
}


@pytest.fixture(scope="module")
def base_and_adapter(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("peft_door")
    torch.manual_seed(3)
    Glm4vMoeForConditionalGeneration(load_hf_config(ModelConfig())).save_pretrained(root / "hf")
    make_adapter(root / "hf", root / "adapter")
    return root / "hf", root / "adapter"


@pytest.fixture(scope="module")
def door(base_and_adapter, tmp_path_factory) -> dict:
    hf_dir, adapter = base_and_adapter
    out = tmp_path_factory.mktemp("peft_door_runs")
    log = launch(SCRIPT, 2, out, "--hf_dir", str(hf_dir), "--adapter", str(adapter), "--steps", str(STEPS))
    return {"out": out, "log": log, "result": json.loads((out / "result.json").read_text())}


def dumped(out: Path, run: str, first: int) -> list[list[dict]]:
    """Each step's batches of the two ranks, as the script dumped them."""
    return [
        [torch.load(out / run / f"step{step}_rank{rank}.pt", weights_only=True) for rank in (0, 1)]
        for step in range(first + 1, STEPS + 1)
    ]


@pytest.mark.parametrize("run", list(RUN_PLANS))
def test_peft_model_through_the_door_equals_peft_on_transformers(door, base_and_adapter, run):
    hf_dir, adapter = base_and_adapter
    steps = dumped(door["out"], run, 0)
    losses, evaluated = reference_run(hf_dir, adapter, steps, steps[0], lr=1e-3)
    result = door["result"][run]
    assert mean_relative_error(result["losses"], losses, STEPS) <= LIMIT, (result["losses"], losses)
    assert abs(result["eval"] - evaluated) <= LIMIT * evaluated, (result["eval"], evaluated)
    assert RUN_PLANS[run] <= set(result["plans"]), result["plans"]
    # 4 text layers x q/k/v/o, the dense layer's and 3 shared experts' gate/up/down, 2 vision blocks x (qkv + 3 MLP),
    # the merger's 3; the 3 MoE layers' experts modules, each with both stacks
    assert result["plans"]["lora"] == 39 + 3


def test_the_log_names_the_adapters_and_the_plans(door):
    log = door["log"]
    assert "GLM-4.5V recognised (PeftModel)" in log
    assert re.search(r"PEFT LoRA adapter 'default' on 39 linear module\(s\), 3 experts module\(s\) \(6 stack", log)
    assert "[plan lora]" in log and "PEFT LoRA routed experts (target_parameters): 3 module(s)" in log
    assert "[plan expert_parallel]" in log and "[plan chunk_loss]" in log
    assert "generic FSDP2" not in log


def test_peft_lora_resume_through_the_door_is_exact(door):
    result = door["result"]
    assert result["resumed"]["losses"] == result["ep"]["losses"][SAVE_AT:]


@pytest.mark.parametrize("run", list(RUN_PLANS))
def test_peft_save_pretrained_from_the_consolidated_state_dict_reloads_in_peft(door, base_and_adapter, run):
    """PEFT's save_pretrained(state_dict=engine._zero3_consolidated_16bit_state_dict()), as the HF Trainer saves
    under ZeRO 3: PEFT loads the adapter and gives the run's final eval loss."""
    from peft_common import eval_loss

    hf_dir, _ = base_and_adapter
    saved = door["out"] / run / "peft_adapter"
    config = json.loads((saved / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["lora_alpha"] == ALPHA
    model = load_peft(hf_dir, saved)
    evaluated = eval_loss(model, dumped(door["out"], run, 0)[0])
    assert abs(evaluated - door["result"][run]["eval"]) <= LIMIT * evaluated


def test_the_trainer_door_with_model_lora_equals_the_engine_door(door, base_and_adapter, tmp_path):
    """`python -m glm45v_fsdp.train --deepspeed <the script's EP ds_config>` with model.lora on the same modules,
    from the same adapter, on the same samples: the engine door's per-step losses. (A ds_config without a scheduler
    keeps DeepSpeed's lr constant; the trainer keeps its own training.lr_scheduler, here constant.)"""
    from peft_door_script import EP

    hf_dir, adapter = base_and_adapter
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(EP))
    overrides = [
        "--deepspeed",
        str(config),
        f"training.load={hf_dir}",
        "data.shuffle=false",
        "data.synthetic_video_every=0",
        f"training.train_iters={STEPS}",
        "training.lr_scheduler=constant",
        f"model.lora.rank={RANK}",
        f"model.lora.alpha={ALPHA}",
        "model.lora.experts=true",
        f"model.lora.target_modules=[{', '.join(OUR_TARGETS)}]",
        f"model.lora.init_from={adapter}",
    ]
    result = train(tmp_path / "trainer", overrides, nproc=2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = read_metrics(tmp_path / "trainer")
    assert {record["lr"] for record in records} == {1e-3}
    losses = [record["loss"] for record in records]
    assert mean_relative_error(losses, door["result"]["ep"]["losses"], STEPS) <= LIMIT, (losses, door["result"]["ep"])


def on_backend(backend: str, script: Path, out: Path, *args: str) -> str:
    """`script --out OUT ARGS` on 2 ranks in `out`: on this backend (`ds_compat`: `python -m ds_compat.run`,
    test_glm_door.launch) or on the real DeepSpeed (`deepspeed`: tests/ds_reference_runner.py, without the JIT build of
    its shm op, as test_hf_integration's references run); the ranks' output."""
    if backend == "ds_compat":
        return launch(script, 2, out, *args)
    out.mkdir(parents=True, exist_ok=True)
    env = {**clean_env(), "DS_ACCELERATOR": "cpu"}
    result = python([str(REFERENCE_RUNNER), str(script), "--out", str(out), *args], 2, env, cwd=out, ranked=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout + result.stderr


SWIFT_SCRIPT = REPO / "tests" / "swift_pattern_script.py"
# The runs of each backend. The real DeepSpeed's full fine-tuning runs at ZeRO 2: at ZeRO 3 on a CPU it fails in its
# own zero_grad on the parameters the hook used outside the forward (`p.grad.record_stream`, a CUDA-only call); the
# ZeRO stage changes no loss, so ours at ZeRO 3 (with EP) and at ZeRO 2 are held to the same numbers.
SWIFT_RUNS = {"ds_compat": "full_zero3_ep,full_zero2,lora_zero3_ep", "deepspeed": "full_zero2,lora_zero3_ep"}


@pytest.fixture(scope="module")
def swift_runs(base_and_adapter, tmp_path_factory) -> dict:
    hf_dir, _ = base_and_adapter
    root = tmp_path_factory.mktemp("swift_pattern")
    found = {}
    for backend, runs in SWIFT_RUNS.items():
        out = root / backend
        log = on_backend(backend, SWIFT_SCRIPT, out, "--hf_dir", str(hf_dir), "--runs", runs)
        found[backend] = {"log": log, **json.loads((out / "result.json").read_text())}
    return found


@pytest.mark.parametrize(
    "ours, theirs", [("full_zero3_ep", "full_zero2"), ("full_zero2", "full_zero2"), ("lora_zero3_ep", "lora_zero3_ep")]
)
def test_ms_swift_pattern_equals_deepspeed(swift_runs, ours, theirs):
    """The hook's direct calls of embed_tokens and the vision tower work under ZeRO 3 (each an FSDP unit of its own,
    gathered when called) and inputs_embeds with the collator's mRoPE positions are taken, with EP on."""
    mine, reference = swift_runs["ds_compat"][ours], swift_runs["deepspeed"][theirs]
    assert mean_relative_error(mine["losses"], reference["losses"], 4) <= LIMIT, (mine["losses"], reference["losses"])
    assert "registered a forward pre-hook on the model" in swift_runs["ds_compat"]["log"]
    if ours.endswith("_ep"):
        assert mine["plans"]["expert_parallel"] == 3
    if ours.startswith("lora"):
        assert mine["plans"]["lora"] > 0


TRAINER_SCRIPT = REPO / "tests" / "peft_trainer_script.py"


@pytest.fixture(scope="module", params=["hf", "trl"])
def trainer_pair(request, base_and_adapter, tmp_path_factory) -> dict:
    hf_dir, _ = base_and_adapter
    root = tmp_path_factory.mktemp(f"peft_{request.param}")
    found = {}
    for backend in ("deepspeed", "ds_compat"):
        out = root / backend
        log = on_backend(backend, TRAINER_SCRIPT, out, "--hf_dir", str(hf_dir), "--trainer", request.param)
        found[backend] = {**json.loads((out / "result.json").read_text()), "log": log, "out": out}
    return found


def test_hf_trainer_and_trl_with_peft_equal_deepspeed(trainer_pair, base_and_adapter):
    """The HF Trainer with a PeftModel / TRL's SFTTrainer(peft_config=...), gradient_checkpointing=True, ZeRO 3 and
    autoep 2: the same per-step losses as the real DeepSpeed (whose AutoEP skips a PEFT model), on the whole engine;
    the adapter save_model writes holds the same weights as DeepSpeed's."""
    from safetensors.torch import load_file

    ours, theirs = trainer_pair["ds_compat"], trainer_pair["deepspeed"]
    assert ours["backend"].startswith("ds_compat") and not theirs["backend"].startswith("ds_compat")
    assert mean_relative_error(ours["losses"], theirs["losses"], 4) <= LIMIT, (ours["losses"], theirs["losses"])
    assert ours["trainable"] == theirs["trainable"]
    assert "GLM-4.5V recognised (PeftModel" in ours["log"] and "[plan lora]" in ours["log"]
    assert "[plan expert_parallel]" in ours["log"] and "[plan recompute]" in ours["log"]
    mine, reference = (load_file(side["out"] / "adapter" / "adapter_model.safetensors") for side in (ours, theirs))
    assert mine.keys() == reference.keys()
    for key in reference:
        torch.testing.assert_close(mine[key], reference[key], rtol=1e-4, atol=1e-6)


def _tiny_peft(**lora) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = Glm4vMoeForConditionalGeneration(load_hf_config(ModelConfig()))
    return get_peft_model(model, LoraConfig(**{"r": 4, "lora_alpha": 8, **lora}))


def test_take_adapters_reads_each_layer_as_peft_built_it():
    """Each layer's own rank and scaling (rank_pattern, rsLoRA), the experts' stacks in our layout, requires_grad by
    name, and PEFT's keys <-> ours both ways; the base is transformers' model again."""
    from peft.tuners.lora import LoraLayer

    from glm45v_fsdp.lora.peft_format import to_peft
    from glm45v_fsdp.lora.peft_model import take_adapters

    model = _tiny_peft(
        target_modules=["q_proj", "v_proj"],
        target_parameters=["mlp.experts.gate_up_proj"],
        rank_pattern={"layers.0.self_attn.q_proj": 8},
        use_rslora=True,
    )
    before = dict(model.state_dict())
    taken = take_adapters(model)
    base = model.get_base_model()
    assert not any(isinstance(module, LoraLayer) for module in base.modules())
    q0 = "model.language_model.layers.0.self_attn.q_proj"
    assert taken.spec.linear[q0].rank == 8 and taken.spec.linear[q0].alpha / 8 == pytest.approx(8 / 8**0.5)
    assert taken.spec.linear["model.language_model.layers.1.self_attn.v_proj"].rank == 4
    assert set(taken.spec.experts) == {f"model.language_model.layers.{i}.mlp.experts" for i in (1, 2, 3)}
    assert all(set(stacks) == {"gate_up_proj"} for stacks in taken.spec.experts.values())
    stack = "model.language_model.layers.1.mlp.experts.gate_up_proj_lora_A"
    assert taken.our_value(stack, taken.parameters[stack].detach()).shape == (8, 4, 64)
    assert taken.spec.trained == frozenset(taken.parameters)  # PEFT froze the base
    names = taken.names
    for key, value in model.state_dict().items():  # the base's tensors, now under our names
        assert torch.equal(before[names.ours_to_peft.get(key, key)], value)
    shell = "base_model.model." + stack
    peft_key = names.ours_to_peft[shell]
    assert peft_key.endswith("experts.lora_A.default.weight")
    round_trip = {peft_key: before[peft_key]}
    names.from_peft(round_trip)
    assert torch.equal(to_peft(stack, round_trip[shell]), before[peft_key])


@pytest.mark.parametrize(
    "lora, words",
    [
        ({"target_modules": ["q_proj"], "use_dora": True}, "use_dora"),
        ({"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"target_modules": ["embed_tokens"]}, "Embedding"),
    ],
)
def test_take_adapters_refuses_what_the_lora_plan_does_not_compute(lora, words):
    from glm45v_fsdp.errors import UserError
    from glm45v_fsdp.lora.peft_model import take_adapters

    with pytest.raises(UserError, match=words):
        take_adapters(_tiny_peft(**lora))
