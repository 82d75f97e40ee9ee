"""Tools: preflight (plans, layout, per-rank memory), the estimator against a real 2-rank FSDP2 allocation and the
saved activations of a real forward, the batch dumper and compare-batches."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
from conftest import clean_env, end_worker, free_port, spawn
from torch.distributed.tensor import DTensor
from transformers import Glm4vMoeForConditionalGeneration

from glm45v_fsdp.config import ModelConfig, load_config
from glm45v_fsdp.data import build_dataset, build_image_processor, build_tiny_tokenizer, collate
from glm45v_fsdp.data.dump import MODEL_KEYS, BatchDumper, dump_path
from glm45v_fsdp.memory.estimate import ParamSpec, ShardLayout, activation_bytes, shard_rows, transient_bytes
from glm45v_fsdp.model import build_meta_model, load_hf_config, materialize, model_loss_sum
from glm45v_fsdp.plans import MoEPlan, PlanContext
from glm45v_fsdp.preflight import minimal_dims
from glm45v_fsdp.runtime import select_device
from glm45v_fsdp.tools import compare_batches, preflight, preflight_report

REPO = Path(__file__).resolve().parents[1]
CONFIG_106B = str(REPO / "configs" / "glm45v_106b_sft.yaml")
GIB = 1 << 30


def run_preflight(capsys, *argv: str) -> tuple[int, str, str]:
    code = preflight.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def preflight_json(capsys, *argv: str) -> dict:
    code, out, err = run_preflight(capsys, "--json", *argv)
    assert code == 0, err
    return json.loads(out)


# Every command-line entry point answers --help (and a usage error) before anything imports torch or transformers.
HELP_PROBE = """
import runpy, sys
for module, argv in {commands!r}:
    sys.argv = [module, *argv, "--help"]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as end:
        assert end.code in (0, None), (module, end.code)
    heavy = sorted(name for name in ("torch", "transformers") if name in sys.modules)
    assert not heavy, (module, argv, heavy)
