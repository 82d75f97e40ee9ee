"""DeepSpeed's ALST names under ds-fsdp, in process (ds_compat/runtime/sequence_parallel, ds_compat/alst.py): what
`deepspeed.runtime.sequence_parallel.ulysses_sp` resolves to, the refusals (another model, a Megatron mpu, Ring with
the adapter, a size that differs from the ds_config's), the adapter's slice of the targets and the forward's check of
it, and TiledFusedLogitsLoss against the untiled loss. The 4-rank HF Trainer and accelerate runs are in
tests/test_glm_door.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from ds_compat import alias
from ds_compat.alst import alst_sequence_parallel_size, sequence_average
from ds_compat.config import translate
from ds_compat.runtime.sequence_parallel import parallel_state_sp
from ds_compat.runtime.sequence_parallel.ulysses_sp import (
    TiledFusedLogitsLoss,
    UlyssesSPAttentionHF,
    UlyssesSPDataLoaderAdapter,
)
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.model.hf_forward import _sliced_targets
from glm45v_fsdp.parallel.sequence import SplitSequence, ZigzagSequence

BASE = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


def test_alst_module_resolves_under_the_deepspeed_name():
    assert alias.target_of("deepspeed.runtime.sequence_parallel.ulysses_sp") == (
        "ds_compat.runtime.sequence_parallel.ulysses_sp"
    )
    assert alias._refusal("deepspeed.runtime.sequence_parallel.ulysses_sp") is None


def test_register_with_transformers_refuses_another_model_and_is_none_at_size_1():
    with torch.device("meta"):
        llama = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64))
    assert UlyssesSPAttentionHF.register_with_transformers(llama, "sdpa", 1, 1) is None
    with pytest.raises(UserError, match="'llama' model: this backend splits sequences for GLM-4.5V .* sp_size=1"):
        UlyssesSPAttentionHF.register_with_transformers(llama, "sdpa", 2, 1)
    assert not parallel_state_sp.is_initialized()  # refused before any group was made
    with pytest.raises(ValueError, match="seq_length_is_variable"):
        UlyssesSPAttentionHF.register_with_transformers(llama, "sdpa", 2, 1, seq_length_is_variable=False)


@pytest.fixture
def mpu_of_two(monkeypatch):
    monkeypatch.setattr(parallel_state_sp, "is_initialized", lambda: True)
    monkeypatch.setattr(parallel_state_sp, "get_sequence_parallel_world_size", lambda: 2)
    return parallel_state_sp


def under_alst(ds_config: dict, mpu: object, world_size: int = 2):
    """The translation the engine makes under `mpu` (deepspeed.initialize(mpu=...))."""
    return translate(ds_config, world_size, alst_sequence_parallel=alst_sequence_parallel_size(mpu))


def test_engine_takes_the_size_from_the_alst_mpu(mpu_of_two):
    for ds_config in (BASE, {**BASE, "sequence_parallel_size": 2}, {**BASE, "sequence_parallel_size": "auto"}):
        translation = under_alst(ds_config, mpu_of_two)
        assert translation.ds_config["sequence_parallel_size"] == 2 and translation.sequence_parallel_size == 2
        assert translation.fields["parallel.ulysses_parallel_size"] == 2
    assert "sequence_parallel_size" not in BASE  # the script's dict is not modified
    assert (sequence_average(3), sequence_average(2)) == (2, 1)  # DeepSpeed 0.19.8: ZeRO-3 averages over SP


def test_engine_refuses_what_the_alst_mpu_cannot_mean(mpu_of_two):
    with pytest.raises(UserError, match="'sequence_parallel_size' = 4 differs from the ALST mpu's .* 2"):
        under_alst({**BASE, "sequence_parallel_size": 4}, mpu_of_two)
    ring = {**BASE, "glm45v_fsdp": {"parallel": {"ring_attention_size": 2}}}
    with pytest.raises(UserError, match="ring_attention_size' = 2 with DeepSpeed's ALST mpu"):
        under_alst(ring, mpu_of_two, world_size=4)
    megatron = type("Mpu", (), {"get_model_parallel_world_size": staticmethod(lambda: 2)})()
    with pytest.raises(UserError, match="Megatron-style model parallelism is not supported"):
        under_alst(BASE, megatron)


def test_adapter_gives_each_rank_its_slice_of_the_shifted_targets_and_the_inputs_whole():
    labels = torch.tensor([[-100, 5, 6, 7, 8]])
    batch = {"input_ids": torch.arange(5)[None], "labels": labels, "image_grid_thw": torch.tensor([[1, 2, 2]])}
    layout = SplitSequence(None, 2, 0, pad_token_id=0)
    whole = F.pad(F.pad(labels, (0, 1), value=-100)[:, 1:], (0, 1), value=-100)  # shifted, padded to 6
    for rank in range(2):
        adapter = UlyssesSPDataLoaderAdapter([], sp_rank=rank, sp_group=None, sp_world_size=2, device="cpu")
        out = adapter._for_this_rank(batch)
        assert "labels" not in out and torch.equal(out["input_ids"], batch["input_ids"])
        layout.rank = rank
        assert torch.equal(out["shift_labels"], layout.shard(whole, dim=1))  # as the engine slices the inputs
    assert out["shift_labels"].tolist() == [[8, -100, -100]]


def test_forward_recognises_sliced_targets_by_length():
    ids = torch.zeros(1, 7, dtype=torch.long)
    layout = SplitSequence(None, 2, 0, pad_token_id=0)  # 7 -> padded 8 -> 4 per rank
    assert _sliced_targets(torch.zeros(1, 4), ids, layout) is not None
    assert _sliced_targets(torch.zeros(1, 7), ids, layout) is None  # whole: the forward splits it
    with pytest.raises(UserError, match="shift_labels of length 5 .* this rank's slice \\(4"):
        _sliced_targets(torch.zeros(1, 5), ids, layout)
    zigzag = ZigzagSequence(None, ring=2, ring_rank=0, ulysses=1, ulysses_rank=0, pad_token_id=0)
    assert zigzag.local_length(7) == 4 and zigzag.local_length(9) == 6  # padded to a multiple of 4


def test_tiled_fused_logits_loss_equals_the_untiled_loss_and_its_gradients():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 32, bias=False)
    x = torch.randn(2, 10, 8, requires_grad=True)
    y = torch.randint(0, 32, (2, 10))

    def loss_fn(module, rows, targets):
        return F.cross_entropy(module(rows), targets, reduction="sum")

    tiled = TiledFusedLogitsLoss.apply(loss_fn, head, x, y, None, 4, [head.weight], "sum")
    tiled.backward()
    grads = x.grad.clone(), head.weight.grad.clone()
    x.grad, head.weight.grad = None, None
    whole = loss_fn(head, x.reshape(-1, 8), y.reshape(-1))
    whole.backward()
    torch.testing.assert_close(tiled, whole)
    torch.testing.assert_close(grads[0], x.grad)
    torch.testing.assert_close(grads[1], head.weight.grad)
    mean = TiledFusedLogitsLoss.apply(loss_fn, head, x, y, None, 4, None, "mean")
    torch.testing.assert_close(mean, whole / 4)  # the mean of the 4 shards' sums, as DeepSpeed's
    with pytest.raises(ValueError, match="unknown reduction"):
        TiledFusedLogitsLoss.apply(loss_fn, head, x, y, None, 4, None, "max")


def _replaced_forward_under_cp_worker(rank: int, port: int) -> None:
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from transformers import Glm4vMoeForConditionalGeneration

    import ds_compat as deepspeed
    from glm45v_fsdp.config import ModelConfig
    from glm45v_fsdp.model import load_hf_config

    deepspeed.init_distributed(dist_backend="gloo")
    model = Glm4vMoeForConditionalGeneration(load_hf_config(ModelConfig()))
    model.forward = lambda **batch: None  # a loss computed from the backbone, as TRL's fused LM head
    config = {**BASE, "sequence_parallel_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(UserError, match="replaced on the instance .* Use parallelism_config"):
        deepspeed.initialize(model=model, config=config)
    # rank 0 holds the rendezvous store: it leaves only when the other rank has got its refusal too (a rank still
    # setting up its process groups would otherwise lose the store: a broken pipe, not the refusal, on a busy machine)
    torch.distributed.barrier()


def test_a_replaced_forward_under_sequence_parallel_size_is_refused():
    """TRL's fused LM head scores the backbone's output against the labels itself: under context parallelism without
    the ALST adapter those labels are the whole sequence's while the output is a slice."""
    from conftest import free_port, spawn

    spawn(_replaced_forward_under_cp_worker, (free_port(),), nprocs=2)
