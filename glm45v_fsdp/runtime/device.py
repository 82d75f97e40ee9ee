"""The device layer: the one place that knows about torch_npu and torch.cuda.

`select_device` picks npu (Ascend, HCCL), cuda (NCCL) or cpu (gloo) and returns a `DeviceLayer`; everything else in
the package asks the layer instead of calling `torch.cuda` / `torch.npu` directly. torch_npu is imported lazily,
only when npu is requested or probed by "auto".
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from glm45v_fsdp.errors import UserError

_BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}


@dataclass(frozen=True)
class DeviceLayer:
    """One accelerator family and its collective backend.

    `_accel` is the accelerator namespace the calls go to: `torch_npu.npu` for npu, `torch.cuda` for cuda, None for
    cpu (CPU calls are no-ops or, for the allocator peak, refused).
    """

    type: str
    backend: str
    _accel: Any = field(default=None, repr=False, compare=False)

    def device(self, local_rank: int) -> torch.device:
        if self.type == "cpu":
            return torch.device("cpu")
        return torch.device(self.type, local_rank)

    def set_device(self, local_rank: int) -> None:
        if self.type == "cpu":
            return
        count = self._accel.device_count()
        if not 0 <= local_rank < count:
            visible = "ASCEND_RT_VISIBLE_DEVICES" if self.type == "npu" else "CUDA_VISIBLE_DEVICES"
            raise UserError(
                f"Local rank {local_rank} has no {self.type} device: only {count} are visible to this process. "
                f"Start at most {count} processes per node (torchrun --nproc_per_node, srun --ntasks-per-node) "
                f"or widen {visible}."
            )
        self._accel.set_device(local_rank)

    def synchronize(self) -> None:
        if self.type != "cpu":
            self._accel.synchronize()

    def has_fused_adamw(self) -> bool:
        """Whether `torch.optim.AdamW(fused=True)` can run on this device type."""
        if self.type not in _fused_optimizer_device_types():
            return False
        return _cpu_fused_adamw_runs() if self.type == "cpu" else True

    def reset_peak_memory(self) -> None:
        assert self.type != "cpu", "the cpu has no allocator peak; use MemoryMeter (tracked tensors)"
        self._accel.reset_peak_memory_stats()

    def peak_allocated_bytes(self) -> int:
        assert self.type != "cpu", "the cpu has no allocator peak; use MemoryMeter (tracked tensors)"
        return int(self._accel.max_memory_allocated())

    def manual_seed_all(self, seed: int) -> None:
        """Seed every device generator (the CPU generator is seeded by `seed.set_seed`)."""
        if self.type != "cpu":
            self._accel.manual_seed_all(seed)

    def rng_state(self) -> torch.Tensor | None:
        """The current device's generator state, for checkpoints; None on cpu."""
        return None if self.type == "cpu" else self._accel.get_rng_state()

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        if self.type != "cpu":
            assert state is not None, f"restoring {self.type} rng state from a checkpoint that has none"
            self._accel.set_rng_state(state)

    # Streams, events and pinned host memory (activation offload). On cpu there are none: the stream and event
    # factories return None, `use_stream(None)` does nothing and copies run synchronously.
    @property
    def has_streams(self) -> bool:
        return self.type != "cpu"

    @property
    def pin_memory(self) -> bool:
        """Whether host buffers for device copies should be pinned (page-locked)."""
        return self.type != "cpu"

    def new_stream(self) -> Any | None:
        """A new stream on the current device (None on cpu)."""
        return None if self.type == "cpu" else self._accel.Stream()

    def current_stream(self) -> Any | None:
        return None if self.type == "cpu" else self._accel.current_stream()

    def use_stream(self, stream: Any | None) -> contextlib.AbstractContextManager:
        """Make `stream` current inside the block (no-op for None)."""
        return contextlib.nullcontext() if stream is None else self._accel.stream(stream)

    def new_event(self, timing: bool = False) -> Any | None:
        return None if self.type == "cpu" else self._accel.Event(enable_timing=timing)

    def record_stream(self, tensor: torch.Tensor, stream: Any | None) -> None:
        """Tell the caching allocator `tensor`'s memory is in use by `stream` (no-op for None)."""
        if stream is not None:
            tensor.record_stream(stream)


