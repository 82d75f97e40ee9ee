"""Translate a DeepSpeed ds_config onto the FSDP2 engine's config, and explain the result.

`translate(source, world_size, base)` loads the config (a dict, a JSON/hjson file or base64 JSON, as DeepSpeed
accepts), fills "auto" values from `base` the way transformers' HF Trainer integration does, derives the batch
triple with DeepSpeed's arithmetic and checks, and maps every key onto our config's fields (key path -> typed value,
`Translation.fields`, which both doors apply as they are) plus an optimizer and a scheduler spec — or lists it as
having no effect on FSDP2, notes what differs from DeepSpeed, or raises a UserError saying why it cannot be honoured.

CLI: python -m ds_compat.config explain ds_config.json --world-size N [--config our.yaml] [--json]; "auto" values come
from --config, by default the config the trainer runs without one (configs/glm45v_tiny.yaml).
"""

from __future__ import annotations

import argparse
import base64
import collections
import copy
import dataclasses
import json
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds_compat import autoep_env, ds_keys, sections
from ds_compat._common import (
    Report,
    as_int,
    format_value,
    is_number,
    key_error,
    render_fields,
)
from ds_compat.extension import map_extension, read_extension
from ds_compat.key_table import KeyAnswer, answer_keys
from ds_compat.sections import AutoEP
from ds_compat.specs import OptimizerSpec, SchedulerSpec, optimizer_spec, scheduler_spec
from glm45v_fsdp.config import (
    Config,
    TrainingConfig,
    config_from_dict,
    load_config,
    set_fields,
    to_dict,
    validate_layout,
)
from glm45v_fsdp.errors import EXIT_USER_ERROR, ConfigError, UserError

TRAIN_BATCH = "train_batch_size"
MICRO_BATCH = "train_micro_batch_size_per_gpu"
ACCUMULATION = "gradient_accumulation_steps"

# --------------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------------


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    counts = collections.Counter(key for key, _ in pairs)
    duplicates = sorted(key for key, count in counts.items() if count > 1)
    if duplicates:
        raise UserError(f"DeepSpeed config has duplicate keys {duplicates}, which DeepSpeed rejects. Keep one of each.")
    return dict(pairs)


def _decode(text: str, reject_duplicates: bool) -> Any:
    """JSON, else hjson (DeepSpeed reads its files with hjson); syntax errors raise ValueError."""
    hook = _no_duplicates if reject_duplicates else None
    try:
        return json.loads(text, object_pairs_hook=hook)
    except json.JSONDecodeError as error:
        try:
            import hjson
        except ImportError:
            raise ValueError(f"{error} (hjson syntax needs the 'hjson' package: pip install hjson)") from None
        return hjson.loads(text, object_pairs_hook=hook or dict)


def load_ds_config(source: dict | str | os.PathLike) -> dict:
    """A ds_config from a dict (copied), a JSON/hjson file path, or a base64-encoded JSON string."""
    if isinstance(source, dict):
        return copy.deepcopy(source)
    if isinstance(source, os.PathLike) or (isinstance(source, str) and os.path.exists(source)):
        path = Path(source)
        if not path.is_file():
            raise UserError(f"DeepSpeed config '{path}' is not a file. Pass the path of a ds_config.json.")
        try:
            data = _decode(path.read_text(encoding="utf-8"), reject_duplicates=True)
        except ValueError as error:
            raise UserError(
                f"DeepSpeed config file '{path}' is neither JSON nor hjson: {error}. Fix the syntax."
            ) from None
        where = f"DeepSpeed config file '{path}'"
    elif isinstance(source, str):
        try:
            data = _decode(base64.urlsafe_b64decode(source).decode("utf-8"), reject_duplicates=False)
        except (ValueError, UnicodeDecodeError):
            raise UserError(
                f"DeepSpeed config {source[:80]!r} is neither an existing file nor base64-encoded JSON. Pass the path "
                "of a ds_config.json, a dict, or the config as base64 JSON."
            ) from None
        where = "base64 DeepSpeed config"
    else:
        raise UserError(
            f"DeepSpeed config must be a dict, a file path or a base64 JSON string, got {type(source).__name__}."
        )
    if not isinstance(data, dict):
        raise UserError(f"{where} must hold a JSON object of keys, got {type(data).__name__}.")
    return data


