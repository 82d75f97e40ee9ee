"""The ds_config sections, one mapper each: our overrides, keys without effect, differences, refusals.

Each mapper reads a resolved ds_config ("auto" filled), validates what it reads the way DeepSpeed 0.19 does, and
records into a Report; what the engine cannot honour raises a UserError naming the key and the reason.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ds_compat import ds_keys
from ds_compat._common import (
    UNKNOWN,
    Report,
    as_bool,
    as_float,
    as_int,
    as_section,
    check_keys,
    format_value,
    key_error,
)
from glm45v_fsdp.errors import UserError

_STRICT_WHY = "DeepSpeed's schema for this section forbids keys it does not define"
# AutoEP's keys that locate the MoE layers in a model (AutoEP.preset_model ... expert_pattern).
AUTOEP_LOCATING_KEYS = ("preset_model", "moe_layer_pattern", "router_pattern", "expert_pattern")
DTYPE_NAMES = {  # the spellings DeepSpeed's DtypeEnum takes -> our names
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
}


def not_yet(path: str, value: Any, what: str, fix: str) -> UserError:
    return key_error(path, value, f"is not supported yet: {what}", fix)


def _cannot(path: str, value: Any, why: str, fix: str = "Remove the key.") -> UserError:
    return key_error(path, value, f"cannot be honoured by the FSDP2 backend: {why}", fix)


def misspelled_top_level(ds: dict) -> dict[str, str]:
    """Top-level keys DeepSpeed does not know that are close to one it does: {written: meant}."""
    known = sorted(ds_keys.KNOWN_TOP)
    unknown = (key for key in ds if isinstance(key, str) and key not in ds_keys.KNOWN_TOP)
    return {key: close[0] for key in unknown if (close := difflib.get_close_matches(key, known, n=1, cutoff=0.8))}


def typo_hint(ds: dict, meant: Iterable[str]) -> str:
    """' The config has X (did you mean Y?), which DeepSpeed ignores.' for misspellings of `meant` keys, else ''."""
    typos = [f"'{key}' (did you mean '{close}'?)" for key, close in misspelled_top_level(ds).items() if close in meant]
    return f" The config has {', '.join(typos)}, which DeepSpeed does not know and ignores." if typos else ""


def check_top_level(ds: dict, report: Report) -> None:
    """DeepSpeed reads the top level as a plain dict and ignores keys it does not know; so does the translation,
    but a key close to a known one is a misspelling whose value has no effect: a warning of its own."""
    misspelled = misspelled_top_level(ds)
    for key, value in ds.items():
        if key in ds_keys.REMOVED_TOP_LEVEL:
            raise key_error(
                key, value, f"is rejected by DeepSpeed 0.19: {ds_keys.REMOVED_TOP_LEVEL[key]}", "Remove it."
            )
        if key in ds_keys.STRICT_SECTIONS and key != "zero_optimization":
            check_keys(key, as_section(key, value), ds_keys.STRICT_SECTIONS[key], _STRICT_WHY)
        if key in ds_keys.NO_EFFECT_TOP:
            report.ignore(key, "tunes DeepSpeed's own machinery (profilers, timers, data loader, I/O)")
        elif key in misspelled:
            report.misspelled.append(
                f"'{key}' = {value!r} is not a DeepSpeed key: did you mean '{misspelled[key]}'? DeepSpeed ignores "
                f"it, and so does the translation: the value has no effect. Rename it to '{misspelled[key]}'."
            )
            report.answers[key] = (UNKNOWN, f"a misspelling of '{misspelled[key]}'? DeepSpeed ignores it too")
        elif key not in ds_keys.KNOWN_TOP:
            report.unknown(key)


def sequence_parallel(ds: dict, world_size: int, report: Report, alst_size: int | None = None) -> int:
    """sequence_parallel_size (checked with data_parallel_size); under DeepSpeed's ALST mpu (`alst_size`: its
    sequence-parallel size) the mpu's size, which the ds_config may leave out or repeat, and which it then holds."""
    if alst_size is not None:
        given = ds.get("sequence_parallel_size", "auto")
        if given not in ("auto", 1, alst_size):
            raise UserError(
                f"DeepSpeed config key 'sequence_parallel_size' = {given!r} differs from the ALST mpu's sequence "
                f"parallel size {alst_size} (register_with_transformers / parallelism_config sp_size). Remove the "
                "key, or set both to the same size."
            )
        ds["sequence_parallel_size"] = alst_size
    sp = ds.get("sequence_parallel_size")
    sp = 1 if sp is None else as_int("sequence_parallel_size", sp, minimum=1)
    if world_size % sp:
        raise key_error(
            "sequence_parallel_size",
            sp,
            f"does not divide the world size {world_size}",
            f"Choose a divisor of {world_size}; the data-parallel size is world size / sequence_parallel_size.",
        )
    if "sequence_parallel_size" in ds and sp == 1:
        report.take("sequence_parallel_size", "1: no sequence parallelism")
    if "data_parallel_size" in ds:
        dp = as_int("data_parallel_size", ds["data_parallel_size"], minimum=1)
        if "sequence_parallel_size" not in ds:
            report.ignore("data_parallel_size")
        elif dp != world_size // sp:
            raise key_error(
                "data_parallel_size",
                dp,
                f"is not world size / sequence_parallel_size = {world_size} / {sp}",
                f"Set it to {world_size // sp} or remove it.",
            )
        else:
            report.take("data_parallel_size", f"{dp} = world size / sequence_parallel_size, as checked")
    return sp


