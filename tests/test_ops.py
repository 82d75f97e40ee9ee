"""The accelerator ops layer (glm45v_fsdp/ops): references against transformers, the NPU kernels through a stand-in
torch_npu (itself checked against mindstudio-probe, Ascend's CPU implementations), selection, fallback, the
first-call check, and the tiny model trained 10 steps on the NPU path against the reference path."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import trainer
from npu_standin import StandInTorchNpu
from transformers.models.glm4v_moe import modeling_glm4v_moe as hf

from glm45v_fsdp import vocab
from glm45v_fsdp.config import ModelConfig, load_config
from glm45v_fsdp.data import SyntheticImageTextDataset, build_image_processor, build_tiny_tokenizer, collate
from glm45v_fsdp.errors import ConfigError
from glm45v_fsdp.model import build_meta_model, load_hf_config, materialize
from glm45v_fsdp.model.moe import LocalDispatcher
from glm45v_fsdp.op_names import IMPLEMENTATION_NAMES, OPS, REFERENCE, check_ops_setting
from glm45v_fsdp.ops import kernels, reference
from glm45v_fsdp.ops.apply import apply_ops
from glm45v_fsdp.ops.registry import IMPLEMENTATIONS, choose_ops
from glm45v_fsdp.ops.verify import verify_ops
from glm45v_fsdp.plans import MoEPlan, PlanContext
from glm45v_fsdp.runtime import ParallelDims, select_device

HF_CONFIG = load_hf_config(ModelConfig())
TEXT, VISION = HF_CONFIG.text_config, HF_CONFIG.vision_config
DIMS = ParallelDims(1, 1, 1, 1, 1, 1)
NPU_NAMES = {
    "rms_norm": "npu_rms_norm",
    "rotary": "npu_rotary_mul",
    "attention": "npu_fusion_attention",
    "experts": "npu_grouped_matmul",
    "permute": "npu_moe_token_permute",
    "swiglu": "npu_swiglu",
}


@pytest.fixture
def npu(monkeypatch) -> StandInTorchNpu:
    """The stand-in as `import torch_npu` (the kernels import it on each call)."""
    stand_in = StandInTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", stand_in)
    return stand_in


def grads_of(fn, inputs: list[torch.Tensor], seed: int = 0):
    """(outputs, gradients of every input) of fn, with seeded random gradients on every output."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    outputs = fn(*leaves)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    generator = torch.Generator().manual_seed(seed)
    torch.autograd.backward(outputs, [torch.randn(o.shape, generator=generator) for o in outputs])
    return [o.detach() for o in outputs], [leaf.grad for leaf in leaves]


def assert_same(got, want, tolerance: float) -> None:
    for g, w in zip(got, want, strict=True):
        error = ((g - w).abs().max() / (w.abs().max() + 1e-12)).item()
        assert error <= tolerance, error


# 1. Every reference equals transformers' own module (fp32, forward and gradients, <= 1e-6) -----------------------


