"""LoRA on the whole engine (glm45v_fsdp/lora): the trainer door with model.lora equals PEFT on transformers'
GLM-4.5V, step by step, on the same batches, from the same adapter (PEFT's, with random A and B so the first step
already tests the update), alone and under expert parallelism with recompute and the chunked loss; the adapter the run
saves loads in PEFT and gives the run's loss; the adapter layout conversions are exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import mean_relative_error, read_metrics, train, train_many
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import Glm4vMoeForConditionalGeneration

from glm45v_fsdp.adapters import is_adapter
from glm45v_fsdp.checkpoint.dcp import read_model_tensors
from glm45v_fsdp.config import ModelConfig
from glm45v_fsdp.lora.peft_format import from_peft, to_peft
from glm45v_fsdp.model import load_hf_config
from glm45v_fsdp.tools import convert, preflight

STEPS = 4
RANK, ALPHA = 4, 8.0
# PEFT's names: the text layers' attention and the vision blocks' fused qkv. (PEFT on transformers 5 turns GLM-4.5V's
# gate_proj / up_proj / down_proj targets into the routed experts' target_parameters, its v4 -> v5 conversion, so the
# shared-expert and vision MLP linears cannot be PEFT targets; ours can.)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "qkv"]
OUR_TARGETS = [f"model.language_model.layers.{{*}}.self_attn.{name}" for name in TARGETS[:4]] + [
    "model.visual.blocks.{*}.attn.qkv"
]
EXPERT_STACKS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
FP32_CONSTANT_LR = [
    "parallel.fsdp_plan.param_dtype=fp32",
    "parallel.fsdp_plan.reduce_dtype=fp32",
    "training.micro_batch_size=2",
    "training.gradient_accumulation_steps=1",
    f"training.train_iters={STEPS}",
    f"training.dump_batches={STEPS}",
    "training.lr=0.001",
    "training.lr_scheduler=constant",
    "training.clip_grad=0",
    "training.progress_bar=false",
    "data.synthetic_video_every=0",  # transformers' forward cannot take images and videos in one batch
]


@pytest.fixture(scope="module")
def base_and_adapter(tmp_path_factory) -> tuple[Path, Path]:
    """transformers' tiny GLM-4.5V (save_pretrained) and a PEFT LoRA adapter of it on the attention and the routed
    experts, A and B both random (init_lora_weights=False)."""
    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(5)
    model = Glm4vMoeForConditionalGeneration(load_hf_config(ModelConfig()))
    model.save_pretrained(root / "base")
    config = LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, target_parameters=EXPERT_STACKS, init_lora_weights=False
    )
    get_peft_model(model, config).save_pretrained(root / "adapter")
    return root / "base", root / "adapter"


def peft_model(base: Path, adapter: Path) -> torch.nn.Module:
    model = Glm4vMoeForConditionalGeneration.from_pretrained(base, dtype=torch.float32)
    return PeftModel.from_pretrained(model, adapter, is_trainable=True)


def loss_sum(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, int]:
    """The summed next-token cross-entropy of a batch and its supervised token count."""
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
    labels = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    total = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return total, int((labels != -100).sum())


def peft_losses(base: Path, adapter: Path, batches: list[list[Path]]) -> list[float]:
    """PEFT on transformers in one process: per step, the data-parallel ranks' batches averaged as the trainer's
    default loss averages them (each micro batch's token mean, then the mean over the ranks), AdamW as the run's
    (constant lr, no clipping)."""
    model = peft_model(base, adapter)
    trainable = [param for param in model.parameters() if param.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    losses = []
    for step_batches in batches:
        sums = [loss_sum(model, torch.load(path, weights_only=True)) for path in step_batches]
        loss = sum(total / count for total, count in sums) / len(sums)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses


def peft_eval_loss(base: Path, adapter: Path, batch_file: Path) -> float:
    model = peft_model(base, adapter)
    with torch.no_grad():
        total, tokens = loss_sum(model, torch.load(batch_file, weights_only=True))
    return float(total) / tokens


LAYOUTS = {
    "one rank": (1, []),
    "EP 2 + recompute + dynamic chunk loss": (
        2,
        [
            "parallel.expert_parallel_size=2",
            "features.recompute.enabled=true",
            "features.chunk_loss.mode=dynamic",
        ],
    ),
    # EP balance: the busiest rank's surplus pairs run on replicas, which bring their experts' adapters along
    "EP 2 + balance": (
        2,
        [
            "parallel.expert_parallel_size=2",
            "features.ep_balance.enabled=true",
            "features.ep_balance.trigger_max_over_mean=1.0",
            "features.ep_balance.target_max_over_mean=1.0",
        ],
    ),
    # one data-parallel rank: both ranks dump the same (whole) batch, the reference counts it twice (same mean)
    "Ulysses 2": (2, ["parallel.ulysses_parallel_size=2"]),
    "Ring 2": (2, ["parallel.ring_attention_size=2"]),
}


def out_dir(root: Path, layout: str) -> Path:
    return root / layout.replace(" ", "_")


@pytest.fixture(scope="module")
def runs(base_and_adapter, tmp_path_factory) -> dict[str, Path]:
    """Each layout's run from PEFT's adapter: the one-rank run alone, the two-rank ones in one job (one start-up)."""
    base, adapter = base_and_adapter
    root = tmp_path_factory.mktemp("lora_runs")
    lora = [
        f"training.load={base}",
        f"model.lora.rank={RANK}",
        f"model.lora.alpha={ALPHA}",
        "model.lora.experts=true",
        f"model.lora.target_modules=[{', '.join(OUR_TARGETS)}]",
        f"model.lora.init_from={adapter}",
    ]
    single = out_dir(root, "one rank")
    result = train(single, FP32_CONSTANT_LR + lora)
    assert result.returncode == 0, result.stderr[-3000:]
    (single / "train.log").write_text(result.stdout + result.stderr)
    two = {name: FP32_CONSTANT_LR + lora + extra for name, (nproc, extra) in LAYOUTS.items() if nproc == 2}
    train_many(root, two, nproc=2)
    return {name: out_dir(root, name) for name in LAYOUTS}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_equals_peft_on_transformers(runs, base_and_adapter, layout):
    out, (nproc, _) = runs[layout], LAYOUTS[layout]
    batches = [[out / "batches" / f"rank{rank}_micro{step}.pt" for rank in range(nproc)] for step in range(STEPS)]
    reference = peft_losses(*base_and_adapter, batches)
    ours = [record["loss"] for record in read_metrics(out)]
    assert len(ours) == STEPS
    assert mean_relative_error(ours, reference, steps=STEPS) <= 1e-5, (ours, reference)
    assert reference[-1] < reference[0]  # it trains: the comparison is not one of constants
    log = (out / "train.log").read_text()
    assert "lora: adapters on 18 linear module(s), 3 experts module(s) (6 stack(s))" in log
    assert "weights: LoRA adapters from PEFT adapter" in log
    if "balance" in layout:  # replicas ran, each with its expert's adapters
        assert sum(record["ep_replicas"] for record in read_metrics(out)) > 0


def test_the_saved_adapter_loads_in_peft_with_our_loss(runs, base_and_adapter, tmp_path):
    """<output_dir>/adapter of the EP 2 run, read back by PEFT on transformers' model and by our trainer
    (model.lora.init_from, lr 0): the same loss on the same batch; and it holds the trained values, not the start."""
    base, start = base_and_adapter
    saved = runs["EP 2 + recompute + dynamic chunk loss"] / "adapter"
    assert (saved / "adapter_config.json").is_file() and (saved / "adapter_model.safetensors").is_file()
    out = tmp_path / "reload"
    lora = [f"training.load={base}", f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}", "model.lora.experts=true"]
    lora.append(f"model.lora.target_modules=[{', '.join(OUR_TARGETS)}]")
    overrides = (
        FP32_CONSTANT_LR
        + lora
        + [f"model.lora.init_from={saved}", "training.lr=0", "training.min_lr=0", "training.train_iters=1"]
    )
    result = train(out, overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    batch = out / "batches" / "rank0_micro0.pt"
    ours = read_metrics(out)[0]["loss"]
    assert abs(peft_eval_loss(base, saved, batch) - ours) <= 1e-5 * ours
    assert abs(peft_eval_loss(base, start, batch) - ours) > 1e-4 * ours  # training moved the adapters


def test_a_lora_run_resumes_exactly(runs, base_and_adapter, tmp_path):
    """2 steps with a checkpoint, then training.resume=auto to step 4: steps 3 and 4 equal the straight run's; the
    checkpoint holds the trainable state only and a reference to the base (which the resume loads, and refuses once
    the base's files changed); its adapter/ loads in PEFT."""
    base, adapter = base_and_adapter
    lora = [f"training.load={base}", f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}", "model.lora.experts=true"]
    lora.append(f"model.lora.target_modules=[{', '.join(OUR_TARGETS)}]")
    lora += [f"model.lora.init_from={adapter}", f"training.save={tmp_path / 'save'}"]
    first = train(tmp_path / "first", FP32_CONSTANT_LR + lora + ["training.train_iters=2"])
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = train(tmp_path / "resumed", FP32_CONSTANT_LR + lora + ["training.resume=auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "continuing from" in resumed.stdout + resumed.stderr
    straight = [record["loss"] for record in read_metrics(runs["one rank"])]
    again = [record["loss"] for record in read_metrics(tmp_path / "resumed")]
    assert [record["step"] for record in read_metrics(tmp_path / "resumed")] == [3, 4]
    assert again == straight[2:], (again, straight)
    # the step-2 checkpoint carries its adapters in PEFT's format, checksummed: PEFT gives the resumed step-3 loss
    adapter = tmp_path / "save" / "step_00000002" / "adapter"
    assert "adapter/adapter_model.safetensors" in (adapter.parent / "manifest.json").read_text()
    step3 = peft_eval_loss(base, adapter, tmp_path / "resumed" / "batches" / "rank0_micro0.pt")
    assert abs(step3 - again[0]) <= 1e-5 * again[0]
    # the trainable state only: the adapters' tensors and their optimizer state, the base by reference
    checkpoint = adapter.parent
    saved = read_model_tensors(checkpoint)
    assert saved and all(is_adapter(name) for name in saved), sorted(saved)[:5]
    reference = json.loads((checkpoint / "base.json").read_text())
    assert reference["path"] == str(base.absolute()) and "base.json" in (checkpoint / "manifest.json").read_text()
    assert "the frozen base from" in resumed.stdout + resumed.stderr
    base_bytes = sum(file.stat().st_size for file in base.glob("*.safetensors"))
    assert sum(file.stat().st_size for file in checkpoint.glob("*.distcp")) < base_bytes / 2  # the whole: > base
    reference["files"] = {name: size + 1 for name, size in reference["files"].items()}
    for step in (tmp_path / "save").glob("step_*"):  # the resumed run's step-4 checkpoint is the latest now
        (step / "base.json").write_text(json.dumps(reference))
        (step / "manifest.json").unlink()  # edited on purpose: the base check, not the checksum, speaks
    refused = train(tmp_path / "refused", FP32_CONSTANT_LR + lora + ["training.resume=auto", "training.train_iters=3"])
    assert refused.returncode != 0 and "not the ones the run started from" in refused.stdout + refused.stderr


def test_expert_stack_layouts_round_trip():
    """PEFT's flat experts factors <-> our [E, r, in] / [E, out, r] stacks, checked against PEFT's own delta."""
    experts, rank, out_features, in_features = 3, 2, 5, 4
    peft_a = torch.randn(rank * experts, in_features)
    peft_b = torch.randn(out_features, rank * experts)
    ours_a, ours_b = (
        from_peft("x.gate_up_proj_lora_A", peft_a, experts),
        from_peft("x.gate_up_proj_lora_B", peft_b, experts),
    )
    # PEFT's ParamWrapper delta for (experts, out, in) stacks: einsum("o r e, e r i -> e o i")
    delta = torch.einsum(
        "ore,eri->eoi", peft_b.reshape(out_features, rank, experts), peft_a.reshape(experts, rank, in_features)
    )
    assert torch.allclose(torch.bmm(ours_b, ours_a), delta)
    assert torch.equal(to_peft("x.gate_up_proj_lora_A", ours_a), peft_a)
    assert torch.equal(to_peft("x.gate_up_proj_lora_B", ours_b), peft_b)


def test_a_frozen_base_in_bf16_changes_no_loss(tmp_path):
    """bf16 compute, EP 2: the frozen base stored in bf16 (the default) or in fp32 gives the same losses, since FSDP2
    all-gathers both as bf16 for compute."""
    lora = ["parallel.expert_parallel_size=2", "model.lora.rank=4", "model.lora.experts=true", "training.train_iters=3"]
    runs = {"bf16 base": lora, "fp32 base": [*lora, "model.lora.frozen_in_compute_dtype=false"]}
    results = train_many(tmp_path, runs, nproc=2)
    bf16, fp32 = ([record["loss"] for record in records] for _, records in results.values())
    assert mean_relative_error(bf16, fp32, steps=3) <= 1e-6, (bf16, fp32)
    assert "the frozen base (0.49M parameters) is stored in bf16" in results["bf16 base"][0]
    assert "is stored in" not in results["fp32 base"][0]
    # ep = dp, but fp32 stacks (the adapters, or the whole base) need FSDP's cast: units, not left plain
    for stdout, _ in results.values():
        assert "expert stack(s) over 1 rank(s)" in stdout and "left plain" not in stdout


def test_preflight_counts_a_frozen_bf16_base_and_no_optimizer_for_it(capsys):
    """106B LoRA r=8 (attention + routed experts) on 8 ranks: the base's bytes per rank halve in bf16; gradients and
    optimizer state are the adapters' only; it fits the 64 GiB device, which the fp32 base does not."""
    figures = {}
    for stored in ("true", "false"):
        argv = ["--json", "--world-size", "8", "--config", "glm45v_106b_sft", "model.lora.rank=8",
                "model.lora.experts=true", f"model.lora.frozen_in_compute_dtype={stored}"]  # fmt: skip
        code = preflight.main(argv)  # in process, as test_plan runs preflight: no interpreter start-up
        out, err = capsys.readouterr()
        assert code == 0, err[-3000:]
        figures[stored] = json.loads(out)["memory"]
    bf16, fp32 = (figures[key]["per_rank"][0] for key in ("true", "false"))
    assert 0.49 < bf16["params"] / fp32["params"] < 0.51
    assert bf16["grads"] == fp32["grads"] and bf16["optimizer"] == fp32["optimizer"]
    assert bf16["optimizer"] < 0.03 * bf16["params"]  # adapters only: r=8 against 106B frozen
    assert figures["true"]["fits"] and not figures["false"]["fits"]


@pytest.mark.parametrize("which", ["ours", "PEFT's"])
def test_lora_merge_gives_the_adapted_models_loss(runs, base_and_adapter, tmp_path, capsys, which):
    """tools.convert lora-merge: base + adapter (the EP 2 run's, or PEFT's own file) -> an HF directory that
    transformers' from_pretrained loads and that gives PEFT's loss with the adapter on the same batch."""
    base, start = base_and_adapter
    out = runs["EP 2 + recompute + dynamic chunk loss"]
    adapter = out / "adapter" if which == "ours" else start
    merged = tmp_path / "merged"
    code = convert.main(["lora-merge", str(base), str(adapter), str(merged)])  # in process, as test_hf_weights
    printed, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    assert "(24 adapted weight(s))" in printed, printed  # 18 linear layers, 3 x 2 expert stacks
    batch_file = out / "batches" / "rank0_micro0.pt"
    model = Glm4vMoeForConditionalGeneration.from_pretrained(merged, dtype=torch.float32)
    with torch.no_grad():
        total, tokens = loss_sum(model, torch.load(batch_file, weights_only=True))
    expected = peft_eval_loss(base, adapter, batch_file)
    assert abs(float(total) / tokens - expected) <= 1e-5 * expected
    assert abs(peft_eval_loss(base, start, batch_file) - peft_eval_loss(base, out / "adapter", batch_file)) > 1e-4


def test_plan_reports_lora_beside_full_finetuning(capsys):
    """tools.plan with model.lora, 106B at 8192 tokens on one node of 910B: the LoRA job's layouts fit, and beside them
    the same job trained in full does not (it needs more than 3x a device's memory)."""
    from glm45v_fsdp.tools.plan import main

    job = ["--config", "glm45v_106b_sft", "--device", "910b", "--nodes", "1", "--tokens", "8192", "--top", "3"]
    job += ["--unit-mib", "default"]  # one FSDP unit size: half the search, the same verdicts
    lora = ["model.lora.rank=8", "model.lora.alpha=16", "model.lora.experts=true"]
    assert main([*job, "--json", *lora]) == 0
    report = json.loads(capsys.readouterr().out)
    full = report["full_finetuning"]
    assert report["fitting"] > 0 and report["top"][0]["gib_per_rank"] <= report["usable_gib"]
    assert full["fitting"] == 0 and full["closest"]["gib_per_rank"] > 3 * report["usable_gib"]
