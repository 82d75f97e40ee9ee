"""HF weights: load (both expert layouts, strictness, per-rank slices, host memory), export, convert/inspect tool.

The reference is transformers' own Glm4vMoeForConditionalGeneration (tiny preset with 509 tokens and 7 experts, so
FSDP shards on 2 ranks are uneven) saved with `save_pretrained`.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from conftest import end_worker, free_port, spawn
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from transformers import Glm4vMoeForConditionalGeneration

from glm45v_fsdp import vocab
from glm45v_fsdp.checkpoint import conversions
from glm45v_fsdp.checkpoint.hf import INDEX_FILE, detect_format, load_hf_weights
from glm45v_fsdp.checkpoint.hf_export import export_hf
from glm45v_fsdp.checkpoint.layout import (
    detect_expert_layout,
    expected_keys,
    model_tensors,
    model_to_hub_tensors,
    summarize_keys,
)
from glm45v_fsdp.config import FsdpPlanConfig, ModelConfig
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.model import REQUIRED_FSDP_UNITS, build_meta_model, load_hf_config, materialize
from glm45v_fsdp.parallel.fsdp import apply_fsdp
from glm45v_fsdp.tools import convert

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
OVERRIDES = {"text_config": {"vocab_size": 509, "n_routed_experts": 7}}
EXPERT = "model.language_model.layers.2.mlp.experts.5.up_proj.weight"
# hidden 512 and 16 experts: a ~97 MiB fp32 checkpoint for the host-memory measurement
BIG_OVERRIDES = {
    "text_config": {
        "hidden_size": 512,
        "intermediate_size": 1024,
        "moe_intermediate_size": 256,
        "n_routed_experts": 16,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
    }
}


def our_model(overrides: dict = OVERRIDES, seed: int = 99) -> nn.Module:
    model = build_meta_model(load_hf_config(ModelConfig(config_overrides=overrides)))
    materialize(model, CPU, seed)
    return model


def reference_model(overrides: dict = OVERRIDES) -> Glm4vMoeForConditionalGeneration:
    """transformers' model with its own init; 1-D tensors (norms, biases, router bias) perturbed so none is trivial."""
    torch.manual_seed(0)
    model = Glm4vMoeForConditionalGeneration(load_hf_config(ModelConfig(config_overrides=overrides))).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.dim() == 1:
                tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.05)
    return model


def read_dir(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def rewrite(directory: Path, edit) -> None:
    """Apply `edit(tensors)` to every shard of a checkpoint directory and rebuild its index."""
    index = json.loads((directory / INDEX_FILE).read_text())
    weight_map = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors = load_file(path)
        edit(tensors, path.name)
        save_file(tensors, path, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, path.name))
    index["weight_map"] = weight_map
    (directory / INDEX_FILE).write_text(json.dumps(index))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """transformers' save_pretrained (sharded, with index) and a stacked single-file bf16 copy of the same weights."""
    root = tmp_path_factory.mktemp("hf")
    reference = reference_model()
    reference.save_pretrained(root / "hub", max_shard_size="200KB")
    state = {k: v.contiguous() for k, v in reference.state_dict().items()}
    (root / "stacked").mkdir()
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, root / "stacked" / "model.safetensors")
    return {"hub": root / "hub", "stacked": root / "stacked", "state": state}


# 1. Both expert layouts load exactly ----------------------------------------------------------------------------------


def test_save_pretrained_writes_per_expert_and_both_layouts_load_exactly(checkpoints):
    index = json.loads((checkpoints["hub"] / INDEX_FILE).read_text())["weight_map"]
    assert detect_expert_layout(index) == "per-expert" and len(set(index.values())) > 5
    assert "model.language_model.layers.1.mlp.experts.6.gate_proj.weight" in index
    assert not any(key.endswith("experts.gate_up_proj") for key in index)
    assert detect_format(checkpoints["hub"]) == "hf"
    state = checkpoints["state"]

    model = our_model()
    report = load_hf_weights(model, checkpoints["hub"])
    assert report.expert_layout == "per-expert" and report.files == len(set(index.values()))
    assert report.tensors_read == len(index) and not (report.missing or report.unexpected or report.mismatched)
    assert report.bytes_read == sum(t.nbytes for t in read_dir(checkpoints["hub"]).values())
    assert model.state_dict().keys() == state.keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]), name

    model = our_model()
    report = load_hf_weights(model, checkpoints["stacked"])
    assert (report.expert_layout, report.files, report.tensors_read) == ("stacked", 1, len(state))
    for name, tensor in model.state_dict().items():  # bf16 file -> fp32 parameters
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, state[name].to(torch.bfloat16).float()), name


