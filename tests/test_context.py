"""Ulysses context parallelism: the split language model against the unsplit one (2 gloo ranks, forward and
backward), the batch padding, the checks, and training under CP against the 1-rank run."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed as dist
from conftest import PARITY, end_worker, free_port, mean_relative_error, read_metrics, spawn, train
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Glm4vMoeConfig
from transformers.models.glm4v_moe.modeling_glm4v_moe import Glm4vMoeTextModel

from glm45v_fsdp.config import RecomputeConfig, load_config
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.memory.recompute import apply_recompute
from glm45v_fsdp.model.presets import PRESETS
from glm45v_fsdp.parallel.context import Ulysses, apply_context_parallel, check_context_parallel
from glm45v_fsdp.parallel.sequence import SplitSequence, image_owners, pad_to_multiple
from glm45v_fsdp.vocab import IGNORE_INDEX

SEQ = 12
# (query heads, key/value heads, kernel, mask) on 2 CP ranks: key/value heads split (2 per rank), one per rank, and
# replicated (1 kv head for 2 ranks); causal without a mask, right padding, packed samples.
CASES = [
    (4, 4, "sdpa", "causal"),
    (4, 2, "eager", "padding"),
    (4, 2, "sdpa", "packed"),
    (4, 1, "sdpa", "padding"),
    (4, 1, "eager", "packed"),
]


def text_config(heads: int, kv_heads: int, kernel: str):
    data = copy.deepcopy(PRESETS["tiny"])
    data["text_config"].update(num_attention_heads=heads, num_key_value_heads=kv_heads, num_hidden_layers=2)
    config = Glm4vMoeConfig.from_dict(data)
    config._attn_implementation = kernel
    return config.text_config


def inputs(mask: str, length: int = SEQ, padding_from: int = 7, samples: tuple[int, ...] = (5, 7)) -> dict:
    """Model inputs as Glm4vMoeModel hands them to its language model: embeddings, positions, padding mask. "causal":
    2 full rows; "padding": the second row padded from `padding_from`; "packed": one row of `samples` (lengths)."""
    generator = torch.Generator().manual_seed(5)
    batch = 1 if mask == "packed" else 2
    embeds = torch.randn(batch, length, 64, generator=generator)
    positions = torch.arange(length).expand(3, batch, length).clone()
    attention_mask = None
    if mask == "padding":
        attention_mask = torch.ones(batch, length, dtype=torch.long)
        attention_mask[1, padding_from:] = 0
        positions[:, 1, padding_from:] = 0
    if mask == "packed":  # row 0 restarts the text positions at every sample
        assert sum(samples) == length
        text = torch.cat([torch.arange(n) for n in samples])
        positions = torch.cat([text[None, None], positions])
    return {"inputs_embeds": embeds, "position_ids": positions, "attention_mask": attention_mask}


def zeros_if_none(param: nn.Parameter) -> torch.Tensor:
    return param.grad if param.grad is not None else torch.zeros_like(param)


def compare_split(reference: nn.Module, split: nn.Module, layout, data: dict, group) -> dict:
    """Run the unsplit and the split language model on the same inputs and weighted sum, backward both; the max
    output error (absolute, and the output's scale), the max relative error over the input and parameter gradients
    (the CP ranks' partial gradients summed over `group`), the local shape and the un-split output's error."""
    weight = torch.randn(*data["inputs_embeds"].shape, generator=torch.Generator().manual_seed(9))
    full_embeds = data["inputs_embeds"].clone().requires_grad_()
    full = reference(**{**data, "inputs_embeds": full_embeds}, use_cache=False).last_hidden_state
    (full * weight).sum().backward()
    local_embeds = data["inputs_embeds"].clone().requires_grad_()
    local = split(**{**data, "inputs_embeds": local_embeds}, use_cache=False).last_hidden_state
    (local * layout.shard(weight, dim=1)).sum().backward()
    # Unused parameters (the token embedding: the inputs are embeddings) have no gradient on either side.
    grads = [local_embeds.grad] + [zeros_if_none(p) for p in split.parameters()]
    for grad in grads:
        dist.all_reduce(grad, group=group)  # the CP ranks' partial gradients add up to the full one
    expected = [full_embeds.grad] + [zeros_if_none(p) for p in reference.parameters()]
    batch, length, hidden = data["inputs_embeds"].shape
    return {
        "output": (local - layout.shard(full, dim=1)).abs().max().item(),
        "scale": full.abs().max().item(),
        "grad": max((g - e).abs().max().item() / (e.abs().max().item() + 1e-12) for g, e in zip(grads, expected)),
        "shape": list(local.shape),
        "expected_shape": [batch, length // layout.size, hidden],
        "unsplit": (layout.unshard(local, dim=1) - full).abs().max().item(),
    }


def split_language_model(heads: int, kv_heads: int, kernel: str, group, world: int, rank: int):
    """(transformers' language model, a copy of it under the Ulysses plan, the copy's sequence layout)."""
    torch.manual_seed(0)
    reference = Glm4vMoeTextModel(text_config(heads, kv_heads, kernel))
    root = nn.Module()
    root.model = nn.Module()
    root.model.language_model = copy.deepcopy(reference)
    layout = SplitSequence(group, world, rank, pad_token_id=0)
    apply_context_parallel(root, layout, Ulysses(group, world, kernel))
    return reference, root, layout


class CountExchanges(TorchDispatchMode):
    """Counts the all-to-alls that really run (a selective-checkpoint cache hit never reaches this mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops._c10d_functional.all_to_all_single.default
        return func(*args, **(kwargs or {}))


def _split_worker(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.group.WORLD
    errors = {}
    for heads, kv_heads, kernel, mask in CASES:
        reference, root, layout = split_language_model(heads, kv_heads, kernel, group, world, rank)
        errors[f"{heads}/{kv_heads} {kernel} {mask}"] = compare_split(
            reference, root.model.language_model, layout, inputs(mask), group
        )
    layout = SplitSequence(group, world, rank, pad_token_id=0)
    for counts in ([3, 2], [0, 4]):  # a rank without images contributes no rows
        parts = [torch.randn(count, 5, generator=torch.Generator().manual_seed(r)) for r, count in enumerate(counts)]
        weights = [torch.randn(sum(counts), 5, generator=torch.Generator().manual_seed(10 + r)) for r in range(world)]
        rows = parts[rank].clone().requires_grad_()
        gathered = layout.gather_rows(rows, counts)
        (gathered * weights[rank]).sum().backward()
        start = sum(counts[:rank])
        expected_grad = sum(weights)[start : start + counts[rank]]  # every rank's use of these rows
        errors[f"gather {counts}"] = {
            "output": (gathered - torch.cat(parts)).abs().max().item(),
            "grad": (rows.grad - expected_grad).abs().max().item() if counts[rank] else 0.0,
            "shape": list(gathered.shape),
            "expected_shape": [sum(counts), 5],
            "unsplit": 0.0,
        }
    exchanges = {}
    for recompute in ("off", "selective", "full"):
        _, root, _ = split_language_model(4, 2, "sdpa", group, world, rank)
        if recompute != "off":
            cfg = RecomputeConfig(
                enabled=True,
                apply_modules=["model.language_model.layers.{*}"],
                granularity=recompute,
                keep_attention=False,
            )
            apply_recompute(root, cfg)
        data = inputs("causal")
        embeds = data["inputs_embeds"].clone().requires_grad_()
        output = root.model.language_model(**{**data, "inputs_embeds": embeds}, use_cache=False).last_hidden_state
        with CountExchanges() as counter:
            output.sum().backward()
        exchanges[recompute] = counter.count
    with open(f"{out}.{rank}", "w") as handle:
        json.dump({"errors": errors, "exchanges": exchanges}, handle)
    end_worker()


def test_split_language_model_matches_unsplit(tmp_path):
    spawn(_split_worker, args=(2, free_port(), str(tmp_path / "errors")), nprocs=2)
    for rank in range(2):
        found = json.loads((tmp_path / f"errors.{rank}").read_text())
        errors = found["errors"]
        assert len(errors) == len(CASES) + 2
        for case, figures in errors.items():
            assert figures["shape"] == figures["expected_shape"], case
            assert figures["output"] < 1e-5, (rank, case, figures)
            assert figures["grad"] < 1e-5, (rank, case, figures)
            assert figures["unsplit"] < 1e-5, (rank, case, figures)
        # Backward exchanges: 4 per layer without recompute (the backward of q, k, v and output); selective
        # recompute keeps the forward's exchanges, so it adds none; full recompute replays them (4 more per layer).
        layers = 2
        assert found["exchanges"] == {"off": 4 * layers, "selective": 4 * layers, "full": 8 * layers}, found


def test_image_owners_are_contiguous_and_balanced_by_patches():
    assert image_owners([4, 4, 4, 4], 2) == [0, 0, 1, 1]
    assert image_owners([100, 1, 1], 2) == [0, 1, 1]
    assert image_owners([1, 1, 100], 2) == [0, 0, 1]
    assert image_owners([16], 2) == [1]  # one image: the other rank runs the dummy image
    assert image_owners([4] * 8, 4) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_pad_to_multiple():
    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 8, 9]]),
        "labels": torch.tensor([[-100, 6, 7, 8, 9]]),
        "mm_token_type_ids": torch.zeros(1, 5, dtype=torch.int32),
        "attention_mask": torch.ones(1, 5, dtype=torch.long),
        "position_ids": torch.arange(5).expand(3, 1, 5),
    }
    padded = pad_to_multiple(batch, 4, pad_token_id=0)
    assert padded["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert padded["labels"][0, 5:].tolist() == [IGNORE_INDEX] * 3
    assert padded["attention_mask"].tolist() == [[1] * 8]  # no explicit mask needed for padding after the last token
    assert padded["position_ids"].shape == (3, 1, 8) and padded["mm_token_type_ids"].shape == (1, 8)
    assert pad_to_multiple(batch, 5, pad_token_id=0) is batch
    packed = {key: value for key, value in batch.items() if key != "attention_mask"}
    packed["position_ids"] = torch.cat([torch.tensor([[[0, 1, 0, 1, 2]]]), batch["position_ids"]])
    padded = pad_to_multiple(packed, 4, pad_token_id=0)
    assert padded["position_ids"][0].tolist() == [[0, 1, 0, 1, 2, 3, 4, 5]]  # the padding joins the last sample
    assert padded["position_ids"][1:, :, 5:].abs().sum() == 0 and "attention_mask" not in padded


def test_checks_name_the_key():
    hf = type("Config", (), {"text_config": text_config(4, 2, "sdpa")})
    check_context_parallel(hf, 2, "sdpa")
    check_context_parallel(hf, 4, "eager")
    with pytest.raises(UserError, match="'parallel.ulysses_parallel_size' = 3 does not divide the model's 4"):
        check_context_parallel(hf, 3, "sdpa")
    hf6 = type("Config", (), {"text_config": text_config(12, 4, "sdpa")})
    with pytest.raises(UserError, match="6 and the model's 4 key/value heads neither divide"):
        check_context_parallel(hf6, 6, "sdpa")
    with pytest.raises(UserError, match="'model.attn_implementation' = 'flash_attention_2' is not supported"):
        check_context_parallel(hf, 2, "flash_attention_2")
    assert load_config(None, ["parallel.ulysses_parallel_size=2"]).parallel.ulysses_parallel_size == 2


def test_training_under_ulysses_matches_one_rank(tmp_path, parity_off):
    """CP 2 (with recompute and the chunked loss, which CP must compose with) against the plain 1-rank run."""
    features = [
        "features.recompute.enabled=true",
        "features.chunk_loss.mode=static",
        "features.chunk_loss.chunk_size=64",
    ]
    result = train(tmp_path, PARITY + features + ["parallel.ulysses_parallel_size=2"], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Ulysses context parallelism over 2 ranks: attention kernel sdpa" in result.stdout
    assert "[plan context_parallel]" in result.stdout
    records, reference = read_metrics(tmp_path), parity_off(1)
    assert {r["global_batch_size"] for r in records} == {r["global_batch_size"] for r in reference}
    assert mean_relative_error([r["loss"] for r in records], [r["loss"] for r in reference]) < 1e-5
    assert mean_relative_error([r["grad_norm"] for r in records], [r["grad_norm"] for r in reference]) < 1e-5


def test_data_and_context_parallel_with_packing(tmp_path):
    """4 ranks = dp 2 x cp 2 against dp 2 alone: packed micro batches of 2, global-token loss normalisation."""
    common = [*PARITY[1:], "training.train_iters=4", "data.packing=true", "training.micro_batch_size=2"]
    common += ["training.loss_type=per_token"]
    curves = {}
    for name, nproc, extra in (("dp2", 2, []), ("dp2_cp2", 4, ["parallel.ulysses_parallel_size=2"])):
        result = train(tmp_path / name, common + extra, nproc=nproc)
        assert result.returncode == 0, result.stderr[-3000:]
        curves[name] = read_metrics(tmp_path / name)
    losses = {name: [r["loss"] for r in records] for name, records in curves.items()}
    assert len(losses["dp2_cp2"]) == 4 and curves["dp2_cp2"][0]["global_batch_size"] == 4
    errors = [abs(a - b) / abs(b) for a, b in zip(losses["dp2_cp2"], losses["dp2"])]
    assert sum(errors) / len(errors) < 1e-5, errors
