"""Chunked lm_head + cross-entropy: exact against the full-logits loss, chunk choice, and OFF/ON training parity."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import PARITY, mean_relative_error, read_metrics, train

from glm45v_fsdp.config import ChunkLossConfig
from glm45v_fsdp.memory.chunk_loss import ChunkedLossHead, choose_chunk, chunked_linear_cross_entropy


def loss_and_grads(fn, hidden, weight, labels):
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    loss = fn(hidden, weight, labels)
    return (loss.double(), *(g.double() for g in torch.autograd.grad(3.0 * loss, (hidden, weight))))


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_loss_and_gradients_are_as_exact_as_the_full_logits(chunk):
    """Against the float64 truth, the chunked fp32 path is at least as accurate as the full-logits fp32 path."""
    torch.manual_seed(0)
    hidden, weight, labels = torch.randn(100, 16), torch.randn(300, 16), torch.randint(0, 300, (100,))

    def full(h, w, y):
        return F.cross_entropy(F.linear(h, w), y, reduction="sum")  # fp32 inputs: fp32; float64: the truth

    truth = loss_and_grads(full, hidden.double(), weight.double(), labels)
    fp32 = loss_and_grads(full, hidden, weight, labels)
    chunked = loss_and_grads(lambda h, w, y: chunked_linear_cross_entropy(h, w, y, chunk), hidden, weight, labels)
    for got, ref, exact in zip(chunked, fp32, truth):
        ref_error = (ref - exact).abs().max().item()
        assert (got - exact).abs().max().item() <= max(2 * ref_error, 1e-6 * exact.abs().max().item())


def test_head_skips_unsupervised_rows_and_matches_the_shifted_loss():
    torch.manual_seed(1)
    head = torch.nn.Linear(8, 50, bias=False)
    reference_weight = head.weight.detach().clone().requires_grad_()
    head.__class__ = ChunkedLossHead
    head.chunk_config, head.last_choice = ChunkLossConfig(mode="static", chunk_size=3), None
    hidden = torch.randn(2, 9, 8, requires_grad=True)
    labels = torch.randint(0, 50, (2, 9))
    labels[0, :4] = -100
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    loss, count = head(hidden, shifted)
    reference = F.cross_entropy(
        F.linear(hidden, reference_weight).reshape(-1, 50), shifted.reshape(-1), reduction="sum"
    )
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=0)
    assert int(count) == int((shifted != -100).sum()) == head.last_choice.rows == 13
    assert head.last_choice.chunk_size == 3 and head.last_choice.chunks == 5
    loss.backward()
    reference.backward()
    torch.testing.assert_close(head.weight.grad, reference_weight.grad, rtol=1e-5, atol=1e-7)


def test_dynamic_choice_fits_the_budget_and_balances_chunks():
    by_budget = choose_chunk(ChunkLossConfig(mode="dynamic", logits_budget_mib=1.0), rows=1000, vocab=1024)
    assert by_budget.chunk_size * 1024 * 4 <= 2**20 and by_budget.chunks == 4 and by_budget.chunk_size == 250
    by_tokens = choose_chunk(ChunkLossConfig(mode="dynamic", total_chunk_size=300), rows=1000, vocab=1024)
    assert (by_tokens.chunk_size, by_tokens.chunks) == (250, 4)
    assert choose_chunk(ChunkLossConfig(mode="static", chunk_size=300), rows=1000, vocab=1024).chunks == 4
    assert choose_chunk(ChunkLossConfig(mode="dynamic", total_chunk_size=300), rows=100, vocab=1024).chunks == 1


CHUNK_MODES = {
    "static": ["features.chunk_loss.mode=static", "features.chunk_loss.chunk_size=16"],
    "dynamic": ["features.chunk_loss.mode=dynamic", "features.chunk_loss.total_chunk_size=40"],
}


@pytest.mark.parametrize("nproc, modes", [(1, ["static", "dynamic"]), (2, ["static"])])
def test_chunk_loss_on_off_parity(tmp_path, parity_off, nproc, modes):
    off = parity_off(nproc)
    for mode in modes:
        result = train(tmp_path / mode, PARITY + CHUNK_MODES[mode], nproc=nproc)
        assert result.returncode == 0, result.stderr[-3000:]
        records = read_metrics(tmp_path / mode)
        assert f"chunked lm_head + cross-entropy ({mode})" in result.stdout
        assert all(r["chunk_count"] and min(r["chunk_count"]) >= 2 for r in records), records[0]
        assert mean_relative_error([r["loss"] for r in records], [r["loss"] for r in off]) <= 1e-6, mode
        assert mean_relative_error([r["grad_norm"] for r in records], [r["grad_norm"] for r in off]) <= 1e-5, mode
