"""Async activation offload by plan: the saved activations of the matched modules wait in (pinned) host memory
between forward and backward.

The plan patches each matched module's `forward` in place (no wrapper module; names, checkpoints and the FSDP plan
are unchanged) so that it runs under `torch.autograd.graph.saved_tensors_hooks`:

  - pack (forward): a tensor autograd saves is *kept* (returned as is) when it is a parameter, a view or dtype cast
    of one (FSDP2's unsharded parameters, autocast's cached casts), a buffer, smaller than `min_tensor_bytes`, not
    on the compute device, or not a plain strided tensor. Any other one is recorded (a tensor saved several times in
    one forward, e.g. a module input used by two ops, is recorded once).
  - copy out (forward): when the next planned module call starts, the previous call is done: its recorded tensors
    are copied to pinned host buffers on a side stream (which first waits for the compute stream), `record_stream`
    tells the caching allocator that stream uses the device blocks, and the references are dropped, so each block is
    freed once its copy has run. The last call before backward keeps its tensors on the device (backward needs them
    first; copying them out and straight back would only cost time).
  - prefetch (backward): when the gradient of a call's output arrives (its backward is about to start), the tensors
    of that call and of the call before it in forward order (the next one backward reaches) are copied back on the
    side stream, into device memory owned by the side stream and marked for the compute stream. A call's tensors are
    therefore on the device during its own backward and the one after it in backward order, in host memory otherwise.
  - unpack (backward): the compute stream waits for the copy's event (a device-side wait; the host does not block),
    or the copy starts there when no prefetch did. When the copy was still running, two timing events around the
    wait measure how long the compute stream stalled (`offload_wait_ms`).

With recompute, the checkpointed forward saves only its inputs (through the checkpoint's own saved tensors, packed
by these hooks, which sit outside the checkpoint's): those inputs are offloaded, and the recomputation in backward
runs the original forward, not this one. On a CPU device there is no separate memory: the same code path runs with
no streams or events (synchronous copies into ordinary host memory), so pack, copy out, prefetch and unpack are
exercised by the tests, and the log says that nothing is saved there.

Every step, `OffloadRuntime.take()` returns (and resets) what moved: tensors and bytes to the host and back, tensors
kept or left in place, copies back started by prefetch vs. by unpack, and the stall time.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook, saved_tensors_hooks
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from glm45v_fsdp.config import ActivationOffloadConfig
from glm45v_fsdp.log import get_logger
from glm45v_fsdp.module_patterns import PlanMatch, match_modules
from glm45v_fsdp.runtime.device import DeviceLayer

# Single-input autograd nodes through which a tensor still "is" a parameter (a view or a dtype cast of it).
# `_ToTorchTensorBackward` is DTensor.to_local(): the expert stacks under EP are DTensor parameters whose local
# shard the grouped GEMM uses (transposed); that shard is FSDP2's unsharded storage, freed by the unit's reshard
# after forward, so it must stay in place (copying it out later read freed memory: a segfault at EP 2).
_PARAMETER_VIEW_NODES = {
    "_ToTorchTensorBackward",
    "TBackward0",
    "TransposeBackward0",
    "PermuteBackward0",
    "ViewBackward0",
    "UnsafeViewBackward0",
    "ReshapeAliasBackward0",
    "ExpandBackward0",
    "UnsqueezeBackward0",
    "SqueezeBackward0",
    "SqueezeBackward1",
    "SliceBackward0",
    "SelectBackward0",
    "AsStridedBackward0",
    "ToCopyBackward0",
    "CloneBackward0",
    "AliasBackward0",
}
_PARAMETER_VIEW_DEPTH = 4
_MAX_GROUPS = 4096


def _is_parameter_like(tensor: torch.Tensor, parameter_storages: set[int]) -> bool:
    """A parameter or buffer of the module (including FSDP2's unsharded parameters, whose storage the module holds
    during forward), or a few view / cast steps away from a leaf parameter (autocast's cached low-precision copy)."""
    if isinstance(tensor, nn.Parameter):
        return True
    if tensor.untyped_storage().data_ptr() in parameter_storages:
        return True
    node = tensor.grad_fn
    for _ in range(_PARAMETER_VIEW_DEPTH):
        if node is None:
            return False
        if type(node).__name__ == "AccumulateGrad":
            return isinstance(node.variable, nn.Parameter)
        if type(node).__name__ not in _PARAMETER_VIEW_NODES:
            return False
        inputs = [edge for edge, _ in node.next_functions if edge is not None]
        if len(inputs) != 1:
            return False
        node = inputs[0]
    return False


@dataclass
class OffloadStats:
    """What moved since the last `take()`; one step's figures."""

    tensors_out: int = 0
    bytes_out: int = 0
    tensors_in: int = 0
    bytes_in: int = 0
    kept: int = 0  # not eligible: parameters, small, not on the device
    stayed: int = 0  # eligible, but saved by the last module call before backward: used in place, never copied
    prefetched: int = 0  # copies back started ahead of their unpack (by a prefetch)
    late: int = 0  # copies back started by the unpack that needed them
    wait_ms: float = 0.0
    pending_waits: list[tuple[Any, Any]] = field(default_factory=list)  # timing events around stalls (accelerator)


class _Record:
    """One saved tensor of a planned module: on the device until the next planned call starts (`pending`), then in
    host memory (`host`), then, once fetched, on the device again (`device_tensor`). Alive while a handle is."""

    __slots__ = ("pending", "host", "device_tensor", "event", "device", "nbytes", "source", "version", "__weakref__")

    def __init__(self, source: torch.Tensor) -> None:
        self.pending: torch.Tensor | None = source
        self.host: torch.Tensor | None = None
        self.device_tensor: torch.Tensor | None = None
        self.event: Any = None  # the copy back's completion (accelerator)
        self.device = source.device
        self.nbytes = source.numel() * source.element_size()
        self.source = weakref.ref(source)  # to copy a tensor saved twice only once (while it is alive)
        self.version = source._version


class _Group:
    """The tensors one call of a planned module saved, in forward order (weak references: autograd owns them)."""

    __slots__ = ("name", "records", "closed", "fetched")

    def __init__(self, name: str) -> None:
        self.name = name
        self.records: list[weakref.ref[_Record]] = []
        self.closed = False
        self.fetched = False

    def live(self) -> list[_Record]:
        return [record for ref in self.records if (record := ref()) is not None]


class _Handle:
    """What autograd holds instead of an offloaded tensor."""

    __slots__ = ("record", "group")

    def __init__(self, record: _Record, group: _Group) -> None:
        self.record = record
        self.group = group


class OffloadRuntime:
    """The state of the offload plan on one rank: side stream, module-call groups, step statistics."""

    def __init__(self, cfg: ActivationOffloadConfig, device: DeviceLayer) -> None:
        self.cfg = cfg
        self.layer = device
        self.stats = OffloadStats()
        self.groups: list[_Group] = []
        self.trace: list[tuple[str, str]] | None = None  # tests: (pack|copy_out|fetch|unpack, module name)
        self._side: Any = None
        self._seen: dict[int, weakref.ref[_Record]] = {}
        self._unflushed: list[_Group] = []  # finished calls whose tensors still wait on the device
        self._backward_started = False
        self._steps_taken = 0

    # ---- forward ---------------------------------------------------------------------------------------------
    def _side_stream(self) -> Any:
        if self._side is None and self.layer.has_streams:
            self._side = self.layer.new_stream()
        return self._side

    def begin(self, name: str) -> _Group:
        """A planned module call starts: the calls before it are done, so their tensors go to the host now. (The
        last call before backward therefore keeps its tensors: backward needs them first.)"""
        if self._backward_started or len(self.groups) > _MAX_GROUPS:
            # A new forward (or forwards that never ran backward): drop the calls whose tensors are all gone.
            self._backward_started = False
            self._seen.clear()
            self.groups = [g for g in self.groups if not g.closed or g.live()]
        for done in self._unflushed:
            self._flush(done)
        self._unflushed.clear()
        group = _Group(name)
        self.groups.append(group)
        return group

    def pack(self, group: _Group, storages: set[int], tensor: torch.Tensor) -> Any:
        if (
            type(tensor) is not torch.Tensor
            or tensor.layout is not torch.strided
            or tensor.device.type != self.layer.type
            or tensor.numel() == 0
            or tensor.numel() * tensor.element_size() < self.cfg.min_tensor_bytes
            or _is_parameter_like(tensor, storages)
        ):
            self.stats.kept += 1
            return tensor
        seen = self._seen.get(id(tensor))
        record = seen() if seen is not None else None
        if record is None or record.source() is not tensor or record.version != tensor._version:
            record = _Record(tensor)
            self._seen[id(tensor)] = weakref.ref(record)
        if self.trace is not None:
            self.trace.append(("pack", group.name))
        group.records.append(weakref.ref(record))
        return _Handle(record, group)

    def end(self, group: _Group, output: Any) -> None:
        group.closed = True
        self._unflushed.append(group)
        tensors = [t for t in _flat_tensors(output) if t.requires_grad]
        if tensors and group.records:
            register_multi_grad_hook(tensors, lambda grad: self.backward_starts(group), mode="any")

    def _flush(self, group: _Group) -> None:
        """Copy a finished call's tensors to host memory on the side stream and let go of the device tensors."""
        records = [r for r in group.live() if r.pending is not None]
        if not records:
            return
        side = self._side_stream()
        if side is not None:
            side.wait_stream(self.layer.current_stream())  # the tensors are written by work queued so far
        for record in records:
            if record.pending is None:  # listed twice (saved twice by this call)
                continue
            tensor, record.pending = record.pending, None
            with torch.no_grad(), self.layer.use_stream(side):
                record.host = torch.empty_like(tensor, device="cpu", pin_memory=self.layer.pin_memory)
                record.host.copy_(tensor, non_blocking=side is not None)
            self.layer.record_stream(tensor, side)  # its block is reused only after the copy has run
            self.stats.tensors_out += 1
            self.stats.bytes_out += record.nbytes
            if self.trace is not None:
                self.trace.append(("copy_out", group.name))

    # ---- backward --------------------------------------------------------------------------------------------
    def backward_starts(self, group: _Group) -> None:
        """The gradient of `group`'s output arrived: bring back its tensors and those of the call before it."""
        self._backward_started = True
        self._fetch_group(group)
        previous = self._previous(group)
        if previous is not None:
            self._fetch_group(previous)

    def _previous(self, group: _Group) -> _Group | None:
        try:
            index = self.groups.index(group)
        except ValueError:
            return None
        for candidate in reversed(self.groups[:index]):
            if not candidate.fetched and candidate.live():
                return candidate
        return None

    def _fetch_group(self, group: _Group) -> None:
        if group.fetched:
            return
        group.fetched = True
        for record in group.live():
            if record.device_tensor is None:
                self._fetch(record, group, prefetch=True)

    def _fetch(self, record: _Record, group: _Group, prefetch: bool) -> None:
        if record.pending is not None:  # never left the device (last call before backward)
            record.device_tensor, record.pending = record.pending, None
            self.stats.stayed += 1
            return
        assert record.host is not None
        side = self._side_stream()
        start = time.perf_counter() if side is None else 0.0
        compute = self.layer.current_stream()
        with torch.no_grad(), self.layer.use_stream(side):  # after the copy out: it ran on this same stream
            device_tensor = torch.empty_like(record.host, device=record.device)
            device_tensor.copy_(record.host, non_blocking=side is not None)
            if side is not None:
                record.event = self.layer.new_event()
                record.event.record(side)
        self.layer.record_stream(device_tensor, compute)  # used (and freed) by the compute stream
        record.device_tensor = device_tensor
        if side is None:  # no streams: the copy ran here, and the backward waited for it
            self.stats.wait_ms += (time.perf_counter() - start) * 1000.0
        self.stats.tensors_in += 1
        self.stats.bytes_in += record.nbytes
        if prefetch:
            self.stats.prefetched += 1
        else:
            self.stats.late += 1
        if self.trace is not None:
            self.trace.append(("fetch", group.name))

    def unpack(self, handle: Any) -> torch.Tensor:
        if isinstance(handle, torch.Tensor):
            return handle
        record, group = handle.record, handle.group
        if not group.fetched:
            self.backward_starts(group)
        if record.device_tensor is None:
            self._fetch(record, group, prefetch=False)
        if self.trace is not None:
            self.trace.append(("unpack", group.name))
        event = record.event
        if event is not None:
            compute = self.layer.current_stream()
            if event.query():
                record.event = None
            else:  # still copying: the compute stream waits; timing events measure the stall
                before, after = self.layer.new_event(timing=True), self.layer.new_event(timing=True)
                before.record(compute)
                compute.wait_event(event)
                after.record(compute)
                self.stats.pending_waits.append((before, after))
        return record.device_tensor  # type: ignore[return-value]

    # ---- per step --------------------------------------------------------------------------------------------
    def take(self) -> dict[str, float | int]:
        """This step's figures for the metrics record (call after the step's device synchronize), then reset."""
        stats, self.stats = self.stats, OffloadStats()
        for before, after in stats.pending_waits:
            after.synchronize()
            stats.wait_ms += before.elapsed_time(after)
        self._steps_taken += 1
        if self._steps_taken == 1:
            self._log_first_step(stats)
        return {
            "offload_tensors": stats.tensors_out,
            "offload_bytes_out": stats.bytes_out,
            "offload_bytes_in": stats.bytes_in,
            "offload_kept_tensors": stats.kept,
            "offload_stayed_tensors": stats.stayed,
            "offload_prefetched": stats.prefetched,
            "offload_late": stats.late,
            "offload_wait_ms": round(stats.wait_ms, 3),
        }

    def _log_first_step(self, stats: OffloadStats) -> None:
        moved = f"{stats.tensors_out} tensors ({stats.bytes_out / 2**20:.2f} MiB)"
        kept = (
            f"{stats.kept} kept (parameters, non-device tensors, under min_tensor_bytes={self.cfg.min_tensor_bytes}), "
            f"{stats.stayed} left in place (last module call before backward)"
        )
        if self.layer.type == "cpu":
            get_logger().info(
                "activation offload on cpu moves %s per step but saves no device memory (host and device are the "
                "same memory; the pack/unpack path runs so that its logic is exercised); %s",
                moved,
                kept,
            )
        else:
            get_logger().info(
                "activation offload: step 1 moved %s to pinned host memory and %.2f MiB back (%d prefetched, %d at "
                "unpack); %s; compute stream waited %.2f ms",
                moved,
                stats.bytes_in / 2**20,
                stats.prefetched,
                stats.late,
                kept,
                stats.wait_ms,
            )


def _flat_tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _flat_tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _flat_tensors(item)]
    return []


