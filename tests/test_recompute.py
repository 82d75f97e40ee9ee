"""Recompute plan: identical routing in the recomputed forward, and OFF/ON training parity (full keeping the
attention outputs or nothing, selective, reentrant; 1 and 2 ranks), and what each granularity keeps."""

from __future__ import annotations

import pytest
import torch
from conftest import PARITY, mean_relative_error, read_metrics, train
from torch.utils._python_dispatch import TorchDispatchMode

from glm45v_fsdp.config import ModelConfig, RecomputeConfig
from glm45v_fsdp.memory.recompute import ATTENTION_OPS, apply_recompute
from glm45v_fsdp.model import build_meta_model, load_hf_config, materialize


@pytest.mark.parametrize("granularity, keep_attention", [("full", True), ("full", False), ("selective", True)])
def test_recomputed_forward_routes_tokens_to_the_same_experts(granularity, keep_attention):
    model = build_meta_model(load_hf_config(ModelConfig()))
    matches = apply_recompute(
        model, RecomputeConfig(enabled=True, granularity=granularity, keep_attention=keep_attention)
    )
    assert [len(m.names) for m in matches] == [2, 4]
    materialize(model, torch.device("cpu"), seed=5)
    layer = model.model.language_model.layers[1]
    routes = []
    layer.mlp.gate.register_forward_hook(lambda module, args, out: routes.append(out[2].clone()))
    hidden = torch.randn(2, 12, 64, requires_grad=True)
    position = torch.arange(12).expand(3, 2, 12)
    cos_sin = model.model.language_model.rotary_emb(hidden, position)
    with AttentionKernelCount() as attention:
        out = layer(hidden, position_embeddings=cos_sin, attention_mask=None, position_ids=position)
        assert len(routes) == 1
        out.square().sum().backward()
    assert len(routes) == 2, "backward must run the layer again"
    assert torch.equal(routes[0], routes[1])
    assert hidden.grad is not None and layer.mlp.experts.gate_up_proj.grad is not None
    # The attention kernel's outputs are kept (it runs once) unless full granularity keeps nothing.
    assert attention.calls == (1 if keep_attention else 2)


class AttentionKernelCount(TorchDispatchMode):
    """Counts the attention kernels that actually run (a selective checkpoint's replay of a kept output does not)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in ATTENTION_OPS
        return func(*args, **(kwargs or {}))


RECOMPUTE = {
    "full": ["features.recompute.enabled=true"],  # keeps the attention kernels' outputs (the default)
    "full_keep_nothing": ["features.recompute.enabled=true", "features.recompute.keep_attention=false"],
    "selective": ["features.recompute.enabled=true", "features.recompute.granularity=selective"],
    "reentrant": ["features.recompute.enabled=true", "features.recompute.use_reentrant=true"],
}


@pytest.mark.parametrize("nproc, modes", [(1, ["full", "full_keep_nothing", "selective", "reentrant"]), (2, ["full"])])
def test_recompute_on_off_parity(tmp_path, parity_off, nproc, modes):
    off = parity_off(nproc)
    for mode in modes:
        result = train(tmp_path / mode, PARITY + RECOMPUTE[mode], nproc=nproc)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "[plan recompute] 2 pattern(s)" in result.stdout
        records = read_metrics(tmp_path / mode)
        assert mean_relative_error([r["loss"] for r in records], [r["loss"] for r in off]) <= 1e-6, mode
        assert mean_relative_error([r["grad_norm"] for r in records], [r["grad_norm"] for r in off]) <= 1e-5, mode