def import_torch_npu() -> Any:
    """torch_npu itself (its `npu` namespace and fused ops such as `npu_fusion_attention`), imported on first use."""
    return importlib.import_module("torch_npu")


def _fused_optimizer_device_types() -> list[str]:
    # torch's own list of device types with fused optimizer kernels (private; there is no public equivalent).
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    return _get_fused_kernels_supported_devices()


@functools.cache
def _cpu_fused_adamw_runs() -> bool:
    """One fused AdamW step on a CPU tensor: the list of device types says cpu; this checks the kernel exists."""
    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    try:
        torch.optim.AdamW([param], lr=0.1, fused=True).step()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _load_npu(loader: Callable[[], Any], requested: str) -> Any | None:
    """torch_npu's `npu` namespace when torch_npu imports and sees an NPU; None when absent (only for "auto")."""
    try:
        module = loader()
    except ModuleNotFoundError as error:
        if error.name != "torch_npu" and error.name is not None:
            raise _broken_npu_error(requested, error) from error
        if requested == "auto":
            return None
        raise UserError(
            "Config key 'training.device' = 'npu' but torch_npu is not installed. Install the torch_npu build that "
            f"matches torch {torch.__version__} and your CANN toolkit (pip install torch_npu==<matching version>), "
            "source CANN's set_env.sh, or set training.device=auto/cuda/cpu."
        ) from None
    except (ImportError, OSError, RuntimeError) as error:
        raise _broken_npu_error(requested, error) from error
    accel = module.npu
    if accel.is_available() and accel.device_count() > 0:
        return accel
    if requested == "auto":
        return None
    raise UserError(
        "Config key 'training.device' = 'npu' but torch_npu sees no NPU (torch_npu.npu.is_available() is False). "
        "Check `npu-smi info`, ASCEND_RT_VISIBLE_DEVICES and that CANN's set_env.sh is sourced, or set "
        "training.device=auto/cuda/cpu."
    )


def _broken_npu_error(requested: str, error: BaseException) -> UserError:
    return UserError(
        f"Config key 'training.device' = {requested!r} probes torch_npu, which is installed but failed to import "
        f"({type(error).__name__}: {error}). Source CANN's set_env.sh and install the torch_npu build that matches "
        f"torch {torch.__version__}, or set training.device=cuda/cpu to skip the NPU probe."
    )


def select_device(requested: str = "auto", npu_module_loader: Callable[[], Any] | None = None) -> DeviceLayer:
    """Resolve `training.device`: "auto" tries npu, then cuda, then cpu; an explicit choice must be usable.

    `npu_module_loader` returns the torch_npu module (default: `import torch_npu`); tests pass a stand-in.
    """
    if requested not in ("auto", *_BACKENDS):
        raise UserError(
            f"Config key 'training.device' = {requested!r} is not one of ['auto', 'npu', 'cuda', 'cpu']. "
            "Set training.device to one of them."
        )
    if requested in ("auto", "npu"):
        accel = _load_npu(npu_module_loader or import_torch_npu, requested)
        if accel is not None:
            return DeviceLayer("npu", _BACKENDS["npu"], accel)
    if requested in ("auto", "cuda"):
        if torch.cuda.is_available():
            return DeviceLayer("cuda", _BACKENDS["cuda"], torch.cuda)
        if requested == "cuda":
            raise UserError(
                "Config key 'training.device' = 'cuda' but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}). Install a CUDA build of "
                "torch and check CUDA_VISIBLE_DEVICES / nvidia-smi, or set training.device=auto/npu/cpu."
            )
    return DeviceLayer("cpu", _BACKENDS["cpu"])
