"""The kernels behind each implementation name of ops/registry.py, one small class per op family and device.

Interfaces (every implementation of an op has the same one, the reference's from ops/reference.py):
  rms_norm(x, weight, eps) -> y
  rotary.text(q, k, cos, sin) -> (q, k);  rotary.vision(q, k, cos, sin) -> (q, k)
  attention(q, k, v, causal=, scale=, cu_seqlens=, seqlens=) -> (out [B, S, Hq, D], lse [B, Hq, S] fp32 or None)
      q [B, Hq, S, D], k / v [B, Hkv, S, D]; cu_seqlens [n + 1] (device) and seqlens (the same as host ints) for
      packed rows (B = 1), None otherwise
  experts(rows, weight, counts) -> rows x weight[e] per group (weight [E, out, in], counts [E])
  permute.permute(hidden, expert_ids) -> (rows, state);  permute.unpermute(rows, state, weights, num_tokens)
  swiglu(x) -> silu(x[..., :I]) * x[..., I:]

NPU kernels call torch_npu with the signatures of Ascend's op-plugin documentation (docs/runtime.md lists the
sources); they are wired and tested against a stand-in with the documented semantics, not run on hardware here.
"""

from __future__ import annotations

from typing import Any

import torch

from glm45v_fsdp.model import moe as moe_module
from glm45v_fsdp.runtime.device import import_torch_npu

# ---------------------------------------------------------------------------------------------------------- cpu / cuda