@pytest.mark.parametrize("module_class", [hf.Glm4vMoeTextRMSNorm, hf.Glm4vMoeRMSNorm])
def test_rms_norm_reference_equals_transformers(module_class):
    norm = module_class(64, eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(2, 7, 64)
    theirs = grads_of(lambda x, w: torch.func.functional_call(norm, {"weight": w}, (x,)), [x, norm.weight])
    ours = grads_of(lambda x, w: reference.rms_norm(x, w, 1e-5), [x, norm.weight])
    assert_same(ours[0] + ours[1], theirs[0] + theirs[1], 1e-6)


def test_text_rotary_reference_equals_transformers_mrope_partial():
    """cos / sin from transformers' rotary embedding on 3-D (mRoPE) positions, with the tiny model's mrope_section
    and partial rotary factor: the rotated part is narrower than the head."""
    rotary = hf.Glm4vMoeTextRotaryEmbedding(TEXT)
    positions = torch.randint(0, 50, (3, 2, 9))
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    head_dim = TEXT.head_dim
    assert cos.shape[-1] < head_dim and sum(TEXT.rope_parameters["mrope_section"]) * 2 == cos.shape[-1]
    q, k = torch.randn(2, 4, 9, head_dim), torch.randn(2, 2, 9, head_dim)
    theirs = grads_of(lambda q, k: hf.apply_rotary_pos_emb(q, k, cos, sin), [q, k])
    ours = grads_of(lambda q, k: reference.rotary(q, k, cos, sin), [q, k])
    assert_same(ours[0] + ours[1], theirs[0] + theirs[1], 1e-6)


def test_vision_rotary_reference_equals_transformers_2d():
    rotary = hf.Glm4vMoeVisionRotaryEmbedding(VISION)
    positions = torch.randint(0, 8, (2, 12))  # (h, w) of 12 patches
    cos, sin = rotary(torch.zeros(1), positions.t())
    head_dim = VISION.hidden_size // VISION.num_heads
    q, k = torch.randn(12, VISION.num_heads, head_dim), torch.randn(12, VISION.num_heads, head_dim)
    theirs = grads_of(lambda q, k: hf.apply_rotary_pos_emb_vision(q, k, cos, sin), [q, k])
    ours = grads_of(lambda q, k: reference.vision_rotary(q, k, cos, sin), [q, k])
    assert_same(ours[0] + ours[1], theirs[0] + theirs[1], 1e-6)


class _Heads(torch.nn.Module):
    """What transformers' attention functions read from the module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups


@pytest.mark.parametrize("causal", [True, False])
def test_attention_reference_equals_transformers_eager(causal):
    """GQA (4 query heads, 2 key/value heads); padded causal or full; gradients of q, k, v."""
    q, k, v = torch.randn(2, 4, 10, 16), torch.randn(2, 2, 10, 16), torch.randn(2, 2, 10, 16)
    mask = torch.full((10, 10), float("-inf")).triu(1)[None, None] if causal else None

    def eager(q, k, v):
        return hf.eager_attention_forward(_Heads(2), q, k, v, mask, scaling=0.25, dropout=0.0)[0]

    theirs = grads_of(eager, [q, k, v])
    ours = grads_of(lambda q, k, v: reference.attention(q, k, v, causal=causal, scale=0.25)[0], [q, k, v])
    assert_same(ours[0] + ours[1], theirs[0] + theirs[1], 1e-6)


def test_packed_attention_reference_equals_each_sample_alone():
    cu = torch.tensor([0, 4, 11, 15])
    q, k, v = torch.randn(1, 4, 15, 16), torch.randn(1, 2, 15, 16), torch.randn(1, 2, 15, 16)
    packed, lse = reference.attention(q, k, v, causal=True, scale=0.25, cu_seqlens=cu)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone, alone_lse = reference.attention(*(t[:, :, start:end] for t in (q, k, v)), causal=True, scale=0.25)
        torch.testing.assert_close(packed[:, start:end], alone, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse[:, :, start:end], alone_lse, rtol=1e-6, atol=1e-6)


def test_swiglu_and_grouped_gemm_references_equal_transformers():
    mlp = hf.Glm4vMoeTextMLP(TEXT, intermediate_size=24)
    x = torch.randn(5, TEXT.hidden_size)
    gate_up = torch.cat((mlp.gate_proj(x), mlp.up_proj(x)), dim=-1).detach()
    theirs = grads_of(lambda h: mlp.act_fn(h[:, :24]) * h[:, 24:], [gate_up])
    ours = grads_of(reference.swiglu, [gate_up])
    assert_same(ours[0] + ours[1], theirs[0] + theirs[1], 1e-6)
    rows, weight, counts = torch.randn(9, 16), torch.randn(3, 8, 16), torch.tensor([4, 0, 5])
    loop = torch.cat([rows[:4] @ weight[0].t(), rows[4:] @ weight[2].t()])
    torch.testing.assert_close(reference.grouped_gemm(rows, weight, counts), loop, rtol=1e-6, atol=1e-6)


# 2. The stand-in torch_npu against mindstudio-probe, an independent implementation of the same ops -------------


def test_stand_in_agrees_with_mindstudio_probe():
    from msprobe.pytorch import bench_functions as msprobe  # mindstudio-probe, a test extra

    stand_in = StandInTorchNpu()
    x, gamma = torch.randn(2, 5, 64), torch.randn(64)
    assert_same(stand_in.npu_rms_norm(x, gamma, 1e-6), [t.float() for t in msprobe.npu_rms_norm(x, gamma, 1e-6)], 1e-6)
    q, r1, r2 = torch.randn(2, 4, 6, 16), torch.randn(2, 1, 6, 16), torch.randn(2, 1, 6, 16)
    assert_same([stand_in.npu_rotary_mul(q, r1, r2)], [msprobe.npu_rotary_mul(q, r1, r2).float()], 1e-6)
    h = torch.randn(5, 32)
    assert_same([stand_in.npu_swiglu(h)], [msprobe.npu_swiglu(h).float()], 1e-6)
    q, k, v = torch.randn(1, 4, 12, 16), torch.randn(1, 2, 12, 16), torch.randn(1, 2, 12, 16)
    mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    for extra in ({}, {"atten_mask": mask, "sparse_mode": 3}):
        ours = stand_in.npu_fusion_attention(q, k, v, 4, "BNSD", scale=0.25, **extra)[:3]
        theirs = msprobe.npu_fusion_attention(q, k, v, 4, "BNSD", scale=0.25, **extra)
        assert_same(ours, [t.float() for t in theirs], 1e-5)


# 3. Selection, fallback, errors ---------------------------------------------------------------------------------


def test_auto_picks_every_npu_kernel_and_reference_none(npu):
    assert choose_ops("auto", "npu", npu).names == NPU_NAMES
    assert choose_ops("reference", "npu", npu).fast() == []
    cpu = choose_ops("auto", "cpu")
    assert cpu.fast() == ["experts"] and cpu.names["experts"] == "grouped_mm"
    assert "experts: torch._grouped_mm" in cpu.describe()
    mixed = choose_ops({"attention": "reference", "experts": "reference"}, "npu", npu)
    assert mixed.names == {**NPU_NAMES, "attention": REFERENCE, "experts": REFERENCE}


def test_a_missing_kernel_falls_back_with_one_line():
    old = StandInTorchNpu(missing=("npu_moe_token_permute", "npu_swiglu"))
    choice = choose_ops("auto", "npu", old)
    assert choice.names["permute"] == choice.names["swiglu"] == REFERENCE
    assert choice.names["rms_norm"] == "npu_rms_norm"
    assert len(choice.fallbacks) == 2 and "this torch_npu has no npu_moe_token_permute" in choice.fallbacks[0]
    cuda = choose_ops("auto", "cuda")  # flash-attn is not installed here
    assert cuda.names["attention"] == REFERENCE and "flash-attn is not installed" in cuda.fallbacks[0]


def test_bad_settings_name_model_ops():
    with pytest.raises(ConfigError, match="'model.ops' = 'fast'"):
        check_ops_setting("fast")
    with pytest.raises(ConfigError, match="'model.ops.matmul' names no op"):
        check_ops_setting({"matmul": "auto"})
    with pytest.raises(ConfigError, match="'model.ops.attention' = 'npu_swiglu' is not one of"):
        check_ops_setting({"attention": "npu_swiglu"})
    with pytest.raises(ConfigError, match="'model.ops.rms_norm' = 'npu_rms_norm' cannot run on this cpu run"):
        choose_ops({"rms_norm": "npu_rms_norm"}, "cpu")
    with pytest.raises(ConfigError, match="this torch_npu has no npu_swiglu"):
        choose_ops({"swiglu": "npu_swiglu"}, "npu", StandInTorchNpu(missing=("npu_swiglu",)))
    assert set(check_ops_setting("auto")) == set(OPS)


def test_the_registry_describes_every_implementation_the_config_accepts():
    """config.py checks model.ops against op_names.py's names; the registry describes the same, in the same order."""
    described = {op: tuple(impl.name for impl in IMPLEMENTATIONS if impl.op == op) for op in OPS}
    assert described == IMPLEMENTATION_NAMES


def test_every_npu_kernel_passes_its_first_call(npu):
    verify_ops(choose_ops("auto", "npu", npu), torch.device("cpu"), torch.float32)
    verify_ops(choose_ops("auto", "npu", npu), torch.device("cpu"), torch.bfloat16)
    assert {"npu_grouped_matmul type 0", "npu_grouped_matmul type 2", "npu_fusion_attention TND"} <= set(npu.calls)


def test_a_kernel_that_fails_its_first_call_stops_naming_model_ops(npu, monkeypatch):
    monkeypatch.setattr(npu, "npu_swiglu", lambda x, dim=-1: F.silu(x.chunk(2, dim)[1]) * x.chunk(2, dim)[0])
    with pytest.raises(
        ConfigError, match=r"model.ops.*torch_npu.npu_swiglu for swiglu.*model.ops=\{swiglu: reference\}"
    ):
        verify_ops(choose_ops("auto", "npu", npu), torch.device("cpu"), torch.float32)

    def rejects(*args, **kwargs):
        raise RuntimeError("EZ1001: input_layout TND is not supported by this CANN")

    monkeypatch.setattr(npu, "npu_fusion_attention", rejects)
    with pytest.raises(ConfigError, match="EZ1001.*model.ops=\\{attention: reference\\}"):
        verify_ops(choose_ops({"swiglu": "reference"}, "npu", npu), torch.device("cpu"), torch.float32)


# 4. Kernels in detail -------------------------------------------------------------------------------------------


def test_tnd_varlen_attention_matches_the_padded_reference(npu):
    """Three samples packed in one row through npu_fusion_attention's TND path, against each sample as its own
    row of a right-padded batch through the reference: outputs, log-sum-exp and gradients."""
    lengths = [5, 9, 3]
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    q, k, v = torch.randn(1, 4, 17, 16), torch.randn(1, 2, 17, 16), torch.randn(1, 2, 17, 16)

    def tnd(q, k, v):
        return kernels.npu_fusion_attention(q, k, v, causal=True, scale=0.25, cu_seqlens=cu, seqlens=cu.tolist())

    packed_out, packed_grads = grads_of(lambda q, k, v: tnd(q, k, v)[0], [q, k, v])
    packed_lse = tnd(q, k, v)[1]
    assert set(npu.calls) == {"npu_fusion_attention TND"}
    longest = max(lengths)
    padded = [torch.zeros(3, t.shape[1], longest, 16) for t in (q, k, v)]
    for row, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        for target, source in zip(padded, (q, k, v)):
            target[row, :, : end - start] = source[0, :, start:end]
    out, lse = reference.attention(*padded, causal=True, scale=0.25)
    for row, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        torch.testing.assert_close(packed_out[0][0, start:end], out[row, : end - start], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed_lse[0, :, start:end], lse[row, :, : end - start], rtol=1e-5, atol=1e-5)
    reference_grads = grads_of(
        lambda q, k, v: reference.attention(q, k, v, causal=True, scale=0.25, cu_seqlens=cu)[0], [q, k, v]
    )[1]
    assert_same(packed_grads, reference_grads, 1e-5)


def test_npu_permute_and_grouped_matmul_match_the_moe_block(npu):
    """The MoE block's dispatcher and experts with torch_npu's permute and grouped matmul (its autograd is ours)
    against the block's own path: same output, same gradients of tokens, routing weights and expert weights."""
    generator = torch.Generator().manual_seed(0)
    hidden, weights = torch.randn(7, 16, generator=generator), torch.rand(7, 2, generator=generator)
    expert_ids = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(7)])
    gate_up, down = torch.randn(4, 12, 16, generator=generator), torch.randn(4, 16, 6, generator=generator)

    def block(dispatcher, gemm, swiglu):
        def run(hidden, weights, gate_up, down):
            dispatched = dispatcher.dispatch(hidden, expert_ids, weights)
            projected = gemm(dispatched.rows, gate_up, dispatched.counts)
            return dispatcher.combine(gemm(swiglu(projected), down, dispatched.counts), dispatched)

        return run

    ours = grads_of(
        block(LocalDispatcher(4, kernels.NpuPermute), kernels.npu_grouped_matmul, kernels.npu_swiglu),
        [hidden, weights, gate_up, down],
    )
    theirs = grads_of(
        block(LocalDispatcher(4), reference.grouped_gemm, reference.swiglu), [hidden, weights, gate_up, down]
    )
    assert_same(ours[0] + ours[1], theirs[0] + theirs[1], 1e-5)
    assert "npu_moe_token_unpermute" in npu.calls and "npu_grouped_matmul type 2" in npu.calls