print("ok")
"""
HELP_COMMANDS = [
    ("glm45v_fsdp.train", []),
    ("glm45v_fsdp.tools.preflight", []),
    ("glm45v_fsdp.tools.plan", []),
    ("glm45v_fsdp.tools.convert", []),
    ("glm45v_fsdp.tools.convert", ["dcp-to-hf"]),
    ("glm45v_fsdp.tools.compare_batches", []),
    ("glm45v_fsdp.tools.compare-batches", []),
    ("glm45v_fsdp.tools.bench", []),
    *[("glm45v_fsdp.tools.bench", [name]) for name in ("overhead", "memory", "ep", "longest", "deepspeed", "ops")],
]


def test_help_of_every_command_answers_before_torch_is_imported():
    probe = HELP_PROBE.format(commands=HELP_COMMANDS)
    result = subprocess.run([sys.executable, "-c", probe], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.endswith("ok\n"), result.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------------------
# Preflight
# ---------------------------------------------------------------------------------------------------------------


def test_shard_rows_follow_torch_chunk():
    for rows in (1, 5, 7, 64, 509):
        for n in (1, 2, 3, 4, 8):
            chunks = torch.arange(rows).chunk(n)
            assert [shard_rows(rows, n, i) for i in range(n)] == [len(c) for c in chunks] + [0] * (n - len(chunks))


def test_preflight_counts_video_patches_and_splits_them_over_cp(capsys):
    """The tiny config: one 56 px image (16 patches) per sample and, with --videos-per-sample 2 --video-frames 8, two
    videos of 4 temporal patches of 16 patches: 144 patches per sample, 288 per micro batch of 2. Ulysses 2 gives
    each rank whole items, the larger share counted; more patches, more activation bytes."""
    reports = {}
    for name, extra in {
        "images": ["--videos-per-sample", "0"],
        "videos": ["--videos-per-sample", "2", "--video-frames", "8"],
        "videos_cp2": ["--videos-per-sample", "2", "--video-frames", "8", "parallel.ulysses_parallel_size=2"],
    }.items():
        code, out, err = run_preflight(capsys, "--json", "--world-size", "2", *extra)
        assert code == 0, err
        reports[name] = json.loads(out)["memory"]
    assumptions = {name: next(a for a in r["assumptions"] if a.startswith("images:")) for name, r in reports.items()}
    assert assumptions["images"].endswith("= 32 patches per micro batch") and "video" not in assumptions["images"]
    assert "2 video(s) of 8 frames 56x56 px per sample -> 4 temporal patches of 16 patches" in assumptions["videos"]
    assert assumptions["videos"].endswith("= 288 patches per micro batch")
    # 18 items of 16 patches over 2 ranks: 9 each
    assert assumptions["videos_cp2"].endswith("split over cp 2: 9 item(s) per rank = 144 patches per micro batch")
    activations = {name: r["activations"]["total"] for name, r in reports.items()}
    assert activations["images"] < activations["videos"]
    code, _, err = run_preflight(capsys, "--videos-per-sample", "-1")
    assert code == 2 and "--videos-per-sample = -1 is invalid" in err


def test_preflight_tiny_on_one_and_four_ranks(capsys):
    code, out, _ = run_preflight(capsys, "--world-size", "4")
    assert code == 0
    assert "[plan fsdp] 5 pattern(s)" in out and "model.language_model.layers.{*}: 4 module(s)" in out
    assert "memory per rank" in out and "rank 0" in out and "activation formula:" in out

    hf_config = load_hf_config(ModelConfig())
    total_params = sum(p.numel() for p in build_meta_model(hf_config).parameters())
    one = preflight_json(capsys, "--world-size", "1")["memory"]
    assert not one["fsdp_applied"] and len(one["per_rank"]) == 1
    rank = one["per_rank"][0]
    # no sharding on one rank: the whole model, no padding; bf16 autocast copies of every weight
    assert (rank["params"], rank["grads"], rank["padding"]) == (4 * total_params, 4 * total_params, 0)
    assert rank["optimizer"] == 8 * total_params + 4 * len(list(build_meta_model(hf_config).parameters()))
    assert rank["transient"] == 2 * total_params

    four = preflight_json(capsys, "--world-size", "4")["memory"]
    assert four["fsdp_applied"] and four["shard_size"] == 4
    assert sum(r["params"] for r in four["per_rank"]) == 4 * total_params  # the shards partition the model
    assert four["max"]["params"] < one["max"]["params"] / 3
    tokens = 2 * 512  # micro_batch_size x cutoff_len of the tiny config
    assert four["activations"]["loss_peak"] == 3 * tokens * hf_config.text_config.vocab_size * 4


def test_preflight_context_parallel_splits_the_activations(capsys):
    code, out, _ = run_preflight(capsys, "--world-size", "4", "parallel.ulysses_parallel_size=2")
    assert code == 0 and "[plan context_parallel] 1 pattern(s)" in out and "model.language_model: 1 module(s)" in out
    cp1 = preflight_json(capsys, "--world-size", "4")["memory"]
    cp2 = preflight_json(capsys, "--world-size", "4", "parallel.ulysses_parallel_size=2")["memory"]
    assert cp2["activations"]["loss_peak"] * 2 == cp1["activations"]["loss_peak"]
    assert cp2["max"]["params"] == cp1["max"]["params"]  # FSDP shards over dp_shard x cp either way
    # Ring CP 2: the same split of the tokens, plus the ring's block buffers; hybrid 2 x 2 splits them 4 ways
    code, out, _ = run_preflight(capsys, "--world-size", "4", "parallel.ring_attention_size=2")
    assert code == 0 and "key/value blocks go round a ring of 2 (Ring attention, zigzag layout)" in out
    assert "ring attention: block buffers" in out
    ring2 = preflight_json(capsys, "--world-size", "4", "parallel.ring_attention_size=2")["memory"]
    assert ring2["activations"]["loss_peak"] == cp2["activations"]["loss_peak"]
    hybrid = ["parallel.ring_attention_size=2", "parallel.ulysses_parallel_size=2"]
    cp4 = preflight_json(capsys, "--world-size", "4", *hybrid)["memory"]
    assert cp4["activations"]["loss_peak"] * 4 == cp1["activations"]["loss_peak"]


def test_preflight_counts_the_units_that_run(capsys):
    """The estimate sees the units apply_fsdp builds: merged to the unit size (the device's default when null; auto
    is the npu target: one unit per module), what cannot fill a unit gathered with the root; prefetch holds more."""
    per_module = preflight_json(capsys, "--world-size", "2", "parallel.fsdp_plan.unit_mib=0")["memory"]
    assert preflight_json(capsys, "--world-size", "2")["memory"]["transient"] == per_module["transient"]
    assert per_module["fsdp_units"] == 10  # 9 planned modules + the root
    merged = preflight_json(capsys, "--world-size", "2", "training.device=cpu")["memory"]
    assert merged["fsdp_units"] == 1  # cpu default 32 MiB: the root holds the whole tiny model
    assert "FSDP units: 0 planned module(s) in 0 unit(s) at unit_mib 32 (the cpu default)" in merged["assumptions"]
    assert merged["transient"]["params"] > 2 * per_module["transient"]["params"]  # the root holds the text model
    prefetched = ["parallel.fsdp_plan.unit_mib=0", "parallel.fsdp_plan.prefetch=3"]
    deeper = preflight_json(capsys, "--world-size", "2", *prefetched)["memory"]["transient"]
    assert "running + 3 prefetched" in deeper["assumption"]
    assert deeper["params"] > per_module["transient"]["params"]


def test_preflight_106b_on_128_ranks(capsys):
    started = time.perf_counter()
    code, out, _ = run_preflight(capsys, "--config", CONFIG_106B, "--world-size", "128", "--device-memory-gib", "64")
    assert time.perf_counter() - started < 60
    assert code == 0
    assert "model.language_model.layers.{*}: 46 module(s)" in out and "memory per rank, GiB" in out
    assert "device memory 64 GiB:" in out
    memory = preflight_json(capsys, "--config", CONFIG_106B, "--world-size", "128")["memory"]
    n_params = 107.71e9
    assert memory["max"]["params"] == pytest.approx(n_params * 4 / 128, rel=0.01)
    assert memory["max"]["grads"] == memory["max"]["params"]
    assert memory["max"]["optimizer"] == pytest.approx(2 * memory["max"]["params"], rel=0.01)
    assert len(memory["per_rank"]) == 128
    # transient: the two largest gathered units in bf16. Without EP two MoE layers (~2.34B parameters each, 128
    # experts); under the shipped config's EP 8 a layer gathers its dense part and 16 experts (~0.40B), so the
    # largest units are the embedding and lm_head (151552 x 4096 each)
    experts_per_layer = 128 * 3 * 4096 * 1408
    assert 2.34e9 - experts_per_layer * 7 / 8 < 151552 * 4096
    assert memory["transient"]["params"] == pytest.approx(2 * 151552 * 4096 * 2, rel=0.01)
    assert memory["max"]["expert_params"] == pytest.approx(45 * experts_per_layer * 4 / 128, rel=0.001)
    assert memory["fits"] and memory["max"]["total"] < 40 * 2**30  # EP 8, recompute and the chunked loss
    ep1 = preflight_json(capsys, "--config", CONFIG_106B, "--world-size", "128", "parallel.expert_parallel_size=1")
    assert ep1["memory"]["transient"]["params"] == pytest.approx(2 * 2.34e9 * 2, rel=0.02)
    assert ep1["memory"]["max"]["expert_params"] == memory["max"]["expert_params"]  # the state is 1/128 either way
    assert ep1["memory"]["max"]["total"] - memory["max"]["total"] > 14 * 2**30
    plain = ["features.recompute.enabled=false", "features.chunk_loss.mode=off", "parallel.expert_parallel_size=1"]
    without = preflight_json(capsys, "--config", CONFIG_106B, "--world-size", "128", *plain)["memory"]
    assert without["activations"]["loss_peak"] == 3 * 8192 * 151552 * 4 and not without["fits"]
    assert without["max"]["total"] > 2.5 * memory["max"]["total"]
    frozen = preflight_json(capsys, "--config", CONFIG_106B, "--world-size", "128", "model.freeze=[model.visual]")
    assert frozen["memory"]["max"]["grads"] < memory["max"]["grads"] - 0.8e9 * 4 / 128


def test_preflight_deepspeed_runs_on_the_translated_config(capsys, tmp_path):
    """--deepspeed: the ds_config translated as `train --deepspeed` does; the plans and the memory are those of the
    YAML with the translation's overrides, and DeepSpeed's keys switch the plans."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "expert_parallel": {"enabled": True, "autoep_size": 2},
        "activation_checkpointing": {"cpu_checkpointing": True},
        "glm45v_fsdp": {"features": {"chunk_loss": {"mode": "dynamic"}}},
    }))  # fmt: skip
    report = preflight_json(capsys, "--world-size", "4", "--deepspeed", str(path))
    assert report["layout"]["ep"] == 2 and not report["errors"]
    enabled = {plan["plan"] for plan in report["plans"] if plan["enabled"]}
    assert {"expert_parallel", "recompute", "activation_offload", "chunk_loss"} <= enabled
    plain = {plan["plan"] for plan in preflight_json(capsys, "--world-size", "4")["plans"] if plan["enabled"]}
    assert not {"expert_parallel", "activation_offload", "chunk_loss"} & plain
    same = preflight_json(capsys, "--world-size", "4", *report["deepspeed"]["overrides"])
    assert same["memory"] == report["memory"] and same["plans"] == report["plans"]
    code, out, _ = run_preflight(capsys, "--world-size", "4", "--deepspeed", str(path))
    assert code == 0 and f"DeepSpeed config {path} for 4 ranks" in out and "parallel.expert_parallel_size=2" in out
    code, _, err = run_preflight(capsys, "--deepspeed", str(path))
    assert code == 2 and "--deepspeed needs --world-size" in err