def torch_grouped_mm(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return moe_module.grouped_mm(rows, weight, counts.cumsum(0).to(torch.int32))


# ---------------------------------------------------------------------------------------------------------- npu

# npu_fusion_attention's causal mask for sparse_mode 2/3: the compressed 2048 x 2048 upper triangle (True: masked)
NPU_CAUSAL_MASK_SIZE = 2048
NPU_CAUSAL_SPARSE_MODE = 3  # rightDownCausal: with equal query and key lengths, the usual causal mask
NPU_STAT_WIDTH = 8  # softmax_max / softmax_sum carry each row's statistic 8 times


def npu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """npu_rms_norm(x, gamma, epsilon) -> (y, rstd fp32 [..., 1]); y = x * rstd * gamma in x's dtype."""
    return import_torch_npu().npu_rms_norm(x, weight, epsilon=eps)[0]


class NpuRotary:
    """npu_rotary_mul(x, r1, r2, rotary_mode='half'): x * r1 + rotate_half(x) * r2 over the last dim, r1 / r2
    broadcast (text: x BNSD, r B1SD; vision: x TND, r T1D). Partial rotary: the op on the first R dims, the rest
    passed through."""

    @staticmethod
    def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        width = cos.shape[-1]
        part = x if width == x.shape[-1] else x[..., :width].contiguous()
        rotated = import_torch_npu().npu_rotary_mul(part, cos, sin)
        return rotated if width == x.shape[-1] else torch.cat((rotated, x[..., width:]), dim=-1)

    @classmethod
    def text(cls, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1).to(q.dtype), sin.unsqueeze(1).to(q.dtype)
        return cls._apply(q, cos, sin), cls._apply(k, cos, sin)

    @classmethod
    def vision(cls, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()  # fp32, as the reference
        return cls._apply(q.float(), cos, sin).to(q.dtype), cls._apply(k.float(), cos, sin).to(k.dtype)


def _npu_lse(softmax_max: torch.Tensor, softmax_sum: torch.Tensor) -> torch.Tensor:
    return softmax_max[..., 0].float() + torch.log(softmax_sum[..., 0].float())


def _tnd_lse(softmax_max, softmax_sum, seqlens: list[int], heads: int) -> torch.Tensor:
    """[N, T] from TND statistics: with the default softmax_layout their memory is each sample's [N, s_i, 8] block
    in turn, although the tensors read [T, N, 8] (MindSpeed's flatten_softmax reads them the same way)."""
    flat = _npu_lse(softmax_max.reshape(-1, NPU_STAT_WIDTH), softmax_sum.reshape(-1, NPU_STAT_WIDTH))
    pieces = [flat[start * heads : end * heads].view(heads, end - start) for start, end in zip(seqlens, seqlens[1:])]
    return torch.cat(pieces, dim=1)


def npu_fusion_attention(q, k, v, *, causal: bool, scale: float, cu_seqlens=None, seqlens=None):
    """TND varlen for packed rows (actual_seq_qlen / actual_seq_kvlen: the cumulative ends without the leading 0,
    host ints), BNSD otherwise. GQA native (head_num = query heads). Causal: sparse_mode 3 with the compressed
    2048 x 2048 upper triangle (True: masked). lse = softmax_max + log(softmax_sum)."""
    npu = import_torch_npu()
    mask = {"atten_mask": None, "sparse_mode": 0}
    if causal:
        triangle = torch.ones(NPU_CAUSAL_MASK_SIZE, NPU_CAUSAL_MASK_SIZE, dtype=torch.bool, device=q.device)
        mask = {"atten_mask": triangle.triu(1), "sparse_mode": NPU_CAUSAL_SPARSE_MODE}
    heads = q.shape[1]
    if seqlens is not None:
        assert q.shape[0] == 1, "packed rows come one per micro batch"
        ends = list(seqlens[1:])
        tnd = [t[0].transpose(0, 1) for t in (q, k, v)]  # [T, N, D]
        outputs = npu.npu_fusion_attention(
            *tnd, heads, "TND", scale=scale, keep_prob=1.0, actual_seq_qlen=ends, actual_seq_kvlen=ends, **mask
        )
        return outputs[0][None], _tnd_lse(outputs[1], outputs[2], list(seqlens), heads)[None]
    outputs = npu.npu_fusion_attention(q, k, v, heads, "BNSD", scale=scale, keep_prob=1.0, **mask)
    return outputs[0].transpose(1, 2), _npu_lse(outputs[1], outputs[2])


def _npu_gmm(rows: torch.Tensor, weight_kn: torch.Tensor, counts: torch.Tensor, group_type: int) -> torch.Tensor:
    return import_torch_npu().npu_grouped_matmul(
        [rows], [weight_kn], group_list=counts, split_item=3, group_type=group_type, group_list_type=1
    )[0]


class _NpuGroupedMatmul(torch.autograd.Function):
    """torch_npu's grouped matmul has no autograd of its own: dx = grad x W_e per group (M-grouped), dW_e =
    x_e^T grad_e (K-grouped, one [E, in, out] result)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows, weight, counts)
        return _npu_gmm(rows, weight.transpose(-2, -1), counts, group_type=0)  # weight [E, out, in] as [E, K, N]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, weight, counts = ctx.saved_tensors
        grad = grad.contiguous()
        grad_rows = _npu_gmm(grad, weight, counts, group_type=0)  # [S, out] x [E, out, in]
        grad_weight = _npu_gmm(rows.t(), grad, counts, group_type=2)  # [E, in, out]
        return grad_rows, grad_weight.transpose(-2, -1), None


def npu_grouped_matmul(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """npu_grouped_matmul([x], [w], group_list=counts, group_list_type=1 (counts), group_type=0 (groups of rows),
    split_item=3 (one output)) under the autograd above."""
    return _NpuGroupedMatmul.apply(rows, weight, counts.to(torch.int64))


class NpuPermute:
    """npu_moe_token_permute(tokens, indices [T, k]) -> (rows sorted stably by expert of the flat t * k + slot
    order, sorted_indices: the inverse permutation, row of each flat entry); npu_moe_token_unpermute(rows,
    sorted_indices, probs [T, k]) -> out[t] = sum_k probs[t, k] * rows[sorted_indices[t * k + slot]]."""

    @staticmethod
    def permute(hidden: torch.Tensor, expert_ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return import_torch_npu().npu_moe_token_permute(hidden, expert_ids.to(torch.int32))

    @staticmethod
    def unpermute(rows: torch.Tensor, sorted_indices, weights: torch.Tensor, num_tokens: int) -> torch.Tensor:
        return import_torch_npu().npu_moe_token_unpermute(rows, sorted_indices, probs=weights.to(rows.dtype))


def npu_swiglu(x: torch.Tensor) -> torch.Tensor:
    """npu_swiglu(x, dim): silu of the first half times the second half."""
    return import_torch_npu().npu_swiglu(x, dim=-1)


# ---------------------------------------------------------------------------------------------------------- cuda


def flash_attn_varlen(q, k, v, *, causal: bool, scale: float, cu_seqlens=None, seqlens=None):
    """flash_attn_varlen_func on [T, H, D] (a padded batch as B rows of S); returns its lse [H, T] per row."""
    from flash_attn import flash_attn_varlen_func

    batch, heads, length, dim = q.shape
    if cu_seqlens is None:
        cu_seqlens = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=q.device)
        longest = length
    else:
        longest = max(b - a for a, b in zip(seqlens[:-1], seqlens[1:]))
    flat = [t.transpose(1, 2).reshape(-1, t.shape[1], dim) for t in (q, k, v)]
    cu = cu_seqlens.to(torch.int32)
    out, lse, _ = flash_attn_varlen_func(
        *flat, cu, cu, longest, longest, softmax_scale=scale, causal=causal, return_attn_probs=True
    )
    return out.reshape(batch, length, heads, dim), lse.reshape(heads, batch, length).transpose(0, 1).float()


KERNELS: dict[tuple[str, str], Any] = {
    ("rms_norm", "npu_rms_norm"): npu_rms_norm,
    ("rotary", "npu_rotary_mul"): NpuRotary,
    ("attention", "npu_fusion_attention"): npu_fusion_attention,
    ("attention", "flash_attn"): flash_attn_varlen,
    ("experts", "grouped_mm"): torch_grouped_mm,
    ("experts", "npu_grouped_matmul"): npu_grouped_matmul,
    ("permute", "npu_moe_token_permute"): NpuPermute,
    ("swiglu", "npu_swiglu"): npu_swiglu,
}
