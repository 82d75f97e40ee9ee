"""`deepspeed.accelerator`: the device family of this backend's device layer, with DeepSpeed's names.

`get_accelerator()` is chosen as `ds_compat.comm.device_layer` chooses it (DS_ACCELERATOR, else npu > cuda > cpu);
`set_accelerator` replaces it (one of ours: DeepSpeed's AssertionError for anything else, as its check for a
DeepSpeedAccelerator subclass gives); `is_current_accelerator_supported()` checks the device name against
DeepSpeed's list. Only the calls the HF / accelerate integrations and common scripts make are here; anything else
raises AttributeError.
"""

from __future__ import annotations

import os

import torch

from ds_compat.comm import device_layer
from glm45v_fsdp.runtime.device import DeviceLayer


class Accelerator:
    """DeepSpeed's abstract accelerator, for one DeviceLayer."""

    def __init__(self, layer: DeviceLayer) -> None:
        self.layer = layer
        self._name = layer.type
        self._communication_backend_name = layer.backend

    def device_name(self, device_index: int | str | None = None) -> str:
        if self._name == "cpu" or device_index is None:
            return self._name
        return f"{self._name}:{int(device_index)}"

    def current_device(self) -> int:
        return 0 if self._name == "cpu" else self.layer._accel.current_device()

    def current_device_name(self) -> str:
        return self.device_name(None if self._name == "cpu" else self.current_device())

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def device_count(self) -> int:
        if self._name == "cpu":
            return int(os.environ.get("LOCAL_SIZE", 1))
        return self.layer._accel.device_count()

    def set_device(self, device_index: int) -> None:
        self.layer.set_device(device_index)

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return self._name != "cpu"  # as DeepSpeed's CPU accelerator

    def synchronize(self, device_index: int | None = None) -> None:
        self.layer.synchronize()

    def empty_cache(self) -> None:
        if self._name != "cpu":
            self.layer._accel.empty_cache()

    def manual_seed(self, seed: int) -> None:
        """Seed the current device's generator (on cpu: torch's, as DeepSpeed's CPU accelerator does)."""
        if self._name == "cpu":
            torch.manual_seed(seed)
        else:
            self.layer._accel.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._name == "cpu":
            torch.manual_seed(seed)
        else:
            self.layer.manual_seed_all(seed)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._name == "cpu":
            return torch.get_rng_state()
        return self.layer._accel.get_rng_state(*([] if device_index is None else [device_index]))

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._name == "cpu":
            torch.set_rng_state(new_state)
        else:
            self.layer._accel.set_rng_state(new_state, *([] if device_index is None else [device_index]))

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return self.layer.peak_allocated_bytes()

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self.layer.reset_peak_memory()

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self.layer.pin_memory() else tensor

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name


# deepspeed.accelerator.real_accelerator.SUPPORTED_ACCELERATOR_LIST
SUPPORTED_ACCELERATOR_LIST = ["cuda", "cpu", "xpu", "npu", "mps", "hpu", "mlu", "sdaa", "supa", "klxpu"]
DeepSpeedAccelerator = Accelerator  # what scripts subclass or check against
_current: Accelerator | None = None


def get_accelerator() -> Accelerator:
    global _current
    if _current is None:
        _current = Accelerator(device_layer())
    return _current


def set_accelerator(accelerator: Accelerator) -> None:
    global _current
    if not isinstance(accelerator, Accelerator):
        raise AssertionError(f"{type(accelerator).__name__} accelerator is not subclass of DeepSpeedAccelerator")
    _current = accelerator


def is_current_accelerator_supported() -> bool:
    return get_accelerator().device_name() in SUPPORTED_ACCELERATOR_LIST


__all__ = [
    "Accelerator",
    "DeepSpeedAccelerator",
    "SUPPORTED_ACCELERATOR_LIST",
    "get_accelerator",
    "is_current_accelerator_supported",
    "set_accelerator",
]