def _offloaded_forward(forward: Callable, runtime: OffloadRuntime, module: nn.Module, name: str, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    # Storages of the module's parameters and buffers as they are now: under FSDP2 the unsharded ones.
    storages = {
        t.untyped_storage().data_ptr()
        for t in (*module.parameters(), *module.buffers())
        if not is_traceable_wrapper_subclass(t)  # FSDP2's sharded DTensors (a unit not gathered yet) are not saved
    }
    group = runtime.begin(name)
    try:
        with saved_tensors_hooks(functools.partial(runtime.pack, group, storages), runtime.unpack):
            output = forward(*args, **kwargs)
    except BaseException:
        group.closed = True
        raise
    runtime.end(group, output)
    return output


def apply_activation_offload(model: nn.Module, cfg: ActivationOffloadConfig, device: DeviceLayer) -> list[PlanMatch]:
    """The offload plan on the meta model (after recompute, before chunk loss and FSDP): patch the forward of every
    matched module. `find_offload_runtime(model)` then gives the runtime whose `take()` holds each step's figures."""
    matches = match_modules(model, cfg.apply_modules, "features.activation_offload.apply_modules")
    runtime = OffloadRuntime(cfg, device)
    for name in sorted({name for match in matches for name in match.names}):
        module = model.get_submodule(name)
        module.forward = functools.partial(_offloaded_forward, module.forward, runtime, module, name)
        module._activation_offload = runtime
    return matches


def describe_offload(cfg: ActivationOffloadConfig, device: DeviceLayer) -> str:
    """The plan's log line: where saved activations go on this device."""
    if device.type == "cpu":
        return (
            "[plan activation_offload] on cpu there is no device memory to free: saved activations of at least "
            f"{cfg.min_tensor_bytes} bytes are copied to ordinary host memory and back by the same pack/unpack/"
            "prefetch path (synchronously, no streams), so the logic runs, but nothing is saved"
        )
    return (
        f"[plan activation_offload] saved activations of at least {cfg.min_tensor_bytes} bytes (not parameters) go "
        f"to pinned host memory on a side {device.type} stream during forward; a module's backward prefetches the "
        "previous module's"
    )


def find_offload_runtime(model: nn.Module) -> OffloadRuntime | None:
    """The runtime of the offload plan applied to `model`, if any."""
    for module in model.modules():
        runtime = getattr(module, "_activation_offload", None)
        if runtime is not None:
            return runtime
    return None