@pytest.mark.parametrize(
    "argv, names",
    [
        (
            ["parallel.fsdp_plan.apply_modules=[model.visual, model.language_model.layerz.{*}]"],
            ["parallel.fsdp_plan.apply_modules", "model.language_model.layerz.{*}"],
        ),
        (["model.freeze=[model.visual.blocks.{5-6}]"], ["model.freeze", "model.visual.blocks.{5-6}"]),
        (["parallel.fsdp_plan.apply_modules=[model, lm_head]"], ["does not select ['model.visual']"]),
        (["parallel.data_parallel_replicate_size=3"], ["parallel.data_parallel_replicate_size", "world size 4"]),
        (
            ["features.recompute.enabled=true", "features.recompute.apply_modules=[model.nothing]"],
            ["[plan recompute]", "features.recompute.apply_modules", "model.nothing"],
        ),
        (
            ["parallel.ulysses_parallel_size=4", "model.config_overrides.text_config.num_attention_heads=6"],
            ["[plan context_parallel]", "'parallel.ulysses_parallel_size' = 4 does not divide the model's 6"],
        ),
    ],
)
def test_preflight_names_each_problem_and_exits_2(capsys, argv, names):
    code, _, err = run_preflight(capsys, "--world-size", "4", *argv)
    assert code == 2
    assert "Traceback" not in err
    for name in names:
        assert name in err


