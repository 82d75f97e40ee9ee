"""Which implementation each op runs: `model.ops` resolved per device, availability probed, first call verified.

`model.ops` is `auto` (every op: the first available implementation of the device's preference list below),
`reference` (every op: the reference, i.e. transformers' own modules, which glm45v_fsdp/ops/reference.py equals), or
a mapping {op: auto | reference | <implementation name>} for the ops named (the others: auto).

A preferred implementation that is missing (a package not installed, a torch_npu without the op) is skipped with one
log line naming why; an implementation asked for by name that is missing, or that belongs to another device, is a
ConfigError. Every chosen implementation other than the reference runs once against the reference before the model
is trained (`verify`, forward and gradients on the run's device); a failure or a wrong result stops the run with a
message naming `model.ops` and how to run that op's reference instead.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from glm45v_fsdp.errors import ConfigError
from glm45v_fsdp.log import get_logger
from glm45v_fsdp.op_names import OPS, REFERENCE, check_ops_setting


@dataclass(frozen=True)
class Implementation:
    """One way to run one op. `available(npu)` returns None when it can run, else why not (for the log)."""

    op: str
    name: str
    label: str  # what the log says runs
    devices: tuple[str, ...]
    available: Callable[[Any], str | None] = lambda npu: None


def _npu_has(function: str) -> Callable[[Any], str | None]:
    def check(npu: Any) -> str | None:
        if npu is None:
            return "torch_npu is not importable"
        return None if hasattr(npu, function) else f"this torch_npu has no {function}"

    return check


def _flash_attn_installed(npu: Any) -> str | None:
    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed (pip install 'glm45v-fsdp[flash-attn]')"
    return None


def _grouped_mm_available(npu: Any) -> str | None:
    if not hasattr(torch, "_grouped_mm"):
        return "this torch has no torch._grouped_mm"
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0):
        return "torch._grouped_mm needs compute capability 8.0 or newer"
    return None


# every implementation op_names.py names, in its order (tests/test_ops.py checks)
IMPLEMENTATIONS = [
    Implementation("rms_norm", REFERENCE, "reference (transformers' RMSNorm)", ("npu", "cuda", "cpu")),
    Implementation("rms_norm", "npu_rms_norm", "torch_npu.npu_rms_norm", ("npu",), _npu_has("npu_rms_norm")),
    Implementation("rotary", REFERENCE, "reference (transformers' rotary)", ("npu", "cuda", "cpu")),
    Implementation("rotary", "npu_rotary_mul", "torch_npu.npu_rotary_mul", ("npu",), _npu_has("npu_rotary_mul")),
    Implementation("attention", REFERENCE, "reference (transformers' attention)", ("npu", "cuda", "cpu")),
    Implementation(
        "attention",
        "npu_fusion_attention",
        "torch_npu.npu_fusion_attention TND varlen",
        ("npu",),
        _npu_has("npu_fusion_attention"),
    ),
    Implementation("attention", "flash_attn", "flash_attn_varlen_func", ("cuda",), _flash_attn_installed),
    Implementation("experts", REFERENCE, "reference (per-expert loop)", ("npu", "cuda", "cpu")),
    Implementation("experts", "grouped_mm", "torch._grouped_mm", ("cuda", "cpu"), _grouped_mm_available),
    Implementation(
        "experts", "npu_grouped_matmul", "torch_npu.npu_grouped_matmul", ("npu",), _npu_has("npu_grouped_matmul")
    ),
    Implementation("permute", REFERENCE, "reference (stable sort + index_add)", ("npu", "cuda", "cpu")),
    Implementation(
        "permute",
        "npu_moe_token_permute",
        "torch_npu.npu_moe_token_permute / npu_moe_token_unpermute",
        ("npu",),
        lambda npu: _npu_has("npu_moe_token_permute")(npu) or _npu_has("npu_moe_token_unpermute")(npu),
    ),
    Implementation("swiglu", REFERENCE, "reference (silu(gate) * up)", ("npu", "cuda", "cpu")),
    Implementation("swiglu", "npu_swiglu", "torch_npu.npu_swiglu", ("npu",), _npu_has("npu_swiglu")),
]
BY_NAME = {(impl.op, impl.name): impl for impl in IMPLEMENTATIONS}

# `auto`: the first available implementation of each list (the reference closes every list)
PREFERENCE = {
    "npu": {
        "rms_norm": ["npu_rms_norm"],
        "rotary": ["npu_rotary_mul"],
        "attention": ["npu_fusion_attention"],
        "experts": ["npu_grouped_matmul"],
        "permute": ["npu_moe_token_permute"],
        "swiglu": ["npu_swiglu"],
    },
    "cuda": {"attention": ["flash_attn"], "experts": ["grouped_mm"]},
    "cpu": {"experts": ["grouped_mm"]},
}


@dataclass
class OpsChoice:
    """The implementation name of every op, with what the log says about it."""

    device_type: str
    names: dict[str, str]
    fallbacks: list[str] = field(default_factory=list)

    def label(self, op: str) -> str:
        return BY_NAME[(op, self.names[op])].label

    def describe(self) -> str:
        return " | ".join(f"{op}: {self.label(op)}" for op in OPS)

    def fast(self) -> list[str]:
        """The ops that do not run their reference."""
        return [op for op in OPS if self.names[op] != REFERENCE]


def choose_ops(setting: Any, device_type: str, npu: Any = None) -> OpsChoice:
    """Resolve `model.ops` for `device_type`; `npu` is the torch_npu module (or a stand-in) where there is one."""
    requested = check_ops_setting(setting)
    names, fallbacks = {}, []
    for op in OPS:
        wanted = requested[op]
        if wanted == REFERENCE:
            names[op] = REFERENCE
            continue
        if wanted != "auto":
            impl = BY_NAME[(op, wanted)]
            why_not = None if device_type in impl.devices else f"it runs on {'/'.join(impl.devices)}"
            why_not = why_not or impl.available(npu)
            if why_not is not None:
                raise ConfigError(
                    f"Config key 'model.ops.{op}' = '{wanted}' cannot run on this {device_type} run: {why_not}. Set "
                    f"model.ops.{op} to auto or reference."
                )
            names[op] = wanted
            continue
        names[op] = REFERENCE
        for candidate in PREFERENCE.get(device_type, {}).get(op, []):
            why_not = BY_NAME[(op, candidate)].available(npu)
            if why_not is None:
                names[op] = candidate
                break
            fallbacks.append(f"{op}: {BY_NAME[(op, candidate)].label} skipped ({why_not}); the next choice runs")
    return OpsChoice(device_type, names, fallbacks)


def log_choice(choice: OpsChoice, setting: Any) -> None:
    log = get_logger()
    for line in choice.fallbacks:
        log.info("ops: %s", line)
    log.info("ops (model.ops=%s, %s): %s", setting, choice.device_type, choice.describe())
