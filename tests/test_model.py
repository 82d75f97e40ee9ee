"""Model layer: presets, config loading, meta build, deterministic (FSDP2-aware) materialization, freezing, loss."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import end_worker, free_port, spawn
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from transformers import Glm4vMoeForConditionalGeneration
from transformers.models.glm4v_moe.modeling_glm4v_moe import Glm4vMoeTextMLP, Glm4vMoeTextMoE

from glm45v_fsdp import vocab
from glm45v_fsdp.config import ModelConfig, load_config
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.model import (
    apply_freeze,
    build_meta_model,
    causal_lm_loss_sum,
    count_parameters,
    describe_model,
    forward_hidden,
    load_hf_config,
    materialize,
)
from glm45v_fsdp.model import init as init_module

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
GRIDS = [[1, 4, 4], [1, 4, 6]]  # one image per sample: 4 and 6 merged image tokens


def tiny_model(seed: int = 1234, **model_kwargs) -> nn.Module:
    model = build_meta_model(load_hf_config(ModelConfig(**model_kwargs)))
    materialize(model, CPU, seed)
    return model


def image_batch(seq_len: int = 100, seed: int = 0) -> dict:
    """Two right-padded samples, each `text <|begin_of_image|> <|image|>*n <|end_of_image|> text`, some labels -100."""
    generator = torch.Generator().manual_seed(seed)
    batch_size, lengths = len(GRIDS), [seq_len, seq_len - 9]
    input_ids = torch.full((batch_size, seq_len), vocab.PAD_TOKEN_ID)
    labels = torch.full((batch_size, seq_len), vocab.IGNORE_INDEX)
    attention_mask = torch.zeros(batch_size, seq_len, dtype=torch.long)
    mm_token_type_ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
    for row, ((t, h, w), length) in enumerate(zip(GRIDS, lengths, strict=True)):
        n_image = t * h * w // 4
        ids = torch.randint(vocab.BYTE_TOKEN_OFFSET, vocab.BYTE_TOKEN_OFFSET + 256, (length,), generator=generator)
        ids[3] = vocab.IMAGE_START_TOKEN_ID
        ids[4 : 4 + n_image] = vocab.IMAGE_TOKEN_ID
        ids[4 + n_image] = vocab.IMAGE_END_TOKEN_ID
        input_ids[row, :length] = ids
        attention_mask[row, :length] = 1
        mm_token_type_ids[row, 4 : 4 + n_image] = 1
        labels[row, 20:length] = ids[20:length]  # prompt and image unsupervised
    n_patches = sum(t * h * w for t, h, w in GRIDS)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": attention_mask,
        "mm_token_type_ids": mm_token_type_ids,
        "pixel_values": torch.randn(n_patches, 3 * 2 * 14 * 14, generator=generator),
        "image_grid_thw": torch.tensor(GRIDS),
    }


def with_positions(model: nn.Module, batch: dict) -> dict:
    """Add mRoPE position_ids [3, B, S] and the collator's bookkeeping keys (which the loss must ignore)."""
    position_ids, _ = model.model.get_rope_index(
        batch["input_ids"], batch["mm_token_type_ids"], batch["image_grid_thw"], attention_mask=batch["attention_mask"]
    )
    bookkeeping = {"num_valid_tokens": 1, "num_samples": 2, "num_tokens": 3, "cu_seqlens": torch.tensor([0, 5])}
    return {**batch, "position_ids": position_ids, **bookkeeping}


# 1. The real architecture on the meta device -------------------------------------------------------------------------


def test_106b_config_builds_on_meta_with_published_structure():
    config = load_config(REPO / "configs" / "glm45v_106b_sft.yaml")
    hf_config = load_hf_config(config.model)
    model = build_meta_model(hf_config)
    assert all(p.is_meta and p.dtype == torch.float32 for p in model.parameters())
    counts = count_parameters(model)
    assert 106e9 <= counts["total"] <= 108e9, counts
    assert counts["total"] == counts["vision"] + counts["language"] + counts["lm_head"] == counts["trainable"]
    layers = model.model.language_model.layers
    assert len(layers) == 46 and len(model.model.visual.blocks) == 24
    assert type(layers[0].mlp) is Glm4vMoeTextMLP
    for layer in layers[1:]:
        assert isinstance(layer.mlp, Glm4vMoeTextMoE)
        assert layer.mlp.experts.gate_up_proj.shape == (128, 2 * 1408, 4096)
        assert layer.mlp.experts.down_proj.shape == (128, 4096, 1408)
    assert counts["experts"] == 45 * 128 * 3 * 1408 * 4096
    assert hf_config.image_token_id == 151363 and hf_config.text_config.vocab_size == 151552
    description = describe_model(model, hf_config)
    assert "107.71B" in description and "46 layers" in description and "attn=sdpa" in description


