"""The reference of every op: plain PyTorch, any device, the semantics each fast path is held against.

Each function equals the transformers module it stands for (tests/test_ops.py: forward and gradients, fp32, within
1e-6), so a run with `model.ops=reference` is transformers' own model.

  rms_norm(x, weight, eps)              Glm4vMoeTextRMSNorm / Glm4vMoeRMSNorm: fp32 statistics, weight * x.to(dtype)
  rotary(q, k, cos, sin)                text attention: q, k [B, H, S, D]; cos, sin [B, S, R] (mRoPE sections already
                                        merged by the rotary embedding; R <= D, the partial rotary part first)
  vision_rotary(q, k, cos, sin)         vision attention: q, k [S, H, D]; cos, sin [S, D]; computed in fp32
  attention(q, k, v, ...)               [B, Hq, S, D] x [B, Hkv, S, D] -> out [B, S, Hq, D] and lse [B, Hq, S]
                                        (fp32); causal or full; `cu_seqlens` makes it block diagonal (packed rows)
  swiglu(x)                             act(x[..., :I]) * x[..., I:], SiLU: the gate half first, as gate_up_proj
  grouped_gemm(rows, weight, counts)    rows [S, in] x weight [E, out, in]: expert e on its counts[e] rows

The permute reference is the MoE block's own LocalDispatcher (model/moe.py: a stable sort by expert, the rows in
(expert, top-k slot, token) order, and an fp32 index_add back onto the tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    hidden = x.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    width = cos.shape[-1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        part, rest = x[..., :width], x[..., width:]
        return torch.cat(((part * cos) + (rotate_half(part) * sin), rest), dim=-1)

    return rotate(q), rotate(k)


def vision_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return ((x32 * cos) + (rotate_half(x32) * sin)).to(x.dtype)

    return rotate(q), rotate(k)


def segment_ids(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """[length] the sample each position of a packed row belongs to (positions past cu_seqlens[-1]: -1)."""
    positions = torch.arange(length, device=cu_seqlens.device)
    ids = torch.bucketize(positions, cu_seqlens[1:].to(positions.dtype), right=True)
    return torch.where(positions < cu_seqlens[-1], ids, -1)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention in fp32 scores: (out [B, S, Hq, D] in q's dtype, lse [B, Hq, S] fp32). GQA: each key/value
    head serves Hq/Hkv consecutive query heads. `cu_seqlens` [n + 1]: every row is packed with the same samples; a
    query sees only keys of its own sample."""
    batch, heads, length, dim = q.shape
    kv_heads = k.shape[1]
    qg = q.float().reshape(batch, kv_heads, heads // kv_heads, length, dim)
    scores = torch.einsum("bhgqd,bhkd->bhgqk", qg, k.float()) * scale
    allowed = torch.ones(length, k.shape[2], dtype=torch.bool, device=q.device)
    if causal:
        allowed = allowed.tril()
    if cu_seqlens is not None:
        ids = segment_ids(cu_seqlens, length)
        allowed = allowed & (ids[:, None] == ids[None, :]) & (ids[:, None] >= 0)
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)  # a row that sees nothing (padding): zeros
    out = torch.einsum("bhgqk,bhkd->bhgqd", probs, v.float()).reshape(batch, heads, length, dim)
    return out.transpose(1, 2).to(q.dtype), lse.reshape(batch, heads, length)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def grouped_gemm(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """rows [S, in] x weight [E, out, in] -> [S, out]: expert e's matrix on its counts[e] contiguous rows."""
    outputs, start = [], 0
    for expert, count in enumerate(counts.tolist()):
        outputs.append(F.linear(rows[start : start + count], weight[expert]))
        start += count
    return torch.cat(outputs) if outputs else rows.new_zeros(0, weight.shape[1])