def test_preflight_reports_every_problem_at_once(capsys):
    code, out, err = run_preflight(
        capsys, "--world-size", "3", "parallel.data_parallel_replicate_size=2", "model.freeze=[model.nothing]"
    )
    assert code == 2
    assert "[layout]" in err and "[plan freeze]" in err and "[plan fsdp]" not in err
    assert "[plan fsdp] 5 pattern(s)" in out and "layout: FAILED" in out
    code, _, err = run_preflight(capsys, "training.micro_batch_sise=2")
    assert code == 2 and "training.micro_batch_size" in err


# ---------------------------------------------------------------------------------------------------------------
# Estimator against a real FSDP2 allocation on 2 ranks
# ---------------------------------------------------------------------------------------------------------------

# vocab 509 shards unevenly (255 / 254 rows); a frozen vision block has no gradients and no optimizer states.
EXACT_OVERRIDES = [
    "model.config_overrides={text_config: {vocab_size: 509}}",
    "model.freeze=[model.visual.blocks.{1}]",
    "training.micro_batch_size=1",
    "data.synthetic_samples=8",
    "training.progress_bar=false",
]


def _storage_bytes(tensors) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _allocation_worker(rank: int, world: int, port: int, out_dir: str, overrides: list[str]) -> None:
    from glm45v_fsdp.builders import build_data, build_model, build_runtime
    from glm45v_fsdp.optim import build_optimizer, recipe_from_training

    torch.set_num_threads(1)
    for name in ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        os.environ.pop(name, None)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    config = load_config(None, EXACT_OVERRIDES + overrides)
    runtime = build_runtime(config)
    model, hf_config = build_model(config, runtime)
    loader, _ = build_data(config, runtime, hf_config)
    optimizer = build_optimizer(model, recipe_from_training(config.training), fused=False)
    loss_sum, tokens = model(next(iter(loader)))
    (loss_sum / tokens).backward()
    optimizer.step()
    named = dict(model.named_parameters())
    params = list(named.values())
    grads = [p.grad for p in params if p.grad is not None]
    assert all(isinstance(p, DTensor) for p in params)
    states = [t for state in optimizer.state.values() for t in state.values()]
    local = [t.to_local() if isinstance(t, DTensor) else t for t in states]
    result = {
        "params": sum(p.to_local().nbytes for p in params),
        "expert_params": sum(p.to_local().nbytes for name, p in named.items() if ".mlp.experts." in name),
        "grads": sum(g.to_local().nbytes for g in grads),
        "optimizer": sum(t.nbytes for t in local),
        "storage": _storage_bytes([p.to_local() for p in params]) + _storage_bytes([g.to_local() for g in grads]),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    end_worker()


@pytest.mark.parametrize("world, extra", [(2, []), (4, ["parallel.expert_parallel_size=2"])], ids=["fsdp2", "ep2x2"])
def test_estimator_equals_a_real_fsdp2_allocation(tmp_path, capsys, world, extra):
    """Dense parameters sharded unevenly (vocab 509); with EP 2 on 4 ranks the expert stacks split 2 ways on dim 0
    and 2 ways on dim 1 (efsdp): the estimate's bytes per rank are the allocation's, byte for byte."""
    port = free_port()
    spawn(_allocation_worker, args=(world, port, str(tmp_path), extra), nprocs=world)
    estimate = preflight_json(capsys, "--world-size", str(world), *EXACT_OVERRIDES, *extra)["memory"]["per_rank"]
    real = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world)]
    assert real[0]["params"] != real[-1]["params"]  # uneven shards: the ranks differ
    for rank in range(world):
        mine = estimate[rank]
        assert mine["params"] == real[rank]["params"], rank
        assert mine["expert_params"] == real[rank]["expert_params"] > 0, rank
        assert mine["grads"] == real[rank]["grads"], rank
        assert mine["optimizer"] == real[rank]["optimizer"], rank
        assert mine["params"] + mine["grads"] + mine["padding"] == real[rank]["storage"], rank
    if extra:  # each rank holds 4 of the 8 experts, half of each one's dim 1: the same bytes as 1/4 of every expert
        text = load_hf_config(ModelConfig()).text_config
        expert_bytes = text.n_routed_experts * 3 * text.moe_intermediate_size * text.hidden_size * 4 * 3  # 3 layers
        assert all(r["expert_params"] == expert_bytes // 4 for r in real)


# ---------------------------------------------------------------------------------------------------------------
# Activation formula against the tensors a real forward saves for backward
# ---------------------------------------------------------------------------------------------------------------


def _tiny_data(hf_config, **overrides):
    config = load_config(None, [f"data.{k}={v}" for k, v in overrides.items()])
    tokenizer = build_tiny_tokenizer()
    dataset = build_dataset(config.data, hf_config, tokenizer, build_image_processor(hf_config.vision_config))
    return dataset, tokenizer.pad_token_id


def test_activation_formula_matches_saved_tensors_of_a_bf16_forward():
    hf_config = load_hf_config(ModelConfig())
    model = build_meta_model(hf_config)
    config = load_config()
    MoEPlan().apply(model, PlanContext(config, minimal_dims(config), hf_config, select_device("cpu")))  # our block
    materialize(model, torch.device("cpu"), 0)
    model.to(torch.bfloat16)  # what FSDP2's param_dtype=bf16 computes with
    dataset, pad = _tiny_data(hf_config, synthetic_text_tokens=300, synthetic_image_size=112)
    batch = collate([dataset[0]], pad)
    batch["pixel_values"] = batch["pixel_values"].bfloat16()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weights |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    packed: list[weakref.ref] = []

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in weights:
            packed.append(weakref.ref(tensor))  # the graph holds the tensor itself: alive while backward needs it
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss_sum, _ = model_loss_sum(model, batch)
    # Count each storage the graph still holds once the forward is done. A tensor saved by a node whose output
    # never reaches the loss (the routing's group selection) is freed during the forward, and its memory may be
    # handed to a later tensor: keyed by address alone, the count would vary from run to run.
    held = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (r() for r in packed) if t is not None
    }
    assert loss_sum.requires_grad and len(held) > 200
    estimate = activation_bytes(hf_config, batch["input_ids"].numel(), len(batch["pixel_values"]), 2)
    saved_estimate = estimate.total - estimate.loss_peak * 2 // 3  # forward keeps the log-probs, not their grads
    assert sum(held.values()) == saved_estimate


