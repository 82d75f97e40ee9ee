"""`deepspeed.runtime.zero.offload_config`: the `offload_param` / `offload_optimizer` sections of zero_optimization.

What the FSDP2 backend does with them is the translator's business (ds_compat/sections.py: device "cpu" offloads
the sharded parameters, "nvme" is refused); these models are what a script that reads them sees.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path

from pydantic import Field, model_validator

from ds_compat.runtime.config_utils import DeepSpeedConfigModel


class OffloadDeviceEnum(str, Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class DeepSpeedZeroOffloadParamConfig(DeepSpeedConfigModel):
    """`zero_optimization.offload_param` (ZeRO-3 parameter offload)."""

    device: OffloadDeviceEnum = "none"
    nvme_path: Path | None = None
    buffer_count: int = Field(5, ge=0)
    buffer_size: int = Field(100_000_000, ge=0)
    max_in_cpu: int = Field(1_000_000_000, ge=0)
    pin_memory: bool = True


class DeepSpeedZeroOffloadOptimizerConfig(DeepSpeedConfigModel):
    """`zero_optimization.offload_optimizer`; `pipeline` is read-only: pipeline_read or pipeline_write."""

    device: OffloadDeviceEnum = "none"
    nvme_path: Path | None = None
    buffer_count: int = Field(4, ge=0)
    pin_memory: bool = True
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = Field(1.0, ge=0.0, le=1.0)
    super_offload: bool = False
    cpuadam_cores_perc: float = Field(0.8, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _set_pipeline(self) -> DeepSpeedZeroOffloadOptimizerConfig:
        self.__dict__["pipeline"] = self.pipeline_read or self.pipeline_write
        return self