def _offload_device(zero: dict, key: str, allowed: frozenset[str], legacy: str, report: Report) -> str:
    """The device of `zero_optimization.<key>` (or its deprecated boolean `legacy` form): none, cpu."""
    path = f"zero_optimization.{key}"
    if legacy in zero and zero[legacy] is None:
        report.ignore(f"zero_optimization.{legacy}", "null: DeepSpeed's default")
    elif legacy in zero:
        on = as_bool(f"zero_optimization.{legacy}", zero[legacy])
        if zero.get(key) is not None:
            raise key_error(
                f"zero_optimization.{legacy}",
                on,
                f"is the deprecated form of {key}",
                "DeepSpeed rejects both: keep one.",
            )
        report.note(
            f"zero_optimization.{legacy} is deprecated in DeepSpeed; read as {key}.device = {'cpu' if on else 'none'}."
        )
        return "cpu" if on else "none"
    if key in zero and zero[key] is None:
        report.take(path, "null: no offload")
    section = as_section(path, zero.get(key))
    check_keys(path, section, allowed, _STRICT_WHY)
    device = section.get("device", "none")
    if device not in ("none", "cpu", "nvme"):
        raise key_error(f"{path}.device", device, "is not an offload device", 'Write "cpu" or "none".')
    if device == "nvme":
        raise _cannot(
            f"{path}.device",
            device,
            "NVMe offload (ZeRO-Infinity) needs DeepSpeed's async I/O engine; FSDP2 offloads to host memory only",
            'Use "cpu".',
        )
    if section.get("super_offload", False) is not False:
        raise _cannot(
            f"{path}.super_offload",
            section["super_offload"],
            "SuperOffload's CPU optimizer runs on Grace-Hopper style superchips inside DeepSpeed's ZeRO-3 engine; "
            "FSDP2 offloads with torch's CPUOffloadPolicy",
            'Remove the key (or set it to false); "device": "cpu" offloads to host memory.',
        )
    if device == "none":
        report.take(f"{path}.device", '"none": no offload, as DeepSpeed')
    for sub in section:
        if sub not in ("device", "ratio"):
            report.ignore(f"{path}.{sub}", "tunes DeepSpeed's offload engine")
    return device


def _bucket_elements(zero: dict, key: str) -> tuple[float, bool]:
    """A bucket size in elements, and whether the config set it: DeepSpeed's default when absent or 'auto'."""
    value = zero.get(key, "auto")
    if value == "auto":
        return ds_keys.BUCKET_KEYS[key], False
    return as_float(f"zero_optimization.{key}", value, minimum=0.0), True


def _unit_mib(zero: dict, stage: int, report: Report) -> tuple[float, list[str]]:
    """DeepSpeed's bucket sizes -> the FSDP2 unit size: a unit is what one collective moves, as a bucket is. Stages
    0-2 reduce (and all-gather) in buckets of reduce_bucket_size / allgather_bucket_size elements; stage 3 fetches
    parameters ahead in buckets of stage3_prefetch_bucket_size elements. Elements count 4 bytes (fp32 parameters).
    Returns the unit size and the bucket keys it follows at this stage."""
    if stage == 3:
        keys = ["stage3_prefetch_bucket_size" if "stage3_prefetch_bucket_size" in zero else "prefetch_bucket_size"]
    else:
        keys = ["reduce_bucket_size", "allgather_bucket_size"]
    key = max(keys, key=lambda name: _bucket_elements(zero, name)[0])
    elements, explicit = _bucket_elements(zero, key)
    for other in ds_keys.BUCKET_KEYS:
        if other in zero and other not in keys:
            report.ignore(f"zero_optimization.{other}", f"the FSDP2 unit size follows {key} at stage {stage}")
    unit_mib = round(elements * 4 / 2**20, 3)
    report.note(
        f"zero_optimization.{key}{'' if explicit else ' (DeepSpeed default)'} = {elements:.3g} elements -> "
        f"parallel.fsdp_plan.unit_mib = {unit_mib:g}: consecutive layers are merged into FSDP2 units of at least "
        "that many MiB of parameters (one collective each), as DeepSpeed fills a bucket."
    )
    return unit_mib, keys


