"""Count what this rank's collectives move: every c10d op and functional collective that reaches the dispatcher
(FSDP2's all-gathers and reduce-scatters, DTensor's reductions, the EP and Ulysses all-to-alls, ring P2P, the
trainer's reductions), by op kind and process group.

A dispatch mode does not see inside a custom op (the ring attention forward is one), so point-to-point sends are
counted where they are posted instead, by wrapping `torch.distributed.batch_isend_irecv` and `send` while the
counter is active (a lone `isend` is not counted: nothing here posts one).

Bytes per call, the convention `glm45v_fsdp.planner.traffic` models (what nccl-tests calls the message size):
all-gather: the gathered output; reduce-scatter: the full input; all-reduce, all-to-all, broadcast: the input
(the send buffer for all-to-all, local rows included); P2P: the bytes this rank sends. Barriers count as calls
of 0 bytes. Used by the planner's validation (tests/test_planner_traffic.py); nothing in training depends on it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# op name -> (kind, which argument holds the counted tensor(s), which holds the group)
_C10D = {
    "_allgather_base_": ("all_gather", 0, 2),
    "allgather_": ("all_gather", 0, 2),
    "allgather_into_tensor_coalesced_": ("all_gather", 0, 2),
    "_reduce_scatter_base_": ("reduce_scatter", 1, 2),
    "reduce_scatter_": ("reduce_scatter", 1, 2),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, 2),
    "allreduce_": ("all_reduce", 0, 1),
    "allreduce_coalesced_": ("all_reduce", 0, 1),
    "alltoall_base_": ("all_to_all", 1, 2),
    "alltoall_": ("all_to_all", 1, 2),
    "broadcast_": ("broadcast", 0, 1),
    "barrier": ("barrier", None, 1),
}
_FUNCTIONAL = {  # the group is the op's last string argument (group_name)
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}


def _nbytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(item) for item in value)
    return 0


@dataclass
class Tally:
    calls: int = 0
    bytes: int = 0


@dataclass
class CollectiveCounter(TorchDispatchMode):
    """`with CollectiveCounter() as counter:` ... then `counter.tally[(kind, group_name)]` (calls, bytes) and
    `counter.group_ranks[group_name]` (the group's global ranks)."""

    tally: dict[tuple[str, str], Tally] = field(default_factory=lambda: defaultdict(Tally))
    group_ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__()

    def __enter__(self) -> CollectiveCounter:
        self._originals = {name: getattr(dist, name) for name in ("batch_isend_irecv", "send")}

        def batch(ops: list) -> list:
            for op in ops:
                if op.op is dist.isend:
                    self._add("p2p", op.group or dist.group.WORLD, _nbytes(op.tensor))
            return self._originals["batch_isend_irecv"](ops)

        def send(tensor: torch.Tensor, *args, group=None, **kwargs):
            self._add("p2p", group or dist.group.WORLD, _nbytes(tensor))
            return self._originals["send"](tensor, *args, group=group, **kwargs)

        dist.batch_isend_irecv, dist.send = batch, send  # P2POp insists on the real isend / irecv
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        super().__exit__(*exc)

    def _add(self, kind: str, group: dist.ProcessGroup, counted: int) -> None:
        group_name = group.group_name
        if group_name not in self.group_ranks:
            self.group_ranks[group_name] = tuple(dist.get_process_group_ranks(group))
        entry = self.tally[(kind, group_name)]
        entry.calls += 1
        entry.bytes += counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace, name = func.namespace, func._schema.name.split("::")[-1]
        if namespace == "c10d" and name in _C10D:
            kind, tensors, group_index = _C10D[name]
            group = dist.ProcessGroup.unbox(args[group_index])  # the dispatcher hands over a script object
            counted = 0 if tensors is None else _nbytes(args[tensors])
        elif namespace == "_c10d_functional" and name in _FUNCTIONAL:
            kind = _FUNCTIONAL[name]
            group = dist.distributed_c10d._resolve_process_group(args[-1])
            counted = _nbytes(args[0]) * (group.size() if kind == "all_gather" else 1)
        else:
            return func(*args, **kwargs)
        self._add(kind, group, counted)
        return func(*args, **kwargs)
