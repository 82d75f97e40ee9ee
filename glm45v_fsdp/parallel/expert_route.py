"""Where each (token, expert) pair of one MoE layer's forward is computed under expert parallelism: the route.

Every rank of an EP group knows the whole count matrix C[source rank][expert] (one all-gather of per-expert counts),
so every rank computes the same route with no further exchange. Rank d owns experts [d*L, (d+1)*L), L = E/ep, and
runs them in its first L slots. Without balance every pair goes to its expert's owner.

EP balance (features.ep_balance) evens the ranks' loads when the busiest rank exceeds `trigger` x the mean: greedy,
longest-processing-time style, it takes the largest share on the busiest rank and moves as many of its pairs as
bring that rank towards the mean, without lifting the receiver above it, to the least-loaded rank that has a free
replica slot (at most `max_dup` per rank and layer) or already holds a replica of that expert; it stops at
`target` x the mean, when no slot is left, or when nothing can move. A replica runs in a slot after the receiver's
own experts; replica slots are ordered by (owner, expert). An expert's pairs, taken in source-rank order (and in
each source's expert-sorted order), are cut into its shares in order: the owner's first, then each replica's.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Piece:
    """`count` consecutive pairs (in the source's expert-sorted order) of one expert, bound for (dest, slot)."""

    dest: int
    slot: int
    count: int


@dataclass
class Route:
    counts: list[list[int]]  # C[source][expert]
    experts_per_rank: int
    shares: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # balanced expert -> [(rank, pairs)]
    replicas: list[list[int]] = field(default_factory=list)  # per rank: its replica experts, (owner, expert) order

    @property
    def size(self) -> int:
        return len(self.counts)

    @property
    def balanced(self) -> bool:
        return bool(self.shares)

    def owner(self, expert: int) -> int:
        return expert // self.experts_per_rank

    def slot(self, dest: int, expert: int) -> int:
        if self.owner(expert) == dest:
            return expert % self.experts_per_rank
        return self.experts_per_rank + self.replicas[dest].index(expert)

    def slots(self, rank: int) -> int:
        return self.experts_per_rank + (len(self.replicas[rank]) if self.replicas else 0)

    def pieces(self, source: int) -> list[Piece]:
        """This source's pairs in its expert-sorted order, cut by destination."""
        pieces = []
        for expert, count in enumerate(self.counts[source]):
            if expert not in self.shares:
                pieces.append(Piece(self.owner(expert), expert % self.experts_per_rank, count))
                continue
            start = sum(self.counts[s][expert] for s in range(source))
            end, share_start = start + count, 0
            for rank, pairs in self.shares[expert]:
                overlap = min(end, share_start + pairs) - max(start, share_start)
                if overlap > 0:
                    pieces.append(Piece(rank, self.slot(rank, expert), overlap))
                share_start += pairs
        return pieces

    def received(self, dest: int) -> list[list[int]]:
        """R[source][slot]: pairs rank `dest` receives from each source for each of its slots."""
        matrix = [[0] * self.slots(dest) for _ in range(self.size)]
        for source in range(self.size):
            for piece in self.pieces(source):
                if piece.dest == dest:
                    matrix[source][piece.slot] += piece.count
        return matrix

    def loads_before(self) -> list[int]:
        """Pairs each rank would compute with every pair at its expert's owner."""
        per_expert = [sum(column) for column in zip(*self.counts)]
        return [sum(per_expert[r * self.experts_per_rank : (r + 1) * self.experts_per_rank]) for r in range(self.size)]

    def loads_after(self) -> list[int]:
        loads = [0] * self.size
        for source in range(self.size):
            for piece in self.pieces(source):
                loads[piece.dest] += piece.count
        return loads

    def replica_count(self) -> int:
        return sum(len(experts) for experts in self.replicas)


def plan_route(
    counts: list[list[int]], experts_per_rank: int, max_dup: int = 0, trigger: float = 1.2, target: float = 1.02
) -> Route:
    """The route for count matrix `counts` [ep][E]; `max_dup` 0 = no balance (every pair to its owner)."""
    route = Route(counts, experts_per_rank)
    size = route.size
    if max_dup == 0 or size == 1:
        return route
    per_expert = [sum(column) for column in zip(*counts)]
    loads = route.loads_before()
    mean = sum(loads) / size
    if mean == 0 or max(loads) <= trigger * mean:
        return route
    shares = {e: [(route.owner(e), n)] for e, n in enumerate(per_expert)}  # every expert's shares, owner first
    slots_used = [0] * size
    for _ in range(size * max_dup * 4):
        busiest = max(range(size), key=lambda r: (loads[r], -r))
        if loads[busiest] <= target * mean:
            break
        expert, on_busiest = max(
            ((e, n) for e, share in shares.items() for rank, n in share if rank == busiest and n > 0),
            key=lambda item: (item[1], -item[0]),
        )
        holders = {rank for rank, _ in shares[expert]}
        receivers = [r for r in range(size) if r != busiest and (r in holders or slots_used[r] < max_dup)]
        if not receivers:
            break
        receiver = min(receivers, key=lambda r: (loads[r], r))
        move = int(min(on_busiest, loads[busiest] - mean, mean - loads[receiver]))
        if move <= 0:
            break
        share = dict(shares[expert])
        share[busiest] -= move
        if receiver not in share:
            slots_used[receiver] += 1
        share[receiver] = share.get(receiver, 0) + move
        owner = route.owner(expert)
        shares[expert] = [(owner, share.pop(owner))] + sorted(share.items())
        loads[busiest] -= move
        loads[receiver] += move
    # the owner's share stays first even when every pair moved (its slot simply runs no row)
    route.shares = {
        e: [(r, n) for r, n in share if n > 0 or r == route.owner(e)] for e, share in shares.items() if len(share) > 1
    }
    route.replicas = [[] for _ in range(size)]
    for expert in sorted(route.shares, key=lambda e: (route.owner(e), e)):
        for rank, _ in route.shares[expert]:
            if rank != route.owner(expert):
                route.replicas[rank].append(expert)
    return route
