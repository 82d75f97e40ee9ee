"""Every key of DeepSpeed's ds_config schema (ds_compat/ds_schema.json, generated from DeepSpeed 0.19.3 - 0.19.8's
source) is answered by the translation: taken, mapped or of no effect (a row of Translation.keys), or refused with a
ConfigError naming the key (or the section that holds it). Never unanswered. The generator reproduces the table's
0.19.8 column from the installed DeepSpeed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from ds_compat._common import MAPPED, NO_EFFECT, TAKEN
from ds_compat.config import explain_text, translate
from ds_compat.key_table import UNANSWERED, answer_keys
from ds_compat.schema_table import SCHEMA_PATH, SECTION_MODELS, Source, directory_reader, extract
from glm45v_fsdp.errors import ConfigError

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402  (the installed DeepSpeed: the reference for the 0.19.8 column)

TABLE = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
REPORTED = "0.19.8"  # the version ds_compat reports (deepspeed.__version__ under ds-fsdp)
BATCH = {"train_micro_batch_size_per_gpu": 1}
ANSWERS = (TAKEN, MAPPED, NO_EFFECT)
SECTIONS = {path.rpartition(".")[0] for path in TABLE["keys"] if "." in path}

# Values for keys whose DeepSpeed default is not a literal (or is required).
SAMPLES: dict[str, Any] = {
    "checkpoint.tag_validation": "Warn",
    "checkpoint.writer.type": "fast",
    "tensor_parallel.dtype": "fp16",
    "zero_optimization.leaf_module": {},
    "zero_optimization.leaf_module.classes": [],
    "zero_optimization.leaf_module.names": [],
    "zero_optimization.leaf_module.name_suffixes": [],
    "zero_optimization.model_persistence_threshold": 10**9,
    "zero_optimization.stage3_model_persistence_threshold": 10**9,
}
# Keys refused even at DeepSpeed's default: a section whose presence turns its feature on (ZenFlow, weight
# quantization), besides the removed features DeepSpeed 0.19.8 rejects (TABLE["rejected"]).
REFUSED_AT_DEFAULT = {"zero_optimization.zenflow", "weight_quantization"}

# The keys users send from DeepSpeed 0.19.3 - 0.20 at non-default values (issue 55): (extra config, key, answer).
NON_DEFAULT: list[tuple[dict, str, str]] = [
    (
        {"zero_optimization": {"offload_optimizer": {"device": "none"}}},
        "zero_optimization.offload_optimizer.device",
        TAKEN,
    ),
    (
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
        "zero_optimization.offload_optimizer.device",
        MAPPED,
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
        "zero_optimization.offload_param.device",
        MAPPED,
    ),
    ({"zero_optimization": {"zero_quantized_weights": True}}, "zero_optimization.zero_quantized_weights", "refused"),
    (
        {"zero_optimization": {"zero_quantized_gradients": True}},
        "zero_optimization.zero_quantized_gradients",
        "refused",
    ),
    ({"zero_optimization": {"zero_quantized_weights": False}}, "zero_optimization.zero_quantized_weights", TAKEN),
    ({"zero_optimization": {"zero_hpz_partition_size": 8}}, "zero_optimization.zero_hpz_partition_size", "refused"),
    ({"zero_optimization": {"zero_hpz_partition_size": 1}}, "zero_optimization.zero_hpz_partition_size", TAKEN),
    (
        {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
        "bf16.bf16_master_weights_and_grads",
        MAPPED,
    ),
    ({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, "torch_autocast.enabled", MAPPED),
    ({"torch_autocast": {"enabled": True, "dtype": "float16"}}, "torch_autocast.dtype", "refused"),
    ({"compile": {"deepcompile": True}}, "compile.deepcompile", "refused"),
    ({"compile": {"deepcompile": False, "offload_activation": True}}, "compile.offload_activation", NO_EFFECT),
    ({"checkpoint": {"load_universal": True}}, "checkpoint.load_universal", "refused"),
    ({"checkpoint": {"load_universal": False}}, "checkpoint.load_universal", NO_EFFECT),
    ({"optimizer": {"type": "Muon", "params": {"lr": 0.02}}}, "optimizer.type", "refused"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}, "optimizer.params.lr", MAPPED),
    ({"zero_optimization": {"stage": 3, "zenflow": {"topk_ratio": 0.1}}}, "zero_optimization.zenflow", "refused"),
    (
        {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": True}}},
        "zero_optimization.offload_optimizer.super_offload",
        "refused",
    ),
    ({"gradient_clipping": 0.5}, "gradient_clipping", MAPPED),
    ({"fp16": {"enabled": True, "loss_scale": 0, "hysteresis": 4}}, "fp16.hysteresis", MAPPED),
    ({"tensorboard": {"enabled": True, "job_name": "x"}}, "tensorboard.job_name", NO_EFFECT),
    ({"csv_monitor": {"enabled": True, "output_path": "x"}}, "csv_monitor.enabled", MAPPED),
    ({"steps_per_print": 10}, "steps_per_print", TAKEN),
    ({"datastates_ckpt": {"enabled": True}}, "datastates_ckpt", NO_EFFECT),
    ({"datastates": {}}, "datastates", "not a DeepSpeed key"),
    ({"activation_checkpointing": {"cpu_checkpointing": True}}, "activation_checkpointing.cpu_checkpointing", MAPPED),
]


def _default(entry: dict) -> Any:
    if "default" in entry:
        return entry["default"]
    by_version = entry["default_by_version"]
    return by_version.get(REPORTED, list(by_version.values())[-1])


def _nested(path: str, value: Any) -> dict:
    *parents, leaf = path.split(".")
    tree: dict = {leaf: value}
    for parent in reversed(parents):
        tree = {parent: tree}
    return tree


def _value(path: str) -> Any:
    if path in SAMPLES:
        return SAMPLES[path]
    value = _default(TABLE["keys"][path])
    if path in SECTIONS and value in (None, {}):
        return {}
    return value


def answer(extra: dict, path: str, switch: str = "") -> str:
    """What the translation made of `path` in BATCH + `extra`: a row's kind, or 'refused' (a ConfigError naming the
    key, a section holding it, or `switch`: the switch that turns the section on), or what went wrong."""
    base = BATCH if path.split(".")[0] not in BATCH else {"train_batch_size": 1}
    try:
        translation = translate({**base, **extra}, 1)
    except ConfigError as error:
        parts = path.split(".")
        names = [".".join(parts[:end]) for end in range(1, len(parts) + 1)] + [switch] * bool(switch)
        named = any(f"key '{name}'" in str(error) for name in names)
        return "refused" if named else f"refused naming another key: {error}"
    rows = {row.path: row for row in translation.keys}
    return rows[path].kind if path in rows else "no row"


def _rejected(path: str) -> bool:
    parts = path.split(".")
    return any(".".join(parts[:end]) in TABLE["rejected"] for end in range(1, len(parts) + 1))


def test_the_table_covers_deepspeed_0_19_3_to_the_reported_version():
    assert TABLE["versions"][0] == "0.19.3" and TABLE["versions"][-1] == REPORTED == deepspeed.__version__
    assert len(TABLE["keys"]) > 300
    needed = [p for p in TABLE["keys"] if isinstance(_value(p), str) and _value(p).startswith(("expr:", "required"))]
    assert needed == [], f"give these keys a value in SAMPLES: {needed}"


def test_every_schema_key_is_taken_mapped_or_refused_at_its_default():
    wrong = []
    for path in TABLE["keys"]:
        got = answer(_nested(path, _value(path)), path)
        refused_ok = _rejected(path) or any(path == k or path.startswith(k + ".") for k in REFUSED_AT_DEFAULT)
        if not (got in ANSWERS or (got == "refused" and refused_ok)):
            wrong.append(f"{path} = {_value(path)!r}: {got}")
    assert wrong == []


def test_every_boolean_key_is_answered_the_other_way_too():
    """true where DeepSpeed's default is false and back: taken, mapped, no effect, or refused naming the key."""
    wrong = []
    for path in TABLE["keys"]:
        if isinstance(_value(path), bool):
            got = answer(_nested(path, not _value(path)), path)
            if got not in (*ANSWERS, "refused"):
                wrong.append(f"{path} = {not _value(path)!r}: {got}")
    assert wrong == []


