"""GLM-4.5V's MoE block, split into the parts expert parallelism and the accelerator ops replace one by one.

Same module path and parameter names and shapes as transformers' Glm4vMoeTextMoE, so checkpoints, HF load/export and
DCP are unchanged: `mlp.gate.weight` [E, H], `mlp.gate.e_score_correction_bias` [E] (a buffer),
`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I], `mlp.shared_experts.*`.

  router      MoERouter, in fp32: sigmoid scores, group-limited top-k chosen with `e_score_correction_bias`, the
              chosen scores normalised and scaled; transformers' Glm4vMoeTextTopkRouter op for op.
  dispatcher  a TokenDispatcher: `dispatch` puts the (token, expert) pairs in expert order and counts them per
              local expert; `combine` returns each pair's output to its token, weighted by its routing weight, and
              sums a token's k outputs in fp32. LocalDispatcher keeps everything on this rank (its permute /
              unpermute from the ops layer); expert parallelism swaps in one that exchanges the pairs between ranks.
  experts     GroupedExperts: every expert's SwiGLU MLP over its contiguous rows, one grouped GEMM per projection
              (the ops layer's `experts` kernel: torch._grouped_mm, torch_npu's grouped matmul) or a per-expert loop
              (the reference), and its `swiglu` kernel.
  shared      transformers' Glm4vMoeTextMLP, added to the routed output.

The pairs are ordered by expert, then top-k slot, then token: the order transformers' eager loop visits them, so in
fp32 the block equals transformers' bit for bit (forward and gradients). An expert that receives no token computes
nothing and gets an exactly zero gradient.

Routing statistics: a training forward hands the router's logits and chosen experts to the block's `observer`, the
router monitor of glm45v_fsdp/model/router_health.py (per-layer figures, bias balancing, auxiliary loss).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.activations import ACT2FN
from transformers.models.glm4v_moe.modeling_glm4v_moe import Glm4vMoeTextMLP

from glm45v_fsdp.adapters import grouped_update


class MoERouter(nn.Module):
    """Top-k routing in fp32; returns (router logits [T, E], top-k weights [T, k] fp32, top-k expert ids [T, k])."""

    def __init__(self, config) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        self.num_groups = config.n_group
        self.top_groups = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Buffer(torch.zeros(self.num_experts, dtype=torch.float32))
        self.skew = 0.0  # model.router_skew: a test knob that favours the low-numbered experts in the selection

    def selection_skew(self, device: torch.device) -> torch.Tensor:
        """skew x (E-1-e)/(E-1) for expert e: added to the selection scores only, never to the routing weights."""
        return self.skew * torch.linspace(1.0, 0.0, self.num_experts, device=device)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden.type(torch.float32), self.weight.type(torch.float32))
        scores = logits.sigmoid()
        biased = scores + self.e_score_correction_bias
        if self.skew:
            biased = biased + self.selection_skew(biased.device)
        per_group = self.num_experts // self.num_groups
        group_scores = biased.view(-1, self.num_groups, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        top_groups = torch.topk(group_scores, k=self.top_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, top_groups, 1)
        expert_mask = group_mask.unsqueeze(-1).expand(-1, self.num_groups, per_group).reshape(-1, self.num_experts)
        biased = biased.masked_fill(~expert_mask.bool(), float("-inf"))
        expert_ids = torch.topk(biased, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, expert_ids)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
        return logits, weights * self.routed_scaling_factor, expert_ids


def grouped_mm(rows: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """rows [S, in] x weight [E, out, in] per group of rows (group e ends at ends[e]) -> [S, out]."""
    return _ContiguousGrad.apply(torch._grouped_mm(rows, weight.transpose(-2, -1), offs=ends))


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: torch._grouped_mm's backward rejects an
    expanded gradient (e.g. of a plain `.sum()`)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class ExtraExperts(Protocol):
    """Experts a forward runs beyond this rank's own (EP balance's replicas): `run` computes the own experts with
    `compute` on the first rows and the extra ones on the rest. `stacks`: this rank's [n, ...] stacks by name, the
    base's and their adapters' (a replica carries all of its expert's)."""

    def run(self, compute, rows: torch.Tensor, counts: torch.Tensor, stacks: dict[str, torch.Tensor]): ...


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored stacked; `forward(rows, counts)` runs expert e on its `counts[e]` contiguous rows.

    Under expert parallelism the two stacks are DTensors sharded on dim 0 over the ep ranks: forward runs this
    rank's E/ep experts (plus, with EP balance, the replicas `extra` brings).
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.gate_up_proj = nn.Parameter(
            torch.empty(self.num_experts, 2 * config.moe_intermediate_size, config.hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, config.moe_intermediate_size))
        self.act_fn = ACT2FN[config.hidden_act]
        # the ops plan (glm45v_fsdp/ops) sets a grouped GEMM `gemm(rows, weight, counts)` and a fused `swiglu`;
        # without them: the per-expert loop (the reference)
        self.kernel = "loop"
        self.gemm = None
        self.swiglu = None
        self.adapter_scaling: dict[str, float] = {}  # the lora plan: stack name -> alpha / r of its adapter

    def stacks(self) -> list[str]:
        """The [E, ...] parameters: the base stacks and their adapters (expert parallelism shards them alike)."""
        return [name for name, _ in self.named_parameters(recurse=False)]

    def use_kernels(self, name: str, gemm, swiglu=None) -> None:
        """Run the experts with a grouped GEMM `gemm(rows, weight, counts)` (logged as `name`) and, if given, a
        fused `swiglu(x)` on the gate / up projection."""
        self.kernel, self.gemm, self.swiglu = name, gemm, swiglu

    def forward(self, rows: torch.Tensor, counts: torch.Tensor, extra: ExtraExperts | None = None) -> torch.Tensor:
        stacks = {name: _local(getattr(self, name)) for name in self.stacks()}
        if extra is not None:
            return extra.run(self.compute, rows, counts, stacks)
        return self.compute(rows, counts, stacks)

    def compute(self, rows: torch.Tensor, counts: torch.Tensor, stacks: dict[str, torch.Tensor]) -> torch.Tensor:
        """Expert e of the stacks (gate_up_proj [n, 2I, H], down_proj [n, H, I] and their adapters' factors, by
        name) on its counts[e] contiguous rows."""
        gate_up, down = stacks["gate_up_proj"], stacks["down_proj"]
        assert counts.numel() == gate_up.shape[0], f"{counts.numel()} row counts for {gate_up.shape[0]} experts"
        if self.gemm is not None:
            projected = self._adapted(self.gemm(rows, gate_up, counts), "gate_up_proj", rows, counts, stacks)
            if self.swiglu is not None:
                hidden = self.swiglu(projected)
            else:
                gate, up = projected.chunk(2, dim=-1)
                hidden = self.act_fn(gate) * up
            return self._adapted(self.gemm(hidden, down, counts), "down_proj", hidden, counts, stacks)
        if self.adapter_scaling:  # the reference loop with adapters: each expert's adapted projections in turn
            return self._adapted_loop(rows, counts, stacks)
        outputs, start = [], 0
        for expert, count in enumerate(counts.tolist()):
            if count:
                gate, up = F.linear(rows[start : start + count], gate_up[expert]).chunk(2, dim=-1)
                outputs.append(F.linear(self.act_fn(gate) * up, down[expert]))
                start += count
        if not outputs:  # no row here (an EP rank whose experts got no pair): still reach the weights, so every
            # rank's backward yields a (zero) gradient and FSDP's reduce-scatter runs on all of them alike
            gate, up = F.linear(rows, gate_up[0]).chunk(2, dim=-1)
            return F.linear(self.act_fn(gate) * up, down[0])
        return torch.cat(outputs)

    def _adapted(
        self,
        projected: torch.Tensor,
        stack: str,
        rows: torch.Tensor,
        counts: torch.Tensor,
        stacks: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """`projected` (rows x stack^T per expert) plus the stack's LoRA update when it has an adapter."""
        scaling = self.adapter_scaling.get(stack)
        if scaling is None:
            return projected
        update = grouped_update(rows, stacks[f"{stack}_lora_A"], stacks[f"{stack}_lora_B"], counts, self.gemm)
        return projected + update * scaling

    def _adapted_loop(self, rows: torch.Tensor, counts: torch.Tensor, stacks: dict[str, torch.Tensor]) -> torch.Tensor:
        gate_up = self._adapted(loop_gemm(rows, stacks["gate_up_proj"], counts), "gate_up_proj", rows, counts, stacks)
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = self.act_fn(gate) * up
        return self._adapted(loop_gemm(hidden, stacks["down_proj"], counts), "down_proj", hidden, counts, stacks)


def loop_gemm(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """rows x weight[e]^T for each expert's contiguous rows, one expert at a time (the reference)."""
    ends = counts.cumsum(0).tolist()
    return torch.cat(
        [F.linear(rows[end - count : end], weight[e]) for e, (end, count) in enumerate(zip(ends, counts.tolist()))]
    )


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts: the local shard of an EP-sharded stack (FSDP has gathered the efsdp dim)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


@dataclass
class Dispatched:
    """What `TokenDispatcher.dispatch` hands the experts and keeps for `combine`."""

    rows: torch.Tensor  # [S, H]: the pairs' hidden states, grouped by local expert
    counts: torch.Tensor  # [local experts]: rows per expert, in order
    token_index: torch.Tensor | None  # [S]: the token each row belongs to (None: an ops permute kernel's `context`)
    weights: torch.Tensor  # [S]: each row's routing weight (fp32); [T, k] with an ops permute kernel
    num_tokens: int
    extra: ExtraExperts | None = None  # replicas run here besides the own experts (EP balance)
    context: object = None  # what the dispatcher itself keeps for combine


class _WeightedCombine(torch.autograd.Function):
    """out[t] = sum over the pairs p of token t of weight[p] * rows[p], accumulated in fp32, returned in the rows'
    dtype. Saves the rows in their own dtype (autograd's product of bf16 rows and fp32 weights would keep an fp32
    copy of every row: 4h bytes per (token, expert) pair)."""

    @staticmethod
    def forward(
        ctx, rows: torch.Tensor, weights: torch.Tensor, token_index: torch.Tensor, num_tokens: int, keep_fp32: bool
    ):
        ctx.save_for_backward(rows, weights, token_index)
        combined = rows.new_zeros(num_tokens, rows.shape[-1], dtype=torch.float32)
        combined.index_add_(0, token_index, rows.float() * weights[:, None])
        return combined if keep_fp32 else combined.to(rows.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, weights, token_index = ctx.saved_tensors
        grad_rows = grad[token_index].float()
        grad_weights = (grad_rows * rows.float()).sum(-1) if ctx.needs_input_grad[1] else None
        return (grad_rows * weights[:, None]).to(rows.dtype), grad_weights, None, None, None


def weighted_combine(
    rows: torch.Tensor, weights: torch.Tensor, token_index: torch.Tensor, num_tokens: int, keep_fp32: bool = False
) -> torch.Tensor:
    """Each pair's expert output weighted by its routing weight, summed per token in fp32 (`_WeightedCombine`);
    returned in the rows' dtype, or in fp32 (`keep_fp32`) for a sum that continues across ranks."""
    return _WeightedCombine.apply(rows, weights, token_index, num_tokens, keep_fp32)


class TokenDispatcher(Protocol):
    def dispatch(self, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> Dispatched: ...

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor: ...

    def describe(self) -> str: ...


class LocalDispatcher:
    """Every expert on this rank: sort the pairs by (expert, top-k slot, token); combine by index_add in fp32. A
    `permute` kernel of the ops layer (`permute(hidden, expert_ids)` / `unpermute(rows, state, weights, tokens)`)
    replaces both steps; the counts per expert stay a bincount."""

    def __init__(self, num_experts: int, permute: object | None = None) -> None:
        self.num_experts = num_experts
        self.permute = permute

    def dispatch(self, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> Dispatched:
        num_tokens, top_k = expert_ids.shape
        slot_major = expert_ids.t().reshape(-1)  # pair p = slot * tokens + token
        counts = torch.bincount(slot_major, minlength=self.num_experts)
        if self.permute is not None:
            rows, state = self.permute.permute(hidden, expert_ids)
            return Dispatched(rows, counts, None, weights, num_tokens, context=state)
        order = torch.sort(slot_major, stable=True)[1]
        token_index = order % num_tokens
        return Dispatched(hidden[token_index], counts, token_index, weights.t().reshape(-1)[order], num_tokens)

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        if self.permute is not None:
            return self.permute.unpermute(expert_out, dispatched.context, dispatched.weights, dispatched.num_tokens)
        return weighted_combine(expert_out, dispatched.weights, dispatched.token_index, dispatched.num_tokens)

    def describe(self) -> str:
        return f"local (all {self.num_experts} experts on every rank)"


def in_backward() -> bool:
    """True while autograd runs a backward pass (e.g. a checkpointed forward being recomputed)."""
    return torch._C._current_graph_task_id() != -1


class MoEBlock(nn.Module):
    """router -> dispatcher -> experts -> combine, plus the shared expert; see the module docstring."""

    def __init__(self, config) -> None:
        super().__init__()
        self.experts = GroupedExperts(config)  # registration order as transformers': parameters() order is the same
        self.gate = MoERouter(config)
        self.shared_experts = Glm4vMoeTextMLP(
            config=config, intermediate_size=config.moe_intermediate_size * config.n_shared_experts
        )
        self.dispatcher: TokenDispatcher = LocalDispatcher(config.n_routed_experts)
        # observer(router logits [T, E], expert ids [T, k], rows): the router monitor (router_health.py)
        self.observer: Callable[[torch.Tensor, torch.Tensor, int], None] | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.view(-1, hidden.shape[-1])
        logits, weights, expert_ids = self.gate(flat)
        if self.observer is not None and self.training:
            self.observer(logits, expert_ids, hidden.shape[0] if hidden.dim() == 3 else 1)
        dispatched = self.dispatcher.dispatch(flat, expert_ids, weights)
        expert_out = self.experts(dispatched.rows, dispatched.counts, dispatched.extra)
        routed = self.dispatcher.combine(expert_out, dispatched)
        return routed.view(hidden.shape) + self.shared_experts(hidden)


def moe_blocks(model: nn.Module) -> list[MoEBlock]:
    return [module for module in model.modules() if isinstance(module, MoEBlock)]