def map_zero(ds: dict, dp: int, report: Report) -> int:
    raw = ds.get("zero_optimization")
    if isinstance(raw, bool):
        report.note("zero_optimization as a boolean is DeepSpeed's deprecated form; read as stage 1 (true) or 0.")
        zero: dict = {"stage": int(raw)}
    else:
        zero = as_section("zero_optimization", raw)
    for key, value in zero.items():
        if key in ds_keys.REMOVED_ZERO:
            raise key_error(
                f"zero_optimization.{key}",
                value,
                f"is rejected by DeepSpeed 0.19: {ds_keys.REMOVED_ZERO[key]}",
                "Remove it.",
            )
    check_keys("zero_optimization", zero, ds_keys.STRICT_SECTIONS["zero_optimization"], _STRICT_WHY)
    for alias, name in ds_keys.ZERO_ALIASES.items():
        if alias in zero and name in zero:
            raise key_error(
                f"zero_optimization.{name}", zero[name], f"repeats its alias {alias}", "Keep one of the two."
            )
    stage = zero.get("stage", 0)
    stage = as_int("zero_optimization.stage", int(stage) if isinstance(stage, str) and stage.isdigit() else stage)
    if stage not in (0, 1, 2, 3):
        raise key_error("zero_optimization.stage", stage, "is not a ZeRO stage", "Write 0, 1, 2 or 3.")
    for key, why in ds_keys.ZERO_UNSUPPORTED.items():
        if zero.get(key) not in (None, False):
            raise _cannot(f"zero_optimization.{key}", zero[key], why, "Remove the key (or set it to false).")
        if key in zero:
            report.take(f"zero_optimization.{key}", "off, as DeepSpeed's default")
    if ds_keys.HPZ_KEY in zero:
        hpz = as_int(f"zero_optimization.{ds_keys.HPZ_KEY}", zero[ds_keys.HPZ_KEY], minimum=1)
        if hpz > 1:
            raise _cannot(
                f"zero_optimization.{ds_keys.HPZ_KEY}",
                hpz,
                "ZeRO++ hpZ keeps a second copy of the parameters sharded within groups of that many ranks; FSDP2 "
                "shards each parameter once (HSDP, which shards within a group and replicates across groups, is the "
                "extension section's parallel.data_parallel_replicate_size)",
                "Remove the key (or set it to 1).",
            )
        report.take(f"zero_optimization.{ds_keys.HPZ_KEY}", "1: no secondary partition, as DeepSpeed's default")
    if zero.get("compute_grad_norm") is False and stage not in (1, 2):
        raise key_error(
            "zero_optimization.compute_grad_norm",
            False,
            "is rejected by DeepSpeed below/above stages 1-2",
            "Remove it.",
        )
    optimizer_device = _offload_device(zero, "offload_optimizer", ds_keys.OFFLOAD_OPTIMIZER_KEYS, "cpu_offload", report)
    param_device = _offload_device(zero, "offload_param", ds_keys.OFFLOAD_PARAM_KEYS, "cpu_offload_param", report)
    ratio_section = as_section("zero_optimization.offload_optimizer", zero.get("offload_optimizer"))
    if "ratio" in ratio_section:
        ratio = as_float("zero_optimization.offload_optimizer.ratio", ratio_section["ratio"], minimum=0.0)
        if ratio > 1 or (ratio < 1 and stage != 3):
            raise key_error(
                "zero_optimization.offload_optimizer.ratio",
                ratio,
                "is rejected by DeepSpeed (a ratio in [0, 1], below 1 only with stage 3)",
                "Write 1.0 or remove it.",
            )
        if ratio < 1:
            report.note("offload_optimizer.ratio < 1: FSDP2 offloads all optimizer state, not a share of it.")
        else:
            report.ignore("zero_optimization.offload_optimizer.ratio")
    for key in zero:
        if key in ds_keys.ZERO_NO_EFFECT:
            report.ignore(f"zero_optimization.{key}", "tunes DeepSpeed's own buckets, streams, partitioning or saving")

    report.override("parallel.data_parallel_replicate_size", dp if stage == 0 else 1, source="zero_optimization.stage")
    report.override("parallel.fsdp_plan.reshard_after_forward", stage == 3, source="zero_optimization.stage")
    unit_mib, bucket_keys = _unit_mib(zero, stage, report)
    report.override("parallel.fsdp_plan.unit_mib", unit_mib)
    for key in bucket_keys:
        if key in zero:
            larger = " (the larger of the two buckets)" if len(bucket_keys) > 1 else ""
            report.mapped(f"zero_optimization.{key}", f"parallel.fsdp_plan.unit_mib={unit_mib:g}{larger}")
    if stage == 0:
        report.note(
            "ZeRO stage 0 -> replicated data parallel: parallel.data_parallel_replicate_size = the data-parallel "
            "size, so FSDP2 shards over groups of one rank and all-reduces gradients (DeepSpeed's DDP-style engine)."
        )
    elif stage in (1, 2):
        report.note(
            f"ZeRO stage {stage} -> FSDP2 without reshard after forward: FSDP2 also shards the parameters at rest "
            f"(DeepSpeed stage {stage} keeps full parameters{' and gradients' if stage == 1 else ''} on every rank) "
            "and all-gathers them once per step; gradients are reduce-scattered. Same updates, less memory."
        )
    offload = (optimizer_device == "cpu" and stage >= 1) or (param_device == "cpu" and stage == 3)
    if optimizer_device == "cpu" and stage == 0:
        report.ignore("zero_optimization.offload_optimizer")
        report.note("offload_optimizer has no effect at ZeRO stage 0 (DeepSpeed offloads only from stage 1).")
    if param_device == "cpu" and stage < 3:
        report.ignore("zero_optimization.offload_param")
        report.note("offload_param has no effect below ZeRO stage 3 (DeepSpeed offloads parameters only at stage 3).")
    for key in ("offload_optimizer.device", "offload_param.device", "cpu_offload", "cpu_offload_param"):
        section, _, leaf = key.rpartition(".")
        node = zero.get(section) if section else zero
        path = f"zero_optimization.{key}"
        if isinstance(node, dict) and node.get(leaf) is not None and not report.answered(path):
            report.mapped(path, f"parallel.fsdp_plan.cpu_offload={format_value(offload)}")
    report.override("parallel.fsdp_plan.cpu_offload", offload)
    if offload:
        report.note(
            "CPU offload -> parallel.fsdp_plan.cpu_offload: FSDP2's CPUOffloadPolicy keeps parameters, gradients and "
            "optimizer states in (pinned) host memory and steps the optimizer on the CPU with torch's AdamW. "
            "DeepSpeed's offload_optimizer alone keeps the parameters on the device (ZeRO-Offload): here they are "
            "offloaded too (less device memory, more host traffic); pin_memory and the CPU-Adam tuning keys do not "
            "apply."
        )
    return stage