def test_every_key_of_a_section_is_answered_with_the_section_on():
    """Each key beside `enabled: true` (fp16's loss scaling, tensorboard's paths, AutoEP's patterns, ...)."""
    wrong = []
    for section in sorted(path.rpartition(".")[0] for path in TABLE["keys"] if path.endswith(".enabled")):
        depth = section.count(".") + 1
        for path in TABLE["keys"]:
            leaf = path.rpartition(".")[2]
            if path.startswith(section + ".") and path.count(".") == depth and leaf != "enabled":
                got = answer(_nested(section, {"enabled": True, leaf: _value(path)}), path, f"{section}.enabled")
                if got not in (*ANSWERS, "refused"):
                    wrong.append(f"{path} = {_value(path)!r} with {section}.enabled: {got}")
    assert wrong == []


@pytest.mark.parametrize(("extra", "path", "expected"), NON_DEFAULT, ids=[case[1] for case in NON_DEFAULT])
def test_the_newer_keys_at_other_values(extra, path, expected):
    assert answer(extra, path) == expected


def test_every_optimizer_deepspeed_knows_is_mapped_or_refused():
    for name in TABLE["optimizers"]:
        assert answer({"optimizer": {"type": name, "params": {}}}, "optimizer.type") in (MAPPED, "refused"), name


