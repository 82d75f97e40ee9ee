"""ds_compat.config: ds_config loading, "auto" filling, DeepSpeed's batch arithmetic, schedules and key mapping.

The installed DeepSpeed is the reference: its DeepSpeedConfig (with a faked world size) for the batch triple and
its errors, its lr_schedules classes for the schedules, its pydantic models for the keys it accepts.
"""

from __future__ import annotations

import base64
import copy
import inspect
import json
import logging
import math
import os
from pathlib import Path

import pytest
import torch

from ds_compat import ds_keys, schedules
from ds_compat._common import format_value
from ds_compat.config import explain_text, load_ds_config, main, resolve_auto, resolve_batch, translate
from ds_compat.sections import AutoEP
from glm45v_fsdp.config import Config, TrainingConfig, config_from_dict, load_config
from glm45v_fsdp.errors import UserError

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# deepspeed is the reference: .ci/run installs it, and these comparisons must run (a skip would hide a gap).
from deepspeed import comm as ds_comm  # noqa: E402
from deepspeed.runtime import lr_schedules as ds_lr  # noqa: E402
from deepspeed.runtime.config import DeepSpeedConfig  # noqa: E402

logging.getLogger("DeepSpeed").setLevel(logging.ERROR)

BASE = config_from_dict(
    {
        "training": {
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 4,
            "lr": 3e-4,
            "min_lr": 3e-5,
            "lr_warmup_ratio": 0.1,
            "train_iters": 200,
            "weight_decay": 0.1,
            "adam_beta1": 0.9,
            "adam_beta2": 0.95,
            "adam_eps": 1e-6,
            "clip_grad": 0.5,
        }
    }
)

HF_ZERO3 = {
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
HF_ZERO2 = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": "auto",
        "contiguous_gradients": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}
MEGATRON_STYLE = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 2,
    "steps_per_print": 10,
    "optimizer": {"type": "Adam", "params": {"lr": 1.5e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 1.5e-4, "warmup_num_steps": 100, "warmup_type": "linear"},
    },
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8},
    "activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": True},
    "wall_clock_breakdown": False,
}

# (name, ds_config, base); each row runs at world sizes 1, 2, 4, 8.
TABLE = [
    ("micro_only_z0", {"train_micro_batch_size_per_gpu": 4}, None),
    ("total_only_z0", {"train_batch_size": 32}, None),
    (
        "total_micro_z1",
        {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}},
        None,
    ),
    (
        "total_accum_z2",
        {
            "train_batch_size": 64,
            "gradient_accumulation_steps": 4,
            "zero_optimization": {
                "stage": 2,
                "overlap_comm": True,
                "reduce_bucket_size": 5e8,
                "allgather_bucket_size": 5e8,
            },
        },
        None,
    ),
    (
        "micro_accum_z3",
        {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 8, "zero_optimization": {"stage": 3}},
        None,
    ),
    (
        "all_three_fit_1",
        {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4},
        None,
    ),
    (
        "all_three_fit_4",
        {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4},
        None,
    ),
    (
        "all_three_fit_8",
        {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4},
        None,
    ),
    (
        "all_three_inconsistent",
        {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4},
        None,
    ),
    ("total_not_multiple", {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 4}, None),
    ("total_below_world", {"train_batch_size": 4}, None),
    ("total_accum_indivisible", {"train_batch_size": 24, "gradient_accumulation_steps": 5}, None),
    ("accum_only", {"gradient_accumulation_steps": 4}, None),
    ("no_batch_keys", {"zero_optimization": {"stage": 2}}, None),
    ("null_total_micro", {"train_batch_size": None, "train_micro_batch_size_per_gpu": 2}, None),
    ("zero_micro", {"train_micro_batch_size_per_gpu": 0}, None),
    ("negative_total", {"train_batch_size": -8, "train_micro_batch_size_per_gpu": 2}, None),
    ("float_total", {"train_batch_size": 32.0, "train_micro_batch_size_per_gpu": 4}, None),
    ("bf16_z2", {"train_batch_size": 16, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}, None),
    (
        "fp16_off_z1",
        {
            "train_micro_batch_size_per_gpu": 2,
            "fp16": {"enabled": False, "initial_scale_power": 12},
            "zero_optimization": {"stage": 1},
        },
        None,
    ),
    (
        "z3_offload",
        {
            "train_batch_size": 64,
            "train_micro_batch_size_per_gpu": 8,
            "bf16": {"enabled": True},
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "cpu"},
                "offload_param": {"device": "cpu"},
            },
        },
        None,
    ),
    (
        "z2_offload_optimizer",
        {
            "train_batch_size": 16,
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}},
        },
        None,
    ),
    ("z1_legacy_cpu_offload", {"train_batch_size": 16, "zero_optimization": {"stage": 1, "cpu_offload": True}}, None),
    ("legacy_zero_bool", {"train_batch_size": 16, "zero_optimization": True}, None),
    ("hf_zero3_auto", HF_ZERO3, BASE),
    ("hf_zero2_auto", HF_ZERO2, BASE),
    ("auto_total_micro_given", {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4}, BASE),
    ("auto_accum_total_given", {"train_batch_size": 64, "gradient_accumulation_steps": "auto"}, BASE),
    ("megatron_style", MEGATRON_STYLE, None),
    (
        "sgd_step_lr",
        {
            "train_batch_size": 32,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
            "scheduler": {"type": "StepLR", "params": {"step_size": 10, "gamma": 0.5}},
        },
        None,
    ),
    (
        "monitors",
        {
            "train_micro_batch_size_per_gpu": 1,
            "steps_per_print": 5,
            "tensorboard": {"enabled": True, "output_path": "tb", "job_name": "j"},
            "csv_monitor": {"enabled": True},
            "flops_profiler": {"enabled": False},
            "comms_logger": {"enabled": False},
        },
        None,
    ),
    ("comm_dtype_bf16", {"train_batch_size": 16, "bf16": {"enabled": True}, "communication_data_type": "bf16"}, None),
    ("sp2_total", {"train_batch_size": 16, "sequence_parallel_size": 2}, None),
    ("sp2_micro", {"train_micro_batch_size_per_gpu": 2, "sequence_parallel_size": 2}, None),
    (
        "sp4_all_three",
        {
            "train_batch_size": 4,
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "sequence_parallel_size": 4,
        },
        None,
    ),
]
WORLD_SIZES = (1, 2, 4, 8)


