"""MoE router health and balancing: per-layer routing figures, aux-loss-free bias balancing and the auxiliary balance
loss, for both doors (the trainer and the DeepSpeed engine).

The moe plan gives the model a `RouterMonitor` (`model.router_monitor`) and every MoE block an observer that hands it,
on each training forward, the router's logits [T, E] and chosen experts [T, k] (T: this rank's tokens of the micro
batch, in the order the block sees them). The training forward says which of those tokens are padding and which
sequence each belongs to (`observed_routing`: padded rows, packed segments, and under context parallelism this
rank's slice of every sequence). Padding is never counted. Counts are of logical experts, taken at the router before
any dispatch, so expert parallelism and EP balance's replicas (which only change where a pair is computed) do not
enter them.

Figures, over the tokens of all ranks since the last report (the trainer reports every log interval):
  router/layerN/load_max_over_mean   busiest expert's (token, expert) pairs / mean pairs per expert (1: even)
  router/layerN/load_min_over_mean   least-loaded expert's pairs / mean (0: some expert got no token)
  router/layerN/dead_fraction        fraction of layer N's experts that received no token
  router/layerN/entropy              mean over tokens of the entropy of the token's normalised routing scores
                                     p_i = s_i / sum_j s_j (s = sigmoid(logits), before the bias), over ln E:
                                     1 = every expert scored alike, 0 = one expert holds all the score
  router/worst_load_max_over_mean, router/worst_load_layer: the layer with the highest max/mean, and its figure
  router/dead_fraction               dead (layer, expert) pairs over all MoE layers' experts
  router/aux_loss                    the auxiliary loss without its coefficient (aux_loss_coef > 0), mean over the
                                     micro batches of all data-parallel ranks
  router/bias_max_abs                the largest |e_score_correction_bias| of any layer (bias_update_rate > 0)

Aux-loss-free balancing (features.router.bias_update_rate > 0): `end_step`, which the shared OptimizerStep calls after
each optimizer step, sums the step's counts over all ranks (one all-reduce) and adds rate x sign(mean load - load_i)
to every layer's e_score_correction_bias: the same summed counts and fp32 arithmetic on every rank, so the buffer
stays bit-identical everywhere. A skipped step (non-finite) leaves it alone.

Auxiliary balance loss (features.router.aux_loss_coef > 0): `take_aux_loss` after each training forward returns its
value without the coefficient; the doors add coef x it to the loss. Both kinds are sum_t <W, p_t> over this rank's
tokens t, with p_t a token's normalised scores (with gradient) and W (no gradient) from counts:
  sequence      DeepSeek-V3's complementary sequence-wise loss, per MoE layer and sequence s of T_s tokens:
                sum_i f_i P_i, f_i = E / (k T_s) x #tokens of s choosing expert i (the real routing),
                P_i = mean over the tokens of s of s_i / sum_j s_j; averaged over the micro batch's sequences and
                summed over the layers (1 per layer when the load is even).
  transformers  transformers' load_balancing_loss_func, which Glm4vMoeForConditionalGeneration adds with
                output_router_logits=True: p = softmax(logits), f from the top-k of p (not the model's routing),
                pooled over all MoE layers and the micro batch's non-padding tokens: E x sum_i f_i P_i.
Under context parallelism a sequence's counts are summed over its ranks (one all-reduce per micro batch) and each
rank returns its tokens' part: the parts add up to the whole loss, and so do their gradients (as the CE sum's).
The score function runs under a checkpoint: backward recomputes it from the kept logits ([T, E] fp32 per layer).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from glm45v_fsdp.config import RouterConfig
from glm45v_fsdp.model.moe import MoEBlock, in_backward


@dataclass(frozen=True)
class RoutingTokens:
    """This rank's tokens of a micro batch as the MoE layers see them."""

    segments: torch.Tensor  # [T] long: the sequence of each token (index in the micro batch), -1 for padding
    num_sequences: int  # sequences of the whole micro batch (every CP rank holds a slice of each)
    group: dist.ProcessGroup | None  # the CP group holding the other slices; None: whole sequences here
    share: float  # this rank's share of the micro batch (1 / CP size): the micro batches add up over the ranks