def test_keys_deepspeed_rejects_are_refused():
    for path, versions in TABLE["rejected"].items():
        assert answer(_nested(path, {}), path) == "refused", (path, versions)


def test_a_key_nobody_answers_shows_as_unanswered():
    rows = answer_keys({"stage": 1, "section": {"key": 2}, "empty": {}}, {"stage": (TAKEN, "")})
    assert [(row.path, row.kind) for row in rows] == [
        ("stage", TAKEN),
        ("section", "section"),
        ("section.key", UNANSWERED),
        ("empty", TAKEN),
    ]


def test_explain_prints_every_key_and_what_became_of_it():
    ds = {
        **BATCH,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3, "overlap_comm": True, "zero_hpz_partition_size": 1},
        "bf16": {"enabled": True},
        "unknown_key": 1,
    }
    text = explain_text(translate(ds, 2), "ds.json")
    table = text.split("Every key")[1]
    for row in (
        "gradient_clipping = 1.0: mapped (training.clip_grad=1.0)",
        "zero_optimization.stage = 3: mapped (parallel.data_parallel_replicate_size=1, "
        "parallel.fsdp_plan.reshard_after_forward=true)",
        "zero_optimization.overlap_comm = True: no effect",
        "zero_optimization.zero_hpz_partition_size = 1: taken",
        "bf16.enabled = True: mapped (precision bf16",
        "unknown_key = 1: not a DeepSpeed key",
        "train_micro_batch_size_per_gpu = 1: mapped (training.micro_batch_size=1)",
    ):
        assert row in table, row


def test_the_generator_reproduces_the_reported_versions_column():
    found = extract(Source(directory_reader(Path(deepspeed.__file__).parent)))
    column = {
        path: entry.get("default", entry.get("default_by_version", {}).get(REPORTED))
        for path, entry in TABLE["keys"].items()
        if entry["versions"] == "all" or REPORTED in entry["versions"]
    }
    assert found["keys"] == column
    assert found["optimizers"] == [n for n, v in TABLE["optimizers"].items() if v == "all" or REPORTED in v]
    assert found["rejected"] == [p for p, v in TABLE["rejected"].items() if v == "all" or REPORTED in v]


def test_the_parsed_sections_hold_every_field_of_deepspeeds_models():
    """The ast reading against the imported models: every field name and alias of each section's model."""
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.compile.config import CompileConfig
    from deepspeed.inference.config import WeightQuantConfig
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.config import HybridEngineConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.utils.config import DeepSpeedThroughputTimerConfig

    models = {
        model.__name__: model
        for model in (
            CommsLoggerConfig,
            CompileConfig,
            WeightQuantConfig,
            CometConfig,
            CSVConfig,
            TensorBoardConfig,
            WandbConfig,
            HybridEngineConfig,
            DeepSpeedBF16Config,
            DeepSpeedFP16Config,
            TPTrainingConfig,
            DeepSpeedZeroConfig,
            DeepSpeedThroughputTimerConfig,
        )
    }
    for section, name in SECTION_MODELS.items():
        if name not in models:
            continue
        fields = models[name].model_fields
        spellings = set(fields) | {f.alias for f in fields.values() if f.alias}
        listed = {p.split(".")[len(section.split("."))] for p in TABLE["keys"] if p.startswith(section + ".")}
        assert spellings <= listed, (section, spellings - listed)