def map_fp16(fp16: dict, report: Report) -> None:
    """fp16 -> FSDP2 fp16 compute with fp32 master weights and DeepSpeed's loss scaler (glm45v_fsdp.loss_scale)."""
    static = as_float("fp16.loss_scale", fp16.get("loss_scale", 0), minimum=0.0)
    power = as_int("fp16.initial_scale_power", fp16.get("initial_scale_power", 16), minimum=0)
    window = as_int("fp16.loss_scale_window", fp16.get("loss_scale_window", 1000))
    hysteresis = as_int("fp16.hysteresis", fp16.get("hysteresis", 2), minimum=1)
    consecutive = as_bool("fp16.consecutive_hysteresis", fp16.get("consecutive_hysteresis", False))
    floor = as_float("fp16.min_loss_scale", fp16.get("min_loss_scale", 1))
    if static == 0 and window <= 0:
        raise key_error(
            "fp16.loss_scale_window",
            window,
            "must be > 0 for dynamic loss scaling, as DeepSpeed says",
            "Write a positive integer.",
        )
    if static == 0 and floor <= 0:
        raise key_error(
            "fp16.min_loss_scale",
            floor,
            "must be > 0 for dynamic loss scaling, as DeepSpeed says",
            "Write a positive number.",
        )
    report.override("training.loss_scale.static_scale", static, source="fp16.loss_scale")
    if static == 0:
        report.override("training.loss_scale.initial_scale_power", power, source="fp16.initial_scale_power")
        report.override("training.loss_scale.window", window, source="fp16.loss_scale_window")
        report.override("training.loss_scale.hysteresis", hysteresis, source="fp16.hysteresis")
        report.override("training.loss_scale.consecutive_hysteresis", consecutive, source="fp16.consecutive_hysteresis")
        report.override("training.loss_scale.min_scale", floor, source="fp16.min_loss_scale")
    else:
        for key in ds_keys.FP16_SCALING_KEYS[1:]:
            if key in fp16:
                report.ignore(f"fp16.{key}")
    report.note(
        "fp16 -> parallel.fsdp_plan.param_dtype=fp16: FSDP2 computes in fp16 and keeps fp32 master weights, "
        "gradients and optimizer states; the loss is scaled as DeepSpeed does (dynamic: from 2**initial_scale_power, "
        "halved after hysteresis overflows, doubled after loss_scale_window good steps, stop at min_loss_scale); an "
        "overflowing step is skipped and does not advance the schedule."
    )


