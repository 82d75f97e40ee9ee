"""Ring attention and hybrid Ulysses x Ring: the pieces of work against the mask they stand for, the attention
alone and the split language model against the unsplit ones (4 gloo ranks: ring 2, ring 4, hybrid 2 x 2; causal,
padded, packed; GQA; both block kernels), the fused block kernels' checks, what recompute does to the ring, and
training under Ring CP against the 1-rank run."""

from __future__ import annotations

import copy
import json
import random
import sys
import types

import pytest
import torch
import torch.distributed as dist
from conftest import PARITY, end_worker, free_port, mean_relative_error, read_metrics, spawn, train
from test_context import compare_split, text_config
from test_context import inputs as context_inputs
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.glm4v_moe.modeling_glm4v_moe import Glm4vMoeTextModel

from glm45v_fsdp.config import RecomputeConfig, load_config
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.memory.recompute import apply_recompute
from glm45v_fsdp.parallel.context import (
    Ulysses,
    apply_context_parallel,
    check_context_parallel,
    context_attention,
    ring_mask,
)
from glm45v_fsdp.parallel.ring import (
    BLOCK_KERNELS,
    RING_ATTENTION_OP,
    Ring,
    causal_pieces,
    choose_block_kernel,
    ring_pieces,
    sequence_segments,
    verify_block_kernel,
)
from glm45v_fsdp.parallel.sequence import ZigzagSequence

SEQ = 24  # a multiple of 2 x 4: every layout below splits it without padding


# ---------------------------------------------------------------------------------------------- pieces (one process)


def allowed_matrix(length: int, mask: list[int] | None, positions: list[int] | None) -> torch.Tensor:
    """What transformers' mask allows: key <= query, same packed sample, key not padding."""
    index = torch.arange(length)
    allowed = index[None, :] <= index[:, None]
    if positions is not None:
        sample = torch.cumsum(
            torch.tensor([1] + [int(positions[t] != positions[t - 1] + 1) for t in range(1, length)]), 0
        )
        allowed &= sample[None, :] == sample[:, None]
    if mask is not None:
        allowed &= torch.tensor(mask, dtype=torch.bool)[None, :]
    return allowed


def covered(length: int, ring: int, rank: int, pieces: torch.Tensor, row: int) -> torch.Tensor:
    """How often each (query, key) pair of the global sequence is computed by ring rank `rank`'s pieces."""
    chunk = length // (2 * ring)

    def global_index(local: int, owner: int) -> int:
        first = local < chunk
        return (owner if first else 2 * ring - 1 - owner) * chunk + local % chunk

    counts = torch.zeros(length, length, dtype=torch.int64)
    for step, piece_row, q0, q1, k0, k1, causal in pieces.tolist():
        if piece_row not in (-1, row):
            continue
        source = (rank - step) % ring
        for qi in range(q0, q1):
            for ki in range(k0, k1):
                if causal and ki - k0 > qi - q0:
                    continue
                counts[global_index(qi, rank), global_index(ki, source)] += 1
    return counts


def random_row(length: int, rng: random.Random) -> tuple[list[int] | None, list[int] | None]:
    kind = rng.choice(["causal", "padded", "packed", "packed_padded"])
    mask = positions = None
    if "padded" in kind:
        valid = rng.randint(1, length)
        mask = [1] * valid + [0] * (length - valid)
    if "packed" in kind:
        cuts = sorted(rng.sample(range(1, length), min(length - 1, rng.randint(1, 4))))
        positions = [t - max([0] + [c for c in cuts if c <= t]) for t in range(length)]
    return mask, positions


def test_pieces_compute_every_allowed_pair_once():
    rng = random.Random(0)
    for trial in range(60):
        ring = rng.choice([1, 2, 3, 4])
        length = 2 * ring * rng.randint(1, 5)
        rows = [random_row(length, rng) for _ in range(rng.choice([1, 2]))]
        segments = [sequence_segments(length, mask, positions) for mask, positions in rows]
        for row, (mask, positions) in enumerate(rows):
            total = sum(
                covered(length, ring, rank, ring_pieces(length, ring, rank, segments), row) for rank in range(ring)
            )
            expected = allowed_matrix(length, mask, positions)
            assert torch.equal(total, expected.long()), (trial, ring, length, rows[row])