def test_model_to_hub_tensors_concatenates_gate_then_up():
    gate_up, down = torch.randn(3, 8, 5), torch.randn(3, 5, 4)
    pieces = dict(model_to_hub_tensors("m.mlp.experts.gate_up_proj", gate_up))
    assert list(pieces) == [f"m.mlp.experts.{e}.{p}_proj.weight" for e in range(3) for p in ("gate", "up")]
    assert torch.equal(pieces["m.mlp.experts.1.gate_proj.weight"], gate_up[1, :4])
    assert torch.equal(pieces["m.mlp.experts.1.up_proj.weight"], gate_up[1, 4:])
    assert torch.equal(
        dict(model_to_hub_tensors("m.mlp.experts.down_proj", down))["m.mlp.experts.2.down_proj.weight"], down[2]
    )
    ((key, value),) = model_to_hub_tensors("m.norm.weight", down[0, 0])
    assert key == "m.norm.weight" and torch.equal(value, down[0, 0])


# 2. Strict loading ----------------------------------------------------------------------------------------------------


def test_strict_names_missing_unexpected_misshapen_and_prefixed_keys_before_copying(checkpoints, tmp_path):
    def variant(name: str, edit) -> Path:
        directory = tmp_path / name
        shutil.copytree(checkpoints["hub"], directory)
        rewrite(directory, edit)
        return directory

    def drop(tensors, _):
        tensors.pop(EXPERT, None)

    def add(tensors, file):
        if file.startswith("model-00001"):
            tensors["model.language_model.layers.1.mlp.extra.weight"] = torch.zeros(2)

    def reshape(tensors, _):
        if "model.language_model.norm.weight" in tensors:
            tensors["model.language_model.norm.weight"] = torch.zeros(65)

    model = our_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for edit, expected in [
        (drop, f"1 missing keys ({EXPERT})"),
        (add, "1 unexpected keys (model.language_model.layers.1.mlp.extra.weight)"),
        (reshape, "model.language_model.norm.weight: checkpoint [65] vs model [64]"),
    ]:
        with pytest.raises(UserError, match="training.load_strict=false") as caught:
            load_hf_weights(model, variant(edit.__name__, edit))
        assert expected in str(caught.value) and "Nothing was loaded" in str(caught.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing was copied

    state = checkpoints["state"]
    for name, keys, wording in [
        ("extra", {f"model.{k}": v for k, v in state.items()}, "carry an extra prefix 'model.'"),
        ("lacking", {k.removeprefix("model."): v for k, v in state.items()}, "lack the prefix 'model.'"),
    ]:
        (tmp_path / name).mkdir()
        save_file(keys, tmp_path / name / "model.safetensors")
        with pytest.raises(UserError, match=wording):
            load_hf_weights(model, tmp_path / name)
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="is not a readable safetensors file"):
        load_hf_weights(model, tmp_path / "corrupt")

    # non-strict: everything else loads; the report lists the rest (the caller logs it)
    def all_three(tensors, file):
        for edit in (drop, add, reshape):
            edit(tensors, file)

    report = load_hf_weights(model, variant("all", all_three), strict=False)
    assert report.missing == [EXPERT] and report.unexpected == ["model.language_model.layers.1.mlp.extra.weight"]
    assert report.mismatched == ["model.language_model.norm.weight: checkpoint [65] vs model [64]"]
    loaded = model.state_dict()
    for name, tensor in loaded.items():
        if name == "model.language_model.norm.weight":
            assert torch.equal(tensor, before[name])
        elif name == "model.language_model.layers.2.mlp.experts.gate_up_proj":
            up = slice(32, 64)  # expert 5's up rows keep their values, everything else loads
            assert torch.equal(tensor[5, up], before[name][5, up])
            assert torch.equal(tensor[5, :32], state[name][5, :32]) and torch.equal(tensor[:5], state[name][:5])
        else:
            assert torch.equal(tensor, state[name]), name

    # an MTP layer at 46 (the index transformers' class declares ignorable) is skipped, as transformers does
    def into_first_shard(extra: dict):
        return lambda tensors, file: tensors.update(extra) if file.startswith("model-00001") else None

    mtp = variant("mtp", into_first_shard({"model.language_model.layers.46.eh_proj.weight": torch.zeros(2)}))
    assert load_hf_weights(model, mtp).ignored == ["model.language_model.layers.46.eh_proj.weight"]
    # ... and one right after this model's 4 layers too: its eh_proj / enorm / hnorm tensors say what it is
    mtp4 = {f"model.language_model.layers.4.{name}.weight": torch.zeros(2) for name in ("eh_proj", "enorm", "hnorm")}
    mtp4["model.language_model.layers.4.mlp.gate.weight"] = torch.zeros(2)
    report = load_hf_weights(model, variant("mtp4", into_first_shard(mtp4)))
    assert report.ignored == sorted(mtp4) and not report.unexpected
    assert summarize_keys(report.ignored) == "model.language_model.layers.4.* (4 tensors)"
    # a plain fifth layer is not an MTP layer: the error says the checkpoint holds a deeper model
    deeper = {"model.language_model.layers.4.input_layernorm.weight": torch.zeros(64)}
    with pytest.raises(UserError, match="decoder layer\\(s\\) model.language_model.layers.4.\\* past the model's 4 "):
        load_hf_weights(model, variant("deeper", into_first_shard(deeper)))