# --------------------------------------------------------------------------------------------------------------
# "auto" values
# --------------------------------------------------------------------------------------------------------------


def _parent(tree: dict, path: str) -> tuple[dict | None, str]:
    *parents, leaf = path.split(".")
    node: Any = tree
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), leaf


def _auto_may_stay(path: str) -> bool:
    """'auto' on a key without effect on FSDP2, on the bucket sizes (DeepSpeed's default unit size), or on AutoEP's
    routing keys (where it means the model's own routing), needs no value."""
    top, _, rest = path.partition(".")
    return (
        top in ds_keys.NO_EFFECT_TOP
        or (top == "zero_optimization" and (rest in ds_keys.ZERO_NO_EFFECT or rest in ds_keys.BUCKET_KEYS))
        or (top == "zero_optimization" and rest.startswith("zenflow."))  # DeepSpeed's own "auto"; zenflow is refused
        or (top == "expert_parallel" and ds_keys.EXPERT_PARALLEL_ROUTING.get(rest, "auto") == "auto")
        or path == "data_types.keep_in_fp32_modules"  # DeepSpeed's default, "auto"
    )


def _leftover_autos(tree: Any, prefix: str = "") -> list[str]:
    if not isinstance(tree, dict):
        return []
    found = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if value == "auto" and not _auto_may_stay(path):
            found.append(path)
        found.extend(_leftover_autos(value, path + "."))
    return found


def _warmup_steps(training: TrainingConfig) -> int:
    """Warmup steps of our schedule (glm45v_fsdp.optim.lr_at rounds the ratio half up), at least 1 as HF fills."""
    return max(1, math.floor(training.lr_warmup_ratio * training.train_iters + 0.5))