def map_precision(ds: dict, stage: int, report: Report) -> str:
    fp16 = as_section("fp16", ds.get("fp16"))
    bf16_key = "bf16" if "bf16" in ds else "bfloat16"
    bf16 = as_section(bf16_key, ds.get(bf16_key))
    autocast = as_section("torch_autocast", ds.get("torch_autocast"))
    fp16_on = as_bool("fp16.enabled", fp16.get("enabled", False))
    bf16_on = as_bool(f"{bf16_key}.enabled", bf16.get("enabled", False))
    autocast_on = as_bool("torch_autocast.enabled", autocast.get("enabled", False))
    if fp16_on and bf16_on:
        raise key_error(
            "fp16.enabled", True, f"is set together with {bf16_key}.enabled, which DeepSpeed rejects", "Keep one."
        )
    if fp16_on:
        map_fp16(fp16, report)
    autocast_dtype = DTYPE_NAMES.get(str(autocast.get("dtype", "bf16")).lower())
    if autocast_on and autocast_dtype != "bf16":
        raise not_yet(
            "torch_autocast.dtype",
            autocast.get("dtype"),
            "torch_autocast maps to bf16 FSDP2 mixed precision only",
            'Use "bfloat16", or "fp16": {"enabled": true} for fp16 with loss scaling.',
        )
    for section, name, key in (
        (fp16, "fp16", "fp16_master_weights_and_grads"),
        (bf16, bf16_key, "bf16_master_weights_and_grads"),
        (bf16, bf16_key, "bf16_optimizer_states"),
    ):
        if as_bool(f"{name}.{key}", section.get(key, False)):
            if stage == 0:
                raise key_error(f"{name}.{key}", True, "is rejected by DeepSpeed without ZeRO (stage 0)", "Remove it.")
            report.mapped(f"{name}.{key}", "fp32 master weights, gradients and optimizer states (FSDP2's)")
            report.note(
                f"{name}.{key}: DeepSpeed keeps {name} master weights{' and gradients' if 'grads' in key else ''} "
                f"{'(and optimizer states) ' if 'states' in key else ''}to save memory; FSDP2 keeps them in fp32 "
                "(more memory, more precise updates)."
            )
    if as_bool(f"{bf16_key}.bf16_optimizer_states", bf16.get("bf16_optimizer_states", False)) and not bf16.get(
        "bf16_master_weights_and_grads", False
    ):
        raise key_error(
            f"{bf16_key}.bf16_optimizer_states", True, "needs bf16_master_weights_and_grads in DeepSpeed", "Remove it."
        )
    precision = "fp16" if fp16_on else "bf16" if bf16_on or autocast_on else "fp32"
    report.override("parallel.fsdp_plan.param_dtype", precision)
    for name, section in (("fp16", fp16), (bf16_key, bf16), ("torch_autocast", autocast)):
        if "enabled" in section:
            report.mapped(f"{name}.enabled", f"precision {precision}: parallel.fsdp_plan.param_dtype={precision}")
    if precision == "fp32":
        report.note('precision fp32: DeepSpeed trains in fp32 unless bf16 is enabled (add "bf16": {"enabled": true}).')
    mapped = {
        "fp16": {"enabled", *ds_keys.FP16_SCALING_KEYS} if fp16_on else {"enabled"},
        bf16_key: {"enabled", "check_grad_overflow"} if bf16_on else {"enabled"},
        "torch_autocast": {"enabled"},
    }
    for name, section in (("fp16", fp16), (bf16_key, bf16), ("torch_autocast", autocast)):
        for key in section:
            if key not in mapped[name]:
                report.ignore(f"{name}.{key}")
    if bf16_on and as_bool(f"{bf16_key}.check_grad_overflow", bf16.get("check_grad_overflow", True)):
        report.override("training.on_nonfinite", "skip", source=f"{bf16_key}.check_grad_overflow")
        report.note(
            "bf16 check_grad_overflow (DeepSpeed's default) -> training.on_nonfinite=skip; DeepSpeed skips without "
            "limit, the trainer stops after training.max_skipped_steps skipped steps.",
            door="trainer",
        )
    if autocast_on:
        report.note(
            "torch_autocast -> bf16 FSDP2 mixed precision: DeepSpeed keeps fp32 parameters and casts per op "
            "(lower_precision_safe_modules); FSDP2 casts each unit's parameters to bf16 for compute."
        )
    comm = ds.get("communication_data_type")
    if comm is None:
        report.override("parallel.fsdp_plan.reduce_dtype", "fp32", source="communication_data_type")
        if precision != "fp32":
            report.note(
                f"gradient reduction in fp32: DeepSpeed reduces {precision} gradients in {precision} unless "
                f'communication_data_type says otherwise (set it to "{precision}" for DeepSpeed\'s behaviour).'
            )
    else:
        reduce = DTYPE_NAMES.get(str(comm).lower())
        if str(comm).lower() not in ("fp32", "bf16", "fp16"):
            raise key_error("communication_data_type", comm, "is rejected by DeepSpeed", 'Write "fp32" or "bf16".')
        report.override("parallel.fsdp_plan.reduce_dtype", reduce, source="communication_data_type")
    data_types = as_section("data_types", ds.get("data_types"))
    for key, value in data_types.items():
        path = f"data_types.{key}"
        if key == "param_dtype" and value is not None and DTYPE_NAMES.get(str(value).lower()) != precision:
            raise key_error(
                path,
                value,
                f"conflicts with the enabled precision ({precision}), which DeepSpeed rejects",
                "Remove it.",
            )
        if key in ("param_dtype", "grad_accum_dtype", "buffer_dtype", "keep_in_fp32_modules"):
            report.ignore(path)
        else:
            report.unknown(path)
    return precision