@pytest.fixture
def ds_batch(monkeypatch):
    """DeepSpeedConfig's batch triple (or its exception) for a faked world size; no process group needed."""

    def run(config: dict, world_size: int) -> tuple | Exception:
        monkeypatch.setattr(ds_comm, "get_rank", lambda group=None: 0)
        monkeypatch.setattr(ds_comm, "get_world_size", lambda group=None: world_size)
        try:
            ds = DeepSpeedConfig(copy.deepcopy(config))
        except Exception as error:  # DeepSpeed raises AssertionError, ValueError, TypeError, ValidationError ...
            return error
        return (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps)

    return run


def test_table_is_large_enough():
    assert len(TABLE) >= 30 and len({name for name, _, _ in TABLE}) == len(TABLE)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name, config, base", TABLE, ids=[row[0] for row in TABLE])
def test_batch_triple_matches_deepspeed(name, config, base, world_size, ds_batch):
    sp = config.get("sequence_parallel_size") or 1
    if world_size % sp:
        with pytest.raises(UserError, match="sequence_parallel_size"):
            translate(config, world_size, base)
        return
    dp = world_size // sp
    resolved, _ = resolve_auto(config, base, dp)
    expected = ds_batch(resolved, world_size)
    if isinstance(expected, Exception):
        with pytest.raises(UserError):
            resolve_batch(resolved, dp)
        with pytest.raises(UserError):
            translate(config, world_size, base)
        return
    ours = resolve_batch(resolved, dp)
    assert (ours.train_batch_size, ours.micro_batch_size, ours.gradient_accumulation_steps) == expected
    translation = translate(config, world_size, base)
    assert translation.batch == ours
    assert len(translation.no_effect) == len(set(translation.no_effect))
    applied = translation.apply(base or Config())
    assert applied.parallel.ulysses_parallel_size == sp == translation.sequence_parallel_size
    assert applied.training.micro_batch_size == ours.micro_batch_size
    assert applied.training.gradient_accumulation_steps == ours.gradient_accumulation_steps
    assert (
        applied.training.micro_batch_size
        * applied.training.gradient_accumulation_steps
        * world_size
        // applied.parallel.ulysses_parallel_size
        == expected[0]
    )


def test_resolve_batch_errors_name_the_keys():
    with pytest.raises(UserError, match="'train_batch_size' = 30 does not equal .* 2 x 4 x 1 = 8"):
        resolve_batch(
            {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 1
        )
    with pytest.raises(UserError, match="as DeepSpeed requires \\(gradient_accumulation_steps = 0 derived"):
        resolve_batch({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1}, 8)
    with pytest.raises(UserError, match="neither 'train_batch_size' nor 'train_micro_batch_size_per_gpu'"):
        resolve_batch({"gradient_accumulation_steps": 2}, 2)
    with pytest.raises(UserError, match="'train_micro_batch_size_per_gpu' = 0 is not positive"):
        resolve_batch({"train_micro_batch_size_per_gpu": 0}, 2)
    with pytest.raises(UserError, match="'train_batch_size' = 'auto' is unresolved"):
        resolve_batch({"train_batch_size": "auto"}, 2)
    with pytest.raises(UserError, match="'gradient_accumulation_steps' = 2.5 is not an integer"):
        resolve_batch({"train_batch_size": 8, "gradient_accumulation_steps": 2.5}, 1)


# --------------------------------------------------------------------------------------------------------------
# LR schedules against deepspeed.runtime.lr_schedules
# --------------------------------------------------------------------------------------------------------------

OPTIMIZER_LR = 2e-3
SCHEDULES = [
    ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-2, "warmup_num_steps": 50, "warmup_type": "log"}),
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 50, "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_num_steps": 1}),
    (
        "WarmupDecayLR",
        {
            "total_num_steps": 120,
            "warmup_min_lr": 1e-5,
            "warmup_max_lr": 3e-3,
            "warmup_num_steps": 20,
            "warmup_type": "linear",
        },
    ),
    ("WarmupDecayLR", {"total_num_steps": 90, "warmup_num_steps": 30}),
    ("WarmupDecayLR", {"total_num_steps": 30, "warmup_num_steps": 50, "warmup_type": "linear"}),
    (
        "WarmupCosineLR",
        {
            "total_num_steps": 150,
            "warmup_min_ratio": 0.1,
            "warmup_num_steps": 25,
            "cos_min_ratio": 0.05,
            "warmup_type": "log",
        },
    ),
    ("WarmupCosineLR", {"total_num_steps": 100, "warmup_num_steps": 10, "warmup_type": "linear"}),
    (
        "OneCycle",
        {
            "cycle_min_lr": 1e-4,
            "cycle_max_lr": 1e-2,
            "cycle_first_step_size": 30,
            "cycle_second_step_size": 20,
            "decay_step_size": 10,
            "decay_lr_rate": 0.1,
            "decay_mom_rate": 0.05,
        },
    ),
    (
        "OneCycle",
        {
            "cycle_min_lr": 1e-3,
            "cycle_max_lr": 5e-3,
            "cycle_first_step_size": 40,
            "cycle_first_stair_count": 4,
            "cycle_second_stair_count": 5,
            "cycle_min_mom": 0.85,
            "cycle_max_mom": 0.95,
        },
    ),
    ("OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 25, "cycle_momentum": False}),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 10, "lr_range_test_step_rate": 2.0}),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 7, "lr_range_test_staircase": True}),
]
STEPS = 160


