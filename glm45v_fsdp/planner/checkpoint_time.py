"""Checkpoint time as part of a plan: the bytes each rank writes per save, the checkpoint's size per format, and the
modelled save, verify and resume time at a stated file-system bandwidth, with the async save's stall.

Sizes come from the same parameter specs and shard layout as preflight's memory rows (preflight.planned_params):
- DCP (training.save): each rank writes the master weights it holds (fp32) and, for the trainable ones, AdamW's
  exp_avg and exp_avg_sq (the `step` scalars are replicated: DCP writes each once, spread over the ranks); replicas
  of a shard (HSDP) share the writing (DCP deduplicates). Each tensor costs DCP_ITEM_BYTES of torch.save framing;
  rank 0 adds `.metadata` (METADATA_CHUNK_BYTES per chunk of every rank), the optimizer's param groups and the
  trainer state, every rank its RNG file. Persistent buffers (the router's correction bias) are not counted.
- HF export (training.save_hf): every parameter whole in its trained dtype, per expert as the Hub stores them, written
  by rank 0 alone at the end of the run; the config and tokenizer files are not counted.

Times, each a bound set by the slowest of its paths (`Storage`: the bandwidths):
- save = staging (device to host copy of the rank's bytes) + hashing (xxh3 on the bytes as written) + write, where
  write = max(all bytes / the file system's aggregate bandwidth, the fullest node's bytes / one node's link);
  DCP does the three item by item on one thread, so they add up.
- verify (a resume, issue 54): each file hashed once, by one rank, the files split over the ranks by bytes: max(all
  bytes / aggregate, the fullest node's share / node link, the largest rank's share / hash rate).
- load = the same read bound + the host to device copy; resume = verify + load.
- async save (training.async_save): the step loop stalls for the staging copy only; the hashing and the write run in
  the background and overrun into the next save when they outlast save_interval steps.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from glm45v_fsdp.config import TrainingConfig
from glm45v_fsdp.memory.estimate import ADAM_STEP_BYTES, ParamSpec, ShardLayout

GB = 1e9
# Measured on the tiny model's checkpoint here (torch 2.13): the small parts of a checkpoint.
DCP_ITEM_BYTES = 1_560  # torch.save's zip framing around one tensor in a DCP file
METADATA_CHUNK_BYTES = 340  # `.metadata`: one chunk of one tensor on one rank (pickled index, offsets, sizes)
OPTIMIZER_GROUPS_BYTES = 2 * 12 * 1_300  # two param groups (decay / no decay) x 12 hyperparameters, each pickled
PARAM_NAME_BYTES = 60  # a trainable parameter's name in its group's `params` list
TRAINER_STATE_BYTES = 5_000  # trainer_state.pt: step, schedule, counters and the config
RNG_FILE_BYTES = 14_500  # rng/rank{R}.pt: the Python, NumPy, torch and device generators
SAFETENSORS_TENSOR_BYTES = 120  # one tensor's entry in a safetensors header (name, dtype, shape, offsets)


@dataclass(frozen=True)
class Storage:
    """The bandwidths a checkpoint meets, in GB/s (1e9 bytes)."""

    fs_gbps: float = 20.0  # the parallel file system's aggregate (a mid-size Lustre / GPFS: 10-50 GB/s)
    node_gbps: float = 2.5  # one node's link to it (a 25 GbE storage port at ~80% of its line rate)
    host_gbps: float = 20.0  # device <-> host copy per device (PCIe 4.0 x16 at ~80%); 0: no copy (cpu)
    hash_gbps: float = 28.0  # xxh3-64 on one core (measured here, checkpoint/integrity.py)


def storage(fs_gbps: float | None = None, node_gbps: float | None = None, on_cpu: bool = False) -> Storage:
    """The storage of the command line's --fs-gbps / --fs-node-gbps (None: the default); no host copy on cpu."""
    default = Storage()
    return Storage(
        fs_gbps=fs_gbps or default.fs_gbps,
        node_gbps=node_gbps or default.node_gbps,
        host_gbps=0.0 if on_cpu else default.host_gbps,
    )


def _seconds(nbytes: float, gbps: float) -> float:
    return nbytes / (gbps * GB) if gbps > 0 else 0.0


@dataclass(frozen=True)
class Sizes:
    """Bytes of one checkpoint: what each rank writes per DCP save, and the HF export."""

    dcp_per_rank: list[int]
    hf: int

    @property
    def dcp(self) -> int:
        return sum(self.dcp_per_rank)