# 3 + 4. Two ranks: sliced reads, HSDP, odd placements, export ---------------------------------------------------------

GRIDS = [[1, 4, 4], [1, 4, 6]]


def image_batch() -> dict:
    """Two right-padded samples `text <|begin_of_image|> <|image|>*n <|end_of_image|> text`."""
    generator = torch.Generator().manual_seed(0)
    seq_len, lengths = 60, [60, 51]
    input_ids = torch.full((2, seq_len), vocab.PAD_TOKEN_ID)
    attention_mask = torch.zeros(2, seq_len, dtype=torch.long)
    mm_token_type_ids = torch.zeros(2, seq_len, dtype=torch.long)
    for row, ((t, h, w), length) in enumerate(zip(GRIDS, lengths, strict=True)):
        n_image = t * h * w // 4
        ids = torch.randint(vocab.BYTE_TOKEN_OFFSET, vocab.BYTE_TOKEN_OFFSET + 200, (length,), generator=generator)
        ids[3], ids[4 + n_image] = vocab.IMAGE_START_TOKEN_ID, vocab.IMAGE_END_TOKEN_ID
        ids[4 : 4 + n_image] = vocab.IMAGE_TOKEN_ID
        input_ids[row, :length], attention_mask[row, :length] = ids, 1
        mm_token_type_ids[row, 4 : 4 + n_image] = 1
    return {
        "input_ids": input_ids,
        "labels": input_ids.masked_fill(attention_mask == 0, vocab.IGNORE_INDEX),
        "attention_mask": attention_mask,
        "mm_token_type_ids": mm_token_type_ids,
        "pixel_values": torch.randn(sum(t * h * w for t, h, w in GRIDS), 3 * 2 * 14 * 14, generator=generator),
        "image_grid_thw": torch.tensor(GRIDS),
    }


def sharded_model(mesh) -> nn.Module:
    model = build_meta_model(load_hf_config(ModelConfig(config_overrides=OVERRIDES)))
    apply_fsdp(model, FsdpPlanConfig(param_dtype="fp32"), mesh, pin_memory=False, required_units=REQUIRED_FSDP_UNITS)
    materialize(model, CPU, 5)
    return model