def routing_tokens(batch: dict, layout: object) -> RoutingTokens:
    """The tokens of a collated micro batch (before the sequence layout pads it), padded and split as `layout` pads
    and splits the sequence. A sequence is a row of a padded batch, or a segment of a packed row (4-row position_ids,
    whose text positions restart at 0 with each sample); attention_mask 0 and the layout's padding are padding."""
    shaped = batch["input_ids"] if batch.get("input_ids") is not None else batch["inputs_embeds"]
    rows, length = shaped.shape[:2]
    positions = batch.get("position_ids")
    if positions is not None and positions.dim() == 3 and positions.shape[0] == 4:
        started = (positions[0] == 0).long().cumsum(dim=1)  # [B, S]: samples begun so far in the row
        per_row = started[:, -1]
        segments = (started - 1 + (per_row.cumsum(0) - per_row)[:, None]).masked_fill(started == 0, -1)
        count = int(per_row.sum())
    else:
        segments = torch.arange(rows, device=shaped.device)[:, None].expand(rows, length)
        count = rows
    mask = batch.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        segments = segments.masked_fill(mask.to(segments.device) == 0, -1)
    padded = layout.local_length(length) * layout.size
    segments = F.pad(segments, (0, padded - length), value=-1)
    local = layout.shard(segments, dim=1).reshape(-1)
    group = getattr(layout, "group", None) if layout.size > 1 else None
    return RoutingTokens(local, count, group, 1.0 / layout.size)


