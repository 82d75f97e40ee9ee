"""AutoEP's newer shape (DeepSpeed 0.20): `expert_parallel` under ZeRO-3, `load_balance_coeff: null`, and the
transport switch DEEPSPEED_AUTOEP_COMM_BACKEND / DEEPSPEED_AUTOEP_COMM_SMS (ds_compat/autoep_env.py).

The installed DeepSpeed's AutoEP parser is the reference for what `load_balance_coeff` accepts. The ZeRO-3 + EP
training itself runs in tests/test_glm_door.py ("on": ZeRO 3, autoep_size 2, load_balance_coeff null).
"""

from __future__ import annotations

import os

import pytest

from ds_compat.autoep_env import COMM_BACKEND, COMM_SMS
from ds_compat.config import translate
from glm45v_fsdp.config import Config
from glm45v_fsdp.errors import ConfigError, UserError

os.environ.setdefault("DS_ACCELERATOR", "cpu")
from deepspeed.module_inject.auto_ep_config import parse_autoep_config  # noqa: E402

EP2_ZERO3 = {
    "train_batch_size": 8,
    "zero_optimization": {"stage": 3},
    "expert_parallel": {"enabled": True, "autoep_size": 2, "load_balance_coeff": None},
}


def _overrides(translation) -> dict[str, str]:
    return dict(item.split("=", 1) for item in translation.overrides)


def test_expert_parallel_under_zero3_with_a_null_balance_coefficient_is_taken():
    parse_autoep_config(EP2_ZERO3["expert_parallel"])  # DeepSpeed accepts the section
    translation = translate(EP2_ZERO3, 4)
    assert translation.zero_stage == 3
    assert _overrides(translation)["parallel.expert_parallel_size"] == "2"
    parallel = translation.apply(Config()).parallel
    assert (parallel.expert_parallel_size, parallel.data_parallel_replicate_size) == (2, 1)
    assert "expert_parallel.load_balance_coeff" in translation.no_effect  # null: DeepSpeed's default, nothing to do
    coefficient = {**EP2_ZERO3, "expert_parallel": {**EP2_ZERO3["expert_parallel"], "load_balance_coeff": 0.01}}
    with pytest.raises(ValueError, match="load_balance_coeff"):
        parse_autoep_config(coefficient["expert_parallel"])  # refused by DeepSpeed too
    with pytest.raises(UserError, match="'expert_parallel.load_balance_coeff' = 0.01"):
        translate(coefficient, 4)


def test_the_nccl_transport_is_taken(monkeypatch):
    monkeypatch.setenv(COMM_BACKEND, "nccl")
    translation = translate(EP2_ZERO3, 4)
    assert any(note.startswith(f"{COMM_BACKEND}=nccl: taken") for note in translation.notes)
    assert _overrides(translation)["parallel.expert_parallel_size"] == "2"


@pytest.mark.parametrize(
    "name, value, said",
    [
        (COMM_BACKEND, "deepep", f"{COMM_BACKEND}='deepep' asks AutoEP's expert all-to-all to travel by DeepEP"),
        (COMM_BACKEND, "ucx", "an unknown transport"),
        (COMM_SMS, "24", f"{COMM_SMS}='24' sets the SMs of DeepEP's kernels"),
    ],
)
def test_deepep_and_its_settings_are_refused(monkeypatch, name, value, said):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=f"{said}.*Unset {name}"):
        translate(EP2_ZERO3, 4)


def test_the_transport_has_no_effect_without_expert_parallelism(monkeypatch):
    monkeypatch.setenv(COMM_BACKEND, "deepep")
    translation = translate({"train_batch_size": 8, "zero_optimization": {"stage": 3}}, 4)
    said = f"{COMM_BACKEND}=deepep: expert parallelism is off (expert_parallel), so it has no effect, as in DeepSpeed."
    assert said in translation.notes
