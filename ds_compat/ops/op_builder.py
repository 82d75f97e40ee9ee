"""`deepspeed.ops.op_builder`: DeepSpeed's op builders by name, for code that asks which ops exist
(`deepspeed.ops.__compatible_ops__[FusedAdamBuilder.NAME]`, DeepSpeed's own tests do) before using them.

No C++/CUDA op is built here. An op that ds_compat provides in PyTorch (ds_compat/ops: the Adam, Adagrad and Lion
optimizers) is compatible, the others are not; `load()` is refused in one sentence naming the class to use instead.
"""

from __future__ import annotations

from typing import NoReturn

from ds_compat.refused import refusal
from glm45v_fsdp.errors import UserError

# op name -> the deepspeed.ops class that runs its update rule in PyTorch here
STAND_INS = {
    "cpu_adam": "deepspeed.ops.adam.DeepSpeedCPUAdam",
    "fused_adam": "deepspeed.ops.adam.FusedAdam",
    "cpu_adagrad": "deepspeed.ops.adagrad.DeepSpeedCPUAdagrad",
    "cpu_lion": "deepspeed.ops.lion.DeepSpeedCPULion",
    "fused_lion": "deepspeed.ops.lion.FusedLion",
}


class OpBuilder:
    """One DeepSpeed op by its NAME: compatible when ds_compat stands in for it, never loadable."""

    NAME = "deepspeed_not_implemented"

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.NAME

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.NAME}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        return self.NAME in STAND_INS

    def load(self, verbose: bool = True) -> NoReturn:
        stand_in = STAND_INS.get(self.NAME)
        instead = f"use {stand_in}, which runs the same update in PyTorch" if stand_in else "this op has no stand-in"
        raise UserError(refusal(f"{type(self).__name__}.load()", f"DeepSpeed's C++/CUDA ops are not built; {instead}"))

    builder = jit_load = load


def _builder(class_name: str, op_name: str) -> type[OpBuilder]:
    return type(class_name, (OpBuilder,), {"NAME": op_name, "__module__": __name__})


AsyncIOBuilder = _builder("AsyncIOBuilder", "async_io")
CCLCommBuilder = _builder("CCLCommBuilder", "deepspeed_ccl_comm")
CPUAdagradBuilder = _builder("CPUAdagradBuilder", "cpu_adagrad")
CPUAdamBuilder = _builder("CPUAdamBuilder", "cpu_adam")
CPULionBuilder = _builder("CPULionBuilder", "cpu_lion")
FusedAdamBuilder = _builder("FusedAdamBuilder", "fused_adam")
FusedLambBuilder = _builder("FusedLambBuilder", "fused_lamb")
FusedLionBuilder = _builder("FusedLionBuilder", "fused_lion")
NotImplementedBuilder = _builder("NotImplementedBuilder", "deepspeed_not_implemented")
PinMemoryBuilder = _builder("PinMemoryBuilder", "pin_memory")
ShareMemCommBuilder = _builder("ShareMemCommBuilder", "deepspeed_shm_comm")

# DeepSpeed 0.19.8's ops on a CPU build (deepspeed/ops/op_builder/all_ops.py's ALL_OPS there)
ALL_OPS: dict[str, OpBuilder] = {
    builder.NAME: builder()
    for builder in (
        NotImplementedBuilder,
        AsyncIOBuilder,
        CCLCommBuilder,
        ShareMemCommBuilder,
        CPUAdagradBuilder,
        CPUAdamBuilder,
        CPULionBuilder,
        FusedAdamBuilder,
        PinMemoryBuilder,
    )
}


def compatible_ops() -> dict[str, bool]:
    """`deepspeed.ops.__compatible_ops__`: each op of ALL_OPS, compatible when ds_compat stands in for it."""
    return {name: builder.is_compatible() for name, builder in ALL_OPS.items()}
