"""Our MoE block (model/moe.py) against transformers' Glm4vMoeTextMoE, and the MoE plan (the routing statistics:
tests/test_router_health.py)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.glm4v_moe.modeling_glm4v_moe import Glm4vMoeTextMoE

from glm45v_fsdp.config import ModelConfig, load_config
from glm45v_fsdp.model import build_meta_model, load_hf_config
from glm45v_fsdp.model.moe import GroupedExperts, MoEBlock
from glm45v_fsdp.ops.kernels import torch_grouped_mm
from glm45v_fsdp.plans import MoEPlan, PlanContext
from glm45v_fsdp.runtime import ParallelDims, select_device

TEXT = load_hf_config(ModelConfig()).text_config
DIMS = ParallelDims(1, 1, 1, 1, 1, 1)


def reference_block(seed: int = 0) -> Glm4vMoeTextMoE:
    """transformers' block with random weights and a non-zero routing bias (so the bias path matters)."""
    torch.manual_seed(seed)
    block = Glm4vMoeTextMoE(TEXT)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.2)
    block.gate.e_score_correction_bias.normal_(std=0.1)
    return block


def ours_like(reference: Glm4vMoeTextMoE, kernel: str) -> MoEBlock:
    block = MoEBlock(TEXT)
    block.load_state_dict(reference.state_dict())
    if kernel == "grouped_mm":
        block.experts.use_kernels(kernel, torch_grouped_mm)
    return block


def forward_backward(block: torch.nn.Module, hidden: torch.Tensor, grad: torch.Tensor):
    hidden = hidden.clone().requires_grad_()
    block.zero_grad(set_to_none=True)
    output = block(hidden)
    output.backward(grad)
    return output.detach(), hidden.grad, {name: p.grad for name, p in block.named_parameters()}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("kernel", ["grouped_mm", "loop"])
def test_block_equals_transformers(kernel):
    """Same names, shapes and parameter order; forward and every parameter gradient bit for bit (fp32), the input
    gradient within rounding (its contributions are summed in another order)."""
    reference = reference_block()
    ours = ours_like(reference, kernel)
    assert [(n, p.shape) for n, p in ours.named_parameters()] == [(n, p.shape) for n, p in reference.named_parameters()]
    assert list(ours.state_dict()) == list(reference.state_dict())
    hidden = torch.randn(2, 37, TEXT.hidden_size, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(2, 37, TEXT.hidden_size, generator=torch.Generator().manual_seed(2))
    out_ref, dx_ref, grads_ref = forward_backward(reference, hidden, grad)
    out, dx, grads = forward_backward(ours, hidden, grad)
    assert torch.equal(out, out_ref)
    assert all(torch.equal(grads[name], grads_ref[name]) for name in grads_ref)
    assert relative(dx, dx_ref) <= 1e-6


def test_grouped_gemm_equals_the_loop_and_a_silent_expert_gets_a_zero_gradient():
    reference = reference_block(3)
    with torch.no_grad():  # expert 5 never wins: a very negative routing bias
        reference.gate.e_score_correction_bias[5] = -1e4
    hidden = torch.randn(3, 11, TEXT.hidden_size, generator=torch.Generator().manual_seed(4))
    grad = torch.randn(3, 11, TEXT.hidden_size, generator=torch.Generator().manual_seed(5))
    grouped = forward_backward(ours_like(reference, "grouped_mm"), hidden, grad)
    loop = forward_backward(ours_like(reference, "loop"), hidden, grad)
    expected = forward_backward(reference, hidden, grad)
    assert torch.equal(grouped[0], loop[0]) and torch.equal(grouped[1], loop[1])
    assert all(torch.equal(grouped[2][name], loop[2][name]) for name in loop[2])
    assert torch.isfinite(grouped[0]).all() and torch.equal(grouped[0], expected[0])
    for name in ("experts.gate_up_proj", "experts.down_proj"):
        assert torch.count_nonzero(grouped[2][name][5]) == 0  # exactly zero, present, no NaN
        assert torch.count_nonzero(grouped[2][name][4]) > 0


def test_zero_tokens_in_a_micro_batch_slice():
    """A rank may route no token at all (an empty slice): empty output, zero expert gradients."""
    block = ours_like(reference_block(), "grouped_mm")
    hidden = torch.zeros(1, 0, TEXT.hidden_size, requires_grad=True)
    output = block(hidden)
    (output.sum() + 0 * sum(p.sum() for p in block.parameters())).backward()
    assert output.shape == (1, 0, TEXT.hidden_size)
    assert torch.count_nonzero(block.experts.gate_up_proj.grad) == 0


def test_moe_plan_replaces_every_moe_layer_and_keeps_the_names():
    config = load_config()
    hf_config = load_hf_config(config.model)
    model = build_meta_model(hf_config)
    names_before = {name: tuple(p.shape) for name, p in model.named_parameters()}
    buffers_before = sorted(name for name, _ in model.named_buffers())
    matches = MoEPlan().apply(model, PlanContext(config, DIMS, hf_config, select_device("cpu")))
    layers = model.model.language_model.layers
    moe = [i for i, layer in enumerate(layers) if isinstance(layer.mlp, MoEBlock)]
    assert moe == list(range(TEXT.first_k_dense_replace, TEXT.num_hidden_layers)) and len(matches[0].names) == 3
    assert not any(isinstance(m, Glm4vMoeTextMoE) for m in model.modules())
    assert {name: tuple(p.shape) for name, p in model.named_parameters()} == names_before
    assert sorted(name for name, _ in model.named_buffers()) == buffers_before
    assert {m.kernel for m in model.modules() if isinstance(m, GroupedExperts)} == {"loop"}  # the ops plan picks
