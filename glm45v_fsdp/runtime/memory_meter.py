"""Peak memory of one training step, and what the figure means.

npu/cuda: the device allocator's peak (`kind == "allocator"`), reset at step start.

cpu: there is no allocator peak, so `kind == "tracked-tensors"`: a TorchDispatchMode records every tensor storage an
op produces (views and storages shared by several tensors count once), holds only a weak reference to it and
subtracts its bytes when it dies; the running total starts from the storages of the `roots` passed to `track` (model
parameters, gradients, optimizer state). The figure is live tensor bytes, not process RSS: allocator caching,
fragmentation, memory that bypasses the dispatcher (gloo's internal buffers, `torch.from_numpy`) and tensors alive
before the step but not in `roots` are not counted. `UntypedStorage.resize_` (how FSDP2 frees and re-allocates
unsharded parameters) is followed by patching it while a step is tracked.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)

from glm45v_fsdp.runtime.device import DeviceLayer

_ORIGINAL_RESIZE = torch.UntypedStorage.resize_


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    """Tensors in an op's arguments or result (tensors, nested lists/tuples of them; the rest is skipped)."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors(item)


def _storages(tensor: torch.Tensor) -> tuple[torch.UntypedStorage, ...]:
    """The untyped storages behind a tensor; a wrapper subclass (DTensor) contributes its inner tensors'."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        inner = (getattr(tensor, name) for name in names)
        return tuple(storage for t in inner if isinstance(t, torch.Tensor) for storage in _storages(t))
    return (tensor.untyped_storage(),) if tensor.layout is torch.strided else ()


@functools.cache
def _may_return_input(func: Any) -> bool:
    """Whether an op can return (views of) its inputs: in-place, out=, view and collective ops."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return True
    if schema.name == "aten::lift_fresh":  # torch.tensor(data): the "input" was allocated just now
        return False
    return schema.is_mutable or any(ret.alias_info is not None for ret in schema.returns)


class _StorageRef(weakref.ref):
    """Weak reference to a tracked storage, with its id and its size when last seen."""

    __slots__ = ("key", "nbytes")


class _StorageTracker(TorchDispatchMode):
    """Live bytes of tracked storages and their running peak; entered for one step only."""

    def __init__(self, roots: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.live: dict[int, _StorageRef] = {}
        self.live_bytes = 0
        self.peak = 0
        for tensor in roots:
            for storage in _storages(tensor):
                if id(storage) not in self.live:
                    self._add(storage)

    def _add(self, storage: torch.UntypedStorage) -> None:
        if storage.device.type == "meta":  # fake tensors (DTensor shape propagation): no memory
            return
        ref = _StorageRef(storage, self._freed)
        ref.key, ref.nbytes = id(storage), storage.nbytes()
        self.live[ref.key] = ref
        self.live_bytes += ref.nbytes
        self.peak = max(self.peak, self.live_bytes)

    def _freed(self, ref: _StorageRef) -> None:
        if self.live.get(ref.key) is ref:
            del self.live[ref.key]
            self.live_bytes -= ref.nbytes

    def _resized(self, storage: torch.UntypedStorage) -> None:
        ref = self.live.get(id(storage))
        if ref is not None:
            nbytes = storage.nbytes()
            self.live_bytes += nbytes - ref.nbytes
            ref.nbytes = nbytes
            self.peak = max(self.peak, self.live_bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if types and any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # let DTensor & co. unwrap; their inner ops come back here as plain tensors
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for tensor in (out,) if isinstance(out, torch.Tensor) else _tensors(out):
            for storage in _storages(tensor):
                ref = self.live.get(id(storage))
                if ref is not None:
                    if storage.nbytes() != ref.nbytes:  # Tensor.resize_, set_
                        self._resized(storage)
                    continue
                if _may_return_input(func) and any(
                    storage is s for t in _tensors((args, tuple(kwargs.values()))) for s in _storages(t)
                ):
                    continue  # an untracked tensor from before the step, returned or viewed: not an allocation
                self._add(storage)
        return out


_tracking = False


@contextlib.contextmanager
def _tracked_step(roots: Iterable[torch.Tensor]) -> Iterator[_StorageTracker]:
    """Enter a tracker with `UntypedStorage.resize_` reporting to it (the dispatcher does not see storage resizes)."""
    global _tracking
    if _tracking:
        raise RuntimeError("MemoryMeter.track() does not nest: one step is tracked at a time.")
    tracker = _StorageTracker(roots)

    @functools.wraps(_ORIGINAL_RESIZE)
    def resize_(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
        result = _ORIGINAL_RESIZE(storage, size)
        tracker._resized(storage)
        return result

    _tracking = True
    torch.UntypedStorage.resize_ = resize_
    try:
        with tracker:
            yield tracker
    finally:
        torch.UntypedStorage.resize_ = _ORIGINAL_RESIZE
        tracker.live.clear()  # drops the weak references, so no callback fires after the step
        _tracking = False


class MemoryMeter:
    """Peak memory of one step: `with meter.track(roots): step()` then `meter.peak_bytes()`.

    `enabled` is `training.track_memory`; None means on for npu/cuda and off on cpu (tracking costs time there).
    """

    def __init__(self, device: DeviceLayer, enabled: bool | None) -> None:
        if enabled is None:
            enabled = device.type != "cpu"
        self.kind = "off" if not enabled else ("tracked-tensors" if device.type == "cpu" else "allocator")
        self._device = device
        self._peak = 0

    @contextlib.contextmanager
    def track(self, roots: Iterable[torch.Tensor] = ()) -> Iterator[None]:
        """Wrap one step (forward, backward, optimizer); the peak restarts at entry. `roots` only matter on cpu."""
        if self.kind == "off":
            yield
        elif self.kind == "allocator":
            self._device.synchronize()
            self._device.reset_peak_memory()
            try:
                yield
            finally:
                self._device.synchronize()
                self._peak = self._device.peak_allocated_bytes()
        else:
            with _tracked_step(roots) as tracker:
                try:
                    yield
                finally:
                    self._peak = tracker.peak

    def peak_bytes(self) -> int:
        """Peak of the last tracked step in bytes (0 when off or before the first step)."""
        return self._peak