class RouterMonitor:
    """Routing statistics, bias balancing and the auxiliary loss of a model's MoE blocks; see the module docstring.

    Statistics accumulate in one flat float64 tensor: counts [L, E] (non-padding (token, expert) pairs), the sum over
    tokens of the normalised entropy [L], the auxiliary loss summed over micro batches, and the micro batches counted
    (shares of them under CP)."""

    def __init__(self, blocks: dict[int, MoEBlock], config: RouterConfig) -> None:
        """`blocks`: decoder layer index -> its MoE block, in layer order."""
        self.layers = list(blocks)
        self.blocks = list(blocks.values())
        gate = self.blocks[0].gate
        self.num_experts, self.top_k = gate.num_experts, gate.top_k
        self.bias_update_rate = config.bias_update_rate
        self.aux_loss_coef = config.aux_loss_coef
        self.aux_loss_type = config.aux_loss_type
        self.tokens: RoutingTokens | None = None  # set by `observed_routing` for the forward under way
        self.pending: torch.Tensor | None = None  # this rank's statistics not yet summed over the ranks
        self.reduced: torch.Tensor | None = None  # statistics summed over all ranks by `end_step`, since the report
        self._aux_inputs: dict[int, tuple[torch.Tensor, torch.Tensor, RoutingTokens]] = {}
        for position, block in enumerate(self.blocks):
            block.observer = functools.partial(self.observe, position)

    # -- recording ------------------------------------------------------------------------------------------------
    @property
    def _size(self) -> int:
        return len(self.blocks) * (self.num_experts + 1) + 2

    def _device(self) -> torch.device:
        return self.blocks[0].gate.e_score_correction_bias.device

    def _stats(self) -> torch.Tensor:
        if self.pending is None:
            self.pending = torch.zeros(self._size, dtype=torch.float64, device=self._device())
        return self.pending

    def _split(self, stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of a flat statistics tensor: counts [L, E], entropy sums [L], aux loss sum, micro batches."""
        layers, experts = len(self.blocks), self.num_experts
        counts = stats[: layers * experts].view(layers, experts)
        return counts, stats[layers * experts : layers * (experts + 1)], stats[-2], stats[-1]

    def _tokens_for(self, num_tokens: int, rows: int, device: torch.device) -> RoutingTokens:
        if self.tokens is not None:
            assert self.tokens.segments.numel() == num_tokens, (
                f"routing tokens of {self.tokens.segments.numel()} positions for a forward of {num_tokens}"
            )
            return self.tokens
        # a forward that did not go through the training loss (a script calling model.model): each row a sequence
        segments = torch.arange(rows, device=device).repeat_interleave(num_tokens // rows)
        return RoutingTokens(segments, rows, None, 1.0)

    def observe(self, position: int, logits: torch.Tensor, expert_ids: torch.Tensor, rows: int) -> None:
        """A training forward of MoE block `position`: count its pairs and score entropy, keep what the auxiliary
        loss needs. The recomputation of a checkpointed forward (in backward) is not counted again."""
        if in_backward():
            return
        tokens = self._tokens_for(logits.shape[0], rows, logits.device)
        valid = tokens.segments >= 0
        counts, entropy, _, _ = self._split(self._stats())
        with torch.no_grad():
            pairs = torch.where(valid[:, None], expert_ids, self.num_experts).reshape(-1)
            chosen = torch.zeros(self.num_experts + 1, device=logits.device).index_add_(
                0, pairs, torch.ones(pairs.numel(), device=logits.device)
            )
            counts[position] += chosen[: self.num_experts].to(counts)
            scores = logits.detach().float().sigmoid()
            token_entropy = torch.special.entr(scores / scores.sum(dim=-1, keepdim=True)).sum(dim=-1)
            entropy[position] += (token_entropy * valid).sum().to(entropy) / math.log(self.num_experts)
        if self.aux_loss_coef > 0 and torch.is_grad_enabled():
            self._aux_inputs[position] = (logits, expert_ids.detach(), tokens)

    # -- auxiliary loss -------------------------------------------------------------------------------------------
    def take_aux_loss(self) -> torch.Tensor | None:
        """The auxiliary balance loss (without its coefficient) of the training forward since the last call: this
        rank's tokens' part under CP. None when the loss is off or no training forward ran."""
        inputs, self._aux_inputs = self._aux_inputs, {}
        if not inputs:
            return None
        layers = [inputs[position] for position in sorted(inputs)]
        tokens = layers[0][2]
        if self.aux_loss_type == "sequence":
            aux = self._sequence_loss(layers, tokens)
        else:
            aux = self._transformers_loss(layers, tokens)
        _, _, aux_sum, micro_batches = self._split(self._stats())
        aux_sum += aux.detach().to(aux_sum)
        micro_batches += tokens.share
        return aux

    def _group_index(self, tokens: RoutingTokens, groups: int) -> torch.Tensor:
        """Each token's row of a [groups + 1, ...] table, the spare last row for padding: its sequence (`groups` =
        the sequences), or row 0 for every token (`groups` = 1: the micro batch as one group)."""
        row = tokens.segments if groups > 1 else torch.zeros_like(tokens.segments)
        return torch.where(tokens.segments >= 0, row, groups)

    def _pair_counts(self, expert_ids: torch.Tensor, index: torch.Tensor, groups: int) -> torch.Tensor:
        """[groups + 1, E] float64: the (token, expert) pairs per group (row `index[t]` for token t) and expert."""
        top_k = expert_ids.shape[1]
        flat = index[:, None].expand(-1, top_k).reshape(-1) * self.num_experts + expert_ids.reshape(-1)
        table = torch.zeros((groups + 1) * self.num_experts, dtype=torch.float64, device=expert_ids.device)
        table.index_add_(0, flat, torch.ones(flat.numel(), dtype=torch.float64, device=expert_ids.device))
        return table.view(groups + 1, self.num_experts)

    def _sequence_loss(self, layers: list, tokens: RoutingTokens) -> torch.Tensor:
        groups, experts, top_k = tokens.num_sequences, self.num_experts, self.top_k
        index = self._group_index(tokens, groups)
        counts = torch.stack([self._pair_counts(ids, index, groups)[:groups] for _, ids, _ in layers])  # [L, S, E]
        if tokens.group is not None:
            dist.all_reduce(counts, group=tokens.group)
        lengths = counts.sum(dim=-1, keepdim=True) / top_k  # [L, S, 1]: tokens of each sequence
        live = (lengths > 0).sum(dim=1, keepdim=True).clamp(min=1)  # sequences with tokens
        # f_i P_i = (E / (k T_s)) c_i x (1 / T_s) sum_t p_ti, averaged over the sequences
        weights = counts * experts / top_k / lengths.clamp(min=1) ** 2 / live
        weights = F.pad(weights, (0, 0, 0, 1))  # the padding's row: weight 0
        return sum(
            checkpoint(_weighted_scores, logits, index, weights[layer].float(), "sigmoid", use_reentrant=False)
            for layer, (logits, _, _) in enumerate(layers)
        )

    def _transformers_loss(self, layers: list, tokens: RoutingTokens) -> torch.Tensor:
        index = self._group_index(tokens, 1)  # one group: the micro batch's tokens
        counts = sum(
            self._pair_counts(torch.topk(logits.detach().float().softmax(dim=-1), self.top_k, dim=-1)[1], index, 1)[0]
            for logits, _, _ in layers
        )
        rows = (tokens.segments >= 0).sum().to(torch.float64) * len(layers)
        totals = torch.cat([counts, rows[None]])
        if tokens.group is not None:
            dist.all_reduce(totals, group=tokens.group)
        # E sum_i (C_i / R) (P_i / R), P_i = sum over layers and tokens of softmax p_ti, R = rows over all layers
        weights = F.pad((self.num_experts * totals[:-1] / totals[-1].clamp(min=1) ** 2)[None], (0, 0, 0, 1))
        return sum(
            checkpoint(_weighted_scores, logits, index, weights.float(), "softmax", use_reentrant=False)
            for logits, _, _ in layers
        )

    # -- step end and figures -------------------------------------------------------------------------------------
    def end_step(self, stepped: bool) -> None:
        """After an optimizer step (both doors, glm45v_fsdp/step.py): with bias balancing, sum the step's statistics
        over all ranks and, unless the step was skipped, update every layer's bias from the summed load."""
        if not self.bias_update_rate:
            return
        step = self._stats()
        self.pending = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(step)
        self.reduced = step if self.reduced is None else self.reduced + step
        if stepped:
            counts, _, _, _ = self._split(step)
            direction = torch.sign(counts.mean(dim=1, keepdim=True) - counts)
            with torch.no_grad():
                for position, block in enumerate(self.blocks):
                    bias = block.gate.e_score_correction_bias
                    bias.add_(direction[position].to(bias), alpha=self.bias_update_rate)

    def interval_stats(self) -> torch.Tensor | None:
        """This rank's statistics since the last report, to be summed over all ranks and handed to `take_figures`;
        None when `end_step` summed them already (bias balancing)."""
        if self.bias_update_rate:
            return None
        stats = self._stats()
        self.pending = None
        return stats

    def take_figures(self, summed: torch.Tensor | None) -> dict[str, float]:
        """The figures (module docstring) of `interval_stats` summed over all ranks (None: of `end_step`'s sums);
        starts the next interval."""
        stats = summed if summed is not None else self.reduced
        self.reduced = None
        if stats is None:
            return {}
        counts, entropy, aux_sum, micro_batches = self._split(stats.double().cpu())
        mean = counts.mean(dim=1)
        tokens = counts.sum(dim=1) / self.top_k
        figures: dict[str, float] = {}
        for position, layer in enumerate(self.layers):
            load, average = counts[position], float(mean[position])
            prefix = f"router/layer{layer}"
            figures[f"{prefix}/load_max_over_mean"] = float(load.max()) / average if average else math.nan
            figures[f"{prefix}/load_min_over_mean"] = float(load.min()) / average if average else math.nan
            figures[f"{prefix}/dead_fraction"] = float((load == 0).double().mean())
            figures[f"{prefix}/entropy"] = float(entropy[position] / tokens[position]) if tokens[position] else math.nan
        worst = max(range(len(self.layers)), key=lambda p: figures[f"router/layer{self.layers[p]}/load_max_over_mean"])
        figures["router/worst_load_max_over_mean"] = figures[f"router/layer{self.layers[worst]}/load_max_over_mean"]
        figures["router/worst_load_layer"] = self.layers[worst]
        figures["router/dead_fraction"] = float((counts == 0).double().mean())
        if self.aux_loss_coef > 0 and micro_batches > 0:
            figures["router/aux_loss"] = float(aux_sum / micro_batches)
        if self.bias_update_rate:
            figures["router/bias_max_abs"] = max(
                float(block.gate.e_score_correction_bias.abs().max()) for block in self.blocks
            )
        return figures