def _two_rank_worker(rank: int, port: int, hub: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    result = {}
    for name, mesh in [
        ("fsdp", init_device_mesh("cpu", (2,))),
        ("hsdp", init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))),
    ]:
        model = sharded_model(mesh)
        report = load_hf_weights(model, hub)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        result[name] = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.state_dict().items()}
        result[f"{name}_bytes"] = report.bytes_read

    placed = build_meta_model(load_hf_config(ModelConfig(config_overrides=OVERRIDES)))  # a dim-1 box, strided shards
    mesh = init_device_mesh("cpu", (2,))
    for module, name, placement in [
        (placed.lm_head, "weight", Shard(1)),
        (placed.model.language_model.layers[1].mlp.experts, "gate_up_proj", _StridedShard(0, split_factor=2)),
    ]:
        meta = getattr(module, name)
        setattr(module, name, nn.Parameter(distribute_tensor(meta, mesh, [placement], src_data_rank=None)))
    materialize(placed, CPU, 5)
    load_hf_weights(placed, hub)
    result["placed"] = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in placed.state_dict().items()}

    captured = []
    hook = model.lm_head.register_forward_hook(lambda module, args, output: captured.append(output.detach()))
    batch = image_batch()
    position_ids, _ = model.model.get_rope_index(
        batch["input_ids"], batch["mm_token_type_ids"], batch["image_grid_thw"], attention_mask=batch["attention_mask"]
    )
    with torch.no_grad():
        model({**batch, "position_ids": position_ids})
    hook.remove()
    result["logits"] = captured[0]
    export_hf(model, Path(out) / "export", model.config, max_shard_bytes=300_000)
    torch.save(result, Path(out) / f"rank{rank}.pt")
    end_worker()


