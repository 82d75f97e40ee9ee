"""Config schema: YAML + typed overrides, and errors that name the key and the closest valid key."""

from pathlib import Path

import pytest
import yaml

from glm45v_fsdp.config import (
    ALL_KEYS,
    Config,
    default_config_path,
    dump_yaml,
    load_config,
    validate_layout,
)
from glm45v_fsdp.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def test_default_config_is_the_tiny_yaml():
    assert default_config_path() == REPO / "configs" / "glm45v_tiny.yaml"
    config = load_config()
    assert config.model.preset == "tiny" and config.model.name_or_path is None
    assert config.data.dataset == "synthetic"


def test_overrides_are_typed():
    config = load_config(
        None,
        [
            "training.train_iters=7",
            "training.lr=3e-4",
            "training.deterministic=true",
            "training.track_memory=null",
            "parallel.fsdp_plan.apply_modules=[model.language_model.layers.{0-1}, lm_head]",
            "parallel.fsdp_plan.param_dtype=fp32",
            "model.config_overrides.text_config.vocab_size=65536",
            "training.output_dir=007",
        ],
    )
    assert config.training.train_iters == 7
    assert config.training.lr == pytest.approx(3e-4)
    assert config.training.deterministic is True
    assert config.training.track_memory is None
    assert config.parallel.fsdp_plan.apply_modules == ["model.language_model.layers.{0-1}", "lm_head"]
    assert config.model.config_overrides == {"text_config": {"vocab_size": 65536}}
    assert config.training.output_dir == "007"


def test_overrides_merge_onto_yaml_dicts(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"config_overrides": {"text_config": {"num_hidden_layers": 3}}}}))
    config = load_config(path, ["model.config_overrides.text_config.vocab_size=1024"])
    assert config.model.config_overrides == {"text_config": {"num_hidden_layers": 3, "vocab_size": 1024}}


@pytest.mark.parametrize(
    "override, expected",
    [
        ("training.micro_batch_sise=2", "Did you mean 'training.micro_batch_size'"),
        ("trainig.lr=1", "Did you mean 'training'"),
        ("micro_batch_size=2", "Did you mean 'training.micro_batch_size'"),
        ("training.micro_batch_size=0", "'training.micro_batch_size' = 0 is invalid"),
        ("training.micro_batch_size=two", "'training.micro_batch_size' expects int"),
        ("training.lr=fast", "'training.lr' expects float"),
        ("parallel.fsdp_plan.param_dtype=fp8", "is not one of ['bf16', 'fp16', 'fp32']"),
        ("training.lr_scheduler=cosin", "Did you mean 'cosine'"),
        ("training.deterministic=maybe", "'training.deterministic' expects bool"),
        ("training.lr", "has no '='"),
        ("training.min_lr=1.0", "'training.min_lr' = 1.0 is invalid"),
        ("parallel.expert_parallel_size=2", "not supported by this version yet"),
        ("data.dataset=json", "'data.data_path' = None is invalid"),
    ],
)
def test_bad_values_name_the_key(override, expected):
    with pytest.raises(UserError, match=None) as info:
        load_config(None, [override])
    assert expected in str(info.value)


def test_unknown_yaml_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  gradient_accumulation: 2\n")
    with pytest.raises(UserError, match="training.gradient_accumulation_steps"):
        load_config(path)


def test_missing_config_file(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_layout_must_divide_world_size():
    config = load_config(None, ["parallel.data_parallel_replicate_size=3"])
    validate_layout(config.parallel, 6)
    with pytest.raises(UserError, match="parallel.data_parallel_replicate_size"):
        validate_layout(config.parallel, 4)


def test_resolved_config_round_trips():
    config = load_config(None, ["training.train_iters=3"])
    again = load_config(None, [])
    tree = yaml.safe_load(dump_yaml(config))
    assert tree["training"]["train_iters"] == 3
    assert isinstance(again, Config)
    assert "parallel.fsdp_plan.param_dtype" in ALL_KEYS


def test_docs_list_every_key():
    text = (REPO / "docs" / "config.md").read_text()
    missing = [key for key in ALL_KEYS if f"`{key}`" not in text and "." in key]
    assert missing == []