# 5. The tiny model, 10 steps: NPU path (stand-in) against the reference path -----------------------------------


def tiny_batches(packing: bool, steps: int = 10) -> list[dict]:
    tokenizer = build_tiny_tokenizer()
    data = SyntheticImageTextDataset(
        2 * steps, 1, 56, 48, tokenizer, build_image_processor(VISION), 512, VISION.spatial_merge_size
    )
    return [collate([data[2 * i], data[2 * i + 1]], vocab.PAD_TOKEN_ID, packing=packing) for i in range(steps)]


def train_losses(ops, batches: list[dict]) -> tuple[list[float], torch.nn.Module]:
    """fp32 AdamW on the tiny model (our MoE block in place, as the trainer builds it) with `ops` applied."""
    model = build_meta_model(HF_CONFIG)
    MoEPlan().apply(model, PlanContext(load_config(), DIMS, HF_CONFIG, select_device("cpu")))
    if ops is not None:
        matches = apply_ops(model, ops)
        assert all(match.names for match in matches), matches
    materialize(model, torch.device("cpu"), 1234)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for batch in batches:
        loss_sum, tokens = model(dict(batch))
        loss = loss_sum / tokens
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_tiny_model_trains_on_the_npu_path_like_the_reference(npu, packing):
    batches = tiny_batches(packing)
    reference_losses, _ = train_losses(None, batches)
    npu_losses, model = train_losses(choose_ops("auto", "npu", npu), batches)
    error = sum(abs(a - b) / abs(b) for a, b in zip(npu_losses, reference_losses)) / len(reference_losses)
    print(f"{'packed' if packing else 'padded'}: mean relative loss error {error:.2e} over 10 steps")
    assert error <= 1e-5, (npu_losses, reference_losses)
    assert reference_losses[-1] < reference_losses[0]  # it trains
    expected = {"npu_rms_norm", "npu_rotary_mul", "npu_swiglu", "npu_moe_token_permute", "npu_moe_token_unpermute"}
    assert expected <= set(npu.calls) and "npu_grouped_matmul type 2" in npu.calls
    assert ("npu_fusion_attention TND" if packing else "npu_fusion_attention BNSD") in npu.calls
    names = {name for name, _ in model.named_parameters()}
    assert names == {name for name, _ in build_meta_model(HF_CONFIG).named_parameters()}  # names kept


# 6. The trainer logs what each op runs on ------------------------------------------------------------------------


def test_trainer_logs_the_ops_and_honours_model_ops(tmp_path):
    argv = [
        "training.train_iters=2",
        f"training.output_dir={tmp_path}",
        "training.progress_bar=false",
        "model.ops={experts: reference}",
    ]
    result = trainer(argv, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ops (model.ops={'experts': 'reference'}, cpu): rms_norm: reference" in result.stdout
    assert "experts=loop" in result.stdout  # the model line: the per-expert loop ran
    bad = trainer(argv[:-1] + ["model.ops=fast"])
    assert bad.returncode == 2 and "'model.ops' = 'fast'" in bad.stderr and "Traceback" not in bad.stderr