def test_zigzag_balances_causal_work_and_skips_blocks_above_the_diagonal():
    ring, length = 4, 64
    segments = [sequence_segments(length, None, None)]
    work = []
    for rank in range(ring):
        pieces = ring_pieces(length, ring, rank, segments)
        area = sum(
            (q1 - q0) * (q1 - q0 + 1) // 2 if causal else (q1 - q0) * (k1 - k0)
            for *_, q0, q1, k0, k1, causal in pieces.tolist()
        )
        work.append(area)
        assert sorted({piece[0] for piece in pieces.tolist()}) == list(range(ring))  # every step does work
        assert len(pieces) == 3 + (ring - 1)  # the diagonal step: 2 causal + 1 full; every other step: one block
    assert len(set(work)) == 1, work
    assert causal_pieces(10, 20, 20, 30) == []  # keys after every query: skipped
    assert causal_pieces(10, 20, 0, 5) == [(10, 20, 0, 5, False)]  # keys before every query: one full block
    assert causal_pieces(10, 20, 5, 15) == [(10, 20, 5, 10, False), (10, 15, 10, 15, True), (15, 20, 10, 15, False)]


def test_block_kernels_match_sdpa_with_their_lse():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    for causal in (False, True):
        reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        scores = q @ k.repeat_interleave(2, 1).transpose(-1, -2) / 8**0.5
        if causal:
            scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
        for kernel in (BLOCK_KERNELS["reference"], BLOCK_KERNELS["cpu_flash"]):
            out, lse = kernel.forward(q, k, v, causal, 8**-0.5)
            assert (out - reference).abs().max() < 1e-5, kernel.name
            assert (lse - scores.logsumexp(-1)).abs().max() < 1e-5, kernel.name
    assert choose_block_kernel("sdpa", "cpu").name == "cpu_flash"
    assert choose_block_kernel("eager", "cpu").name == "reference"
    assert choose_block_kernel("sdpa", "npu").name == "npu_fusion"
    assert choose_block_kernel("sdpa", "cuda").name == "cuda_efficient"


def test_cuda_block_kernel_call_signature_on_the_meta_device():
    """No GPU here: the CUDA kernel's calls (argument order, the lse's 32-row padding for the backward, GQA folding)
    go through the ops' meta implementations, which check arguments and give the output shapes."""
    kernel = BLOCK_KERNELS["cuda_efficient"]
    q, kv = torch.empty(2, 4, 40, 16, device="meta"), torch.empty(2, 2, 40, 16, device="meta")
    for causal in (False, True):
        out, lse = kernel.forward(q, kv, kv, causal, 0.25)
        assert out.shape == q.shape and lse.shape == (2, 4, 40)
        dq, dk, dv = kernel.backward(out, q, kv, kv, out, lse, causal, 0.25)
        assert dq.shape == q.shape and dk.shape == dv.shape == kv.shape


class WrongLse(type(BLOCK_KERNELS["cpu_flash"])):
    def forward(self, q, k, v, causal, scale):
        out, lse = super().forward(q, k, v, causal, scale)
        return out, lse + 0.1


def test_a_fused_block_kernel_that_disagrees_stops_the_run_naming_the_key(monkeypatch):
    for dtype in (torch.float32, torch.bfloat16):
        verify_block_kernel(BLOCK_KERNELS["cpu_flash"], torch.device("cpu"), dtype)
    with pytest.raises(UserError, match=r"'model.attn_implementation' = 'sdpa' chose .* relative error .*=eager"):
        verify_block_kernel(WrongLse(), torch.device("cpu"), torch.float32)
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(sys, "path", [])  # torch_npu cannot be imported
    with pytest.raises(UserError, match="No module named 'torch_npu'"):
        verify_block_kernel(BLOCK_KERNELS["npu_fusion"], torch.device("cpu"), torch.float32)


