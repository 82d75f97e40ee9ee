"""`deepspeed.runtime.config`, `deepspeed.runtime.zero.config` / `offload_config`, `deepspeed.runtime.precision_config`
and `deepspeed.runtime.fp16.loss_scaler` under ds-fsdp (and every module path issue 33 names, imported through the
alias finder) against the real DeepSpeed (issue 33): the same calls on both,
results and raised error classes compared. The batch-arithmetic corpus is tests/test_ds_config.py's TABLE at world
sizes 1, 2, 4, 8; the section models are compared field by field and on a corpus of good and bad sections; the loss
scalers on random overflow sequences."""

from __future__ import annotations

import base64
import copy
import importlib
import json
import logging
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

os.environ.setdefault("DS_ACCELERATOR", "cpu")
from deepspeed import comm as ds_comm  # noqa: E402
from deepspeed.runtime import config as ds_config  # noqa: E402
from deepspeed.runtime import precision_config as ds_precision  # noqa: E402
from deepspeed.runtime.fp16 import loss_scaler as ds_scaler  # noqa: E402
from deepspeed.runtime.zero import config as ds_zero  # noqa: E402
from deepspeed.runtime.zero import offload_config as ds_offload  # noqa: E402
from test_ds_config import HF_ZERO2, HF_ZERO3, MEGATRON_STYLE, TABLE, WORLD_SIZES  # noqa: E402

from ds_compat import comm as our_comm  # noqa: E402
from ds_compat import ds_keys  # noqa: E402
from ds_compat.alias import SHIM_DIR  # noqa: E402
from ds_compat.config import resolve_auto  # noqa: E402
from ds_compat.runtime import config as our_config  # noqa: E402
from ds_compat.runtime import precision_config as our_precision  # noqa: E402
from ds_compat.runtime.fp16 import loss_scaler as our_scaler  # noqa: E402
from ds_compat.zero import config as our_zero  # noqa: E402
from ds_compat.zero import offload_config as our_offload  # noqa: E402
from glm45v_fsdp.errors import ConfigError, TrainingStopped  # noqa: E402

logging.getLogger("DeepSpeed").setLevel(logging.ERROR)


def outcome(call):
    """The call's result, or the class of what it raised."""
    try:
        return call()
    except Exception as error:  # noqa: BLE001 - the class is what is compared
        return error


def same_outcome(ours, theirs) -> None:
    """Equal results, or errors of the same class (DeepSpeedConfigError: the class under the same module path)."""
    if isinstance(theirs, Exception):
        expected = (
            our_config.DeepSpeedConfigError if isinstance(theirs, ds_config.DeepSpeedConfigError) else type(theirs)
        )
        assert isinstance(ours, expected), (ours, theirs)
    else:
        assert not isinstance(ours, Exception), (ours, theirs)
        assert ours == theirs


@pytest.fixture
def world(monkeypatch):
    """Fake a process group of `n` ranks for both DeepSpeedConfigs (they only ask for the rank and the size)."""

    def set_world(n: int) -> None:
        monkeypatch.setattr(ds_comm, "get_rank", lambda group=None: 0)
        monkeypatch.setattr(ds_comm, "get_world_size", lambda group=None: n)
        monkeypatch.setattr(our_comm, "is_initialized", lambda: True)
        monkeypatch.setattr(our_comm, "get_rank", lambda group=None: 0)
        monkeypatch.setattr(our_comm, "get_world_size", lambda group=None: n)

    return set_world


def triple(config) -> tuple:
    return (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps)