# ---------------------------------------------------------------------------------------------------------------
# Batch dump and compare-batches
# ---------------------------------------------------------------------------------------------------------------


VIDEO_KEYS = {"pixel_values_videos", "video_grid_thw"}


def test_dump_writes_forward_inputs_that_transformers_takes(tmp_path):
    hf_config = load_hf_config(ModelConfig())
    dataset, pad = _tiny_data(hf_config, synthetic_video_every=0)  # images only; videos in the next test
    batches = [collate([dataset[0], dataset[1]], pad), collate([dataset[2], dataset[3]], pad, packing=True)]
    batches.append(collate([dataset[4]], pad))
    stale = dump_path(tmp_path, 0, 7)
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"old run")
    dumper = BatchDumper(tmp_path, rank=0, count=2)
    for batch in batches:
        dumper.dump(batch)
    files = sorted(p.name for p in (tmp_path / "batches").iterdir())
    assert files == ["rank0_micro0.pt", "rank0_micro1.pt"]  # the stale file and the third batch are not there

    padded, packed = (torch.load(dump_path(tmp_path, 0, k), weights_only=True) for k in range(2))
    assert set(padded) == set(MODEL_KEYS) - VIDEO_KEYS
    assert set(packed) == set(MODEL_KEYS) - VIDEO_KEYS - {"attention_mask"} and packed["position_ids"].shape[0] == 4
    assert torch.equal(padded["input_ids"], batches[0]["input_ids"])

    model = build_meta_model(hf_config)
    materialize(model, torch.device("cpu"), 0)
    reference = Glm4vMoeForConditionalGeneration(hf_config)
    reference.load_state_dict(model.state_dict(), strict=True)
    for dumped, batch in ((padded, batches[0]), (packed, batches[1])):
        loss = reference(**dumped, use_cache=False).loss
        loss_sum, tokens = model_loss_sum(model, batch)
        torch.testing.assert_close(loss, loss_sum / tokens)

    with pytest.raises(KeyError, match="new_key"):
        BatchDumper(tmp_path / "other", 0, 1).dump({**batches[0], "new_key": torch.zeros(1)})