class StandInTorchNpu(types.ModuleType):
    """torch_npu's fused attention as its docs describe it, in plain PyTorch: BNSD layout, head_num = query heads
    (GQA: key/value heads divide them), atten_mask True = masked, sparse_mode 0 (the mask as given) or 2/3 (causal
    from the compressed 2048 x 2048 mask, corners agreeing on square blocks); softmax_max / softmax_sum are the row
    maximum and the sum of exp(score - max), 8 copies in the last dim; the grad takes them (or any max/sum pair with
    the same ratio) and the forward's output."""

    def __init__(self) -> None:
        super().__init__("torch_npu")
        self.calls = []

    @staticmethod
    def _scores(query, key, head_num, scale, atten_mask, sparse_mode):
        assert query.shape[1] == head_num
        key = key.repeat_interleave(head_num // key.shape[1], 1)
        scores = (query.float() @ key.float().transpose(-1, -2)) * scale
        if sparse_mode in (2, 3):
            assert atten_mask is not None and atten_mask.shape == (2048, 2048)
            scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        elif atten_mask is not None:
            scores = scores.masked_fill(atten_mask, float("-inf"))
        return scores

    def npu_fusion_attention(self, query, key, value, head_num, input_layout, *, pse=None, padding_mask=None,
                             atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=2147483647,
                             next_tockens=2147483647, inner_precise=0, prefix=None, sparse_mode=0,
                             gen_mask_parallel=True, sync=False):  # fmt: skip
        assert input_layout == "BNSD" and keep_prob == 1.0
        self.calls.append("forward")
        scores = self._scores(query, key, head_num, scale, atten_mask, sparse_mode)
        row_max = scores.amax(-1, keepdim=True)
        row_sum = torch.exp(scores - row_max).sum(-1, keepdim=True)
        probs = torch.exp(scores - row_max) / row_sum
        out = (probs @ value.float().repeat_interleave(head_num // value.shape[1], 1)).to(query.dtype)
        stats = [row_max.expand(*row_max.shape[:-1], 8), row_sum.expand(*row_sum.shape[:-1], 8)]
        return out, *stats, torch.empty(0), 0, 0, 0

    def npu_fusion_attention_grad(self, query, key, value, dy, head_num, input_layout, *, pse=None,
                                  padding_mask=None, atten_mask=None, softmax_max=None, softmax_sum=None,
                                  softmax_in=None, attention_in=None, scale_value=1.0, keep_prob=1.0,
                                  pre_tockens=2147483647, next_tockens=2147483647, inner_precise=0, seed=0,
                                  offset=0, numels=0, prefix=None, sparse_mode=0, gen_mask_parallel=True,
                                  sync=False):  # fmt: skip
        assert input_layout == "BNSD" and softmax_max.shape[-1] == softmax_sum.shape[-1] == 8
        self.calls.append("grad")
        groups = head_num // key.shape[1]
        scores = self._scores(query, key, head_num, scale_value, atten_mask, sparse_mode)
        probs = torch.exp(scores - softmax_max[..., :1]) / softmax_sum[..., :1]
        dy = dy.float()
        d_value = probs.transpose(-1, -2) @ dy
        d_probs = dy @ value.float().repeat_interleave(groups, 1).transpose(-1, -2)
        d_scores = probs * (d_probs - (dy * attention_in.float()).sum(-1, keepdim=True)) * scale_value
        d_query = d_scores @ key.float().repeat_interleave(groups, 1)
        d_key = d_scores.transpose(-1, -2) @ query.float()
        fold = lambda t: t.unflatten(1, (key.shape[1], groups)).sum(2)  # noqa: E731
        return d_query, fold(d_key), fold(d_value), None


def test_npu_block_kernel_through_a_stand_in_matches_the_reference(monkeypatch):
    """The NPU kernel's wiring (lse from softmax_max/sum, the backward fed the final lse as softmax_max with a sum of
    1, the causal sparse mode) against the reference kernel, forward and backward, with a stand-in torch_npu."""
    stand_in = StandInTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", stand_in)
    npu, reference = BLOCK_KERNELS["npu_fusion"], BLOCK_KERNELS["reference"]
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    dout = torch.randn(2, 4, 6, 8)
    for causal in (False, True):
        out, lse = npu.forward(q, k, v, causal, 0.3)
        ref_out, ref_lse = reference.forward(q, k, v, causal, 0.3)
        assert (out - ref_out).abs().max() < 1e-5 and (lse - ref_lse).abs().max() < 1e-5
        # as in the ring: the backward of a block gets the final out / lse (here the block is everything)
        grads = npu.backward(dout, q, k, v, ref_out, ref_lse, causal, 0.3)
        ref_grads = reference.backward(dout, q, k, v, ref_out, ref_lse, causal, 0.3)
        for grad, ref_grad in zip(grads, ref_grads):
            assert grad.shape == ref_grad.shape and (grad - ref_grad).abs().max() < 1e-5
    assert stand_in.calls == ["forward", "grad"] * 2
    verify_block_kernel(npu, torch.device("cpu"), torch.float32)  # the check a run makes before its first step


# ---------------------------------------------------------------------------------- language model (4 gloo ranks)

# (layout, query heads, key/value heads, kernel, mask); layouts on 4 ranks: ring 2 (two independent rings), ring 4,
# hybrid Ulysses 2 x Ring 2. GQA with fewer key/value heads than r x u (1 and 2 for 4 ranks).
CASES = [
    ("ring2", 4, 2, "sdpa", "causal"),
    ("ring2", 4, 1, "eager", "padded"),
    ("ring2", 4, 2, "sdpa", "packed"),
    ("ring4", 4, 1, "sdpa", "padded"),
    ("ring4", 4, 2, "eager", "packed"),
    ("ring4", 4, 2, "sdpa", "causal"),
    ("hybrid", 4, 1, "sdpa", "packed"),
    ("hybrid", 4, 2, "eager", "padded"),
    ("hybrid", 4, 2, "sdpa", "causal"),
]


def inputs(mask: str) -> dict:
    """test_context's inputs on SEQ tokens: "padded" pads the second row from 15, "packed" holds three samples of
    unequal length (5, 12, 7)."""
    return context_inputs("padding" if mask == "padded" else mask, SEQ, padding_from=15, samples=(5, 12, 7))


class Groups:
    """The process groups of the three layouts on 4 ranks (created collectively, in the same order everywhere)."""

    def __init__(self, rank: int) -> None:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        across = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        world = dist.group.WORLD
        self.rank = rank
        # layout -> (cp group, ring group, ring size, ring rank, ulysses group, ulysses size, ulysses rank)
        self.layouts = {
            "ring2": (pairs[rank // 2], pairs[rank // 2], 2, rank % 2, None, 1, 0),
            "ring4": (world, world, 4, rank, None, 1, 0),
            "hybrid": (world, across[rank % 2], 2, rank // 2, pairs[rank // 2], 2, rank % 2),
        }


def split_model(layout_name: str, heads: int, kv_heads: int, kernel: str, groups: Groups):
    torch.manual_seed(0)
    reference = Glm4vMoeTextModel(text_config(heads, kv_heads, kernel))
    root = nn.Module()
    root.model = nn.Module()
    root.model.language_model = copy.deepcopy(reference)
    cp, ring_group, ring, ring_rank, ulysses_group, ulysses, ulysses_rank = groups.layouts[layout_name]
    layout = ZigzagSequence(cp, ring, ring_rank, ulysses, ulysses_rank, pad_token_id=0)
    block_kernel = choose_block_kernel(kernel, "cpu")
    apply_context_parallel(root, layout, Ulysses(ulysses_group, ulysses, kernel), Ring(ring_group, ring, block_kernel))
    return reference, root, layout, cp


class CountRings(TorchDispatchMode):
    """Counts the ring op's forward runs (a selective-checkpoint cache hit never reaches this mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is RING_ATTENTION_OP
        return func(*args, **(kwargs or {}))


def attention_alone(layout_name: str, kv_heads: int, kernel: str, mask: str, groups: Groups) -> dict:
    """The context attention function alone (Ulysses exchange and/or ring) on this rank's shards of q/k/v against
    sdpa on the whole sequence with transformers' mask: output and the q/k/v gradients, relative max errors."""
    cp, ring_group, ring, ring_rank, ulysses_group, ulysses, ulysses_rank = groups.layouts[layout_name]
    layout = ZigzagSequence(cp, ring, ring_rank, ulysses, ulysses_rank, pad_token_id=0)
    generator = torch.Generator().manual_seed(11)
    data = inputs(mask)
    batch, heads, dim = data["inputs_embeds"].shape[0], 4, 8
    q = torch.randn(batch, heads, SEQ, dim, generator=generator)
    k, v = (torch.randn(batch, kv_heads, SEQ, dim, generator=generator) for _ in range(2))
    dout = torch.randn(batch, SEQ, heads, dim, generator=generator)
    # the reference: sdpa with what transformers allows (causal, same packed sample, key not padding)
    text_positions = data["position_ids"][0] if mask == "packed" else None
    attention_mask = data["attention_mask"]
    allowed = torch.stack(
        [
            allowed_matrix(
                SEQ,
                attention_mask[row].tolist() if attention_mask is not None else None,
                text_positions[row].tolist() if text_positions is not None else None,
            )
            for row in range(batch)
        ]
    )
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = torch.nn.functional.scaled_dot_product_attention(
        *full, attn_mask=allowed[:, None], scale=dim**-0.5, enable_gqa=True
    ).transpose(1, 2)
    (expected * dout).sum().backward()
    module = types.SimpleNamespace(
        ulysses=Ulysses(ulysses_group, ulysses, kernel),
        ring=Ring(ring_group, ring, choose_block_kernel(kernel, "cpu")),
        num_key_value_groups=heads // kv_heads,
    )
    local = [layout.shard(t, dim=2).clone().requires_grad_() for t in (q, k, v)]
    pieces = ring_mask(layout, batch, SEQ, attention_mask, text_positions)
    output, _ = context_attention(module, *local, pieces, scaling=dim**-0.5)
    (output * layout.shard(dout, dim=1)).sum().backward()

    def relative(got: torch.Tensor, want: torch.Tensor) -> float:
        return (got - want).abs().max().item() / want.abs().max().item()

    return {
        "output": relative(layout.unshard(output.contiguous(), dim=1), expected),
        "grad": max(relative(layout.unshard(t.grad, dim=2), f.grad) for t, f in zip(local, full)),
    }


def _ring_worker(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    groups = Groups(rank)
    alone = {
        f"{layout_name} kv {kv_heads} {kernel} {mask}": attention_alone(layout_name, kv_heads, kernel, mask, groups)
        for layout_name, _, kv_heads, kernel, mask in CASES
    }
    errors = {}
    for layout_name, heads, kv_heads, kernel, mask in CASES:
        reference, root, layout, cp = split_model(layout_name, heads, kv_heads, kernel, groups)
        figures = compare_split(reference, root.model.language_model, layout, inputs(mask), cp)
        figures["output"] /= figures["scale"]  # relative to the output's largest value, as the gradients
        figures["unsplit"] /= figures["scale"]
        errors[f"{layout_name} {heads}/{kv_heads} {kernel} {mask}"] = figures
    rings = {}
    for recompute, keep_attention in (("off", False), ("selective", False), ("full", True), ("full", False)):
        _, root, _, _ = split_model("ring4", 4, 2, "sdpa", groups)
        if recompute != "off":
            cfg = RecomputeConfig(
                enabled=True,
                apply_modules=["model.language_model.layers.{*}"],
                granularity=recompute,
                keep_attention=keep_attention,
            )
            apply_recompute(root, cfg)
        data = inputs("causal")
        output = root.model.language_model(**data, use_cache=False).last_hidden_state
        with CountRings() as counter:
            output.sum().backward()
        rings[f"{recompute} keep_attention={keep_attention}"] = counter.count
    with open(f"{out}.{rank}", "w") as handle:
        json.dump({"alone": alone, "errors": errors, "rings": rings}, handle)
    end_worker()


def test_ring_language_model_matches_unsplit(tmp_path):
    spawn(_ring_worker, args=(4, free_port(), str(tmp_path / "errors")), nprocs=4)
    for rank in range(4):
        found = json.loads((tmp_path / f"errors.{rank}").read_text())
        assert len(found["alone"]) == len(CASES)
        for case, figures in found["alone"].items():
            assert figures["output"] < 1e-5 and figures["grad"] < 1e-5, (rank, case, figures)
        assert len(found["errors"]) == len(CASES)
        for case, figures in found["errors"].items():
            assert figures["shape"] == figures["expected_shape"], case
            assert figures["output"] < 1e-5, (rank, case, figures)
            assert figures["grad"] < 1e-5, (rank, case, figures)
            assert figures["unsplit"] < 1e-5, (rank, case, figures)
        # The forward ring in backward: none without recompute, none when recompute keeps the ring op's outputs
        # (selective, full with keep_attention); once per layer when full recompute replays the layer.
        layers = 2
        assert found["rings"] == {
            "off keep_attention=False": 0,
            "selective keep_attention=False": 0,
            "full keep_attention=True": 0,
            "full keep_attention=False": layers,
        }, found


def test_ring_checks():
    hf = type("Config", (), {"text_config": text_config(4, 2, "sdpa")})
    check_context_parallel(hf, 1, "sdpa", ring=8)  # the ring puts no condition on the heads
    config = load_config(None, ["parallel.ring_attention_size=2", "parallel.ulysses_parallel_size=2"])
    assert config.parallel.ring_attention_size == 2
    with pytest.raises(Exception, match="'parallel.ring_attention_size' = 0"):
        load_config(None, ["parallel.ring_attention_size=0"])


# ------------------------------------------------------------------------------------------------------- training

OFFLOAD = "features.activation_offload.enabled=true"
FEATURES = ["features.recompute.enabled=true", "features.chunk_loss.mode=static", "features.chunk_loss.chunk_size=64"]


@pytest.mark.parametrize(
    "nproc, layout",
    [
        (2, ["parallel.ring_attention_size=2"]),
        # hybrid with activation offload too (saved q/k/v/out of the ring op go through the offload hooks)
        (4, ["parallel.ring_attention_size=2", "parallel.ulysses_parallel_size=2", OFFLOAD]),
    ],
    ids=["ring2", "hybrid2x2_offload"],
)
def test_training_under_ring_matches_one_rank(tmp_path, parity_off, nproc, layout):
    """Ring 2 and hybrid Ulysses 2 x Ring 2 (images in every sample, recompute, chunked loss; the hybrid with
    activation offload) against the plain 1-rank run at the same global batch."""
    result = train(tmp_path, PARITY + FEATURES + layout, nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Ring attention over 2 ranks (zigzag: 2 of 4 chunks per rank), block kernel aten." in result.stdout
    records, reference = read_metrics(tmp_path), parity_off(1)
    assert {r["global_batch_size"] for r in records} == {r["global_batch_size"] for r in reference}
    assert mean_relative_error([r["loss"] for r in records], [r["loss"] for r in reference]) < 1e-5
    assert mean_relative_error([r["grad_norm"] for r in records], [r["grad_norm"] for r in reference]) < 1e-5