def resolve_auto(ds: dict, base: Config | None, dp_world_size: int) -> tuple[dict, list[str]]:
    """Fill "auto" values from `base` as transformers' HfTrainerDeepSpeedConfig does; returns (copy, what was filled).

    An "auto" nothing can fill is a UserError naming the key; "auto" on keys without effect on FSDP2 stays.
    """
    ds = copy.deepcopy(ds)
    filled: list[str] = []
    t = base.training if base is not None else None

    def from_base(get: Any) -> Any:
        return None if t is None else get(t)

    def batch_total() -> int | None:
        micro = ds.get(MICRO_BATCH) if is_number(ds.get(MICRO_BATCH)) else from_base(lambda t: t.micro_batch_size)
        accum = (
            ds.get(ACCUMULATION)
            if is_number(ds.get(ACCUMULATION))
            else from_base(lambda t: t.gradient_accumulation_steps)
        )
        return None if micro is None or accum is None else micro * accum * dp_world_size

    def optimizer_lr() -> float | None:
        node, _ = _parent(ds, "optimizer.params.lr")
        lr = node.get("lr") if node else None
        return lr if is_number(lr) else from_base(lambda t: t.lr)

    bf16 = None if base is None else base.parallel.fsdp_plan.param_dtype == "bf16"
    fillers: list[tuple[str, str, Any]] = [
        (MICRO_BATCH, "training.micro_batch_size", lambda: from_base(lambda t: t.micro_batch_size)),
        (
            ACCUMULATION,
            "training.gradient_accumulation_steps",
            lambda: from_base(lambda t: t.gradient_accumulation_steps),
        ),
        (TRAIN_BATCH, f"micro x accumulation x data-parallel size {dp_world_size}", batch_total),
        ("gradient_clipping", "training.clip_grad", lambda: from_base(lambda t: t.clip_grad)),
        ("optimizer.params.lr", "training.lr", lambda: from_base(lambda t: t.lr)),
        ("optimizer.params.betas", "training.adam_beta1/2", lambda: from_base(lambda t: [t.adam_beta1, t.adam_beta2])),
        ("optimizer.params.eps", "training.adam_eps", lambda: from_base(lambda t: t.adam_eps)),
        ("optimizer.params.weight_decay", "training.weight_decay", lambda: from_base(lambda t: t.weight_decay)),
        ("scheduler.params.warmup_min_lr", "0, as the HF Trainer fills it", lambda: 0),
        ("scheduler.params.warmup_max_lr", "the optimizer's lr", optimizer_lr),
        (
            "scheduler.params.warmup_num_steps",
            "training.lr_warmup_ratio x train_iters",
            lambda: from_base(_warmup_steps),
        ),
        ("scheduler.params.total_num_steps", "training.train_iters", lambda: from_base(lambda t: t.train_iters)),
        (
            "scheduler.params.cos_min_ratio",
            "training.min_lr / lr",
            lambda: from_base(lambda t: t.min_lr / t.lr if t.lr else 0.0),
        ),
        ("bf16.enabled", "parallel.fsdp_plan.param_dtype", lambda: bf16),
        ("bfloat16.enabled", "parallel.fsdp_plan.param_dtype", lambda: bf16),
        (
            "fp16.enabled",
            "parallel.fsdp_plan.param_dtype",
            lambda: None if base is None else base.parallel.fsdp_plan.param_dtype == "fp16",
        ),
    ]
    for path, source, compute in fillers:
        node, leaf = _parent(ds, path)
        if node is None or node.get(leaf) != "auto":
            continue
        value = compute()
        if value is None:
            raise key_error(
                path,
                "auto",
                f"has nothing to fill it: no base config was given (it would come from {source})",
                "Pass base= (CLI: --config our.yaml) or write a value.",
            )
        node[leaf] = value
        filled.append(f"{path}: auto -> {format_value(value)} ({source})")
    leftover = _leftover_autos(ds)
    misspelled = sections.misspelled_top_level(ds)
    if leftover and leftover[0] in misspelled:
        raise key_error(
            leftover[0],
            "auto",
            f"is not a DeepSpeed key: did you mean '{misspelled[leftover[0]]}'? DeepSpeed ignores it, so nothing "
            "fills its 'auto'",
            f"Rename it to '{misspelled[leftover[0]]}'.",
        )
    if leftover:
        raise key_error(
            leftover[0],
            "auto",
            "is not a value the HF Trainer integration (or this translation) fills",
            "Write a value.",
        )
    return ds, filled


# --------------------------------------------------------------------------------------------------------------
# Batch arithmetic
# --------------------------------------------------------------------------------------------------------------


@dataclass
class BatchTriple:
    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int


def _batch_key(ds: dict, key: str) -> int | None:
    value = ds.get(key)
    if value is None:
        return None
    if value == "auto":
        raise key_error(key, value, "is unresolved", "Fill 'auto' values first (translate / resolve_auto with a base).")
    value = as_int(key, value)
    if value <= 0:
        raise key_error(key, value, "is not positive, which DeepSpeed requires", "Write an integer >= 1.")
    return value