def _deepspeed_trace(name: str, params: dict) -> list[tuple[float, tuple]]:
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=OPTIMIZER_LR)
    scheduler = getattr(ds_lr, name)(optimizer, **params)
    trace = [(optimizer.param_groups[0]["lr"], tuple(optimizer.param_groups[0]["betas"]))]
    for _ in range(STEPS):
        scheduler.step()
        trace.append((optimizer.param_groups[0]["lr"], tuple(optimizer.param_groups[0]["betas"])))
    return trace


@pytest.mark.parametrize("name, params", SCHEDULES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(SCHEDULES)])
def test_schedule_matches_deepspeed_step_by_step(name, params):
    config = {
        "train_batch_size": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": OPTIMIZER_LR}},
        "scheduler": {"type": name, "params": params},
    }
    scheduler = translate(config, 1).scheduler
    assert scheduler is not None and scheduler.type == name
    cycles_momentum = name == "OneCycle" and params.get("cycle_momentum", True)
    for step, (lr, betas) in enumerate(_deepspeed_trace(name, params)):
        assert math.isclose(scheduler.lr_at(step), lr, rel_tol=1e-12, abs_tol=1e-15), (step, scheduler.lr_at(step), lr)
        if cycles_momentum:
            assert scheduler.momentum_at(step) == pytest.approx(betas, rel=1e-12, abs=1e-15), step
        else:
            assert scheduler.momentum_at(step) is None


def test_schedule_defaults_match_deepspeed_signatures():
    for name in schedules.DS_SCHEDULERS:
        signature = inspect.signature(getattr(ds_lr, name).__init__).parameters
        theirs = {
            key: None if p.default is inspect.Parameter.empty else p.default
            for key, p in signature.items()
            if key not in ("self", "optimizer", "last_batch_iteration")
        }
        assert schedules.DEFAULTS[name] == theirs, name
        required = {key for key, p in signature.items() if p.default is inspect.Parameter.empty} - {"self", "optimizer"}
        assert set(schedules.REQUIRED.get(name, ())) == required, name


def test_torch_scheduler_is_replayed_like_deepspeed_steps_it():
    config = {
        "train_batch_size": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "scheduler": {"type": "OneCycleLR", "params": {"max_lr": 0.01, "total_steps": 60}},
    }
    spec = translate(config, 1).scheduler
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    reference = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.01, total_steps=60)
    for step in range(60):
        assert spec.lr_at(step) == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-12)
        assert spec.momentum_at(step) == pytest.approx(optimizer.param_groups[0]["betas"])
        optimizer.step()
        reference.step()


def test_scheduler_parameter_errors():
    def scheduler(name, params):
        return translate({"train_batch_size": 8, "scheduler": {"type": name, "params": params}}, 1)

    with pytest.raises(
        UserError, match="'scheduler.params.warmup_num_step' .* Did you mean 'scheduler.params.warmup_num_steps'"
    ):
        scheduler("WarmupLR", {"warmup_num_step": 10})
    with pytest.raises(UserError, match="'scheduler.params.total_num_steps' = None is missing"):
        scheduler("WarmupDecayLR", {"warmup_num_steps": 10})
    with pytest.raises(UserError, match="'scheduler.params.warmup_num_steps' = 0 is below 1"):
        scheduler("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 0})
    with pytest.raises(UserError, match="per-parameter-group list"):
        scheduler("WarmupLR", {"warmup_max_lr": [0.1, 0.2]})
    with pytest.raises(UserError, match="'scheduler.params' = None is missing"):
        translate({"train_batch_size": 8, "scheduler": {"type": "WarmupLR"}}, 1)
    with pytest.raises(UserError, match="last_batch_iteration.*cannot be honoured"):
        scheduler("WarmupLR", {"last_batch_iteration": 5})
    with pytest.raises(UserError, match="ReduceLROnPlateau.*validation metric"):
        scheduler("ReduceLROnPlateau", {})
    with pytest.raises(UserError, match="'scheduler.type' = 5 is not a name"):
        scheduler(5, {})
    with pytest.raises(UserError, match="Did you mean 'WarmupCosineLR'"):
        scheduler("WarmupCosinLR", {})
    with pytest.raises(UserError, match="does not build torch.optim.lr_scheduler.StepLR"):
        scheduler("StepLR", {"gamma": 0.5})
    unknown = scheduler("WarmupLR", {"warmup_type": "cosine"})
    assert any("falls back to 'log'" in note for note in unknown.notes)


# --------------------------------------------------------------------------------------------------------------
# "auto"
# --------------------------------------------------------------------------------------------------------------


def test_auto_values_are_filled_from_the_base_config():
    translation = translate(HF_ZERO3, 4, BASE)
    ds = translation.ds_config
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["gradient_accumulation_steps"] == 4
    assert ds["train_batch_size"] == 2 * 4 * 4
    assert ds["gradient_clipping"] == 0.5 and translation.clip == 0.5
    assert ds["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}
    assert ds["scheduler"]["params"] == {
        "warmup_min_lr": 0,
        "warmup_max_lr": 3e-4,
        "warmup_num_steps": 20,
        "total_num_steps": 200,
    }
    assert ds["bf16"]["enabled"] is True and translation.precision == "bf16"
    assert ds["zero_optimization"]["reduce_bucket_size"] == "auto"  # DeepSpeed's default bucket: needs no value
    assert unit_mib_of(translation) == pytest.approx(5e7 * 4 / 2**20, abs=1e-3)  # stage 3: the prefetch bucket
    assert any(line.startswith("train_batch_size: auto -> 32") for line in translation.auto_filled)
    fp32_base = config_from_dict({"parallel": {"fsdp_plan": {"param_dtype": "fp32"}}})
    resolved, _ = resolve_auto(HF_ZERO2, fp32_base, 2)
    assert resolved["bf16"]["enabled"] is False and resolved["fp16"]["enabled"] is False
    cosine = {
        "train_batch_size": 8,
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "cos_min_ratio": "auto"}},
    }
    assert translate(cosine, 1, BASE).scheduler.params["cos_min_ratio"] == pytest.approx(0.1)