def sizes(specs: list[ParamSpec], shards: ShardLayout, world: int, trainable_only: bool = False) -> Sizes:
    """The checkpoint bytes of `world` ranks holding `specs` as `shards` splits them (rank r at FSDP index
    r % shards.dense); `trainable_only`: a LoRA run's checkpoint (the trainable parameters; the base is a
    reference)."""
    shard_count = shards.dense if shards.sharded else 1
    replicas = max(1, world // shard_count)
    trainable = [spec for spec in specs if spec.trainable]
    steps_per_rank = math.ceil(len(trainable) / world)  # AdamW's replicated step scalars, spread by DCP
    per_index = []
    chunks = 0
    for index in range(shard_count):
        nbytes = items = 0
        for spec in specs:
            if trainable_only and not spec.trainable:
                continue
            numel, _ = shards.local(spec, index)
            if numel == 0:
                continue
            copies = 3 if spec.trainable else 1  # weight, exp_avg, exp_avg_sq
            nbytes += copies * numel * spec.itemsize
            items += copies
        chunks += items
        per_index.append(nbytes / replicas + math.ceil(items / replicas) * DCP_ITEM_BYTES)
    step_bytes = steps_per_rank * (ADAM_STEP_BYTES + DCP_ITEM_BYTES)
    metadata = (chunks + len(trainable) + 24) * METADATA_CHUNK_BYTES
    groups = OPTIMIZER_GROUPS_BYTES + len(trainable) * PARAM_NAME_BYTES
    per_rank = [int(per_index[rank % shard_count] + step_bytes + RNG_FILE_BYTES) for rank in range(world)]
    per_rank[0] += metadata + groups + TRAINER_STATE_BYTES
    return Sizes(per_rank, _hf_bytes(specs))


def _hf_bytes(specs: list[ParamSpec]) -> int:
    """Every parameter whole, per expert (gate_up_proj stacks become 2 tensors per expert, down_proj one)."""
    tensors = 0
    for spec in specs:
        per_expert = 2 if spec.name.endswith("gate_up_proj") else 1
        tensors += spec.shape[0] * per_expert if spec.routed else 1
    weights = sum(math.prod(spec.shape) * spec.itemsize for spec in specs)
    return weights + 8 + tensors * SAFETENSORS_TENSOR_BYTES


def _node_bytes(per_rank: list[int], ranks_per_node: int) -> int:
    """The bytes of the fullest node (ranks placed by node, as launchers do)."""
    return max(sum(per_rank[start : start + ranks_per_node]) for start in range(0, len(per_rank), ranks_per_node))


def model(
    specs: list[ParamSpec],
    shards: ShardLayout,
    world: int,
    ranks_per_node: int,
    training: TrainingConfig,
    storage: Storage = Storage(),
    step_s: float | None = None,
    trainable_only: bool = False,
) -> dict[str, Any]:
    """The checkpoint figures of one layout (JSON-able): sizes per format, bytes per rank per save, save / verify /
    load / resume seconds, the async save's stall, at `storage`'s bandwidths; `step_s` (modelled seconds per step,
    when known) tells whether a background save outlasts save_interval steps."""
    found = sizes(specs, shards, world, trainable_only)
    per_rank = found.dcp_per_rank
    largest = max(per_rank)
    total, node = found.dcp, _node_bytes(per_rank, ranks_per_node)
    read_write = max(_seconds(total, storage.fs_gbps), _seconds(node, storage.node_gbps))
    staging = _seconds(largest, storage.host_gbps)
    hashing = _seconds(largest, storage.hash_gbps)
    save = staging + hashing + read_write
    verify = max(read_write, hashing)  # the files split by bytes: each rank's share about its own shard
    load = read_write + staging
    background = hashing + read_write
    interval_s = training.save_interval * step_s if step_s is not None and training.save_interval else None
    return {
        "storage": asdict(storage),
        "world": world,
        "ranks_per_node": ranks_per_node,
        "dcp": {
            "saved": training.save is not None,
            "total_bytes": total,
            "bytes_per_rank": {"min": min(per_rank), "max": largest, "rank0": per_rank[0]},
            "fullest_node_bytes": node,
            "save_s": {"staging": staging, "hashing": hashing, "write": read_write, "total": save},
            "verify_s": verify,
            "load_s": load,
            "resume_s": verify + load,
        },
        "async_save": {
            "enabled": training.async_save,
            "stall_s": staging,
            "background_s": background,
            "save_interval": training.save_interval,
            "interval_s": interval_s,
            "overrun_s": None if interval_s is None else max(0.0, background - interval_s),
        },
        "hf": {
            "saved": training.save_hf is not None,
            "total_bytes": found.hf,
            "export_write_s": _seconds(found.hf, min(storage.fs_gbps, storage.node_gbps)),
        },
    }


def format_lines(figures: dict[str, Any]) -> list[str]:
    """The report's lines (plan and preflight print the same)."""
    dcp, background, hf, storage = figures["dcp"], figures["async_save"], figures["hf"], figures["storage"]
    save = dcp["save_s"]
    per_rank = dcp["bytes_per_rank"]
    lines = [
        f"checkpoint (file system {storage['fs_gbps']:g} GB/s aggregate, {storage['node_gbps']:g} GB/s per node; "
        f"{figures['world']} ranks, {figures['ranks_per_node']} per node):",
        f"  DCP (training.save{'' if dcp['saved'] else ', not set in this config'}): "
        f"{_size(dcp['total_bytes'])} model + optimizer; per rank per save {_size(per_rank['min'])} - "
        f"{_size(per_rank['max'])} (rank 0 {_size(per_rank['rank0'])})",
        f"    save {_time(save['total'])} (host copy {_time(save['staging'])} + checksums "
        f"{_time(save['hashing'])} + write {_time(save['write'])}); verify {_time(dcp['verify_s'])}; load "
        f"{_time(dcp['load_s'])}; resume {_time(dcp['resume_s'])} (verify + load)",
    ]
    stall = f"    async save (training.async_save={str(background['enabled']).lower()}): the step loop stalls "
    stall += f"{_time(background['stall_s'])}; {_time(background['background_s'])} in the background"
    if background["interval_s"] is not None:
        over = background["overrun_s"]
        stall += (
            f", {'within' if over == 0 else 'OVER'} save_interval {background['save_interval']} steps "
            f"({_time(background['interval_s'])})" + (f" by {_time(over)}: the next save waits" if over else "")
        )
    lines.append(stall)
    lines.append(
        f"  HF export (training.save_hf{'' if hf['saved'] else ', not set in this config'}): {_size(hf['total_bytes'])}"
        f", written by rank 0 alone in {_time(hf['export_write_s'])}"
    )
    return lines


def _size(nbytes: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes / 1e3:.1f} kB"


def _time(seconds: float) -> str:
    if seconds >= 10:
        return f"{seconds:,.0f} s"
    return f"{seconds:.2f} s" if seconds >= 0.1 else f"{seconds * 1e3:.2f} ms"