def resolve_batch(ds: dict, dp_world_size: int) -> BatchTriple:
    """DeepSpeed's derivation of the missing batch keys from the given ones, and its checks, as UserErrors.

    Global batch = micro batch x accumulation x data-parallel size; a missing key is derived with floor division,
    a missing accumulation (or two missing keys) defaults to 1, and the product must come out exact.
    """
    if isinstance(dp_world_size, bool) or not isinstance(dp_world_size, int) or dp_world_size < 1:
        raise UserError(f"The data-parallel world size must be an integer >= 1, got {dp_world_size!r}.")
    dp = dp_world_size
    train, micro, accum = (_batch_key(ds, key) for key in (TRAIN_BATCH, MICRO_BATCH, ACCUMULATION))
    derived = ""
    if train is not None and micro is not None and accum is None:
        accum, derived = train // micro // dp, ACCUMULATION
    elif train is not None and micro is None:
        accum = 1 if accum is None else accum
        micro, derived = train // dp // accum, MICRO_BATCH
    elif micro is not None and train is None:
        accum = 1 if accum is None else accum
        train, derived = micro * accum * dp, TRAIN_BATCH
    elif train is None:
        raise ConfigError(
            f"DeepSpeed config sets neither '{TRAIN_BATCH}' nor '{MICRO_BATCH}', and DeepSpeed needs at least one."
            f"{sections.typo_hint(ds, (TRAIN_BATCH, MICRO_BATCH))} Add {MICRO_BATCH} (samples per rank per micro "
            f"step) or {TRAIN_BATCH} (the global batch)."
        )
    if micro * accum * dp != train:
        how = (
            f" ({derived} = {micro if derived == MICRO_BATCH else accum} derived by floor division)" if derived else ""
        )
        typos = sections.typo_hint(ds, (TRAIN_BATCH, MICRO_BATCH, ACCUMULATION))
        raise key_error(
            TRAIN_BATCH,
            train,
            f"does not equal {MICRO_BATCH} x {ACCUMULATION} x data-parallel size = {micro} x {accum} x {dp} = "
            f"{micro * accum * dp}, as DeepSpeed requires{how}",
            f"{typos.lstrip()}{' ' if typos else ''}Choose values with {TRAIN_BATCH} = {MICRO_BATCH} x "
            f"{ACCUMULATION} x {dp} exactly, or give fewer of the three keys and let the rest be derived.",
        )
    return BatchTriple(train, micro, accum)


# --------------------------------------------------------------------------------------------------------------
# Translation
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Translation:
    """A ds_config mapped onto the engine: set `fields` on our config, build `optimizer`, drive `scheduler`."""

    batch: BatchTriple
    fields: dict[str, Any]  # our config key path -> typed value, in the order the sections set them
    optimizer: OptimizerSpec
    scheduler: SchedulerSpec | None
    zero_stage: int
    precision: str
    clip: float
    no_effect: list[str]
    notes: list[str]
    auto_filled: list[str] = field(default_factory=list)
    trainer_notes: set[str] = field(default_factory=set)  # the notes that concern only our trainer's door
    misspelled: list[str] = field(default_factory=list)  # warnings: top-level keys close to a DeepSpeed key
    # The ds_config with "auto" values filled (what DeepSpeed itself would be given).
    ds_config: dict = field(default_factory=dict)
    world_size: int = 1
    dp_world_size: int = 1
    steps_per_print: float = sections.DEFAULT_STEPS_PER_PRINT  # a positive int, or math.inf (never)

    ring_attention_size: int = 1  # the extension section's, which also takes ranks from data parallelism
    expert_parallel: AutoEP = field(default_factory=AutoEP)  # the expert_parallel section as the engine needs it
    extension: dict[str, Any] = field(default_factory=dict)  # the extension section's keys (key path -> value)
    keys: list[KeyAnswer] = field(default_factory=list)  # every key of the ds_config and what became of it

    @property
    def sequence_parallel_size(self) -> int:
        return self.world_size // (self.dp_world_size * self.ring_attention_size)

    @property
    def overrides(self) -> list[str]:
        """`fields` as `key.path=value` lines, for people (explain, logs, --json); nothing parses them back."""
        return render_fields(self.fields)

    def apply(self, base: Config, extra: Mapping[str, Any] | None = None) -> Config:
        """`base` with `fields` (then `extra`, key path -> typed value) set, validated (layout included) for this
        world size."""
        config = config_from_dict(set_fields(set_fields(to_dict(base), self.fields), extra or {}))
        validate_layout(config.parallel, self.world_size)
        return config

    def to_json(self) -> dict:
        scheduler = None
        if self.scheduler is not None:
            scheduler = {
                "type": self.scheduler.type,
                "params": self.scheduler.params,
                "base_lr": self.scheduler.base_lr,
                "lr_at": {str(step): self.scheduler.lr_at(step) for step in preview_steps(self.scheduler)},
            }
        return {
            "world_size": self.world_size,
            "dp_world_size": self.dp_world_size,
            "batch": {  # DeepSpeed's own names
                TRAIN_BATCH: self.batch.train_batch_size,
                MICRO_BATCH: self.batch.micro_batch_size,
                ACCUMULATION: self.batch.gradient_accumulation_steps,
            },
            "zero_stage": self.zero_stage,
            "precision": self.precision,
            "clip": self.clip,
            "steps_per_print": self.steps_per_print,
            "optimizer": dataclasses.asdict(self.optimizer),
            "scheduler": scheduler,
            "overrides": self.overrides,
            "auto_filled": self.auto_filled,
            "no_effect": self.no_effect,
            "notes": self.notes,
            "misspelled": self.misspelled,
            "keys": [dataclasses.asdict(row) for row in self.keys],
            "ds_config": self.ds_config,
        }