def _weighted_scores(logits: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, scores: str) -> torch.Tensor:
    """sum over tokens t and experts i of weights[index[t], i] x p_ti, p_t the token's normalised routing scores:
    softmax(logits_t), or sigmoid(logits_t) / sum(sigmoid(logits_t))."""
    logits = logits.float()
    if scores == "softmax":
        probabilities = logits.softmax(dim=-1)
    else:
        sigmoid = logits.sigmoid()
        probabilities = sigmoid / sigmoid.sum(dim=-1, keepdim=True)
    return (probabilities * weights[index]).sum()


def attach_router_monitor(model: nn.Module, block_names: list[str], config: RouterConfig) -> RouterMonitor:
    """The moe plan: a monitor over the MoE blocks `block_names` (`...layers.N.mlp`), as `model.router_monitor`."""
    blocks = {int(name.split(".")[-2]): model.get_submodule(name) for name in block_names}
    model.router_monitor = RouterMonitor(dict(sorted(blocks.items())), config)
    return model.router_monitor


def router_monitor(model: nn.Module) -> RouterMonitor | None:
    """The model's router monitor; None for a model without MoE layers (or not built by the plans)."""
    return getattr(model, "router_monitor", None)


@contextlib.contextmanager
def observed_routing(model: nn.Module, batch: dict, layout: object) -> Iterator[None]:
    """A training forward of `model` on `batch` (before `layout` pads it): its MoE layers' tokens are known to the
    router monitor while it runs."""
    monitor = router_monitor(model)
    if monitor is None or not model.training:
        yield
        return
    monitor.tokens = routing_tokens(batch, layout)
    try:
        yield
    finally:
        monitor.tokens = None
