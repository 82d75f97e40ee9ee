"""Expert parallelism: the routed experts split over the ep ranks, and the token dispatchers that reach them.

`apply_expert_parallel` (the `expert_parallel` plan, on the meta model) turns each matched `mlp.experts` stack into
a DTensor sharded on dim 0 over the ep mesh (E/ep whole experts per rank; FSDP then shards each rank's stack on
dim 1 over efsdp) and gives its MoE block one of two dispatchers:

  alltoall   the (token, expert) pairs, sorted by expert, go to the ranks that compute them: one all-gather of the
             per-expert counts (every rank then knows the whole count matrix and computes the same route, see
             expert_route.py), a variable-size all-to-all of the rows, a regroup into per-slot order for the grouped
             GEMM, the reverse all-to-all, and the weighted combine in fp32 on the source rank (routing weights
             never travel). With EP balance, a route may send pairs of a hot expert to a replica on another rank;
             the replica's weights travel from the owner in one all-to-all, and autograd returns their gradient to
             the owner's, before FSDP reduces it.
  allgather  every rank gathers its EP group's tokens, routing weights and expert ids, runs its own experts on the
             pairs that chose them, combines in fp32 and reduce-scatters the sums back to the tokens' ranks.

Both are dropless (no capacity, no token dropped); an expert or a whole rank with no pair is fine. All exchanges are
torch's functional collectives, which selective recompute keeps (memory/recompute.py), so its backward does not run
them again; full recompute replays the forward, exchanges included.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import (
    all_gather_single,
    all_gather_single_autograd,
    all_to_all_single_autograd,
    reduce_scatter_single_autograd,
)
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from glm45v_fsdp.config import EpBalanceConfig
from glm45v_fsdp.errors import ConfigError
from glm45v_fsdp.model.moe import Dispatched, GroupedExperts, MoEBlock, in_backward, weighted_combine
from glm45v_fsdp.module_patterns import PlanMatch, match_modules
from glm45v_fsdp.parallel.expert_route import Route, plan_route

DISPATCHERS = ("alltoall", "allgather")

Compute = Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


@dataclass
class BalanceStats:
    """Summed over the forwards since the last `take`: pairs per EP rank before / after balance, replicas, bytes."""

    before: torch.Tensor
    after: torch.Tensor
    replicas: int = 0
    replica_bytes: int = 0
    forwards: int = 0


class AllToAllDispatcher:
    def __init__(
        self, group: dist.ProcessGroup, size: int, rank: int, num_experts: int, balance: EpBalanceConfig | None
    ) -> None:
        self.group, self.size, self.rank = group, size, rank
        self.num_experts = num_experts
        self.experts_per_rank = num_experts // size
        self.balance = balance
        self.stats = self._empty_stats()

    def _empty_stats(self) -> BalanceStats:
        return BalanceStats(torch.zeros(self.size, dtype=torch.float64), torch.zeros(self.size, dtype=torch.float64))

    def route(self, counts: torch.Tensor) -> Route:
        matrix = all_gather_single(counts, 0, self.group).view(self.size, self.num_experts).tolist()
        if self.balance is None:
            return plan_route(matrix, self.experts_per_rank)
        return plan_route(
            matrix,
            self.experts_per_rank,
            self.balance.max_dup_experts_num,
            self.balance.trigger_max_over_mean,
            self.balance.target_max_over_mean,
        )

    def dispatch(self, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> Dispatched:
        num_tokens = expert_ids.shape[0]
        slot_major = expert_ids.t().reshape(-1)  # pair p = top-k slot * tokens + token, as LocalDispatcher
        order = torch.sort(slot_major, stable=True)[1]
        token_index = order % num_tokens
        route = self.route(torch.bincount(slot_major, minlength=self.num_experts))
        pieces = route.pieces(self.rank)
        send_splits = [sum(p.count for p in pieces if p.dest == d) for d in range(self.size)]
        received = route.received(self.rank)
        recv_splits = [sum(row) for row in received]
        rows = hidden[token_index]
        send_order = _send_order(pieces, hidden.device) if route.balanced else None
        if send_order is not None:
            rows = rows[send_order]
        arrived = all_to_all_single_autograd(rows, recv_splits, send_splits, self.group)
        regroup = _slot_major(received, hidden.device)
        extra = ReplicaWeights(route, self.rank, self.group, self.stats) if route.balanced else None
        if not in_backward():
            self._record(route)
        context = _AllToAllContext(send_splits, recv_splits, send_order, regroup)
        slot_counts = torch.tensor([sum(column) for column in zip(*received)], dtype=torch.long, device=hidden.device)
        return Dispatched(
            arrived[regroup], slot_counts, token_index, weights.t().reshape(-1)[order], num_tokens, extra, context
        )

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        context: _AllToAllContext = dispatched.context
        source_major = expert_out[_inverse(context.regroup)]
        returned = all_to_all_single_autograd(source_major, context.send_splits, context.recv_splits, self.group)
        if context.send_order is not None:
            returned = returned[_inverse(context.send_order)]
        return weighted_combine(returned, dispatched.weights, dispatched.token_index, dispatched.num_tokens)

    def _record(self, route: Route) -> None:
        self.stats.before += torch.tensor(route.loads_before(), dtype=torch.float64)
        self.stats.after += torch.tensor(route.loads_after(), dtype=torch.float64)
        self.stats.replicas += route.replica_count()
        self.stats.forwards += 1

    def take_stats(self) -> BalanceStats:
        stats, self.stats = self.stats, self._empty_stats()
        return stats

    def describe(self) -> str:
        balance = (
            f", balance: up to {self.balance.max_dup_experts_num} replica(s) per rank when max/mean load > "
            f"{self.balance.trigger_max_over_mean}"
            if self.balance
            else ""
        )
        return f"alltoall over {self.size} EP ranks ({self.experts_per_rank} experts each{balance})"


@dataclass
class _AllToAllContext:
    send_splits: list[int]
    recv_splits: list[int]
    send_order: torch.Tensor | None  # source side: expert-sorted rows -> (dest, slot) order; None when identical
    regroup: torch.Tensor  # receiver side: arrived (source-major) rows -> slot-major rows


def _send_order(pieces: list, device: torch.device) -> torch.Tensor:
    starts, start = [], 0
    for piece in pieces:
        starts.append(start)
        start += piece.count
    ordered = sorted(range(len(pieces)), key=lambda i: (pieces[i].dest, pieces[i].slot, starts[i]))
    index = [torch.arange(starts[i], starts[i] + pieces[i].count) for i in ordered]
    return torch.cat(index).to(device) if index else torch.zeros(0, dtype=torch.long, device=device)


def _slot_major(received: list[list[int]], device: torch.device) -> torch.Tensor:
    """Index that reorders rows arrived source by source (each source's rows slot by slot) into slot by slot
    (each slot's rows source by source)."""
    counts = torch.tensor(received, dtype=torch.long)  # [sources, slots]
    starts = (counts.reshape(-1).cumsum(0) - counts.reshape(-1)).view_as(counts)
    counts_t, starts_t = counts.t().reshape(-1), starts.t().reshape(-1)
    output_starts = counts_t.cumsum(0) - counts_t
    total = int(counts.sum())
    index = torch.repeat_interleave(starts_t - output_starts, counts_t, output_size=total) + torch.arange(total)
    return index.to(device)


def _inverse(index: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.numel(), device=index.device)
    return inverse


class ReplicaWeights:
    """EP balance: brings this rank the weights of the replicas its route assigns it (one all-to-all from the
    owners, in the receiver's replica order) and runs own experts and replicas in turn. Every rank of the group
    takes part in the exchange, with or without replicas of its own; autograd's backward returns each replica's
    weight gradient to its owner, where it adds to the owner's own."""

    def __init__(self, route: Route, rank: int, group: dist.ProcessGroup, stats: BalanceStats) -> None:
        self.route, self.rank, self.group, self.stats = route, rank, group, stats

    def run(
        self, compute: Compute, rows: torch.Tensor, counts: torch.Tensor, stacks: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """`stacks`: this rank's experts' [n, ...] stacks by name (the base's and any adapters'); a replica brings
        all of its expert's, packed in one row per expert (all of one dtype: the adapters take the base's on the
        way and return their gradients in it)."""
        route, own = self.route, stacks["gate_up_proj"].shape[0]
        first = route.experts_per_rank * self.rank
        sent = [e - first for dest in range(route.size) for e in route.replicas[dest] if route.owner(e) == self.rank]
        send_splits = [sum(route.owner(e) == self.rank for e in route.replicas[d]) for d in range(route.size)]
        recv_splits = [sum(route.owner(e) == owner for e in route.replicas[self.rank]) for owner in range(route.size)]
        dtype = stacks["gate_up_proj"].dtype
        index = torch.tensor(sent, dtype=torch.long, device=rows.device)
        packed = torch.cat([stack[index].flatten(1).to(dtype) for stack in stacks.values()], dim=1)
        arrived = all_to_all_single_autograd(packed, recv_splits, send_splits, self.group)
        if not in_backward():
            self.stats.replica_bytes += arrived.numel() * arrived.element_size()
        replicas, start = {}, 0
        for name, stack in stacks.items():
            size = stack[0].numel()
            replicas[name] = arrived[:, start : start + size].view(-1, *stack.shape[1:]).to(stack.dtype)
            start += size
        own_rows = int(counts[:own].sum())
        out = compute(rows[:own_rows], counts[:own], stacks)
        if arrived.shape[0]:
            out = torch.cat([out, compute(rows[own_rows:], counts[own:], replicas)])
        else:  # no replica here: tie the (empty) exchange into the output so its backward runs on this rank too
            out = out + arrived.sum().to(out.dtype) * 0
        return out


class AllGatherDispatcher:
    def __init__(self, group: dist.ProcessGroup, size: int, rank: int, num_experts: int) -> None:
        self.group, self.size, self.rank = group, size, rank
        self.num_experts = num_experts
        self.experts_per_rank = num_experts // size

    def dispatch(self, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> Dispatched:
        num_tokens, top_k = expert_ids.shape
        local_count = torch.tensor([num_tokens], dtype=torch.long, device=hidden.device)
        padded = int(all_gather_single(local_count, 0, self.group).max())
        pad = padded - num_tokens
        hidden = torch.nn.functional.pad(hidden, (0, 0, 0, pad))
        gathered = all_gather_single_autograd(hidden, 0, self.group)
        gathered_weights = all_gather_single_autograd(torch.nn.functional.pad(weights, (0, 0, 0, pad)), 0, self.group)
        gathered_ids = all_gather_single(torch.nn.functional.pad(expert_ids, (0, 0, 0, pad), value=-1), 0, self.group)
        first = self.rank * self.experts_per_rank
        local = (gathered_ids >= first) & (gathered_ids < first + self.experts_per_rank)
        key = torch.where(local, gathered_ids - first, self.experts_per_rank).t().reshape(-1)
        order = torch.sort(key, stable=True)[1][: int(local.sum())]
        all_tokens = self.size * padded
        token_index = order % all_tokens
        counts = torch.bincount(key[order], minlength=self.experts_per_rank)
        pair_weights = gathered_weights.t().reshape(-1)[order]
        return Dispatched(gathered[token_index], counts, token_index, pair_weights, all_tokens, None, num_tokens)

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        partial = weighted_combine(
            expert_out, dispatched.weights, dispatched.token_index, dispatched.num_tokens, keep_fp32=True
        )
        mine = reduce_scatter_single_autograd(partial, "sum", 0, self.group)
        return mine[: dispatched.context].to(expert_out.dtype)

    def describe(self) -> str:
        return f"allgather over {self.size} EP ranks ({self.experts_per_rank} experts each)"


def check_expert_parallel(hf_config: object, ep: int) -> None:
    experts = hf_config.text_config.n_routed_experts
    if experts % ep:
        raise ConfigError(
            f"Config key 'parallel.expert_parallel_size' = {ep} does not divide the model's {experts} routed "
            f"experts: each EP rank holds E/ep whole experts. Choose a divisor of {experts}."
        )


def apply_expert_parallel(
    model: nn.Module,
    patterns: list[str],
    dispatcher: str,
    balance: EpBalanceConfig | None,
    ep_mesh: object | None,
) -> list[PlanMatch]:
    """Shard every matched experts stack on the ep mesh and give its MoE block the dispatcher; `ep_mesh` None:
    a dry run that matches and checks only."""
    key = "parallel.ep_plan.apply_modules"
    matches = match_modules(model, patterns, key)
    for name in sorted({name for match in matches for name in match.names}):
        experts = model.get_submodule(name)
        block = model.get_submodule(name.rpartition(".")[0]) if "." in name else None
        if not isinstance(experts, GroupedExperts) or not isinstance(block, MoEBlock):
            raise ConfigError(
                f"{key}: '{name}' is a {type(experts).__name__}, not the experts of an MoE block; the patterns must "
                f"select MoE layers' `mlp.experts` (default: model.language_model.layers.{{*}}.mlp.experts)."
            )
        if ep_mesh is None:
            continue
        for stack in experts.stacks():  # the base stacks and their LoRA adapters
            full = getattr(experts, stack)
            sharded = distribute_tensor(full, ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(experts, stack, nn.Parameter(sharded, requires_grad=full.requires_grad))
        group, size, rank = ep_mesh.get_group(), ep_mesh.size(), ep_mesh.get_local_rank()
        if dispatcher == "alltoall":
            block.dispatcher = AllToAllDispatcher(group, size, rank, experts.num_experts, balance)
        else:
            block.dispatcher = AllGatherDispatcher(group, size, rank, experts.num_experts)
    return matches


def expert_sharded_modules(model: nn.Module) -> list[str]:
    """Names of the modules whose parameters expert parallelism sharded (FSDP shards them over efsdp)."""
    return [
        name
        for name, module in model.named_modules()
        if any(isinstance(param, DTensor) for param in module.parameters(recurse=False))
    ]


class BalanceFigures:
    """EP rank load over the step: max/mean and coefficient of variation of the pairs each EP rank computed, before
    and after balance (mean over MoE layers, then over all ranks), the replicas run and the MiB their weights moved
    (summed over layers, mean over ranks), and the per-EP-rank pairs of this rank's group (summed over layers).

    `local_sums` takes (and resets) the dispatchers' counts of the step as this rank's figures; the trainer sums
    them over the ranks in its per-step all-gather and hands the sums to `figures`."""

    NAMES = (
        "ep_load_max_over_mean_before",
        "ep_load_cv_before",
        "ep_load_max_over_mean_after",
        "ep_load_cv_after",
        "ep_replicas",
        "ep_replica_mib",
    )

    def __init__(self, blocks: list[MoEBlock]) -> None:
        self.dispatchers = [block.dispatcher for block in blocks if isinstance(block.dispatcher, AllToAllDispatcher)]
        self.per_rank: dict[str, list[float]] = {}

    def local_sums(self) -> torch.Tensor | None:
        """This rank's figures of the step (NAMES order); None without an all-to-all dispatcher or a forward."""
        stats = [dispatcher.take_stats() for dispatcher in self.dispatchers]
        stats = [s for s in stats if s.forwards]
        if not stats:
            return None
        figures = []
        for when in ("before", "after"):
            loads = torch.stack([getattr(s, when) for s in stats])  # [layers, ep ranks]
            mean = loads.mean(dim=1).clamp(min=1e-12)
            figures += [(loads.max(dim=1).values / mean).mean(), (loads.std(dim=1, correction=0) / mean).mean()]
        figures += [sum(s.replicas for s in stats), sum(s.replica_bytes for s in stats) / 2**20]
        self.per_rank = {
            f"ep_load_per_rank_{when}": sum(getattr(s, when) for s in stats).tolist() for when in ("before", "after")
        }
        return torch.tensor([float(f) for f in figures], dtype=torch.float64)

    def figures(self, summed: torch.Tensor | None, world: int) -> dict[str, float | list[float]]:
        """The step's figures from `local_sums` summed over the `world` ranks; {} when there were none."""
        if summed is None:
            return {}
        result: dict[str, float | list[float]] = dict(zip(self.NAMES, (summed / world).tolist()))
        return {**result, **self.per_rank}
