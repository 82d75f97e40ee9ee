"""The engine's DeepSpeed-named accessors: the batch triple, clipping, ZeRO stage, precision, loss scale, data-parallel
rank, gradient norm, learning rates and momenta, as DeepSpeed's engine answers them (EngineQueries, a mixin of
DeepSpeedEngine over its translation, meshes, optimizer and step outcome)."""

from __future__ import annotations

from typing import Any


class EngineQueries:
    """What scripts, accelerate and the HF Trainer ask the engine, under DeepSpeed's names."""

    def train_batch_size(self) -> int:
        return self.translation.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.translation.batch.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.translation.batch.gradient_accumulation_steps

    def get_batch_info(self) -> tuple[int, int, int]:
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def gradient_clipping(self) -> float:
        return self.translation.clip

    def zero_optimization_stage(self) -> int:
        return self.translation.zero_stage

    def zero_optimization(self) -> bool:
        return self.translation.zero_stage > 0

    def bfloat16_enabled(self) -> bool:
        return self.translation.precision == "bf16"

    def fp16_enabled(self) -> bool:
        return self.translation.precision == "fp16"

    def cur_scale(self) -> float:
        """The fp16 loss scale (1.0 without fp16)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def get_data_parallel_rank(self) -> int:
        return self.meshes.dp.get_local_rank()

    def get_global_grad_norm(self) -> float | None:
        return self._global_grad_norm

    def was_step_applied(self) -> bool:
        return self._step_applied

    def _optimizer_param(self, name: str) -> list[Any]:
        if self.optimizer is None:
            return []
        return [group.get(name, 0.0) for group in self.optimizer.param_groups]

    def get_lr(self) -> list[float]:
        return self._optimizer_param("lr")

    def get_mom(self) -> list[Any]:
        name = "momentum" if type(self.optimizer).__name__ in ("SGD", "RMSprop") else "betas"
        return self._optimizer_param(name)
