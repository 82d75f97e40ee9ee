"""HF config loading, meta-device model construction, freezing and parameter accounting."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from torch import nn
from transformers import Glm4vMoeConfig, PreTrainedConfig
from transformers.models.glm4v_moe.modeling_glm4v_moe import Glm4vMoeTextExperts

from glm45v_fsdp.config import ModelConfig, closest_keys
from glm45v_fsdp.errors import ConfigError, UserError
from glm45v_fsdp.log import get_logger
from glm45v_fsdp.model.loss import Glm4vMoeForTraining
from glm45v_fsdp.model.moe import GroupedExperts
from glm45v_fsdp.model.presets import PRESETS
from glm45v_fsdp.module_patterns import PlanMatch, match_modules

MODEL_TYPE = "glm4v_moe"
OVERRIDES_KEY = "model.config_overrides"


def read_json_file(path: Path, named_by: str) -> Any:
    """The JSON in `path` (an HF directory's config.json, a PEFT adapter's adapter_config.json); a UserError naming
    the setting that pointed at it (`named_by`) when the file is not readable JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise UserError(f"{named_by}: '{path}' is not readable JSON: {error}.") from None


def _read_config_dir(name_or_path: str) -> dict:
    directory = Path(name_or_path).expanduser()
    if not directory.is_dir():
        raise UserError(
            f"Config key 'model.name_or_path' = '{name_or_path}': directory '{directory}' does not exist. Point it at "
            f"a local GLM-4.5V model directory holding config.json, or set it to null to use model.preset."
        )
    path = directory / "config.json"
    if not path.is_file():
        raise UserError(
            f"Config key 'model.name_or_path' = '{name_or_path}': '{path}' does not exist. The directory must be a "
            f"Hugging Face model directory with config.json (as downloaded from zai-org/GLM-4.5V)."
        )
    data = read_json_file(path, "Config key 'model.name_or_path'")
    model_type = data.get("model_type") if isinstance(data, dict) else None
    if model_type != MODEL_TYPE:
        raise UserError(
            f"Model config '{path}' (model.name_or_path) has model_type {model_type!r}; this backend trains only "
            f"'{MODEL_TYPE}' (Glm4vMoeForConditionalGeneration, e.g. GLM-4.5V); point model.name_or_path at such a "
            f"model."
        )
    remote = {key: data.pop(key) for key in ("auto_map", "custom_pipelines") if key in data}
    if remote:
        get_logger().warning(
            "model config: %s names remote code (%s); it is ignored: this backend builds its own "
            "Glm4vMoeForTraining and never imports code from a model directory",
            path,
            ", ".join(f"{key}: {value}" for key, value in remote.items()),
        )
    return data


def _make_config(data: dict, source: str) -> Glm4vMoeConfig:
    try:
        return Glm4vMoeConfig.from_dict(copy.deepcopy(data))
    except (StrictDataclassError, ValueError, TypeError) as error:
        raise ConfigError(f"{source} gives an invalid GLM-4.5V config: {error}. Fix the value named above.") from None


def _merge_overrides(base: dict, overrides: dict, reference: Any, path: str) -> dict:
    """Deep-merge `overrides` onto `base` (a config's to_dict()); keys of config objects must exist.

    `reference` is the config object at this level (None inside plain dict fields such as rope_parameters, whose
    keys are merged unchecked). Attribute aliases (num_local_experts, num_heads, ...) map to their stored key.
    """
    if not isinstance(overrides, dict):
        raise ConfigError(f"Config key '{path}' must be a mapping of config keys, got {overrides!r}.")
    merged = dict(base)
    aliases = getattr(reference, "attribute_map", {}) if reference is not None else {}
    for key, value in overrides.items():
        key = aliases.get(key, key)
        full = f"{path}.{key}"
        if reference is not None and key not in base:
            keys = sorted(f"{path}.{k}" for k in base if not str(k).startswith("_"))
            hint = closest_keys(full, keys, cutoff=0.6) or f" '{path}' has {len(keys)} keys, none of them close."
            raise ConfigError(
                f"Config key '{full}' is not a key of the GLM-4.5V config.{hint} The model's config.json (or "
                f"transformers' Glm4vMoeConfig) lists them."
            )
        child = getattr(reference, key, None) if reference is not None else None
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merged[key] = _merge_overrides(
                base[key], value, child if isinstance(child, PreTrainedConfig) else None, full
            )
        else:
            merged[key] = value
    return merged