DEFAULT_GRADIENT_CLIPPING = 1.0  # DeepSpeed 0.19's


def map_clipping(ds: dict, report: Report) -> float:
    if "gradient_clipping" not in ds:
        report.note(
            "gradient_clipping is not set: DeepSpeed 0.19 clips at its default 1.0, and so does the trainer.",
            door="trainer",
        )
    clip = as_float("gradient_clipping", ds.get("gradient_clipping", DEFAULT_GRADIENT_CLIPPING))
    if clip < 0:
        report.note(f"gradient_clipping = {clip} < 0 disables clipping in DeepSpeed; training.clip_grad=0 does here.")
        clip = 0.0
    report.override("training.clip_grad", clip, source="gradient_clipping")
    return clip


def _enabled(ds: dict, key: str) -> tuple[dict, bool]:
    section = as_section(key, ds.get(key))
    return section, as_bool(f"{key}.enabled", section.get("enabled", False))


DEFAULT_STEPS_PER_PRINT = math.inf  # DeepSpeed 0.19.8's default is None: no progress line


def map_logging(ds: dict, report: Report) -> float:
    """Logging keys; returns steps_per_print, which keeps DeepSpeed's meaning: the engine's own periodic line."""
    steps_per_print: float = DEFAULT_STEPS_PER_PRINT
    if ds.get("steps_per_print") == math.inf:  # accelerate writes float("inf"): never
        steps_per_print = math.inf
    elif ds.get("steps_per_print") is not None:
        steps_per_print = as_int("steps_per_print", ds["steps_per_print"], minimum=1)
    if "steps_per_print" in ds:
        report.take("steps_per_print", "the engine API's progress line every N optimizer steps (null: never)")
    if ds.get("steps_per_print") is not None:
        report.note(
            f"steps_per_print {steps_per_print}: DeepSpeed's own progress line (step, skipped, lr, mom) every "
            f"{steps_per_print} optimizer steps (inf: never), which the engine API prints as DeepSpeed does. Our "
            "trainer (--deepspeed) keeps its progress bar and its loss line every training.log_interval steps (our "
            "YAML's key: steps_per_print would silence a short run's losses, as the HF Trainer's 2000 does)."
        )
    if "tensorboard" in ds:
        section, on = _enabled(ds, "tensorboard")
        report.override("training.tensorboard", on, source="tensorboard.enabled")
        for key in ("output_path", "job_name"):
            if key in section:
                report.ignore(f"tensorboard.{key}", "events go to <training.output_dir>/tensorboard")
        if on and ("output_path" in section or "job_name" in section):
            report.note(
                "tensorboard events go to <training.output_dir>/tensorboard, not output_path/job_name.", door="trainer"
            )
    if "csv_monitor" in ds:
        section, on = _enabled(ds, "csv_monitor")
        if on:
            report.mapped("csv_monitor.enabled", "the trainer's <training.output_dir>/metrics.jsonl")
            for key in ("output_path", "job_name"):
                if key in section:
                    report.ignore(f"csv_monitor.{key}", "metrics go to <training.output_dir>/metrics.jsonl")
            report.note(
                "csv_monitor -> the trainer's <training.output_dir>/metrics.jsonl (JSON lines, not CSV files).",
                door="trainer",
            )
        else:
            report.ignore("csv_monitor")
    for key in ("wandb", "comet"):
        if key in ds:
            _, on = _enabled(ds, key)
            if on:
                report.note(f"{key} is not supported: metrics go to metrics.jsonl (and TensorBoard when enabled).")
            report.ignore(key)
    return steps_per_print


