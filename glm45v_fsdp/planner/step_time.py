"""Modelled milliseconds of one optimizer step: compute, the communication each family leaves exposed, the
optimizer.

  compute      FLOPs of every micro batch (forward, backward, recompute's replay; flops.py) over the device's peak
               for the compute dtype x compute_efficiency.
  a collective calls x latency + bytes x f / bandwidth (traffic.py's bytes): f = (n-1)/n for all-gather,
               reduce-scatter and all-to-all, 2(n-1)/n for all-reduce (ring algorithms, the nccl-tests bus factor),
               1 for P2P; the bandwidth and latency of the node's links when every group of the family stays in a
               node, else of the NIC (runtime/topology.py's placement, ranks placed by node), x comm_efficiency.
  overlap      assumptions, one per family:
               fsdp, efsdp, dp_replicate: on their own stream, prefetched a unit ahead: hidden behind compute but for
                 each micro batch's first gather and what exceeds the compute time;
               cp_ring: each block's P2P runs under the previous block's attention: hidden behind the attention
                 kernel's time (forward and backward) but for the excess;
               ep, cp_ulysses, cp, dp: on the critical path (the next op needs the result): fully exposed;
               a device without overlap (the calibrated CPU: gloo runs on the compute's cores): every family exposed.
  optimizer    AdamW over this rank's shards, bound by memory bandwidth: 36 bytes per fp32 element (parameter,
               gradient, two moments read and written, the norm and clip pass).
"""

from __future__ import annotations

from dataclasses import dataclass

from glm45v_fsdp.planner.devices import Device
from glm45v_fsdp.planner.traffic import Collective

OPTIMIZER_BYTES_PER_ELEMENT = 36
OVERLAPPED = ("fsdp", "efsdp", "dp_replicate")
BUS_FACTOR = {"all_gather": 1, "reduce_scatter": 1, "all_to_all": 1, "all_reduce": 2, "p2p": None}


def collective_ms(c: Collective, device: Device, crosses_nodes: bool) -> float:
    if c.group_size <= 1:
        return 0.0
    bandwidth = (device.inter_gbps if crosses_nodes else device.intra_gbps) * 1e9 * device.comm_efficiency
    latency = device.inter_latency_us if crosses_nodes else device.intra_latency_us
    factor = BUS_FACTOR[c.kind]
    share = 1.0 if factor is None else factor * (c.group_size - 1) / c.group_size
    return c.calls * latency / 1e3 + c.bytes * share / bandwidth * 1e3


@dataclass
class StepTime:
    compute_ms: float
    attention_ms: float  # of compute: the attention kernels (what the ring hides behind)
    comm_ms: dict[str, float]  # per family, whole
    exposed_ms: dict[str, float]  # per family, what the step waits for
    optimizer_ms: float

    @property
    def total_ms(self) -> float:
        return self.compute_ms + sum(self.exposed_ms.values()) + self.optimizer_ms

    def terms(self) -> dict[str, float]:
        """Every term of the step, largest first: compute, each family's exposed time, the optimizer."""
        found = {"compute": self.compute_ms, "optimizer": self.optimizer_ms}
        found |= {f"{family} (exposed)": ms for family, ms in self.exposed_ms.items() if ms > 0}
        return dict(sorted(found.items(), key=lambda item: -item[1]))


def step_time(
    flops: float,
    attention_flops: float,
    collectives: list[Collective],
    crossing: dict[str, bool],
    first_gathers: dict[str, float],
    shard_elements: int,
    device: Device,
    dtype: str,
) -> StepTime:
    """`flops`: the step's (all micro batches); `crossing`: family -> whether its groups cross nodes;
    `first_gathers`: family -> bytes of the gathers no compute can hide (each micro batch's first unit)."""
    rate = device.peak_flops(dtype) * device.compute_efficiency
    compute = flops / rate * 1e3
    attention = attention_flops / rate * 1e3
    comm: dict[str, float] = {}
    for c in collectives:
        comm[c.family] = comm.get(c.family, 0.0) + collective_ms(c, device, crossing.get(c.family, False))
    exposed: dict[str, float] = {}
    hidden_fsdp = sum(comm.get(f, 0.0) for f in OVERLAPPED)
    unhidden = 0.0
    for family, nbytes in first_gathers.items():
        bandwidth = (device.inter_gbps if crossing.get(family) else device.intra_gbps) * 1e9 * device.comm_efficiency
        unhidden += nbytes / bandwidth * 1e3
    if not device.overlap:
        exposed = dict(comm)
    else:
        if hidden_fsdp:
            exposed["fsdp"] = max(0.0, hidden_fsdp - compute) + min(unhidden, hidden_fsdp)
        if "cp_ring" in comm:
            exposed["cp_ring"] = max(0.0, comm["cp_ring"] - attention)
        for family, ms in comm.items():
            if family not in OVERLAPPED and family != "cp_ring":
                exposed[family] = ms
    optimizer = shard_elements * OPTIMIZER_BYTES_PER_ELEMENT / (device.hbm_tbps * 1e12) * 1e3
    return StepTime(compute, attention, comm, exposed, optimizer)