def test_dump_holds_the_video_tensors_and_transformers_takes_them(tmp_path, capsys):
    """Video-only samples (transformers' forward scatters image features over a video's tokens too, so a sample
    with both only runs through ours): the dump holds the video tensors, transformers' loss on the dump equals ours on
    the batch, and compare-batches names a changed video patch."""
    hf_config = load_hf_config(ModelConfig())
    dataset, pad = _tiny_data(hf_config, synthetic_images_per_sample=0, synthetic_video_every=1)
    batch = collate([dataset[0], dataset[1]], pad)
    BatchDumper(tmp_path / "a", rank=0, count=1).dump(batch)
    dumped = torch.load(dump_path(tmp_path / "a", 0, 0), weights_only=True)
    assert set(dumped) == set(MODEL_KEYS) - {"pixel_values", "image_grid_thw"}
    assert dumped["video_grid_thw"].shape == (2, 3) and int((dumped["mm_token_type_ids"] == 2).sum()) > 0
    model = build_meta_model(hf_config)
    materialize(model, torch.device("cpu"), 0)
    reference = Glm4vMoeForConditionalGeneration(hf_config)
    reference.load_state_dict(model.state_dict(), strict=True)
    loss_sum, tokens = model_loss_sum(model, batch)
    torch.testing.assert_close(reference(**dumped, use_cache=False).loss, loss_sum / tokens)

    shutil.copytree(tmp_path / "a", tmp_path / "b")
    dumped["pixel_values_videos"][5, 7] += 1.0
    torch.save(dumped, dump_path(tmp_path / "b", 0, 0))
    assert compare_batches.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    out = capsys.readouterr().out
    assert "pixel_values_videos: first difference at index [5, 7]" in out and "video_grid_thw: equal" in out