def map_activation_checkpointing(ds: dict, report: Report) -> None:
    """A non-empty section switches on the recompute plan (full granularity, default apply_modules).

    DeepSpeed recomputes only inside models that call deepspeed.checkpointing.checkpoint(); this engine recomputes
    by plan, so the section's presence is the switch. Recompute changes memory and time, never the numerics.
    """
    section = as_section("activation_checkpointing", ds.get("activation_checkpointing"))
    for key in section:
        if key not in ds_keys.ACTIVATION_CHECKPOINTING_KEYS:
            report.unknown(f"activation_checkpointing.{key}")
        elif key != "cpu_checkpointing":
            report.ignore(f"activation_checkpointing.{key}")
    if not section:
        return
    report.override("features.recompute.enabled", True, source="activation_checkpointing")
    report.note(
        "activation_checkpointing -> features.recompute.enabled=true (full granularity; default plan: the vision "
        "blocks and the text decoder layers). partition_activations has nothing to split without tensor "
        "parallelism; the other keys tune DeepSpeed's own checkpointing buffers.",
        door="trainer",
    )
    if as_bool("activation_checkpointing.cpu_checkpointing", section.get("cpu_checkpointing", False)):
        report.override(
            "features.activation_offload.enabled", True, source="activation_checkpointing.cpu_checkpointing"
        )
        report.note(
            "activation_checkpointing.cpu_checkpointing -> features.activation_offload.enabled=true: the recomputed "
            "modules' saved inputs wait in pinned host memory and are prefetched in backward (DeepSpeed moves its "
            "checkpointed activations to the CPU the same way, there only together with partition_activations).",
            door="trainer",
        )
    elif "cpu_checkpointing" in section:
        report.ignore("activation_checkpointing.cpu_checkpointing")


def map_unsupported_features(ds: dict, report: Report) -> None:
    op = ds.get("gradient_allreduce_op", "mean")
    if str(op).lower() != "mean":
        raise _cannot(
            "gradient_allreduce_op", op, "the engine averages gradients over data-parallel ranks", 'Use "mean".'
        )
    if "gradient_allreduce_op" in ds:
        report.take("gradient_allreduce_op", "mean: gradients averaged over the data-parallel ranks")
    if "managed_gradient_accumulation" in ds:
        if not as_bool("managed_gradient_accumulation", ds["managed_gradient_accumulation"]):
            raise _cannot(
                "managed_gradient_accumulation", False, "the engine owns the accumulation boundary", "Remove the key."
            )
        report.take("managed_gradient_accumulation", "the engine owns the accumulation boundary, as DeepSpeed's")
    refusals = {
        "hybrid_engine": "DeepSpeed-Chat's hybrid training/inference engine",
        "data_efficiency": "curriculum learning and random-LTD change the data the model sees",
    }
    for key, what in refusals.items():
        if key in ds:
            if _enabled(ds, key)[1]:
                raise _cannot(f"{key}.enabled", True, what)
            report.ignore(key)
    if "pipeline" in ds:
        if as_section("pipeline", ds["pipeline"]):
            raise _cannot(
                "pipeline", ds["pipeline"], "pipeline parallelism (DeepSpeed's PipelineModule) is not available"
            )
        report.ignore("pipeline")
    if "tensor_parallel" in ds:
        size = as_section("tensor_parallel", ds["tensor_parallel"]).get("autotp_size", 0)
        if as_int("tensor_parallel.autotp_size", size) > 1:
            raise _cannot("tensor_parallel.autotp_size", size, "tensor parallelism (AutoTP) is not available")
        report.ignore("tensor_parallel")
    if "weight_quantization" in ds:
        raise _cannot("weight_quantization", ds["weight_quantization"], "quantized weights change the numerics")
    _refuse_switch(
        ds,
        "compile.deepcompile",
        "DeepCompile rewrites the compiled graph with DeepSpeed's own ZeRO passes (prefetch, selective gather, "
        "offload), which have no FSDP2 counterpart",
        "Remove the key (or set it to false); the FSDP2 units and features.recompute / activation_offload give the "
        "memory savings.",
        report,
        off="configures DeepCompile only, which is off",
    )
    _refuse_switch(
        ds,
        "checkpoint.load_universal",
        "it loads DeepSpeed's universal checkpoint (the folder ds_to_universal.py writes); this backend saves and "
        "loads DCP checkpoints, which already load at another world size or ZeRO stage (DCP reshards on load)",
        "Remove the key (or set it to false) and load the DCP checkpoint this backend wrote; convert a DeepSpeed "
        "checkpoint with python -m glm45v_fsdp.tools.convert first.",
        report,
        off="tunes DeepSpeed's checkpoint engine; checkpoints are DCP here",
    )


def _refuse_switch(ds: dict, path: str, why: str, fix: str, report: Report, off: str) -> None:
    """`section.switch: true` turns on a DeepSpeed feature with no FSDP2 counterpart: refused; the section with the
    switch off has no effect here (`off` says why)."""
    section_name, switch = path.split(".")
    section = as_section(section_name, ds.get(section_name))
    if as_bool(path, section.get(switch, False)):
        raise _cannot(path, True, why, fix)
    if section_name in ds:
        report.ignore(section_name, off)


@dataclass(frozen=True)
class AutoEP:
    """The expert_parallel section as the engine needs it: the EP size (1: off), and, when the section is enabled, the
    keys that say where the MoE layers live, which the engine checks against the model it is given (None: unset)."""

    size: int = 1
    enabled: bool = False
    preset_model: Any = None
    moe_layer_pattern: Any = None
    router_pattern: Any = None
    expert_pattern: Any = None


