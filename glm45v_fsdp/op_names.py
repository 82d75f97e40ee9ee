"""The values `model.ops` takes: the ops and the names of each op's implementations.

config.py checks the key with `check_ops_setting`; ops/registry.py describes every implementation named here (what
the log calls it, its devices, whether it can run) and chooses one per op for the run's device. On the ground floor
(docs/architecture.md, "Floors"), so the config is checked without the ops package.
"""

from __future__ import annotations

from typing import Any

from glm45v_fsdp.errors import ConfigError

OPS = ("rms_norm", "rotary", "attention", "experts", "permute", "swiglu")
REFERENCE = "reference"
# each op's implementations, the reference first (ops/registry.py's IMPLEMENTATIONS, in the same order)
IMPLEMENTATION_NAMES: dict[str, tuple[str, ...]] = {
    "rms_norm": (REFERENCE, "npu_rms_norm"),
    "rotary": (REFERENCE, "npu_rotary_mul"),
    "attention": (REFERENCE, "npu_fusion_attention", "flash_attn"),
    "experts": (REFERENCE, "grouped_mm", "npu_grouped_matmul"),
    "permute": (REFERENCE, "npu_moe_token_permute"),
    "swiglu": (REFERENCE, "npu_swiglu"),
}


def check_ops_setting(setting: Any) -> dict[str, str]:
    """`model.ops` as {op: auto | reference | name} for every op; ConfigError for unknown ops or names."""
    if isinstance(setting, str):
        if setting not in ("auto", REFERENCE):
            raise ConfigError(
                f"Config key 'model.ops' = {setting!r} is not 'auto', 'reference' or a mapping of ops, e.g. "
                f"{{attention: reference}}. Ops: {', '.join(OPS)}."
            )
        return dict.fromkeys(OPS, setting)
    assert isinstance(setting, dict), setting
    chosen = dict.fromkeys(OPS, "auto")
    for op, name in setting.items():
        if op not in OPS:
            raise ConfigError(f"Config key 'model.ops.{op}' names no op. Ops: {', '.join(OPS)}.")
        valid = ["auto", *IMPLEMENTATION_NAMES[op]]
        if name not in valid:
            raise ConfigError(f"Config key 'model.ops.{op}' = {name!r} is not one of {valid}.")
        chosen[op] = name
    return chosen