# --------------------------------------------------------------------------------------------------------------
# deepspeed.runtime.config
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name, config, base", TABLE, ids=[row[0] for row in TABLE])
def test_batch_corpus_through_deepspeed_config(name, config, base, world_size, world):
    world(world_size)
    sp = config.get("sequence_parallel_size") or 1
    resolved, _ = resolve_auto(config, base, max(1, world_size // sp))
    theirs = outcome(lambda: triple(ds_config.DeepSpeedConfig(copy.deepcopy(resolved))))
    ours = outcome(lambda: triple(our_config.DeepSpeedConfig(copy.deepcopy(resolved))))
    if world_size % sp:
        # DeepSpeed divides into a fractional data-parallel size (e.g. 0.5) and goes on (or fails on it); we refuse.
        their_world = outcome(lambda: ds_config.DeepSpeedConfig(copy.deepcopy(resolved)).world_size)
        assert isinstance(their_world, Exception) or their_world != int(their_world)
        assert isinstance(ours, our_config.DeepSpeedConfigError) and "sequence_parallel_size" in str(ours)
        return
    same_outcome(ours, theirs)
    if isinstance(ours, AssertionError):
        assert isinstance(ours, ConfigError) and "DeepSpeed" in str(ours)  # a clear error, not a bare assert


def test_the_corpus_holds_accepted_and_rejected_triples(world):
    world(4)
    outcomes = [outcome(lambda c=c, b=b: our_config.DeepSpeedConfig(resolve_auto(c, b, 4)[0])) for _, c, b in TABLE]
    rejected = sum(isinstance(o, AssertionError) for o in outcomes)
    assert rejected >= 8 and len(outcomes) - rejected >= 20


SECTION_MODELS = ("zero_config", "float16_config", "bfloat16_config")  # compared by their dumps
CONFIGS = {
    "minimal": {"train_batch_size": 8},
    "megatron": MEGATRON_STYLE,
    "hf_zero3": resolve_auto(HF_ZERO3, TABLE[-9][2], 2)[0],
    "hf_zero2": resolve_auto(HF_ZERO2, TABLE[-9][2], 2)[0],
    "fp16_dynamic": {
        "train_micro_batch_size_per_gpu": 1,
        "fp16": {"enabled": True, "loss_scale_window": 50, "hysteresis": 3, "min_loss_scale": 4},
        "optimizer": {"type": "ADAM", "params": {"lr": 1e-3}},
        "gradient_clipping": 0.3,
        "steps_per_print": 7,
        "communication_data_type": "fp32",
    },
    "checkpoint_data_types_autocast": {
        "train_batch_size": 8,
        "checkpoint": {"tag_validation": "fail", "load_universal": True, "parallel_write": {"pipeline_stage": True}},
        "data_types": {"grad_accum_dtype": "fp32", "keep_in_fp32_modules": ["lm_head"]},
        "torch_autocast": {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": ["torch.nn.Linear"]},
        "gradient_allreduce_op": "SUM",
        "pipeline": {"stages": 2},
        "data_efficiency": {"enabled": True},
        "log_level": "info",
        "disable_python_gc": True,
        "managed_gradient_accumulation": False,
        "use_data_before_expert_parallelism": True,
        "seq_parallel_communication_data_type": "bf16",
    },
    "legacy_bf16_custom_optimizer": {
        "train_micro_batch_size_per_gpu": 1,
        "bfloat16": {"enabled": True},
        "optimizer": {"type": "MyOptimizer", "params": {"x": 1}, "legacy_fusion": True},
        "zero_optimization": {"stage": 2, "cpu_offload": True},
        "wall_clock_breakdown": True,
    },
}


@pytest.mark.parametrize("name", CONFIGS)
def test_attributes_scripts_read_equal_deepspeeds(name, world):
    """Every attribute DeepSpeed's DeepSpeedConfig sets, except the documented section objects, with its value."""
    world(2)
    theirs = ds_config.DeepSpeedConfig(copy.deepcopy(CONFIGS[name]))
    ours = our_config.DeepSpeedConfig(copy.deepcopy(CONFIGS[name]))
    attributes = set(vars(theirs)) - our_config.SECTIONS_NOT_PROVIDED - set(SECTION_MODELS) - {"_param_dict"}
    assert len(attributes) >= 40
    for attribute in sorted(attributes):
        assert getattr(ours, attribute) == getattr(theirs, attribute), attribute
    for section in SECTION_MODELS:
        assert getattr(ours, section).model_dump() == getattr(theirs, section).model_dump(), section
    for section in our_config.SECTIONS_NOT_PROVIDED:  # the list in docs/ds_compat.md is exact
        assert hasattr(theirs, section) and not hasattr(ours, section), section
    assert ours._param_dict == CONFIGS[name]  # untouched (DeepSpeed writes data_efficiency defaults into it)


@pytest.mark.parametrize(
    "fp16, bf16, loss_scale, initial_scale, scaler_args",
    [
        (None, None, 0, 2**16, None),
        ({"enabled": True}, None, 0, 2**16, None),
        ({"enabled": True, "loss_scale": 128, "initial_scale_power": 12}, None, 128, 2**12, "given"),
        ({"enabled": True, "hysteresis": 4}, None, 0, 2**16, "given"),
        ({"enabled": False, "hysteresis": 4}, {"enabled": True}, 1.0, 1, None),
    ],
)
def test_pre_018_attributes_answer_as_that_deepspeed(fp16, bf16, loss_scale, initial_scale, scaler_args):
    """DeepSpeed 0.17 read these off the config: the fp16 values when fp16 is on, no scaling under bf16, its fp16
    defaults otherwise, and loss-scaler arguments only when the fp16 section sets one."""
    config = {"train_batch_size": 2, **({"fp16": fp16} if fp16 else {}), **({"bf16": bf16} if bf16 else {})}
    ours = our_config.DeepSpeedConfig(config)
    assert (ours.loss_scale, ours.initial_dynamic_scale) == (loss_scale, initial_scale)
    expected = None if scaler_args is None else ours.float16_config.dynamic_loss_scale_args()
    assert ours.dynamic_loss_scale_args == expected
    assert ours.fp16_auto_cast == (False if ours.fp16_enabled else None)
    assert ours.fp16_enabled == bool(fp16 and fp16["enabled"]) and ours.bfloat16_enabled == bool(bf16)


def test_mpu_and_sequence_parallel_set_the_data_parallel_size(world):
    world(8)

    class DataParallel:
        def get_data_parallel_world_size(self):
            return 2

    class SequenceOnly:
        def get_sequence_parallel_world_size(self):
            return 4

    config = {"train_micro_batch_size_per_gpu": 3}
    for mpu in (DataParallel(), SequenceOnly(), None):
        ours, theirs = our_config.DeepSpeedConfig(dict(config), mpu), ds_config.DeepSpeedConfig(dict(config), mpu)
        assert ours.world_size == theirs.world_size and triple(ours) == triple(theirs)
    sp = {**config, "sequence_parallel_size": 2}
    assert triple(our_config.DeepSpeedConfig(sp)) == triple(ds_config.DeepSpeedConfig(sp)) == (12, 3, 1)


def test_no_process_group_means_one_rank():
    ours, theirs = (
        our_config.DeepSpeedConfig({"train_batch_size": 4}),
        ds_config.DeepSpeedConfig({"train_batch_size": 4}),
    )
    assert (ours.global_rank, ours.world_size, triple(ours)) == (theirs.global_rank, theirs.world_size, triple(theirs))


@pytest.mark.parametrize(
    "extra",
    [
        {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
        {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
        {"bf16": {"enabled": True, "bf16_optimizer_states": True}, "zero_optimization": {"stage": 1}},
        {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
        *({key: {}} for key in ds_keys.REMOVED_TOP_LEVEL),
        *({"zero_optimization": {"stage": 1, key: 1}} for key in ds_keys.REMOVED_ZERO),
        {"zero_optimization": {"stage": 5}},
        {"zero_optimization": {"stage": 2, "bogus": True}},
        {"fp16": {"enabled": True, "loss_scale": -1}},
        {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
        {"checkpoint": {"tag_validation": "sometimes"}},
        {"checkpoint": {"parallel_write": {"pipeline_stage": "yes"}}},
        {"data_types": {"keep_in_fp32_modules": 5}},
        {"gradient_allreduce_op": "max"},
        {"torch_autocast": {"enabled": True, "dtype": "fp8"}},
        {"torch_autocast": {"lower_precision_safe_modules": [1]}},
        {"communication_data_type": "int4"},
    ],
)
def test_config_errors_have_deepspeeds_class(extra, world):
    world(1)
    config = {"train_batch_size": 4, **extra}
    theirs = outcome(lambda: ds_config.DeepSpeedConfig(copy.deepcopy(config)))
    ours = outcome(lambda: our_config.DeepSpeedConfig(copy.deepcopy(config)))
    assert isinstance(theirs, Exception)
    same_outcome(ours, theirs)


def test_file_base64_and_bad_strings(tmp_path):
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    encoded = base64.urlsafe_b64encode(json.dumps(config).encode()).decode()
    for source in (str(path), encoded):
        ours, theirs = our_config.DeepSpeedConfig(source), ds_config.DeepSpeedConfig(source)
        assert triple(ours) == triple(theirs) and ours.zero_optimization_stage == theirs.zero_optimization_stage == 2
    path.write_text('{"train_batch_size": 4, "train_batch_size": 8}')
    for make in (our_config.DeepSpeedConfig, ds_config.DeepSpeedConfig):
        with pytest.raises(ValueError):
            make(str(path))
    for make in (our_config.DeepSpeedConfig, ds_config.DeepSpeedConfig):  # DeepSpeed's is binascii.Error
        with pytest.raises(ValueError):
            make("no-such-file-%%")


def test_translation_tells_what_the_engine_runs():
    translation = our_config.DeepSpeedConfig(copy.deepcopy(MEGATRON_STYLE)).translation(world_size=4)
    assert translation.batch.gradient_accumulation_steps == 8 and translation.zero_stage == 1


def test_config_writer_round_trips(tmp_path):
    for writer_class in (our_config.DeepSpeedConfigWriter, ds_config.DeepSpeedConfigWriter):
        writer = writer_class()
        writer.add_config("train_batch_size", 8)
        writer.write_config(tmp_path / "w.json")
        writer.load_config(str(tmp_path / "w.json"))
        assert writer.data == {"train_batch_size": 8}


# --------------------------------------------------------------------------------------------------------------
# Section models: zero_optimization, offload_param / offload_optimizer, fp16, bf16
# --------------------------------------------------------------------------------------------------------------

MODEL_PAIRS = [
    (our_zero.DeepSpeedZeroConfig, ds_zero.DeepSpeedZeroConfig),
    (our_zero.DeepSpeedZeroLeafModuleConfig, ds_zero.DeepSpeedZeroLeafModuleConfig),
    (our_offload.DeepSpeedZeroOffloadParamConfig, ds_offload.DeepSpeedZeroOffloadParamConfig),
    (our_offload.DeepSpeedZeroOffloadOptimizerConfig, ds_offload.DeepSpeedZeroOffloadOptimizerConfig),
    (our_precision.DeepSpeedFP16Config, ds_precision.DeepSpeedFP16Config),
    (our_precision.DeepSpeedBF16Config, ds_precision.DeepSpeedBF16Config),
]


@pytest.mark.parametrize("ours, theirs", MODEL_PAIRS, ids=[pair[0].__name__ for pair in MODEL_PAIRS])
def test_section_fields_aliases_and_defaults_are_deepspeeds(ours, theirs):
    assert list(ours.model_fields) == list(theirs.model_fields)
    for name, field in ours.model_fields.items():
        other = theirs.model_fields[name]
        assert field.alias == other.alias, name
        assert field.is_required() == other.is_required() is False, name
    assert ours().model_dump() == theirs().model_dump()


def test_zero_model_accepts_exactly_the_translators_key_table():
    fields = our_zero.DeepSpeedZeroConfig.model_fields
    accepted = set(fields) | {field.alias for field in fields.values() if field.alias}
    assert accepted == ds_keys.STRICT_SECTIONS["zero_optimization"]
    assert set(our_offload.DeepSpeedZeroOffloadParamConfig.model_fields) == ds_keys.OFFLOAD_PARAM_KEYS
    assert set(our_offload.DeepSpeedZeroOffloadOptimizerConfig.model_fields) == ds_keys.OFFLOAD_OPTIMIZER_KEYS
    assert set(our_precision.DeepSpeedFP16Config.model_fields) == ds_keys.FP16_KEYS
    assert set(our_precision.DeepSpeedBF16Config.model_fields) == ds_keys.BF16_KEYS


ZERO_SECTIONS = [
    {},
    {"stage": 3},
    {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5e8, "allgather_bucket_size": 2e8},
    {"stage": 3, "stage3_prefetch_bucket_size": 1e6, "stage3_param_persistence_threshold": 1e4},
    {"stage": 3, "prefetch_bucket_size": 123, "stage3_max_live_parameters": 5},
    {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": False}, "offload_optimizer": {"device": "nvme"}},
    {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3, "pipeline_read": True}},
    {"stage": 2, "cpu_offload": True},
    {"stage": 3, "cpu_offload_param": True, "cpu_offload_use_pin_memory": True},
    {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True},
    {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
    {"stage": 1, "compute_grad_norm": False},
    {"stage": "auto", "reduce_bucket_size": "auto"},
    {"stage": 3, "leaf_module": {"classes": "my.Block", "names": ["model.moe"]}},
    {"stage": 3, "sub_group_size": 1e9, "zero_hpz_partition_size": 8},
    # rejected
    {"stage": 4},
    {"stage": "three"},
    {"reduce_bucket_size": 0},
    {"allgather_bucket_size": -1},
    {"stage": 2, "bogus": 1},
    {"offload_param": {"device": "gpu"}},
    {"offload_optimizer": {"device": "cpu", "ratio": 1.5}},
    {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}},
    {"stage": 3, "compute_grad_norm": False},
    {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}},
    {"stage": 3, "leaf_module": 5},
    {"stage": 3, "overlap_comm": "yes please"},
    {"offload_param": {"device": "cpu", "buffer_count": -1}},
]


@pytest.mark.parametrize("section", ZERO_SECTIONS, ids=[str(i) for i in range(len(ZERO_SECTIONS))])
def test_zero_sections_read_and_fail_as_deepspeeds(section):
    param_dict = {"zero_optimization": copy.deepcopy(section)}
    theirs = outcome(lambda: ds_zero.get_zero_config(copy.deepcopy(param_dict)).model_dump())
    ours = outcome(lambda: our_zero.get_zero_config(copy.deepcopy(param_dict)).model_dump())
    same_outcome(ours, theirs)


def test_zero_corpus_holds_both_outcomes():
    """The first 15 sections are accepted, the rest rejected (the deprecated key beside its replacement with
    DeepSpeed's AssertionError, a leaf_module that is no section with its TypeError, the others with
    ValidationError)."""
    results = [outcome(lambda s=s: our_zero.DeepSpeedZeroConfig(**s)) for s in ZERO_SECTIONS]
    assert not any(isinstance(r, Exception) for r in results[:15])
    for section, result in zip(ZERO_SECTIONS[15:], results[15:]):
        special = {"cpu_offload": AssertionError, "leaf_module": TypeError}
        expected = next((error for key, error in special.items() if key in section), ValidationError)
        assert isinstance(result, expected), (section, result)


def test_legacy_boolean_zero_section_and_enums():
    for value in (True, False):
        param_dict = {"zero_optimization": value, "allgather_size": 3e8}
        assert our_zero.get_zero_config(param_dict).model_dump() == ds_zero.get_zero_config(param_dict).model_dump()
    assert [(e.name, e.value) for e in our_zero.ZeroStageEnum] == [(e.name, e.value) for e in ds_zero.ZeroStageEnum]
    assert our_zero.ZeroStageEnum.max_stage == ds_zero.ZeroStageEnum.max_stage == 3
    assert [e.value for e in our_offload.OffloadDeviceEnum] == [e.value for e in ds_offload.OffloadDeviceEnum]
    config = our_zero.DeepSpeedZeroConfig(stage=1, offload_optimizer={"device": "cpu", "pipeline_write": True})
    assert config.offload_optimizer.pipeline is True and config.offload_optimizer.device == "cpu"
    with pytest.raises(ValidationError):
        config.reduce_bucket_size = -5  # assignments are validated, as DeepSpeed's


FP16_SECTIONS = [
    {},
    {"enabled": True},
    {"enabled": True, "loss_scale": 128, "loss_scale_window": 0},  # static: the window is unused
    {"enabled": True, "initial_scale_power": 12, "hysteresis": 4, "consecutive_hysteresis": True},
    {"enabled": "auto", "loss_scale": "auto"},
    {"enabled": True, "loss_scale": -1},
    {"loss_scale": True},
    {"loss_scale": "x"},
    {"loss_scale": float("inf")},
    {"enabled": True, "loss_scale_window": 0},
    {"enabled": True, "min_loss_scale": 0},
    {"min_loss_scale": True},
    {"loss_scale_window": float("nan")},
    {"initial_scale_power": "big"},
    {"enabled": True, "bogus": 1},
]


@pytest.mark.parametrize("section", FP16_SECTIONS, ids=[str(i) for i in range(len(FP16_SECTIONS))])
def test_fp16_sections_read_and_fail_as_deepspeeds(section):
    theirs = outcome(lambda: ds_precision.get_float16_config({"fp16": dict(section)}))
    ours = outcome(lambda: our_precision.get_float16_config({"fp16": dict(section)}))
    if isinstance(theirs, Exception):
        same_outcome(ours, theirs)
        return
    assert ours.model_dump() == theirs.model_dump()
    assert ours.dynamic_loss_scale_args() == theirs.dynamic_loss_scale_args()
    assert ours.initial_dynamic_scale() == theirs.initial_dynamic_scale()


@pytest.mark.parametrize(
    "param_dict",
    [{}, {"bf16": {"enabled": True}}, {"bfloat16": {"enabled": True}}, {"bf16": None, "bfloat16": {"enabled": True}},
     {"bf16": {"enabled": True, "immediate_grad_update": True}}, {"bf16": {"enable": True}}],
)  # fmt: skip
def test_bf16_sections_read_and_fail_as_deepspeeds(param_dict):
    theirs = outcome(lambda: ds_precision.get_bfloat16_config(copy.deepcopy(param_dict)).model_dump())
    ours = outcome(lambda: our_precision.get_bfloat16_config(copy.deepcopy(param_dict)).model_dump())
    same_outcome(ours, theirs)


# --------------------------------------------------------------------------------------------------------------
# deepspeed.runtime.fp16.loss_scaler
# --------------------------------------------------------------------------------------------------------------


def scaler_state(scaler) -> tuple:
    return (scaler.cur_scale, scaler.cur_iter, scaler.last_overflow_iter, scaler.cur_hysteresis, scaler.loss_scale)


@pytest.mark.parametrize("seed", range(12))
def test_dynamic_loss_scaler_update_sequences_equal_deepspeeds(seed, monkeypatch):
    monkeypatch.setattr(ds_comm, "get_rank", lambda group=None: 0)  # DeepSpeed logs from rank 0
    rng = random.Random(seed)
    args = {
        "init_scale": 2 ** rng.randint(2, 16),
        "scale_window": rng.choice([1, 2, 5, 20]),
        "min_scale": rng.choice([1, 0.25, 8]),
        "delayed_shift": rng.choice([1, 2, 3]),
        "consecutive_hysteresis": seed % 2 == 0,
        "raise_error_at_min_scale": seed % 3 != 0,
    }
    theirs, ours = ds_scaler.DynamicLossScaler(**args), our_scaler.DynamicLossScaler(**args)
    overflow_rate = (0.05, 0.3, 0.7)[seed % 3]
    for step in range(500):
        overflow = rng.random() < overflow_rate
        their_error = outcome(lambda o=overflow: theirs.update_scale(o))
        our_error = outcome(lambda o=overflow: ours.update_scale(o))
        if isinstance(their_error, Exception):  # DeepSpeed raises Exception at the floor: a TrainingStopped here
            assert isinstance(our_error, TrainingStopped), step
            return
        assert our_error is None, step
        assert scaler_state(ours) == scaler_state(theirs), (step, scaler_state(ours), scaler_state(theirs))
    assert ours.dynamic and theirs.dynamic


SCALER_ATTRIBUTES = {
    "scale_window": 3,
    "delayed_shift": 1,
    "min_scale": 4,
    "consecutive_hysteresis": True,
    "raise_error_at_min_scale": False,
    "cur_scale": 64.0,
    "cur_iter": 10,
    "last_overflow_iter": 7,
    "cur_hysteresis": 1,
}


@pytest.mark.parametrize("name", SCALER_ATTRIBUTES)
def test_loss_scaler_attributes_written_by_a_script_take_effect_as_in_deepspeed(name, monkeypatch):
    monkeypatch.setattr(ds_comm, "get_rank", lambda group=None: 0)
    args = {"init_scale": 2**10, "scale_window": 5, "min_scale": 1, "delayed_shift": 2, "consecutive_hysteresis": False}
    theirs, ours = ds_scaler.DynamicLossScaler(**args), our_scaler.DynamicLossScaler(**args)
    for scaler in (theirs, ours):
        setattr(scaler, name, SCALER_ATTRIBUTES[name])
    for step, overflow in enumerate([False] * 7 + [True, True, False, True] + [False] * 8 + [True] * 12):
        their_error = outcome(lambda o=overflow: theirs.update_scale(o))
        our_error = outcome(lambda o=overflow: ours.update_scale(o))
        if isinstance(their_error, Exception):
            assert isinstance(our_error, TrainingStopped) and "raise_error_at_min_scale=False" in str(our_error)
            return
        state = [(getattr(s, a) for a in SCALER_ATTRIBUTES) for s in (ours, theirs)]
        assert list(state[0]) == list(state[1]), (name, step)


def test_loss_scaler_sequences_reach_every_rule(monkeypatch):
    """The sequences above halve, double, use the hysteresis and hit the floor, so every rule is compared."""
    monkeypatch.setattr(ds_comm, "get_rank", lambda group=None: 0)
    seen = set()
    for seed in range(12):
        rng = random.Random(seed)
        scaler = our_scaler.DynamicLossScaler(
            init_scale=2 ** rng.randint(2, 16),
            scale_window=rng.choice([1, 2, 5, 20]),
            min_scale=rng.choice([1, 0.25, 8]),
            delayed_shift=rng.choice([1, 2, 3]),
            consecutive_hysteresis=seed % 2 == 0,
            raise_error_at_min_scale=seed % 3 != 0,
        )
        for _ in range(500):
            before, hysteresis = scaler.cur_scale, scaler.cur_hysteresis
            try:
                scaler.update_scale(rng.random() < (0.05, 0.3, 0.7)[seed % 3])
            except TrainingStopped:
                seen.add("stopped at the floor")
                break
            seen.add("halved" if scaler.cur_scale < before else "doubled" if scaler.cur_scale > before else "kept")
            if scaler.cur_hysteresis < hysteresis:
                seen.add("hysteresis used")
            if scaler.cur_scale == scaler.min_scale and not scaler.raise_error_at_min_scale:
                seen.add("held at the floor")
    assert seen == {"halved", "doubled", "kept", "hysteresis used", "stopped at the floor", "held at the floor"}


@pytest.mark.parametrize(
    "dtype, static, dynamic",
    [(torch.half, 0, True), (torch.half, 256.0, False), (torch.bfloat16, 256.0, False), (torch.float32, 4.0, True)],
)
def test_create_loss_scaler_as_deepspeeds(dtype, static, dynamic):
    args = ds_precision.DeepSpeedFP16Config(enabled=True, initial_scale_power=10).dynamic_loss_scale_args()
    theirs = ds_scaler.CreateLossScaler(dtype, static, dynamic, dict(args))
    ours = our_scaler.CreateLossScaler(dtype, static, dynamic, dict(args))
    assert type(ours).__name__ == type(theirs).__name__
    assert (ours.loss_scale, ours.dynamic) == (theirs.loss_scale, theirs.dynamic)
    loss = torch.tensor(1.5, requires_grad=True)
    assert ours.scale_loss(loss).item() == theirs.scale_loss(loss).item()
    ours.backward(loss * 2)
    assert loss.grad.item() == 2 * ours.loss_scale
    same_outcome(
        outcome(lambda: our_scaler.CreateLossScaler(torch.half, 0, True, None)),
        outcome(lambda: ds_scaler.CreateLossScaler(torch.half, 0, True, None)),
    )


def test_overflow_checks():
    good, bad, none = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
    good.grad, bad.grad = torch.ones(2), torch.tensor([1.0, float("nan")])
    args = {"init_scale": 8, "scale_window": 2, "min_scale": 1, "delayed_shift": 1, "consecutive_hysteresis": False}
    scaler = our_scaler.DynamicLossScaler(**args)
    assert scaler.has_overflow_serial([good, none]) is False and scaler.has_overflow_serial([good, bad]) is True
    with pytest.raises(TypeError):  # DeepSpeed 0.19.8's has_overflow_serial calls a method that lacks `self`
        ds_scaler.DynamicLossScaler(**args).has_overflow_serial([good])
    for module in (our_scaler, ds_scaler):
        assert module.LossScaler(4).has_overflow([bad]) is False


# --------------------------------------------------------------------------------------------------------------
# The module paths, through the alias finder as ds-fsdp installs it
# --------------------------------------------------------------------------------------------------------------

DOCS = Path(__file__).resolve().parents[1] / "docs" / "ds_compat.md"
MODULE_TABLE = "### Every `deepspeed` module path provided"


def documented_names() -> dict[str, list[str]]:
    """docs/ds_compat.md's module table: {module path: the names its row lists}."""
    text = DOCS.read_text()
    rows = text[text.index(MODULE_TABLE) :].split("\n\n")[2].splitlines()[2:]
    table: dict[str, list[str]] = {}
    for row in rows:
        paths_cell, names_cell = row.split(" | ")[:2]
        paths = re.findall(r"`([^`]+)`", paths_cell)
        names = [re.match(r"[A-Za-z_][A-Za-z0-9_]*", name).group() for name in re.findall(r"`([^`]+)`", names_cell)]
        for path in paths:
            table[path] = names
    return table


def test_every_documented_name_imports_under_the_alias_and_exists_in_deepspeed():
    table = documented_names()
    assert len(table) >= 24 and sum(map(len, table.values())) >= 150
    script = "\n".join(
        [
            "import importlib, json, sys, deepspeed",
            "missing = []",
            f"for path, names in {table!r}.items():",
            "    module = importlib.import_module(path)",
            "    if not module.__name__.startswith('ds_compat'): missing.append(path)",
            "    missing += [f'{path}.{name}' for name in names if not hasattr(module, name)]",
            "print(json.dumps(missing))",
        ]
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SHIM_DIR), os.getcwd()])}
    env.pop("DS_FSDP_BACKEND", None)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []
    # the same names in the real DeepSpeed
    absent = [f"{path}.{name}" for path, names in table.items() for name in names if not hasattr(real(path), name)]
    assert absent == []


def reachable_by_attribute(paths: list[str], shim: bool) -> list[str]:
    """The module paths reachable as attributes right after `import deepspeed` (ours under the shim, or DeepSpeed's)."""
    script = "\n".join(
        [
            "import functools, json, deepspeed",
            "def walk(path):",
            "    try:",
            "        return functools.reduce(getattr, path.split('.')[1:], deepspeed) is not None",
            "    except AttributeError:",
            "        return False",
            f"print(json.dumps([path for path in {paths!r} if walk(path)]))",
        ]
    )
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": os.getcwd()}
    if shim:
        env["PYTHONPATH"] = os.pathsep.join([str(SHIM_DIR), os.getcwd()])
    env.pop("DS_FSDP_BACKEND", None)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_module_paths_deepspeed_reaches_as_attributes_are_reached_here():
    paths = [path for path in documented_names() if path != "deepspeed"]
    theirs = reachable_by_attribute(paths, shim=False)
    assert len(theirs) >= 10
    assert set(theirs) - set(reachable_by_attribute(paths, shim=True)) == set()


def real(path: str):
    """DeepSpeed's module at `path`, or the attribute it is (`deepspeed.zero` is `deepspeed.runtime.zero`)."""
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:
        parent, _, name = path.rpartition(".")
        return getattr(real(parent), name)
