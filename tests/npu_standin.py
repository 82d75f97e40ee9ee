"""A stand-in `torch_npu` for CPU tests: the fused ops the ops layer calls, in plain PyTorch, with torch_npu's
signatures (Ascend op-plugin's op_plugin_functions.yaml) and documented semantics, written from those docs and
independent of glm45v_fsdp/ops/reference.py. tests/test_ops.py checks it against mindstudio-probe's CPU
implementations where that package has one (rms_norm, rotary_mul, swiglu, fusion attention in BNSD).

What it reproduces because the kernels depend on it:
  - npu_fusion_attention's TND statistics: each sample's [N, s_i, 8] block in turn, read as [T, N, 8];
    the causal sparse modes require the compressed 2048 x 2048 upper-triangular mask; `scale` defaults to 1;
  - npu_grouped_matmul has no autograd (its outputs do not require grad) and needs group_type passed;
  - npu_moe_token_permute returns the inverse permutation as sorted_indices.
`calls` records each op called, so tests can see which path ran.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

CAUSAL_MASK = 2048


class StandInTorchNpu(types.ModuleType):
    def __init__(self, missing: tuple[str, ...] = ()) -> None:
        super().__init__("torch_npu")
        self.calls: list[str] = []
        self._missing = set(missing)  # ops an older torch_npu does not have

    def __getattribute__(self, name: str):
        if name in object.__getattribute__(self, "__dict__").get("_missing", ()):
            raise AttributeError(f"module 'torch_npu' has no attribute '{name}'")
        return object.__getattribute__(self, name)

    # ------------------------------------------------------------------------------------------------ norm / rotary

    def npu_rms_norm(self, self_, gamma, epsilon=1e-06):
        self.calls.append("npu_rms_norm")
        x = self_.float()
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon)
        return (x * rstd * gamma.float()).to(self_.dtype), rstd

    def npu_rotary_mul(self, self_, r1, r2, rotary_mode="half"):
        self.calls.append("npu_rotary_mul")
        assert rotary_mode == "half", rotary_mode
        x = self_
        assert x.dim() in (3, 4) and x.shape[-1] % 2 == 0, "x must be 3-D or 4-D with an even last dim"
        for r in (r1, r2):
            assert r.dim() == x.dim() and r.shape[-1] == x.shape[-1], f"r {tuple(r.shape)} against x {tuple(x.shape)}"
            assert all(a in (1, b) for a, b in zip(r.shape[:-1], x.shape[:-1])), "r must broadcast over x"
        first, second = x.chunk(2, dim=-1)
        return x * r1 + torch.cat((-second, first), dim=-1) * r2

    def npu_swiglu(self, self_, dim=-1):
        self.calls.append("npu_swiglu")
        gate, up = self_.chunk(2, dim=dim)
        return F.silu(gate) * up

    # ------------------------------------------------------------------------------------------------ attention

    def npu_fusion_attention(
        self,
        query,
        key,
        value,
        head_num,
        input_layout,
        pse=None,
        padding_mask=None,
        atten_mask=None,
        scale=1.0,
        keep_prob=1.0,
        pre_tockens=2147483647,
        next_tockens=2147483647,
        inner_precise=0,
        prefix=None,
        actual_seq_qlen=None,
        actual_seq_kvlen=None,
        sparse_mode=0,
        gen_mask_parallel=True,
        sync=False,
    ):
        self.calls.append(f"npu_fusion_attention {input_layout}")
        assert pse is None and padding_mask is None and keep_prob == 1.0
        causal = atten_mask is not None
        if causal:
            assert sparse_mode in (2, 3), f"sparse_mode {sparse_mode} with a mask"
            assert atten_mask.shape == (CAUSAL_MASK, CAUSAL_MASK) and atten_mask.dtype == torch.bool
            assert torch.equal(atten_mask.cpu(), torch.ones(CAUSAL_MASK, CAUSAL_MASK, dtype=torch.bool).triu(1))
        else:
            assert sparse_mode == 0
        if input_layout == "BNSD":
            assert query.shape[1] == head_num
            out, row_max, row_sum = self._attend(query, key, value, causal, scale)
            stat = lambda t: t.unsqueeze(-1).expand(*t.shape, 8).contiguous()  # noqa: E731
            return out, stat(row_max), stat(row_sum), query.new_empty(0), 0, 0, 0
        assert input_layout == "TND" and query.shape[1] == head_num
        assert actual_seq_qlen is not None and list(actual_seq_qlen) == list(actual_seq_kvlen)
        ends = [int(e) for e in actual_seq_qlen]
        assert ends == sorted(ends) and ends[-1] == query.shape[0], "cumulative ends without the leading 0"
        outs, maxes, sums = [], [], []
        for start, end in zip([0, *ends[:-1]], ends):
            as_bnsd = [t[start:end].transpose(0, 1)[None] for t in (query, key, value)]
            out, row_max, row_sum = self._attend(*as_bnsd, causal, scale)
            outs.append(out[0].transpose(0, 1))
            maxes.append(row_max[0].reshape(-1))  # [N, s_i] blocks, one sample after another
            sums.append(row_sum[0].reshape(-1))
        shape = (query.shape[0], head_num, 8)
        tnd_stat = lambda parts: torch.cat(parts)[:, None].expand(-1, 8).reshape(shape)  # noqa: E731
        return torch.cat(outs), tnd_stat(maxes), tnd_stat(sums), query.new_empty(0), 0, 0, 0

    @staticmethod
    def _attend(q, k, v, causal: bool, scale: float):
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = (q.float() @ k.float().transpose(-2, -1)) * scale
        if causal:
            sq, sk = scores.shape[-2:]
            scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1), float("-inf"))
        row_max = scores.amax(-1)
        weights = torch.exp(scores - row_max.unsqueeze(-1))
        row_sum = weights.sum(-1)
        out = (weights / row_sum.unsqueeze(-1)) @ v.float()
        return out.to(q.dtype), row_max, row_sum

    # ------------------------------------------------------------------------------------------------ MoE

    def npu_grouped_matmul(
        self, x, weight, *, bias=None, group_list=None, split_item=0, group_type=None, group_list_type=0, **unused
    ):
        self.calls.append(f"npu_grouped_matmul type {group_type}")
        assert bias is None and not unused and len(x) == 1 and len(weight) == 1
        assert group_type is not None, "Requires manual passing group_type"
        assert split_item in (2, 3) and group_list_type in (0, 1)
        if group_list_type == 1:  # counts per group
            counts = group_list.tolist()
        else:  # cumulative ends
            counts = torch.diff(group_list, prepend=group_list.new_zeros(1)).tolist()
        (rows,), (w,) = x, weight
        with torch.no_grad():  # torch_npu registers no autograd for this op
            if group_type == 0:  # groups of rows: rows [M, K] x w [E, K, N] -> [M, N]
                assert w.dim() == 3 and sum(counts) == rows.shape[0]
                parts, start = [], 0
                for expert, count in enumerate(counts):
                    parts.append(rows[start : start + count] @ w[expert])
                    start += count
                return [torch.cat(parts)]
            assert group_type == 2  # groups along K: x [M, K] x w [K, N] -> [E, M, N]
            assert w.dim() == 2 and sum(counts) == rows.shape[1]
            parts, start = [], 0
            for count in counts:
                parts.append(rows[:, start : start + count] @ w[start : start + count])
                start += count
            return [torch.stack(parts)]

    def npu_moe_token_permute(self, tokens, indices, num_out_tokens=None, padded_mode=False):
        self.calls.append("npu_moe_token_permute")
        assert not padded_mode and indices.dtype in (torch.int32, torch.int64)
        top_k = indices.shape[1] if indices.dim() == 2 else 1
        order = torch.argsort(indices.reshape(-1), stable=True)
        return tokens[order // top_k], torch.argsort(order).to(torch.int32)

    def npu_moe_token_unpermute(
        self, permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None
    ):
        self.calls.append("npu_moe_token_unpermute")
        assert sorted_indices.dtype == torch.int32 and not padded_mode
        top_k = probs.shape[1] if probs is not None else 1
        gathered = permuted_tokens[sorted_indices.long()].view(-1, top_k, permuted_tokens.shape[-1])
        if probs is None:
            return gathered[:, 0]
        return (gathered.float() * probs.float().unsqueeze(-1)).sum(1).to(permuted_tokens.dtype)