def load_hf_config(model_cfg: ModelConfig) -> Glm4vMoeConfig:
    """Preset or `<name_or_path>/config.json`, then `config_overrides` deep-merged, then the attention backend."""
    if model_cfg.name_or_path:
        config = _make_config(_read_config_dir(model_cfg.name_or_path), f"'{model_cfg.name_or_path}/config.json'")
    else:
        config = _make_config(PRESETS[model_cfg.preset], f"model.preset '{model_cfg.preset}'")
    if model_cfg.config_overrides:
        merged = _merge_overrides(config.to_dict(), model_cfg.config_overrides, config, OVERRIDES_KEY)
        config = _make_config(merged, f"Config key '{OVERRIDES_KEY}' = {model_cfg.config_overrides!r}")
    config._attn_implementation = model_cfg.attn_implementation  # the setter propagates to text and vision configs
    return config


def build_meta_model(hf_config: Glm4vMoeConfig) -> Glm4vMoeForTraining:
    """Construct the training model on the meta device (no memory, no init), with fp32 master parameters.

    Sets `dtype=float32` on the config and its sub-configs first: transformers builds the sub-models in
    `config.dtype` (bf16 in the published config.json); compute precision is FSDP2's job.
    """
    hf_config.dtype = torch.float32
    for key in hf_config.sub_configs:
        getattr(hf_config, key).dtype = torch.float32
    try:
        with torch.device("meta"):
            return Glm4vMoeForTraining(hf_config)
    except ImportError as error:
        raise UserError(
            f"Config key 'model.attn_implementation' = {hf_config._attn_implementation!r} cannot be used here: "
            f"{error} Install its kernel package or set model.attn_implementation=sdpa."
        ) from None


def apply_freeze(model: nn.Module, patterns: list[str]) -> list[PlanMatch]:
    """requires_grad_(False) on every parameter of the modules the patterns match (config key model.freeze)."""
    matches = match_modules(model, patterns, "model.freeze")
    modules = dict(model.named_modules())
    for match in matches:
        for name in match.names:
            modules[name].requires_grad_(False)
    return matches


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Parameter counts (global sizes; works on meta and FSDP2-sharded models).

    `experts` counts the routed, 3-D stacked experts only (shared experts are in `language`).
    """
    expert_params = {
        id(p)
        for m in model.modules()
        if isinstance(m, (Glm4vMoeTextExperts, GroupedExperts))
        for p in m.parameters(recurse=False)
    }
    counts = dict.fromkeys(("total", "trainable", "vision", "language", "experts", "lm_head"), 0)
    for name, param in model.named_parameters():
        n = param.numel()
        counts["total"] += n
        counts["trainable"] += n if param.requires_grad else 0
        counts["experts"] += n if id(param) in expert_params else 0
        for key, prefix in (
            ("vision", "model.visual."),
            ("language", "model.language_model."),
            ("lm_head", "lm_head."),
        ):
            counts[key] += n if name.startswith(prefix) else 0
    return counts


def _human(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _expert_kernel(model: nn.Module, text_config) -> str:
    """What computes the routed experts: our grouped experts' kernel, or transformers' experts implementation."""
    kernels = {m.kernel for m in model.modules() if isinstance(m, GroupedExperts)}
    return ",".join(sorted(kernels)) if kernels else str(text_config._experts_implementation or "eager")


def describe_model(model: nn.Module, hf_config: Glm4vMoeConfig) -> str:
    """Two log lines: class and parameter counts, then backends and dimensions."""
    c = count_parameters(model)
    text, vision = hf_config.text_config, hf_config.vision_config
    head_dim = getattr(text, "head_dim", text.hidden_size // text.num_attention_heads)
    return (
        f"{type(model).__name__}: {_human(c['total'])} params (trainable {_human(c['trainable'])}, frozen "
        f"{_human(c['total'] - c['trainable'])}; vision {_human(c['vision'])}, language {_human(c['language'])} "
        f"incl. routed experts {_human(c['experts'])}, lm_head {_human(c['lm_head'])})\n"
        f"  attn={hf_config._attn_implementation} experts={_expert_kernel(model, text)} | text: "
        f"{text.num_hidden_layers} layers ({text.first_k_dense_replace} dense), hidden {text.hidden_size}, heads "
        f"{text.num_attention_heads}/{text.num_key_value_heads} kv x {head_dim}, {text.n_routed_experts} experts "
        f"top-{text.num_experts_per_tok} + {text.n_shared_experts} shared (moe_intermediate "
        f"{text.moe_intermediate_size}), vocab {text.vocab_size} | vision: {vision.depth} blocks, hidden "
        f"{vision.hidden_size}, heads {vision.num_heads}, patch {vision.patch_size}, merge {vision.spatial_merge_size}"
    )