def test_compare_batches_reports_the_first_differing_token(tmp_path, capsys):
    hf_config = load_hf_config(ModelConfig())
    dataset, pad = _tiny_data(hf_config)
    dumper = BatchDumper(tmp_path / "a", rank=0, count=3)
    for k in range(3):
        dumper.dump(collate([dataset[2 * k], dataset[2 * k + 1]], pad))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert compare_batches.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "result: all equal" in capsys.readouterr().out

    changed = dump_path(tmp_path / "b", 0, 1)
    batch = torch.load(changed, weights_only=True)
    batch["input_ids"][1, 17] += 1
    torch.save(batch, changed)
    dump_path(tmp_path / "b", 0, 2).unlink()
    assert compare_batches.main([str(tmp_path / "a"), str(tmp_path / "b" / "batches")]) == 1
    out = capsys.readouterr().out
    assert "rank0_micro1.pt: DIFFERENT" in out and "input_ids: first difference at sample 1, token 17" in out
    assert "rank0_micro2.pt: only in A" in out and "labels: equal" in out

    a_file, b_file = dump_path(tmp_path / "a", 0, 1), changed
    assert compare_batches.main([str(a_file), str(b_file), "--json"]) == 1
    (entry,) = json.loads(capsys.readouterr().out)["files"]
    (ids,) = [k for k in entry["keys"] if k["key"] == "input_ids"]
    assert ids["first_difference"] == {"sample": 1, "token": 17} and ids["num_different"] == 1
    assert ids["b_value"] == ids["a_value"] + 1

    result = subprocess.run(
        [sys.executable, "-m", "glm45v_fsdp.tools.compare-batches", str(a_file), str(b_file)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 1 and "sample 1, token 17" in result.stdout
    assert compare_batches.main([str(tmp_path / "a"), str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# The estimate follows every plan: its decrease against the measured CPU peak decrease, switch by switch
# ---------------------------------------------------------------------------------------------------------------
ESTIMATE_RUN = [
    "training.train_iters=1",
    "training.micro_batch_size=1",
    "data.cutoff_len=2048",
    "data.synthetic_text_tokens=2500",  # every sample is cut at cutoff_len: the estimate's token count
    "data.shuffle=false",
    "parallel.fsdp_plan.param_dtype=fp32",
    "model.config_overrides.text_config.num_hidden_layers=6",
]
OFFLOAD = ["features.activation_offload.enabled=true", "features.activation_offload.min_tensor_bytes=0"]
SWITCHES = {  # name: (ranks, overrides, the run it is compared with)
    "off": (1, [], None),
    "chunk_loss": (1, ["features.chunk_loss.mode=static", "features.chunk_loss.chunk_size=256"], "off"),
    "recompute": (1, ["features.recompute.enabled=true"], "off"),
    "recompute_keep_nothing": (
        1,
        ["features.recompute.enabled=true", "features.recompute.keep_attention=false"],
        "off",
    ),
    "recompute_selective": (
        1,
        ["features.recompute.enabled=true", "features.recompute.granularity=selective"],
        "off",
    ),
    "offload": (1, OFFLOAD, None),
    "recompute_offload": (1, ["features.recompute.enabled=true", *OFFLOAD], None),
    "cp1": (2, [], None),
    "cp2": (2, ["parallel.ulysses_parallel_size=2"], "cp1"),
}
ESTIMATE_FACTOR = 1.5  # stated in docs/tools.md: estimated change within 1.5x of the measured one, same direction


def test_estimate_follows_each_plan_like_the_measured_peak(tmp_path):
    """Each memory switch on the tiny model (2048 tokens, 6 layers, fp32, CPU tracker): the estimated decrease of the
    peak per rank (preflight's total) against the measured one. Offload saves nothing on the CPU (host and device
    are one memory), so for it the estimated bytes moved to the host are held against the measured ones."""
    from conftest import train_many

    measured, estimated = {}, {}
    for world in sorted({ranks for ranks, _, _ in SWITCHES.values()}):
        named = {name: [*ESTIMATE_RUN, *extra] for name, (ranks, extra, _) in SWITCHES.items() if ranks == world}
        tracked = {name: [*run, "training.track_memory=true"] for name, run in named.items()}
        runs = train_many(tmp_path / f"ranks{world}", tracked, world)
        for name, run in named.items():
            record = runs[name][1][0]
            assert record["tokens"] == 2048 * record["global_batch_size"]
            measured[name] = record
            report = preflight_report.build_report(preflight.parse_args(["--world-size", str(world), *run]))
            estimated[name] = report["memory"]
    for name, (_, _, reference) in SWITCHES.items():
        if reference is None:
            continue
        drop = (measured[reference]["mem_peak_max_gib"] - measured[name]["mem_peak_max_gib"]) * 2**30
        estimate = estimated[reference]["max"]["total"] - estimated[name]["max"]["total"]
        assert drop > 0 and 1 / ESTIMATE_FACTOR <= estimate / drop <= ESTIMATE_FACTOR, (name, estimate, drop)
    for name in ("offload", "recompute_offload"):
        moved, estimate = measured[name]["offload_bytes_out"], estimated[name]["activations"]["offloaded"]
        assert moved > 0 and 1 / ESTIMATE_FACTOR <= estimate / moved <= ESTIMATE_FACTOR, (name, estimate, moved)


def test_estimate_leaves_out_expert_stacks_fsdp_leaves_plain():
    """parallel/fsdp.py leaves expert stacks out of FSDP when their mesh (replicas x efsdp) has one rank and they are
    stored in the compute dtype: no gathered copy, no gradient buffer. Otherwise they are a unit of their layer."""
    dense = ParamSpec("layers.0.attn.weight", (64, 64), 4, True, "layers.0")
    expert = ParamSpec("layers.0.mlp.experts.gate_up_proj", (8, 64, 64), 4, True, "layers.0.mlp.experts", True, True)
    layer_fp32, layer_bf16 = 64 * 64 * 4, 64 * 64 * 2  # the dense layer's gathered bytes (2 ranks, no padding)
    experts_fp32 = 4 * 64 * 64 * 4  # this rank's E/ep = 4 experts

    def gathered(specs, layout, compute=4, cpu_offload=False):
        return transient_bytes(specs, layout, compute, 4, True, cpu_offload=cpu_offload).params

    ep_is_dp = ShardLayout(2, ep=2, efsdp=1)
    assert gathered([dense, expert], ep_is_dp) == layer_fp32  # left plain
    assert gathered([dense, expert], ep_is_dp, cpu_offload=True) == layer_fp32 + experts_fp32
    assert gathered([dense, expert], ShardLayout(2, ep=2, efsdp=1, replicas=2)) == layer_fp32 + experts_fp32
    assert gathered([dense, expert], ShardLayout(2, ep=1, efsdp=2)) == layer_fp32 + 8 * 64 * 64 * 4
    # bf16 compute of fp32 stacks: FSDP casts them, so they stay a unit
    assert gathered([dense, expert], ep_is_dp, compute=2) == layer_bf16 + experts_fp32 // 2


def test_preflight_counts_the_dispatch_buffers_and_ep_balance_replicas(capsys):
    base = ["--config", CONFIG_106B, "--world-size", "128"]
    balance = ["features.ep_balance.enabled=true", "features.ep_balance.max_dup_experts_num=2"]
    terms = {}
    for granularity in ("full", "selective"):
        report = preflight_json(capsys, *base, *balance, f"features.recompute.granularity={granularity}")
        terms[granularity] = {t["name"]: t["bytes"] for t in report["memory"]["activations"]["terms"]}
    expert = 3 * 4096 * 1408 * 2  # one expert's weights in bf16
    assert terms["full"]["EP balance: replica weights"] == 2 * expert  # one layer's replicas at a time
    assert terms["selective"]["EP balance: replica weights"] == 45 * 2 * expert  # kept by every layer
    assert terms["full"]["expert parallel: dispatch buffers"] == 8192 * 8 * 4096 * 2 * 2
    plain = {t["name"] for t in preflight_json(capsys, *base)["memory"]["activations"]["terms"]}
    assert "expert parallel: dispatch buffers" in plain and "EP balance: replica weights" not in plain
