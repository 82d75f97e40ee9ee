"""The ds_config's extension section: this backend's own keys for what DeepSpeed has no key for.

    "glm45v_fsdp": {"features": {"chunk_loss": {"mode": "dynamic"}, "ep_balance": {"enabled": true}},
                    "model": {"ops": "auto"}, "parallel": {"data_parallel_replicate_size": 2}}

The section holds our YAML config's keys (docs/config.md), nested as in the YAML, and is validated as YAML overrides
are: an unknown key is an error with "did you mean". DeepSpeed ignores the section, so one ds_config serves both
backends. Keys that a DeepSpeed key already decides, and what the script owns (its data, its training loop, its
model), are refused with the key to use instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ds_compat._common import Report, as_int, as_section, key_error
from ds_compat.ds_keys import EXTENSION_KEY
from glm45v_fsdp.config import Config, config_from_dict, deep_merge, set_fields, to_dict
from glm45v_fsdp.errors import ConfigError, UserError

# Our keys that a DeepSpeed key decides -> that key.
DECIDED_BY_DEEPSPEED = {
    "parallel.expert_parallel_size": "expert_parallel.autoep_size",
    "parallel.ulysses_parallel_size": "sequence_parallel_size",
    "parallel.fsdp_plan.param_dtype": "bf16.enabled / fp16.enabled",
    "parallel.fsdp_plan.reduce_dtype": "communication_data_type",
    "parallel.fsdp_plan.reshard_after_forward": "zero_optimization.stage",
    "parallel.fsdp_plan.cpu_offload": "zero_optimization.offload_param",
    "features.recompute.enabled": "activation_checkpointing (or the model's gradient_checkpointing_enable())",
    "features.activation_offload.enabled": "activation_checkpointing.cpu_checkpointing",
}
# The training keys the section may hold (the step deadline, ds_compat/step_watch.py): DeepSpeed has none for them.
TRAINING_KEYS_TAKEN = ("training.step_timeout_s", "training.output_dir")
# Sections and keys the script owns under the DeepSpeed API (and the ds_config's own keys under our trainer).
OWNED_ELSEWHERE = {
    "training": "the batch sizes, optimizer, schedule, clipping and precision come from the ds_config's DeepSpeed "
    "keys, the training loop from the script (of this section only training.step_timeout_s and training.output_dir "
    "are taken: the step deadline)",
    "data": "the script's data loader feeds the batches",
    "model.preset": "the model is the one the script passes to deepspeed.initialize",
    "model.name_or_path": "the model is the one the script passes to deepspeed.initialize",
    "model.config_overrides": "the model's config is the one the script built it with",
    "model.attn_implementation": "the model's attention is the one the script built it with (attn_implementation=)",
}


def section_leaves(tree: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted path, value) of every leaf of a nested section."""
    items = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            items.extend(section_leaves(value, path + "."))
        else:
            items.append((path, value))
    return items


@dataclass(frozen=True)
class ExtensionSection:
    """The extension section as the ds_config writes it (read once, by `read_extension`); `given`: the key is there."""

    given: bool = False
    value: Any = None

    def ring_attention_size(self, world_size: int, sequence_parallel_size: int, alst: bool = False) -> int:
        """The section's Ring size (1 when unset), which takes ranks from data parallelism as sequence_parallel_size
        does: it must divide world size / sequence_parallel_size, and stay 1 under DeepSpeed's ALST mpu (`alst`).
        Read before the batch arithmetic needs the data-parallel size; the rest of the section is validated by
        map_extension."""
        parallel = as_section(EXTENSION_KEY, self.value or {}).get("parallel") or {}
        ring = parallel.get("ring_attention_size", 1) if isinstance(parallel, dict) else 1
        path = f"{EXTENSION_KEY}.parallel.ring_attention_size"
        if alst and ring != 1:
            raise UserError(
                f"'{path}' = {ring!r} with DeepSpeed's ALST mpu (parallelism_config sp_size): the ALST loader adapter "
                "slices the targets contiguously for Ulysses, while Ring splits sequences zigzag. Use Ring and hybrid "
                "through sequence_parallel_size and the extension section without parallelism_config, or remove "
                "ring_attention_size."
            )
        ring = as_int(path, ring, minimum=1)
        ranks = world_size // sequence_parallel_size
        if ranks % ring:
            raise key_error(
                path,
                ring,
                f"does not divide world size / sequence_parallel_size = {world_size} / {sequence_parallel_size}",
                f"Choose a divisor of {ranks}; the data-parallel size is world size / (sequence_parallel_size x Ring).",
            )
        return ring


def read_extension(ds: dict) -> ExtensionSection:
    """The ds_config's extension section: the one place that reads it."""
    return ExtensionSection(EXTENSION_KEY in ds, ds.get(EXTENSION_KEY))


def map_extension(extension: ExtensionSection, report: Report) -> dict[str, Any]:
    """The extension section onto our config's fields (call after the DeepSpeed keys are mapped); returns its keys
    (key path -> value)."""
    if not extension.given:
        return {}
    section = as_section(EXTENSION_KEY, extension.value)
    leaves = section_leaves(section)
    for path, value in leaves:
        owner = next((key for key in OWNED_ELSEWHERE if path == key or path.startswith(key + ".")), None)
        if owner is not None and path not in TRAINING_KEYS_TAKEN:
            raise ConfigError(
                f"DeepSpeed config key '{EXTENSION_KEY}.{path}' = {value!r} cannot be set here: "
                f"{OWNED_ELSEWHERE[owner]}. Remove it from the '{EXTENSION_KEY}' section."
            )
        if path in DECIDED_BY_DEEPSPEED:
            raise ConfigError(
                f"DeepSpeed config key '{EXTENSION_KEY}.{path}' = {value!r} is decided by DeepSpeed's own key "
                f"'{DECIDED_BY_DEEPSPEED[path]}'. Set that key instead and remove this one."
            )
    # validated together with what the DeepSpeed keys set (EP for EP balance, ...)
    tree = set_fields(to_dict(Config()), report.fields)
    try:
        config_from_dict(deep_merge(tree, section))
    except ConfigError as error:
        raise ConfigError(f"DeepSpeed config section '{EXTENSION_KEY}': {error}") from None
    for path, value in leaves:
        report.override(path, value, source=f"{EXTENSION_KEY}.{path}")
    report.note(
        f"'{EXTENSION_KEY}' (this backend's keys, which DeepSpeed ignores): "
        + ", ".join(f"{path}={value!r}" for path, value in leaves)
    )
    return dict(leaves)