@pytest.mark.parametrize(
    "config, key",
    [
        ({"train_batch_size": "auto"}, "train_batch_size"),
        ({"train_micro_batch_size_per_gpu": "auto"}, "train_micro_batch_size_per_gpu"),
        ({"train_batch_size": 8, "gradient_clipping": "auto"}, "gradient_clipping"),
        ({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, "optimizer.params.lr"),
        ({"train_batch_size": 8, "bf16": {"enabled": "auto"}}, "bf16.enabled"),
        (
            {"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}},
            "scheduler.params.total_num_steps",
        ),
    ],
)
def test_auto_without_a_base_names_the_key(config, key):
    with pytest.raises(UserError, match=f"'{key}' = 'auto' has nothing to fill it.*--config"):
        translate(config, 2)


def test_auto_the_hf_trainer_cannot_fill_is_an_error_even_with_a_base():
    with pytest.raises(UserError, match="'zero_optimization.stage' = 'auto' is not a value"):
        translate({"train_batch_size": 8, "zero_optimization": {"stage": "auto"}}, 1, BASE)
    with pytest.raises(UserError, match="'steps_per_print' = 'auto'"):
        translate({"train_batch_size": 8, "steps_per_print": "auto"}, 1, BASE)
    # Without a base, fixed fills still work and no-effect keys may stay "auto".
    translation = translate(
        {
            "train_batch_size": 8,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto"}},
            "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"},
        },
        1,
    )
    assert translation.scheduler.params["warmup_min_lr"] == 0 and translation.scheduler.params["warmup_max_lr"] == 1e-3


# --------------------------------------------------------------------------------------------------------------
# Keys: rejected like DeepSpeed, no effect, cannot honour
# --------------------------------------------------------------------------------------------------------------


def _pydantic_keys(model) -> set[str]:
    return {name for name in model.model_fields} | {f.alias for f in model.model_fields.values() if f.alias}


def test_strict_key_tables_match_deepspeed_models():
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.compile.config import CompileConfig
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.config import HybridEngineConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    models = {
        "zero_optimization": DeepSpeedZeroConfig,
        "fp16": DeepSpeedFP16Config,
        "bf16": DeepSpeedBF16Config,
        "bfloat16": DeepSpeedBF16Config,
        "tensorboard": TensorBoardConfig,
        "csv_monitor": CSVConfig,
        "wandb": WandbConfig,
        "comet": CometConfig,
        "comms_logger": CommsLoggerConfig,
        "hybrid_engine": HybridEngineConfig,
        "compile": CompileConfig,
        "tensor_parallel": TPTrainingConfig,
    }
    assert set(ds_keys.STRICT_SECTIONS) == set(models)
    for section, model in models.items():
        assert ds_keys.STRICT_SECTIONS[section] == _pydantic_keys(model), section
    assert ds_keys.OFFLOAD_PARAM_KEYS == _pydantic_keys(DeepSpeedZeroOffloadParamConfig)
    assert ds_keys.OFFLOAD_OPTIMIZER_KEYS == _pydantic_keys(DeepSpeedZeroOffloadOptimizerConfig)
    from deepspeed.runtime import config as ds_config_module

    assert set(ds_keys.REMOVED_TOP_LEVEL) == set(ds_config_module._REMOVED_TOP_LEVEL_CONFIG_KEYS)
    assert set(ds_keys.REMOVED_ZERO) == set(ds_config_module._REMOVED_ZERO_CONFIG_KEYS)


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            {"zero_optimization": {"stage": 2, "overlap_com": True}},
            "'zero_optimization.overlap_com'.*Did you mean 'zero_optimization.overlap_comm'",
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin": True}}},
            "'zero_optimization.offload_param.pin'",
        ),
        (
            {"fp16": {"enabled": False, "initial_scale": 16}},
            "'fp16.initial_scale'.*Did you mean 'fp16.initial_scale_power'",
        ),
        ({"bf16": {"enabled": True, "foo": 1}}, "'bf16.foo'"),
        ({"tensorboard": {"enabled": True, "path": "x"}}, "'tensorboard.path'"),
        ({"zero_optimization": {"stage": 4}}, "'zero_optimization.stage' = 4 is not a ZeRO stage"),
        ({"zero_optimization": {"stage": 2, "mics_shard_size": 8}}, "'zero_optimization.mics_shard_size'.*MiCS"),
        ({"amp": {"enabled": True}}, "'amp'.*rejected by DeepSpeed 0.19"),
        ({"elasticity": {"enabled": True}}, "'elasticity'.*rejected"),
        ({"compression_training": {}}, "'compression_training'.*compression"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "together with bf16.enabled"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}, "ratio"),
        ({"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}}, "'gradient_allreduce_op' = 'sum'"),
    ],
)
def test_keys_deepspeed_rejects_are_rejected(extra, message, ds_batch):
    config = {"train_batch_size": 8, **extra}
    assert isinstance(ds_batch(config, 1), Exception), "DeepSpeed accepts it: the test case is wrong"
    with pytest.raises(UserError, match=message):
        translate(config, 1)


def test_unknown_top_level_keys_are_ignored_like_deepspeed_and_a_misspelling_says_so(ds_batch):
    config = {"train_batch_size": 8, "train_batch_sizee": 16, "team_comment": "sft run 7"}
    assert ds_batch(config, 1) == (8, 8, 1)  # DeepSpeed ignores both
    translation = translate(config, 1)
    assert translation.misspelled == [
        "'train_batch_sizee' = 16 is not a DeepSpeed key: did you mean 'train_batch_size'? DeepSpeed ignores it, and "
        "so does the translation: the value has no effect. Rename it to 'train_batch_size'."
    ]
    assert "WARNING: misspelled keys (no effect):" in explain_text(translation, "ds.json")
    assert any("'team_comment' is not a DeepSpeed key" in note for note in translation.notes)  # no close key


