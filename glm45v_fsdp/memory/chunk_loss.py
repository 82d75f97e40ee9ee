"""Chunked lm_head + cross-entropy: the [tokens, vocab] logits never exist at once.

`chunked_linear_cross_entropy` computes, chunk by chunk of rows, the logits in fp32, their log-sum-exp and the CE
sum, and right away the gradients of the hidden states and of the weight (fp32 accumulation), which backward only
scales. Peak memory of the loss is then about one chunk's [rows, vocab] fp32 buffer plus the fp32 weight gradient,
instead of three [tokens, vocab] fp32 tensors. Only supervised rows are computed at all (labels = ignore_index
contribute nothing to the loss or the gradients). Written with plain tensor ops (no fused kernel), so the engine's
CPU memory tracker sees every buffer it allocates and the figures it reports are honest.

The head is applied as a plan: `ChunkedLossHead` replaces `lm_head`'s class on the meta model (same parameter), so
FSDP2 gathers the weight once per micro batch, for all chunks, and reduce-scatters its gradient once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from glm45v_fsdp.config import ChunkLossConfig
from glm45v_fsdp.module_patterns import PlanMatch, match_modules
from glm45v_fsdp.vocab import IGNORE_INDEX

FP32_BYTES = 4


def _loss_and_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk: int,
    want_hidden: bool,
    want_weight: bool,
    row_losses: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(CE sum, d sum / d hidden or None, d sum / d weight in fp32 or None), `chunk` rows at a time; `row_losses`
    (fp32, one per row), when given, receives each row's CE (the terms of the sum)."""
    weight32 = weight.float()
    grad_hidden = torch.empty_like(hidden) if want_hidden else None
    grad_weight = torch.zeros_like(weight32) if want_weight else None
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk):
        rows = hidden[start : start + chunk]
        targets = labels[start : start + chunk]
        logits = rows.float() @ weight32.T  # [c, V] fp32: the only large buffer
        lse = torch.logsumexp(logits, dim=-1)
        index = torch.arange(len(targets), device=hidden.device)
        row_loss = lse - logits[index, targets]
        loss += row_loss.sum()
        if row_losses is not None:
            row_losses[start : start + chunk] = row_loss
        if grad_hidden is None and grad_weight is None:
            continue
        probs = logits.sub_(lse[:, None]).exp_()  # softmax in place: d(sum CE)/d logits = softmax - one hot
        probs[index, targets] -= 1.0
        if grad_hidden is not None:
            grad_hidden[start : start + chunk] = (probs @ weight32).to(hidden.dtype)
        if grad_weight is not None:
            grad_weight.addmm_(probs.T, rows.float())
        del logits, probs
    return loss, grad_hidden, grad_weight


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk: int,
        row_losses: torch.Tensor | None,
    ) -> torch.Tensor:
        with torch.autocast(device_type=hidden.device.type, enabled=False):  # fp32 logits whatever the context
            loss, grad_hidden, grad_weight = _loss_and_grads(
                hidden, weight, labels, chunk, *ctx.needs_input_grad[:2], row_losses
            )
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk: int,
    row_losses: torch.Tensor | None = None,
):
    """Sum of CE of `hidden @ weight.T` against `labels` (all supervised: no ignore_index here), `chunk` rows at a
    time; same value as cross_entropy(linear(hidden, weight).float(), labels, reduction="sum"). `row_losses` (fp32,
    one per row), when given, receives each row's CE (the terms of that sum). Without grad mode (an eval) the sum
    alone: no gradient is computed or held (an autograd Function's forward cannot tell)."""
    if torch.is_grad_enabled():
        return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, chunk, row_losses)
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        return _loss_and_grads(hidden, weight, labels, chunk, False, False, row_losses)[0]


@dataclass
class ChunkChoice:
    rows: int
    chunk_size: int

    @property
    def chunks(self) -> int:
        return math.ceil(self.rows / self.chunk_size) if self.rows else 0


def choose_chunk(cfg: ChunkLossConfig, rows: int, vocab: int) -> ChunkChoice:
    """static: chunk_size rows. dynamic: the most rows whose fp32 logits fit the budget (logits_budget_mib, else
    total_chunk_size rows), then balanced over the batch's supervised rows so no chunk is a small remainder."""
    if cfg.mode == "static":
        return ChunkChoice(rows, max(1, min(cfg.chunk_size, rows)))
    if cfg.total_chunk_size is not None:
        limit = cfg.total_chunk_size
    else:
        limit = int(cfg.logits_budget_mib * 2**20) // (vocab * FP32_BYTES)
    limit = max(1, limit)
    count = max(1, math.ceil(rows / limit))
    return ChunkChoice(rows, max(1, math.ceil(rows / count)))


class ChunkedLossHead(nn.Linear):
    """lm_head whose forward with targets returns (CE sum, supervised tokens) through the chunked loss.

    Called as `lm_head(hidden, targets)` with per-position targets (already shifted: position t predicts
    targets[t]); `computes_loss` tells the model's loss to hand it the targets. `last_choice` holds the chunking of
    the last call, for the step metrics; with `keep_row_losses`, `last_row_losses` holds its supervised rows' CE
    (detached, in position order), for per-source figures (model/loss.py keep_token_losses).
    """

    computes_loss = True
    chunk_config: ChunkLossConfig
    last_choice: ChunkChoice | None
    keep_row_losses = False
    last_row_losses: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor | None = None):  # type: ignore[override]
        if targets is None:
            return super().forward(hidden)
        supervised = targets.reshape(-1) != IGNORE_INDEX
        rows = hidden.reshape(-1, hidden.shape[-1])[supervised]
        targets = targets.reshape(-1)[supervised]
        choice = choose_chunk(self.chunk_config, rows.shape[0], self.weight.shape[0])
        self.last_choice = choice
        row_losses = rows.new_zeros(choice.rows, dtype=torch.float32) if self.keep_row_losses else None
        self.last_row_losses = row_losses
        if choice.rows == 0:  # still a (zero) weight gradient, so every rank reduce-scatters the same tensors
            return (hidden.sum() + self.weight.sum()) * 0.0, supervised.sum()
        loss = chunked_linear_cross_entropy(rows, self.weight, targets, choice.chunk_size, row_losses)
        return loss, supervised.sum()


def apply_chunk_loss(model: nn.Module, cfg: ChunkLossConfig) -> list[PlanMatch]:
    """The chunk-loss plan: turn `lm_head` into a ChunkedLossHead (same parameter; meta model, before FSDP)."""
    matches = match_modules(model, ["lm_head"], "features.chunk_loss")
    head = model.get_submodule("lm_head")
    assert type(head) is nn.Linear and head.bias is None, f"unexpected lm_head {type(head).__name__}"
    head.__class__ = ChunkedLossHead
    head.chunk_config = cfg
    head.last_choice = None
    return matches