def map_expert_parallel(ds: dict, world_size: int, dp: int, stage: int, report: Report) -> AutoEP:
    """DeepSpeed 0.19's AutoEP section onto parallel.expert_parallel_size (call after map_zero: `stage`, `dp` the
    data-parallel ranks); returns the section as the engine needs it.

    `enabled` + `autoep_size` choose the size. The keys that tell AutoEP where an arbitrary model's MoE layers,
    experts and router live, and its kernel choices, have no effect (our MoE plan knows GLM-4.5V's MoE block). Routing
    settings must stay at their "auto" defaults: routing comes from the model's own config here, and what the ds_config
    cannot honour (expert tensor parallelism, DeepEP, an auxiliary balance loss) is refused.
    """
    section, on = _enabled(ds, "expert_parallel")
    for key in section:
        if key not in ds_keys.EXPERT_PARALLEL_KEYS:
            report.unknown(
                f"expert_parallel.{key}",
                f"'expert_parallel.{key}' is not an AutoEP key: DeepSpeed ignores it, and so does the translation.",
            )
    size = as_int("expert_parallel.autoep_size", section.get("autoep_size", 1), minimum=1)
    locate = {key: section.get(key) for key in AUTOEP_LOCATING_KEYS} if on else {}
    use_data_first = ds.get("use_data_before_expert_parallelism", False)
    if not on or size == 1:
        report.ignore("expert_parallel")
        if "use_data_before_expert_parallelism" in ds:
            report.ignore("use_data_before_expert_parallelism")
        return AutoEP(1, on, **locate)
    if world_size % size:
        raise key_error(
            "expert_parallel.autoep_size",
            size,
            f"does not divide the world size {world_size}",
            f"Choose a divisor of {world_size} that also divides the model's routed experts.",
        )
    if as_bool("use_data_before_expert_parallelism", use_data_first):
        raise _cannot(
            "use_data_before_expert_parallelism",
            True,
            "expert-parallel groups are blocks of adjacent ranks here (DeepSpeed's default E + D order: ranks 0..ep-1 "
            "share a layer's experts), not strided over the data-parallel ranks",
            "Remove the key or set it to false.",
        )
    etp = as_int("expert_parallel.expert_tensor_parallel_size", section.get("expert_tensor_parallel_size", 1), 1)
    if etp > 1:
        raise _cannot("expert_parallel.expert_tensor_parallel_size", etp, "tensor parallelism is not available")
    if section.get("comm_backend", "comm") != "comm":
        raise _cannot(
            "expert_parallel.comm_backend",
            section["comm_backend"],
            "DeepEP's kernels are not used; tokens travel by torch's all_to_all_single (parallel.ep_plan.dispatcher)",
            'Write "comm" or remove the key.',
        )
    if section.get("load_balance_coeff") is not None:
        raise _cannot(
            "expert_parallel.load_balance_coeff",
            section["load_balance_coeff"],
            "no auxiliary balance loss is added (DeepSpeed 0.19 refuses it too); EP balance by expert replicas is "
            "features.ep_balance",
            "Remove the key or set it to null.",
        )
    for key, default in ds_keys.EXPERT_PARALLEL_ROUTING.items():
        value = section.get(key, default)
        if value != default and value is not None:
            raise key_error(
                f"expert_parallel.{key}",
                value,
                "overrides the model's routing, which comes from the model's own config on this backend",
                f"Leave it at {default!r} (or remove it); change the routing in the model config instead "
                f"(model.config_overrides.text_config.*) if you must.",
            )
    report.override("parallel.expert_parallel_size", size, source="expert_parallel.autoep_size")
    report.mapped("expert_parallel.enabled", f"parallel.expert_parallel_size={size}")
    if stage == 0:
        if dp % size:
            raise key_error(
                "expert_parallel.autoep_size",
                size,
                f"does not divide the {dp} data-parallel ranks",
                f"Choose a divisor of {dp}.",
            )
        report.override("parallel.data_parallel_replicate_size", dp // size)
        report.note(
            f"ZeRO stage 0 with expert parallelism: the ranks form {dp // size} replica(s) of {size} (HSDP), so the "
            f"experts split over the {size} ranks of each replica; the dense parameters are sharded over them too "
            "(DeepSpeed keeps them whole on every rank). Same updates, less memory."
        )
    report.note(
        f"expert_parallel.autoep_size {size}: the routed experts split over {size} adjacent ranks (E/{size} each), "
        "tokens exchanged by all-to-all; the keys that locate MoE layers in an arbitrary model and AutoEP's kernel "
        "choices have no effect (our MoE plan knows GLM-4.5V's MoE block).",
    )
    for key in section:
        if key in ds_keys.EXPERT_PARALLEL_KEYS and key not in ("enabled", "autoep_size"):
            report.ignore(f"expert_parallel.{key}")
    if "use_data_before_expert_parallelism" in ds:
        report.ignore("use_data_before_expert_parallelism")
    return AutoEP(size, on, **locate)