# 2. Parity with transformers' own model and loss ---------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_loss_matches_transformers_with_images(attn):
    ours = tiny_model(attn_implementation=attn)
    theirs = Glm4vMoeForConditionalGeneration(ours.config)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    assert theirs.config._attn_implementation == attn
    batch = image_batch()
    loss_sum, n_tokens = ours(with_positions(ours, batch))
    reference = theirs(**batch).loss
    assert n_tokens.item() == (batch["labels"][:, 1:] != vocab.IGNORE_INDEX).sum().item()
    assert abs(loss_sum.item() / n_tokens.item() - reference.item()) / reference.item() <= 1e-6
    # position_ids from the batch are used (not recomputed): plain 1-D positions change the hidden states.
    hidden = forward_hidden(ours, with_positions(ours, batch))
    plain = torch.arange(batch["input_ids"].shape[1]).expand(3, *batch["input_ids"].shape)
    assert not torch.allclose(hidden, forward_hidden(ours, {**with_positions(ours, batch), "position_ids": plain}))


def test_forward_hidden_on_a_packed_row_matches_the_padded_batch():
    """[4, B, S] position_ids (row 0: per-sequence text positions) and no attention_mask, as the packing collator."""
    model = tiny_model()
    batch = with_positions(model, image_batch())
    padded = forward_hidden(model, batch)
    lengths = batch["attention_mask"].sum(-1).tolist()
    keep = batch["attention_mask"].bool()
    text_positions = torch.cat([torch.arange(n) for n in lengths])
    packed = {
        "input_ids": batch["input_ids"][keep][None],
        "mm_token_type_ids": batch["mm_token_type_ids"][keep][None],
        "position_ids": torch.cat([text_positions[None], batch["position_ids"][:, keep]])[:, None],
        "pixel_values": batch["pixel_values"],
        "image_grid_thw": batch["image_grid_thw"],
    }
    hidden = forward_hidden(model, packed)[0]
    torch.testing.assert_close(hidden, padded[keep], rtol=1e-5, atol=1e-5)


# 3. Deterministic materialization ------------------------------------------------------------------------------------


def test_materialize_is_a_pure_function_of_seed_and_follows_init_rules():
    first, again, other = tiny_model(seed=7).state_dict(), tiny_model(seed=7).state_dict(), tiny_model(seed=8)
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    gate_up = "model.language_model.layers.{}.mlp.experts.gate_up_proj"
    assert not torch.equal(first[gate_up.format(1)], other.state_dict()[gate_up.format(1)])
    assert not torch.equal(first[gate_up.format(1)], first[gate_up.format(2)])  # the FQN seeds the stream

    fresh = Glm4vMoeForConditionalGeneration(other.config)  # transformers' own CPU init
    for name, buffer in fresh.named_buffers():
        assert torch.equal(dict(other.named_buffers())[name], buffer), name
    assert any(name.endswith("rotary_emb.inv_freq") for name, _ in other.named_buffers())
    for name, param in other.named_parameters():
        assert torch.isfinite(param).all(), name
        if "norm" in name and name.endswith("weight"):
            assert torch.equal(param, torch.ones_like(param)), name
        elif name.endswith("bias"):
            assert torch.equal(param, torch.zeros_like(param)), name
        elif param.numel() >= 4096:
            assert 0.018 < param.std().item() < 0.022, name
    assert not other.model.language_model.embed_tokens.weight[vocab.PAD_TOKEN_ID].any()


def test_blockwise_normal_draw_gives_any_row_range_of_one_tensor(monkeypatch):
    """A shard that starts or ends inside a block sees exactly the rows of the full draw (blocks of 8 rows here)."""
    monkeypatch.setattr(init_module, "_BLOCK_NUMEL", 8 * 6)
    shape = torch.Size((37, 2, 3))
    full = init_module._normal_rows(shape, 0.02, 7, "w", 0, 37)
    assert full.shape == shape and not torch.equal(full[:8], full[8:16])
    for start, stop in [(0, 5), (3, 17), (8, 16), (15, 37), (36, 37), (37, 37)]:
        assert torch.equal(init_module._normal_rows(shape, 0.02, 7, "w", start, stop), full[start:stop])


# 4. FSDP2 on 2 ranks starts from the same weights --------------------------------------------------------------------


def _fsdp_worker(rank: int, world_size: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    hf_config = load_hf_config(ModelConfig(config_overrides={"text_config": {"vocab_size": 509}}))  # uneven shards

    model = build_meta_model(hf_config)
    for module in [
        *model.model.visual.blocks,
        *model.model.language_model.layers,
        model.model.visual,
        model.model,
        model.lm_head,
        model,
    ]:
        fully_shard(module, mesh=mesh)
    materialize(model, CPU, 7)
    full = {name: p.full_tensor() for name, p in model.named_parameters()}
    loss_sum, n_tokens = model(with_positions(model, image_batch()))
    (loss_sum / n_tokens).backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}

    placed = build_meta_model(hf_config)  # other placements: a dim-1 box and strided shards (full-draw fallback)
    custom = [
        (placed.lm_head, "weight", Shard(1)),
        (placed.model.language_model.layers[1].mlp.experts, "gate_up_proj", _StridedShard(0, split_factor=2)),
        (placed.model.language_model.embed_tokens, "weight", _StridedShard(0, split_factor=2)),
    ]
    for module, name, placement in custom:
        meta = getattr(module, name)
        setattr(module, name, nn.Parameter(distribute_tensor(meta, mesh, [placement], src_data_rank=None)))
    materialize(placed, CPU, 7)
    full_placed = {name: p.full_tensor() if isinstance(p, DTensor) else p for name, p in placed.named_parameters()}

    if rank == 0:
        torch.save(
            {
                "params": full,
                "placed": full_placed,
                "buffers": dict(model.named_buffers()),
                "loss": loss_sum,
                "grads": grads,
            },
            out,
        )
    end_worker()