def preview_steps(scheduler: SchedulerSpec) -> list[int]:
    """Steps worth showing: the start and the schedule's landmarks (torch schedules: a few early steps)."""
    steps = {0, 1}
    for key in ("warmup_num_steps", "total_num_steps", "cycle_first_step_size", "lr_range_test_step_size"):
        value = scheduler.params.get(key)
        if is_number(value) and value > 0:
            steps.add(int(value))
    return sorted(steps) if len(steps) > 2 else [0, 1, 10, 100]


def translate(
    source: dict | str | os.PathLike,
    world_size: int,
    base: Config | None = None,
    alst_sequence_parallel: int | None = None,
) -> Translation:
    """Map a ds_config onto the engine for `world_size` ranks; `base` fills "auto" values (our config's);
    `alst_sequence_parallel`: the sequence-parallel size of DeepSpeed's ALST mpu (ds_compat.alst), if one is given."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise UserError(f"The world size must be an integer >= 1, got {world_size!r}.")
    raw = load_ds_config(source)
    report = Report()
    sections.check_top_level(raw, report)
    sp = sections.sequence_parallel(raw, world_size, report, alst_sequence_parallel)
    extension = read_extension(raw)
    ring = extension.ring_attention_size(world_size, sp, alst=alst_sequence_parallel is not None)
    dp = world_size // (sp * ring)
    ds, filled = resolve_auto(raw, base, dp)
    batch = resolve_batch(ds, dp)
    if sp > 1:
        report.override("parallel.ulysses_parallel_size", sp, source="sequence_parallel_size")
        report.note(
            f"sequence_parallel_size {sp}: Ulysses context parallelism over {sp} ranks (each sequence split {sp} "
            f"ways, all-to-all around attention); {dp} data-parallel rank(s) see different data."
        )
    report.override("training.micro_batch_size", batch.micro_batch_size, source=MICRO_BATCH)
    report.override("training.gradient_accumulation_steps", batch.gradient_accumulation_steps, source=ACCUMULATION)
    if TRAIN_BATCH in ds:
        report.take(TRAIN_BATCH, f"{batch.train_batch_size} = micro x accumulation x data-parallel size, as checked")
    stage = sections.map_zero(ds, dp, report)
    precision = sections.map_precision(ds, stage, report)
    clip = sections.map_clipping(ds, report)
    optimizer = optimizer_spec(ds.get("optimizer"), base.training if base else TrainingConfig(), report)
    scheduler = scheduler_spec(ds.get("scheduler"), optimizer, report)
    if scheduler is None:
        report.note(
            "no scheduler: DeepSpeed keeps the optimizer's lr constant unless the script passes one; the trainer keeps "
            "its own training.lr_scheduler at the ds_config's lr, as the HF Trainer integration does.",
            door="trainer",
        )
    else:
        report.note(
            f"scheduler {scheduler.type}: the trainer sets the lr after each optimizer step from the ds_config's "
            "schedule (Translation.scheduler.lr_at); training.lr_scheduler and lr_warmup_ratio are not used, and a "
            "skipped step does not advance it.",
            door="trainer",
        )
    steps_per_print = sections.map_logging(ds, report)
    sections.map_activation_checkpointing(ds, report)
    expert_parallel = sections.map_expert_parallel(ds, world_size, dp, stage, report)
    autoep_env.check(os.environ, expert_parallel.size, report)
    sections.map_unsupported_features(ds, report)
    extension_keys = map_extension(extension, report)
    return Translation(
        batch=batch,
        fields=report.fields,
        optimizer=optimizer,
        scheduler=scheduler,
        zero_stage=stage,
        precision=precision,
        clip=clip,
        no_effect=report.no_effect,
        notes=report.notes,
        auto_filled=filled,
        trainer_notes=report.trainer_notes,
        misspelled=report.misspelled,
        ds_config=ds,
        world_size=world_size,
        dp_world_size=dp,
        ring_attention_size=ring,
        steps_per_print=steps_per_print,
        expert_parallel=expert_parallel,
        extension=extension_keys,
        keys=answer_keys(ds, report.answers),
    )


# --------------------------------------------------------------------------------------------------------------
# explain
# --------------------------------------------------------------------------------------------------------------


def explain_text(translation: Translation, source: str) -> str:
    t = translation
    b = t.batch
    layout = {
        0: "replicated (DDP-style)",
        1: "sharded, no reshard after forward",
        2: "sharded, no reshard after forward",
    }
    lines = [
        f"DeepSpeed config: {source if len(source) <= 100 else f'base64 string ({len(source)} characters)'}",
        f"World size {t.world_size}, data-parallel size {t.dp_world_size}",
        f"Batch: train_batch_size {b.train_batch_size} = micro {b.micro_batch_size} x accumulation "
        f"{b.gradient_accumulation_steps} x data-parallel {t.dp_world_size}",
        f"ZeRO stage {t.zero_stage} -> FSDP2 {layout.get(t.zero_stage, 'sharded, reshard after forward')}",
        f"Precision: {t.precision}; gradient clipping: {t.clip or 'off'}",
        f"Optimizer: {t.optimizer.describe()}"
        + (f"  [DeepSpeed type {t.optimizer.ds_type!r}]" if t.optimizer.ds_type else "  [from our config]"),
    ]
    if t.scheduler is None:
        lines.append("Scheduler: none in the DeepSpeed config")
    else:
        s = t.scheduler
        lines.append(f"Scheduler: {s.type}({', '.join(f'{k}={v!r}' for k, v in s.params.items())})")
        lines.append("  lr after N optimizer steps: " + ", ".join(f"{n}: {s.lr_at(n):.6g}" for n in preview_steps(s)))
    for title, items in (
        ("WARNING: misspelled keys (no effect)", t.misspelled),
        ('"auto" values filled', t.auto_filled),
        ("Overrides (key.path=value)", t.overrides),
        ("No effect on the FSDP2 backend", t.no_effect),
        ("Differences from DeepSpeed and warnings", t.notes),
        ("Every key (taken, mapped, no effect; refused keys stop the translation)", [row.line() for row in t.keys]),
    ):
        if items:
            lines.append(f"{title}:")
            lines.extend(f"  - {item}" for item in items)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_compat.config", description="DeepSpeed config translation.")
    commands = parser.add_subparsers(dest="command", required=True)
    explain = commands.add_parser("explain", help="show how a ds_config maps onto the FSDP2 engine")
    explain.add_argument("ds_config", help="ds_config.json (JSON or hjson) or base64 JSON")
    explain.add_argument("--world-size", type=int, required=True, help="number of ranks the job runs on")
    explain.add_argument(
        "--config",
        help='our YAML config (a path or a shipped config name) whose values fill "auto"; default: the one the trainer '
        "runs without --config, configs/glm45v_tiny.yaml",
    )
    explain.add_argument("--json", action="store_true", help="print the translation as JSON")
    args = parser.parse_args(argv)
    try:
        translation = translate(args.ds_config, args.world_size, load_config(args.config))
    except UserError as error:
        print(f"ds_compat.config: error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(json.dumps(translation.to_json(), indent=2) if args.json else explain_text(translation, args.ds_config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