def test_two_ranks_read_their_slices_and_export_loads_in_transformers(checkpoints, tmp_path):
    spawn(_two_rank_worker, args=(free_port(), str(checkpoints["hub"]), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    state = checkpoints["state"]
    total = sum(t.nbytes for t in read_dir(checkpoints["hub"]).values())
    for result in ranks:
        for name in ("fsdp", "hsdp"):
            assert result[name].keys() == state.keys()
            for key, tensor in result[name].items():
                assert torch.equal(tensor, state[key]), (name, key)
            assert 0.4 * total < result[f"{name}_bytes"] < 0.6 * total, (result[f"{name}_bytes"], total)
        assert all(torch.equal(tensor, state[key]) for key, tensor in result["placed"].items())

    out = tmp_path / "export"
    index = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    assert detect_expert_layout(index) == "per-expert" and len(set(index.values())) > 1
    assert not list(tmp_path.glob(".export*"))  # the temporary directory was renamed
    theirs, info = Glm4vMoeForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert theirs.dtype == torch.float32
    with torch.no_grad():
        logits = theirs.eval()(**{k: v for k, v in image_batch().items() if k != "labels"}).logits
    assert (logits - ranks[0]["logits"]).abs().max().item() <= 1e-5


# 4b. Under expert parallelism (4 ranks: efsdp 2 x ep 2): each rank reads its 4 experts, half of dim 1 ----------------

EP_OVERRIDES = {"text_config": {"vocab_size": 509}}  # 8 experts: 4 per EP rank
EP_PATTERN = "model.language_model.layers.{*}.mlp.experts"


@pytest.fixture(scope="module")
def ep_checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf_ep")
    reference = reference_model(EP_OVERRIDES)
    reference.save_pretrained(root / "per-expert", max_shard_size="200KB")
    state = {k: v.contiguous() for k, v in reference.state_dict().items()}
    (root / "stacked").mkdir()
    save_file(state, root / "stacked" / "model.safetensors")
    return {"root": root, "state": state}


def expert_parallel_model(meshes) -> nn.Module:
    from glm45v_fsdp.config import Config
    from glm45v_fsdp.parallel.expert import apply_expert_parallel, expert_sharded_modules
    from glm45v_fsdp.plans import MoEPlan, PlanContext
    from glm45v_fsdp.runtime import select_device

    hf_config = load_hf_config(ModelConfig(config_overrides=EP_OVERRIDES))
    model = build_meta_model(hf_config)
    MoEPlan().apply(model, PlanContext(Config(), meshes.dims, hf_config, select_device("cpu")))
    apply_expert_parallel(model, [EP_PATTERN], "alltoall", None, meshes.ep)
    apply_fsdp(
        model,
        FsdpPlanConfig(param_dtype="fp32"),
        meshes.dense_shard,
        pin_memory=False,
        required_units=REQUIRED_FSDP_UNITS,
        expert_units=expert_sharded_modules(model),
        expert_mesh=meshes.expert_shard,
    )
    materialize(model, CPU, 5)
    return model


def _expert_parallel_worker(rank: int, port: int, root: str) -> None:
    from glm45v_fsdp.runtime import ParallelDims, ParallelMeshes

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    meshes = ParallelMeshes(ParallelDims(4, 1, 4, 1, 1, 2), "cpu")
    result = {}
    for layout in ("per-expert", "stacked"):
        model = expert_parallel_model(meshes)
        report = load_hf_weights(model, Path(root) / layout)
        experts = model.get_parameter("model.language_model.layers.1.mlp.experts.gate_up_proj")
        result[layout] = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.state_dict().items()}
        result[f"{layout}_bytes"] = report.bytes_read
        result[f"{layout}_layout"] = report.expert_layout
    result["local_shape"] = tuple(experts.to_local().shape)
    result["local_bytes"] = experts.to_local().untyped_storage().nbytes()
    result["placements"] = [repr(p) for p in experts.placements]
    export_hf(model, Path(root) / "export", model.config, max_shard_bytes=300_000)
    torch.save(result, Path(root) / f"ep_rank{rank}.pt")
    end_worker()


def test_expert_parallel_ranks_read_only_their_experts_and_export_unchanged(ep_checkpoints):
    """Both checkpoint layouts load exactly into experts split 2 ways on dim 0 (ep) and 2 ways on dim 1 (efsdp);
    each rank reads about a quarter of the checkpoint; the export writes the Hub's tensors back bit for bit."""
    root, state = ep_checkpoints["root"], ep_checkpoints["state"]
    spawn(_expert_parallel_worker, args=(free_port(), str(root)), nprocs=4)
    text = load_hf_config(ModelConfig(config_overrides=EP_OVERRIDES)).text_config
    total = sum(t.nbytes for t in state.values())
    for rank in range(4):
        result = torch.load(root / f"ep_rank{rank}.pt")
        assert result["placements"] == ["Shard(dim=1)", "Shard(dim=0)"]  # efsdp on dim 1, ep on dim 0: one box
        assert result["local_shape"] == (4, text.moe_intermediate_size, text.hidden_size)
        assert result["local_bytes"] == 4 * text.moe_intermediate_size * text.hidden_size * 4
        for layout in ("per-expert", "stacked"):
            assert result[f"{layout}_layout"] == layout
            assert result[layout].keys() == state.keys()
            for key, tensor in result[layout].items():
                assert torch.equal(tensor, state[key]), (layout, key)
            assert 0.2 * total < result[f"{layout}_bytes"] < 0.3 * total, (layout, result[f"{layout}_bytes"], total)
    exported = read_dir(root / "export")
    hub = read_dir(root / "per-expert")
    assert exported.keys() == hub.keys() and all(torch.equal(exported[k], hub[k]) for k in hub)


# 5. The convert / inspect tool ----------------------------------------------------------------------------------------


def run_convert(capsys, *argv: str) -> tuple[int, str, str]:
    code = convert.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_convert_inspect_and_round_trip(checkpoints, tmp_path, capsys):
    hub = checkpoints["hub"]
    fits = tmp_path / "fits.yaml"
    fits.write_text(yaml.safe_dump({"model": {"config_overrides": OVERRIDES}}))
    misfit = REPO / "configs" / "glm45v_tiny.yaml"  # 8 experts, 512 tokens

    code, out, _ = run_convert(capsys, "inspect", hub, "--config", fits)
    assert code == 0 and "expert layout: per-expert" in out and "fits --config" in out
    assert "model.language_model.layers.{1-3}.mlp.experts.{0-6}.gate_proj.weight  [32, 64] float32  (21 tensors)" in out
    assert "model.visual. (" in out and "lm_head.weight (1)" in out
    code, out, _ = run_convert(capsys, "inspect", hub, "--config", misfit)
    assert code == 1 and "does not fit" in out and "model.language_model.layers.1.mlp.experts.7.gate_proj.weight" in out

    one = tmp_path / "one"  # hf-to-dcp takes the model from the HF directory's config.json
    code, out, _ = run_convert(capsys, "hf-to-dcp", hub, one)
    assert code == 0 and (one / ".metadata").is_file()
    state = {k: torch.zeros_like(v) for k, v in checkpoints["state"].items()}
    with conversions.single_process_group():
        dcp.load({"model": state}, checkpoint_id=one)
    assert all(torch.equal(v, checkpoints["state"][k]) for k, v in state.items())

    saves = tmp_path / "save"  # a save directory: the newest complete checkpoint is picked, never a .tmp one
    for name in ("step_00000002", "step_00000010", "step_00000020.tmp"):
        shutil.copytree(one, saves / name)
        # the trainer state (with the run's config) is what makes a training checkpoint complete
        torch.save({"step": int(name[5:13]), "config": fits.read_text()}, saves / name / "trainer_state.pt")
        if name != "step_00000010":
            (saves / name / "__0_0.distcp").write_bytes(b"broken")
    code, out, _ = run_convert(capsys, "inspect", saves, "--config", fits)
    assert code == 0 and "DCP checkpoint" in out and "step_00000010" in out and "expert layout: stacked" in out
    assert "model.model.language_model.layers.{1-3}.mlp.experts.gate_up_proj  [7, 64, 64] float32" in out
    code, out, _ = run_convert(capsys, "inspect", saves, "--config", misfit)
    assert code == 1 and "model.language_model.layers.1.mlp.experts.gate_up_proj: checkpoint [7, 64, 64]" in out

    back = tmp_path / "back"
    code, out, _ = run_convert(capsys, "dcp-to-hf", saves, back)
    assert code == 0 and "step_00000010" in out
    original, round_trip = read_dir(hub), read_dir(back)
    assert original.keys() == round_trip.keys()
    assert all(torch.equal(original[k], round_trip[k]) for k in original)

    code, _, err = run_convert(capsys, "dcp-to-hf", saves, back)
    assert code == 2 and "already exists" in err
    code, _, err = run_convert(capsys, "inspect", tmp_path / "nowhere")
    assert code == 2 and "is not a directory" in err
    (tmp_path / "empty").mkdir()
    code, _, err = run_convert(capsys, "inspect", tmp_path / "empty")
    assert code == 2 and "holds neither" in err
    code, _, err = run_convert(capsys, "dcp-to-hf", one, tmp_path / "x", "--config", misfit)
    assert code == 2 and "does not fit" in err and "--config" in err
    process = subprocess.run(
        [sys.executable, "-m", "glm45v_fsdp.tools.convert", "hf-to-dcp", tmp_path, tmp_path / "y"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert process.returncode == 2 and "Traceback" not in process.stderr and "convert: error:" in process.stderr


# 6. Host memory of a sliced load --------------------------------------------------------------------------------------


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise AssertionError(field)


def _memory_worker(rank: int, port: int, directory: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = build_meta_model(load_hf_config(ModelConfig(config_overrides=BIG_OVERRIDES)))
    apply_fsdp(model, FsdpPlanConfig(param_dtype="fp32"), init_device_mesh("cpu", (2,)), pin_memory=False)
    materialize(model, CPU, 0)
    base = _vm("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM (the peak) to the current RSS
    report = load_hf_weights(model, directory)
    torch.save({"increase": _vm("VmHWM") - base, "bytes_read": report.bytes_read}, Path(out) / f"mem{rank}.pt")
    end_worker()


def test_sliced_load_peak_host_memory_is_far_below_the_checkpoint(tmp_path):
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pytest.skip("/proc/self/clear_refs is not writable here: the peak RSS cannot be reset")
    torch.manual_seed(0)
    Glm4vMoeForConditionalGeneration(load_hf_config(ModelConfig(config_overrides=BIG_OVERRIDES))).save_pretrained(
        tmp_path / "big", max_shard_size="5GB"
    )
    size = sum(p.stat().st_size for p in (tmp_path / "big").glob("*.safetensors"))
    assert size > 90 * 2**20
    spawn(_memory_worker, args=(free_port(), str(tmp_path / "big"), str(tmp_path)), nprocs=2)
    for rank in range(2):
        result = torch.load(tmp_path / f"mem{rank}.pt")
        print(
            f"rank {rank}: peak RSS +{result['increase'] / 2**20:.1f} MiB, read {result['bytes_read'] / 2**20:.1f} "
            f"MiB of a {size / 2**20:.1f} MiB checkpoint"
        )
        assert result["bytes_read"] < 0.55 * size
        assert result["increase"] < 0.2 * size


def test_published_glm45v_has_18106_hub_tensors_in_layers_0_to_45():
    """What docs/weights.md says of the published checkpoint's index: 18,106 per-expert keys, no layer 46."""
    hf_config = load_hf_config(ModelConfig(preset="glm-4.5v"))
    with torch.device("meta"):
        model = Glm4vMoeForConditionalGeneration(hf_config)
    tensors, _ = model_tensors(model)
    keys = expected_keys({name: tuple(t.shape) for name, t in tensors.items()}, "per-expert")
    layers = {int(key.split(".")[3]) for key in keys if key.startswith("model.language_model.layers.")}
    assert len(keys) == 18106 and layers == set(range(46))