def test_materialize_under_fsdp2_matches_single_rank(tmp_path):
    port = free_port()
    out = tmp_path / "rank0.pt"
    spawn(_fsdp_worker, args=(2, port, str(out)), nprocs=2)
    sharded = torch.load(out)

    single = tiny_model(seed=7, config_overrides={"text_config": {"vocab_size": 509}})
    params = dict(single.named_parameters())
    assert params.keys() == sharded["params"].keys()
    for name, param in params.items():
        assert torch.equal(param, sharded["params"][name]), name
        assert torch.equal(param, sharded["placed"][name]), name
    for name, buffer in single.named_buffers():
        assert torch.equal(buffer, sharded["buffers"][name]), name
    loss_sum, n_tokens = single(with_positions(single, image_batch()))
    (loss_sum / n_tokens).backward()
    torch.testing.assert_close(sharded["loss"], loss_sum.detach())
    for name, param in params.items():
        torch.testing.assert_close(sharded["grads"][name], param.grad, msg=name)


# 5. Config loading and overrides -------------------------------------------------------------------------------------


def test_config_overrides_local_dirs_and_errors(tmp_path):
    hf_config = load_hf_config(ModelConfig(config_overrides={"text_config": {"vocab_size": 65536}}))
    assert hf_config.text_config.vocab_size == 65536
    assert hf_config.text_config.num_hidden_layers == 4  # the rest of the preset is kept
    assert hf_config.image_token_id == vocab.IMAGE_TOKEN_ID

    with pytest.raises(UserError, match=r"model\.config_overrides\.text_config\.vocab_sise") as caught:
        load_hf_config(ModelConfig(config_overrides={"text_config": {"vocab_sise": 1}}))
    assert "Did you mean 'model.config_overrides.text_config.vocab_size'" in str(caught.value)

    missing = tmp_path / "no_such_model"
    with pytest.raises(UserError, match="model.name_or_path") as caught:
        load_hf_config(ModelConfig(name_or_path=str(missing)))
    assert str(missing) in str(caught.value)

    for sub in (hf_config, hf_config.text_config, hf_config.vision_config):
        sub.dtype = torch.bfloat16  # as in the published config.json: master weights must still be fp32
    hf_config.save_pretrained(tmp_path / "saved")
    loaded = load_hf_config(ModelConfig(name_or_path=str(tmp_path / "saved"), attn_implementation="eager"))
    assert loaded.text_config.vocab_size == 65536 and loaded.text_config.head_dim == 16
    assert loaded.text_config._attn_implementation == loaded.vision_config._attn_implementation == "eager"
    assert {p.dtype for p in build_meta_model(loaded).parameters()} == {torch.float32}


# 6. Freezing ---------------------------------------------------------------------------------------------------------


def test_apply_freeze_freezes_exactly_the_matched_modules():
    model = build_meta_model(load_hf_config(ModelConfig()))
    matches = apply_freeze(model, ["model.visual.blocks.{*}"])
    assert matches[0].names == ("model.visual.blocks.0", "model.visual.blocks.1")
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {name for name, _ in model.named_parameters() if name.startswith("model.visual.blocks.")}
    counts = count_parameters(model)
    assert counts["total"] - counts["trainable"] == sum(p.numel() for p in model.model.visual.blocks.parameters())
    with pytest.raises(UserError, match="model.freeze"):
        apply_freeze(model, ["model.vision.blocks.{*}"])


# 7. Summed causal-LM loss --------------------------------------------------------------------------------------------


def test_causal_lm_loss_sum_matches_shifted_cross_entropy_by_hand():
    torch.manual_seed(0)
    hidden, lm_head = torch.randn(2, 7, 16), nn.Linear(16, 11, bias=False)
    labels = torch.randint(0, 11, (2, 7))
    labels[0, :3] = vocab.IGNORE_INDEX
    labels[1, 5] = vocab.IGNORE_INDEX
    loss_sum, n_tokens = causal_lm_loss_sum(hidden, lm_head, labels)
    logits = lm_head(hidden)
    expected, count = torch.zeros(()), 0
    for row in range(2):
        for t in range(6):
            if labels[row, t + 1] != vocab.IGNORE_INDEX:
                expected = expected + F.cross_entropy(logits[row, t], labels[row, t + 1])
                count += 1
    assert n_tokens.item() == count == 9
    torch.testing.assert_close(loss_sum, expected)
    assert loss_sum.dtype == torch.float32