@pytest.mark.parametrize(
    "config, message",
    [
        (  # with a number: no batch key left, which DeepSpeed rejects; the error names the spelling
            {"train_micro_batch_size_per_gpuu": 4, "gradient_accumulation_steps": 1},
            "neither 'train_batch_size' nor 'train_micro_batch_size_per_gpu'.*The config has "
            "'train_micro_batch_size_per_gpuu' \\(did you mean 'train_micro_batch_size_per_gpu'\\?\\)",
        ),
        (  # with "auto": nothing fills it (DeepSpeed ignores the key); the error is the spelling, not "auto"
            {"train_micro_batch_size_per_gpuu": "auto", "gradient_accumulation_steps": 1},
            "'train_micro_batch_size_per_gpuu' = 'auto' is not a DeepSpeed key: did you mean "
            "'train_micro_batch_size_per_gpu'\\?",
        ),
        (
            {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_stepss": 2},
            "as DeepSpeed requires.*The config has 'gradient_accumulation_stepss' \\(did you mean",
        ),
    ],
)
def test_a_misspelled_key_deepspeed_would_reject_is_an_error_naming_the_spelling(config, message, ds_batch):
    # the HF integration fills no "auto" of a key DeepSpeed does not know, so DeepSpeed gets these as they are
    assert isinstance(ds_batch(config, 4), Exception), "DeepSpeed accepts it: the test case is wrong"
    with pytest.raises(UserError, match=message):
        translate(config, 4, Config())


def test_no_effect_keys_are_listed_once():
    config = {
        "train_batch_size": 8,
        "zero_optimization": {
            "stage": 2,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e8,
            "allgather_bucket_size": 5e8,
            "offload_optimizer": {"device": "cpu", "pin_memory": True, "buffer_count": 4},
            "offload_param": {"device": "cpu"},
        },
        "wall_clock_breakdown": False,
        "prescale_gradients": False,
        "flops_profiler": {"enabled": False},
        "fp16": {"enabled": False, "loss_scale_window": 500},
        "activation_checkpointing": {"partition_activations": False},
    }
    translation = translate(config, 2)
    assert len(translation.no_effect) == len(set(translation.no_effect))
    assert not any("bucket_size" in key for key in translation.no_effect)  # they set the FSDP2 unit size
    assert {
        "zero_optimization.overlap_comm",
        "zero_optimization.contiguous_gradients",
        "zero_optimization.offload_optimizer.pin_memory",
        "zero_optimization.offload_optimizer.buffer_count",
        "zero_optimization.offload_param",
        "wall_clock_breakdown",
        "prescale_gradients",
        "flops_profiler",
        "fp16.loss_scale_window",
        "activation_checkpointing.partition_activations",
    } <= set(translation.no_effect)
    assert _overrides(translation)["features.recompute.enabled"] == "true"


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}},
            "offload_param.device' = 'nvme' cannot be honoured.*NVMe",
        ),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}, "NVMe"),
        (
            {"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}},
            "'optimizer.type' = 'OneBitAdam' cannot be honoured.*1-bit",
        ),
        ({"optimizer": {"type": "ZeroOneAdam", "params": {}}}, "1-bit"),
        ({"optimizer": {"type": "Lamb", "params": {}}}, "DeepSpeed's own optimizer kernels"),
        ({"pipeline": {"stages": 2}}, "'pipeline'.*pipeline parallelism"),
        ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "quantized weight"),
        ({"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.1}}}, "ZenFlow"),
        ({"weight_quantization": {"quantized_initialization": {}}}, "quantized weights"),
        ({"hybrid_engine": {"enabled": True}}, "hybrid"),
        ({"data_efficiency": {"enabled": True}}, "curriculum"),
        ({"tensor_parallel": {"autotp_size": 2}}, "tensor parallelism"),
        (
            {"expert_parallel": {"enabled": True, "autoep_size": 2, "expert_tensor_parallel_size": 2}},
            "expert_tensor_parallel_size' = 2 cannot be honoured.*tensor parallelism",
        ),
        ({"expert_parallel": {"enabled": True, "autoep_size": 2, "comm_backend": "deepep"}}, "DeepEP"),
        ({"expert_parallel": {"enabled": True, "autoep_size": 2, "load_balance_coeff": 0.01}}, "balance loss"),
        (
            {"expert_parallel": {"enabled": True, "autoep_size": 2}, "use_data_before_expert_parallelism": True},
            "adjacent ranks",
        ),
        ({"gradient_allreduce_op": "sum"}, "averages gradients"),
        ({"managed_gradient_accumulation": False}, "accumulation boundary"),
        ({"optimizer": {"type": "Adam", "params": {"bias_correction": False}}}, "bias_correction"),
        (
            {"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}},
            "'optimizer.params.max_grad_norm'.*gradient_clipping",
        ),
        ({"optimizer": {"type": "AdamW", "params": {"momentum": 0.9}}}, "'optimizer.params.momentum'.*FusedAdam"),
        ({"optimizer": {"type": "sgd", "params": {}}}, "Did you mean 'SGD'"),
        ({"optimizer": {"type": "LBFGS", "params": {}}}, "closure"),
        ({"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.99]}}}, "'optimizer.params.betas'.*torch.optim.SGD"),
        ({"torch_autocast": {"enabled": True, "dtype": "float16"}}, "torch_autocast.dtype"),
        # DeepSpeed's engine (not its config class) rejects this one.
        (
            {"bf16": {"enabled": True}, "data_types": {"param_dtype": "fp32"}},
            "'data_types.param_dtype' = 'fp32' conflicts",
        ),
    ],
)
def test_keys_we_cannot_honour_fail_with_the_reason(extra, message):
    with pytest.raises(UserError, match=message):
        translate({"train_batch_size": 8, **extra}, 2 if "expert_parallel" in extra else 1)


def test_autoep_key_tables_match_deepspeeds_config():
    import dataclasses

    from deepspeed.module_inject.auto_ep_config import AutoEPConfig

    fields = {field.name: field for field in dataclasses.fields(AutoEPConfig) if not field.name.startswith("_")}
    assert ds_keys.EXPERT_PARALLEL_KEYS == set(fields)
    for key, default in ds_keys.EXPERT_PARALLEL_ROUTING.items():
        assert fields[key].default == default, key


def test_the_translation_hands_both_doors_typed_fields():
    """Issue 53: the translator's result is values (key path -> typed value) and typed sections, applied as they are;
    its `key=value` lines are a rendering of the same fields, which nothing reads back."""
    patterns = ["model.language_model.layers.{0-1,3}.mlp.experts"]
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "gradient_clipping": 0.5,
        "expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "glm4v_moe"},
        "glm45v_fsdp": {"parallel": {"ep_plan": {"apply_modules": patterns}}},
    }
    translation = translate(ds, 2)
    fields = translation.fields
    assert type(fields["parallel.expert_parallel_size"]) is int and fields["parallel.expert_parallel_size"] == 2
    assert fields["parallel.fsdp_plan.reshard_after_forward"] is True and fields["training.clip_grad"] == 0.5
    assert fields["parallel.ep_plan.apply_modules"] == patterns
    assert translation.expert_parallel == AutoEP(2, True, preset_model="glm4v_moe")
    assert translation.extension == {"parallel.ep_plan.apply_modules": patterns}
    assert translation.overrides == [f"{key}={format_value(value)}" for key, value in fields.items()]
    config = translation.apply(Config(), {"model.attn_implementation": "eager", "model.lora.alpha": 8})
    assert (config.parallel.expert_parallel_size, config.parallel.ep_plan.apply_modules) == (2, patterns)
    assert (config.model.attn_implementation, config.model.lora.alpha) == ("eager", 8.0)
    assert translate({"train_micro_batch_size_per_gpu": 1}, 2).expert_parallel == AutoEP()


def test_expert_parallel_maps_to_the_ep_size():
    section = {"enabled": True, "autoep_size": 2, "top_k": "auto", "use_grouped_mm": True, "preset_model": "x"}
    translation = translate({"train_batch_size": 8, "zero_optimization": {"stage": 2}, "expert_parallel": section}, 4)
    overrides = _overrides(translation)
    assert overrides["parallel.expert_parallel_size"] == "2"
    assert {"expert_parallel.top_k", "expert_parallel.use_grouped_mm", "expert_parallel.preset_model"} <= set(
        translation.no_effect
    )
    config = translation.apply(Config())
    assert (config.parallel.expert_parallel_size, config.parallel.data_parallel_replicate_size) == (2, 1)
    # ZeRO-0 replicates everything: EP takes replicas of 2 ranks (HSDP), the experts split inside each
    zero0 = translate({"train_batch_size": 8, "expert_parallel": {"enabled": True, "autoep_size": 2}}, 4)
    assert zero0.apply(Config()).parallel.data_parallel_replicate_size == 2
    assert any("ZeRO stage 0 with expert parallelism" in note for note in zero0.notes)
    off = translate({"train_batch_size": 8, "expert_parallel": {"enabled": False, "autoep_size": 4}}, 4)
    assert "parallel.expert_parallel_size" not in _overrides(off) and "expert_parallel" in off.no_effect
    unknown = translate({"train_batch_size": 8, "expert_parallel": {"enabled": True, "autoep_size": 2, "sise": 1}}, 2)
    assert any("'expert_parallel.sise' is not an AutoEP key" in note for note in unknown.notes)
    for key, value in (("top_k", 4), ("score_func", "softmax"), ("routed_scaling_factor", 2.5), ("route_scale", 2.0)):
        with pytest.raises(UserError, match=f"'expert_parallel.{key}' = .* overrides the model's routing"):
            translate({"train_batch_size": 8, "expert_parallel": {"enabled": True, "autoep_size": 2, key: value}}, 2)
    with pytest.raises(UserError, match="'expert_parallel.autoep_size' = 3 does not divide the world size 4"):
        translate({"train_batch_size": 8, "expert_parallel": {"enabled": True, "autoep_size": 3}}, 4)


def test_fp16_maps_to_fp16_compute_and_deepspeeds_loss_scaler():
    config = {
        "train_batch_size": 8,
        "fp16": {
            "enabled": True,
            "initial_scale_power": 12,
            "loss_scale_window": 500,
            "hysteresis": 3,
            "min_loss_scale": 4,
            "auto_cast": False,
        },
        "communication_data_type": "fp16",
    }
    translation = translate(config, 1)
    overrides = _overrides(translation)
    assert translation.precision == "fp16" and overrides["parallel.fsdp_plan.param_dtype"] == "fp16"
    assert overrides["parallel.fsdp_plan.reduce_dtype"] == "fp16"
    assert "fp16.auto_cast" in translation.no_effect
    scale = translation.apply(BASE).training.loss_scale
    assert (scale.static_scale, scale.initial_scale_power, scale.window, scale.hysteresis, scale.min_scale) == (
        0.0,
        12,
        500,
        3,
        4.0,
    )
    static = translate({"train_batch_size": 8, "fp16": {"enabled": True, "loss_scale": 128, "hysteresis": 5}}, 1)
    assert static.apply(BASE).training.loss_scale.static_scale == 128.0
    assert "fp16.hysteresis" in static.no_effect
    with pytest.raises(UserError, match="'fp16.loss_scale_window' = 0"):
        translate({"train_batch_size": 8, "fp16": {"enabled": True, "loss_scale_window": 0}}, 1)


def test_extension_ring_size_takes_ranks_from_data_parallelism():
    """Ring from the extension section splits sequences as sequence_parallel_size does: the batch arithmetic's
    data-parallel size is world / (Ulysses x Ring)."""
    ring = {"glm45v_fsdp": {"parallel": {"ring_attention_size": 2}}}
    translation = translate({"train_micro_batch_size_per_gpu": 2, "sequence_parallel_size": 2, **ring}, 8)
    assert translation.dp_world_size == 2 and translation.batch.train_batch_size == 4
    assert (translation.sequence_parallel_size, translation.ring_attention_size) == (2, 2)
    config = translation.apply(Config())
    assert (config.parallel.ulysses_parallel_size, config.parallel.ring_attention_size) == (2, 2)
    with pytest.raises(UserError, match="'glm45v_fsdp.parallel.ring_attention_size' = 2 does not divide world size"):
        translate({"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2, **ring}, 2)
    with pytest.raises(UserError, match="train_batch_size"):  # 8 is not micro 2 x accumulation x dp 2
        translate(
            {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, **ring}, 4
        )


def test_sequence_parallel_size_maps_to_ulysses_and_must_divide():
    with pytest.raises(UserError, match="'sequence_parallel_size' = 3 does not divide the world size 4"):
        translate({"train_batch_size": 8, "sequence_parallel_size": 3}, 4)
    translation = translate({"train_batch_size": 8, "sequence_parallel_size": 2}, 4)
    assert "parallel.ulysses_parallel_size=2" in translation.overrides
    assert translation.dp_world_size == 2 and translation.batch.micro_batch_size * 2 == 8
    config = translation.apply(Config())
    assert (config.parallel.ulysses_parallel_size, config.training.micro_batch_size) == (2, 4)
    assert "parallel.ulysses_parallel_size" not in " ".join(translate({"train_batch_size": 8}, 4).overrides)
    with pytest.raises(UserError, match="'data_parallel_size' = 4 is not world size / sequence_parallel_size"):
        translate({"train_batch_size": 8, "sequence_parallel_size": 2, "data_parallel_size": 4}, 4)


# --------------------------------------------------------------------------------------------------------------
# Mapping
# --------------------------------------------------------------------------------------------------------------


def _overrides(translation) -> dict[str, str]:
    """The translation's fields as the report renders them (key path -> text)."""
    return {key: format_value(value) for key, value in translation.fields.items()}


@pytest.mark.parametrize(
    "zero, replicate, reshard, offload",
    [
        ({}, "4", "false", "false"),
        ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "4", "false", "false"),
        ({"stage": 1}, "1", "false", "false"),
        ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, "1", "false", "true"),
        ({"stage": 2, "offload_param": {"device": "cpu"}}, "1", "false", "false"),
        ({"stage": 3}, "1", "true", "false"),
        ({"stage": 3, "offload_param": {"device": "cpu"}}, "1", "true", "true"),
        ({"stage": "3", "offload_optimizer": {"device": "none"}}, "1", "true", "false"),
    ],
)
def test_zero_stage_and_offload_map_onto_the_fsdp_plan(zero, replicate, reshard, offload):
    translation = translate({"train_batch_size": 16, "zero_optimization": zero}, 4)
    overrides = _overrides(translation)
    assert overrides["parallel.data_parallel_replicate_size"] == replicate
    assert overrides["parallel.fsdp_plan.reshard_after_forward"] == reshard
    assert overrides["parallel.fsdp_plan.cpu_offload"] == offload
    assert translation.zero_stage == int(zero.get("stage", 0))
    if offload == "true":
        assert any("keeps the parameters on the device" in note for note in translation.notes)
    config = translation.apply(Config())
    assert config.parallel.fsdp_plan.cpu_offload is (offload == "true")


def test_precision_clipping_logging_and_optimizer_mapping():
    translation = translate(MEGATRON_STYLE, 8)
    overrides = _overrides(translation)
    assert translation.precision == "bf16" and overrides["parallel.fsdp_plan.param_dtype"] == "bf16"
    assert overrides["parallel.fsdp_plan.reduce_dtype"] == "fp32"
    assert overrides["training.on_nonfinite"] == "skip"
    assert translation.clip == 1.0 and overrides["training.clip_grad"] == "1.0"
    assert "training.log_interval" not in overrides and translation.steps_per_print == 10
    assert any(note.startswith("steps_per_print 10: DeepSpeed's own progress line") for note in translation.notes)
    assert translation.optimizer.type == "AdamW" and translation.optimizer.ds_type == "Adam"
    assert translation.optimizer.kwargs == {"lr": 1.5e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}
    assert overrides["features.recompute.enabled"] == "true"
    assert "features.activation_offload.enabled" not in overrides
    offloaded = translate({**MEGATRON_STYLE, "activation_checkpointing": {"cpu_checkpointing": True}}, 8)
    assert _overrides(offloaded)["features.activation_offload.enabled"] == "true"
    assert offloaded.apply(BASE).features.activation_offload.enabled
    config = translation.apply(BASE)
    assert config.training.lr == 1.5e-4 and config.training.weight_decay == 0.01 and config.training.adam_beta2 == 0.95
    assert config.training.micro_batch_size == 2 and config.training.gradient_accumulation_steps == 4
    assert config.training.log_interval == BASE.training.log_interval
    optimizer = translation.optimizer.build([torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["betas"] == (0.9, 0.95)

    fp32 = translate({"train_batch_size": 8, "tensorboard": {"enabled": True}, "communication_data_type": "bf16"}, 1)
    overrides = _overrides(fp32)
    assert fp32.precision == "fp32" and overrides["parallel.fsdp_plan.param_dtype"] == "fp32"
    assert overrides["parallel.fsdp_plan.reduce_dtype"] == "bf16" and overrides["training.tensorboard"] == "true"
    assert "training.on_nonfinite" not in overrides


def test_gradient_clipping_default_is_deepspeeds():
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    translation = translate({"train_batch_size": 8}, 1)
    assert translation.clip == GRADIENT_CLIPPING_DEFAULT == 1.0
    assert any("default 1.0" in note for note in translation.notes)
    assert translate({"train_batch_size": 8, "gradient_clipping": 0.0}, 1).clip == 0.0


def test_adam_modes_and_defaults_follow_deepspeed():
    from deepspeed.ops.adam import FusedAdam

    fused = inspect.signature(FusedAdam.__init__).parameters
    spec = translate({"train_batch_size": 8, "optimizer": {"type": "adam", "params": {}}}, 1).optimizer
    assert spec.type == "AdamW" and spec.adam_w_mode is True
    assert spec.kwargs == {
        key: (tuple(fused[key].default) if key == "betas" else fused[key].default)
        for key in ("lr", "betas", "eps", "weight_decay")
    }
    adam = translate(
        {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}}, 1
    )
    assert adam.optimizer.type == "Adam" and adam.optimizer.adam_w_mode is False
    assert any("L2 weight decay" in note for note in adam.notes)
    adamw = translate({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}}, 1)
    assert adamw.optimizer.type == "AdamW" and "optimizer.params.adam_w_mode" in adamw.no_effect
    torch_adam = translate(
        {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"torch_adam": True, "amsgrad": True}}}, 1
    )
    assert torch_adam.optimizer.kwargs["amsgrad"] is True
    sgd = translate({"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}, 1)
    assert sgd.optimizer.type == "SGD" and sgd.optimizer.kwargs == {"lr": 0.1, "momentum": 0.9}
    assert isinstance(sgd.optimizer.build([torch.nn.Parameter(torch.zeros(1))]), torch.optim.SGD)
    adagrad = translate({"train_batch_size": 8, "optimizer": {"type": "AdaGrad", "params": {}}}, 1).optimizer
    assert adagrad.type == "Adagrad" and adagrad.lr == 0.01
    default = translate({"train_batch_size": 8}, 1, BASE).optimizer
    assert default.ds_type is None and default.kwargs["lr"] == 3e-4 and default.kwargs["betas"] == (0.9, 0.95)


# --------------------------------------------------------------------------------------------------------------
# Inputs and the explain command
# --------------------------------------------------------------------------------------------------------------


def test_dict_file_hjson_and_base64_inputs(tmp_path):
    config = {"train_batch_size": 16, "zero_optimization": {"stage": 2}}
    original = copy.deepcopy(config)
    assert load_ds_config(config) == config
    translate(config, 2)
    assert config == original, "the caller's dict must not be modified"
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    assert load_ds_config(str(path)) == config and load_ds_config(path) == config
    hjson_path = tmp_path / "ds.hjson"
    hjson_path.write_text("{\n  # comment\n  train_batch_size: 16\n  zero_optimization: {stage: 2}\n}\n")
    assert load_ds_config(hjson_path) == config
    encoded = base64.urlsafe_b64encode(json.dumps(config).encode()).decode()
    assert load_ds_config(encoded) == config
    assert translate(encoded, 2).batch == translate(path, 2).batch == translate(config, 2).batch
    duplicate = tmp_path / "dup.json"
    duplicate.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(UserError, match="duplicate keys \\['train_batch_size'\\]"):
        load_ds_config(duplicate)
    with pytest.raises(UserError, match="neither an existing file nor base64"):
        load_ds_config("missing_ds_config.json")
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2]")
    with pytest.raises(UserError, match="must hold a JSON object"):
        load_ds_config(listing)
    broken = tmp_path / "broken.json"
    broken.write_text('{"train_batch_size": 8,, }')
    with pytest.raises(UserError, match="neither JSON nor hjson"):
        load_ds_config(broken)
    with pytest.raises(UserError, match="is not a file"):
        load_ds_config(tmp_path)


def test_explain_prints_the_triple_and_the_full_mapping(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(HF_ZERO3))
    base_path = tmp_path / "base.yaml"
    base_path.write_text("training:\n  micro_batch_size: 2\n  gradient_accumulation_steps: 4\n  train_iters: 200\n")
    assert main(["explain", str(path), "--world-size", "4", "--config", str(base_path)]) == 0
    out = capsys.readouterr().out
    assert "Batch: train_batch_size 32 = micro 2 x accumulation 4 x data-parallel 4" in out
    assert "ZeRO stage 3 -> FSDP2 sharded, reshard after forward" in out
    assert "parallel.fsdp_plan.cpu_offload=true" in out and "zero_optimization.overlap_comm" in out
    assert "Scheduler: WarmupDecayLR" in out and "keeps the parameters on the device" in out
    assert main(["explain", str(path), "--world-size", "4", "--config", str(base_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["batch"] == {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
    }
    assert data["zero_stage"] == 3 and data["precision"] == "bf16"
    assert data["scheduler"]["lr_at"]["0"] == 0 and "zero_optimization.sub_group_size" in data["no_effect"]
    assert load_config(base_path).training.micro_batch_size == 2


def test_explain_without_config_uses_the_trainers_default_config(capsys):
    """The README's example: the shipped all-"auto" ds_config, no --config: "auto" comes from the config the trainer
    runs without --config (configs/glm45v_tiny.yaml, lr 1e-3), not from the schema defaults (lr 1e-4)."""
    shipped = Path(__file__).resolve().parents[1] / "launch" / "ds_config_zero3_bf16.json"
    assert main(["explain", str(shipped), "--world-size", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    trainer_default = load_config(None).training
    assert trainer_default.lr != TrainingConfig().lr  # otherwise this test could not tell the two apart
    assert data["optimizer"]["kwargs"]["lr"] == trainer_default.lr
    assert data["batch"]["train_micro_batch_size_per_gpu"] == trainer_default.micro_batch_size
    assert main(["explain", str(shipped), "--world-size", "2", "--config", "glm45v_106b_sft"]) == 0
    assert "Batch: train_batch_size" in capsys.readouterr().out


def unit_mib_of(translation) -> float:
    return translation.fields["parallel.fsdp_plan.unit_mib"]


@pytest.mark.parametrize(
    "zero, unit_mib",
    [
        ({"stage": 2}, 5e8 * 4 / 2**20),  # DeepSpeed's default reduce / all-gather bucket
        ({"stage": 1, "reduce_bucket_size": 2**20, "allgather_bucket_size": 2**22}, 16.0),  # the larger bucket
        ({"stage": 3}, 5e7 * 4 / 2**20),  # DeepSpeed's default prefetch bucket
        ({"stage": 3, "stage3_prefetch_bucket_size": "auto", "reduce_bucket_size": 2**30}, 5e7 * 4 / 2**20),
        ({"stage": 3, "prefetch_bucket_size": 2**18}, 1.0),
    ],
)
def test_bucket_sizes_set_the_fsdp_unit_size(zero, unit_mib):
    translation = translate({"train_batch_size": 8, "zero_optimization": zero}, 2)
    assert unit_mib_of(translation) == pytest.approx(unit_mib, abs=1e-3)
    assert any("-> parallel.fsdp_plan.unit_mib" in note for note in translation.notes)
