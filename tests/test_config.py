"""Config schema: YAML + typed overrides, and errors that name the key and the closest valid key."""

import typing
from pathlib import Path

import pytest
import yaml

from glm45v_fsdp.config import (
    ALL_KEYS,
    Config,
    _field_type,
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
        ("training.micro_batch_sise=2", "Did you mean 'training.micro_batch_size'? docs/config.md lists every"),
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
        ("parallel.ring_attention_size=0", "'parallel.ring_attention_size' = 0 is invalid"),
        ("features.ep_balance.enabled=true", "needs expert parallelism with the alltoall dispatcher"),
        ("parallel.ep_plan.dispatcher=broadcast", "is not one of ['alltoall', 'allgather']"),
        ("model.router_skew=-1", "'model.router_skew' = -1.0 is invalid"),
        ("features.router.bias_update_rate=-0.001", "'features.router.bias_update_rate' = -0.001 is invalid"),
        ("features.router.bias_update_rate=1", "in [0, 1)"),
        ("features.router.aux_loss_coef=-1", "'features.router.aux_loss_coef' = -1.0 is invalid"),
        ("features.router.aux_loss_coef=.nan", "a finite number >= 0"),
        ("features.router.aux_loss_type=switch", "is not one of ['sequence', 'transformers']"),
        ("features.router.aux_loss_type=transformers", "set features.router.aux_loss_coef > 0"),
        ("data.dataset=json", "'data.data_path' = None is invalid"),
    ],
)
def test_bad_values_name_the_key(override, expected):
    with pytest.raises(UserError, match=None) as info:
        load_config(None, [override])
    assert expected in str(info.value)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["features.router.bias_update_rate=0.001", "model.lora.rank=8"], "a LoRA run's checkpoints and its PEFT"),
        (
            [
                "features.router.aux_loss_coef=0.01",
                "features.recompute.enabled=true",
                "features.recompute.use_reentrant=true",
            ],
            "the auxiliary loss would get no gradient",
        ),
    ],
)
def test_router_balancing_refuses_what_it_cannot_do(overrides, expected):
    with pytest.raises(UserError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert expected in message and ("bias_update_rate=0" in message or "aux_loss_coef=0" in message), message


def test_an_unknown_key_names_the_closest_few_not_every_key():
    with pytest.raises(UserError) as info:
        load_config(None, ["training.save_inteval=2"])
    message = str(info.value)
    close = "Also close: 'training.eval_interval', 'training.log_interval'."
    assert f"Did you mean 'training.save_interval'? {close}" in message
    assert "training.dump_batches" not in message and len(message) < 200


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


def _literal_keys() -> list[tuple[str, tuple]]:
    """Every key of the schema whose type is a Literal of strings (the enum keys), with its choices."""
    keys = []
    for key in ALL_KEYS:
        field_type = _field_type(key)
        if typing.get_origin(field_type) is typing.Literal:
            keys.append((key, typing.get_args(field_type)))
    return keys


def _nested(key: str, value: object) -> dict:
    tree: dict = {}
    node = tree
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return tree


def test_every_enum_value_reads_as_written_from_files_and_overrides(tmp_path):
    """YAML 1.1 read `mode: off` as False; the config reads YAML 1.2 scalars, so each documented literal (off, on,
    none, ...) arrives as its string, from a YAML file and from a key=value override alike."""
    keys = _literal_keys()
    assert len(keys) >= 10 and ("features.chunk_loss.mode", ("off", "static", "dynamic")) in keys
    needs = {  # what makes the rest of the config valid
        ("data.dataset", "json"): ["data.data_path=d.json"],
        ("data.dataset", "hf"): ["data.data_path=d"],
        ("training.load_format", "hf"): ["training.load=ckpt"],
        ("training.load_format", "dcp"): ["training.load=ckpt"],
        ("training.load_format", "deepspeed"): ["training.load=ckpt"],
        ("features.router.aux_loss_type", "transformers"): ["features.router.aux_loss_coef=0.01"],
    }
    for key, choices in keys:
        for choice in choices:
            path = tmp_path / "c.yaml"
            path.write_text(f"{key.split('.')[0]}:\n" + _yaml_block(key.split(".")[1:], choice, 1))
            extra = needs.get((key, choice), [])
            from_file = _value_of(load_config(path, extra), key)
            from_override = _value_of(load_config(None, [f"{key}={choice}", *extra]), key)
            assert from_file == from_override == choice, (key, choice, from_file, from_override)


def _yaml_block(parts: list[str], value: str, depth: int) -> str:
    """`a:\\n  b: value` as a user writes it by hand (unquoted)."""
    indent = "  " * depth
    if len(parts) == 1:
        return f"{indent}{parts[0]}: {value}\n"
    return f"{indent}{parts[0]}:\n" + _yaml_block(parts[1:], value, depth + 1)


def _value_of(config: Config, key: str) -> object:
    node: object = config
    for part in key.split("."):
        node = getattr(node, part)
    return node


def test_bool_keys_take_yaml_11_words_and_floats_need_no_dot(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("features:\n  recompute:\n    enabled: yes\ntraining:\n  lr: 1e-3\n  deterministic: off\n")
    config = load_config(path, ["features.activation_offload.enabled=on"])
    assert config.features.recompute.enabled is True and config.features.activation_offload.enabled is True
    assert config.training.deterministic is False and config.training.lr == 1e-3
    with pytest.raises(UserError, match="'training.deterministic' expects bool, got 'maybe'"):
        load_config(None, ["training.deterministic=maybe"])


@pytest.mark.parametrize("key", ["data.data_path", "data.image_root"])
def test_a_data_file_with_synthetic_data_is_an_error(tmp_path, key):
    """data.data_path without data.dataset=json used to train on synthetic data, silently."""
    with pytest.raises(UserError, match=rf"'{key}' = .* data.dataset is 'synthetic'.*Set data.dataset=json"):
        load_config(None, [f"{key}={tmp_path}"])
    assert load_config(None, ["data.dataset=json", f"data.data_path={tmp_path}/d.json"]).data.dataset == "json"


def test_shipped_configs_are_reachable_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside the checkout: no configs/ folder here
    for name in ("glm45v_106b_sft", "glm45v_106b_sft.yaml"):
        assert load_config(name).model.preset == "glm-4.5v"
    with pytest.raises(UserError, match="shipped config: glm45v_106b_sft, glm45v_tiny"):
        load_config("glm45v_107b")
    (tmp_path / "glm45v_106b_sft.yaml").write_text("training:\n  train_iters: 3\n")
    assert load_config("glm45v_106b_sft.yaml").model.preset == "tiny"  # a file of that name wins


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["data.mixture=[]"], "'data.mixture' = [] is an empty list: a mixture needs at least one source"),
        (["data.mixture=[{weight: 1}, {weight: 0}]"], "'data.mixture[1].weight' = 0.0 is invalid: it must be a finite"),
        (["data.mixture=[{weight: -2}]"], "'data.mixture[0].weight' = -2.0 is invalid"),
        (["data.mixture=[{weight: .inf}]"], "'data.mixture[0].weight' = inf is invalid"),
        (["data.mixture=[{weight: heavy}]"], "'data.mixture[0].weight' expects float, got 'heavy'"),
        (["data.mixture=[{dataset: jsn, data_path: a.json}]"], "'data.mixture[0].dataset' = 'jsn' is not one of"),
        (
            ["data.mixture=[{weight: 1}, {dataset: json}]"],
            "'data.mixture[1].data_path' = None is invalid: it must be set",
        ),
        (["data.mixture=[{data_path: a.json}]"], "data.mixture[0].dataset is 'synthetic', which reads no file"),
        (
            ["data.mixture=[{wieght: 2}]"],
            "Unknown config key 'data.mixture[0].wieght'. Did you mean 'data.mixture[0].weight'",
        ),
        (
            ["data.mixture=[{max_samples: 0}]"],
            "'data.mixture[0].max_samples' = 0 is invalid: it must be an integer >= 1",
        ),
        (["data.mixture=[{name: a b}]"], "'data.mixture[0].name' = 'a b' is invalid: it must be letters, digits"),
        (["data.mixture=[{name: x}, {name: x}]"], "'data.mixture[0]' and 'data.mixture[1]' have the same name 'x'"),
        (["data.mixture=[3]"], "'data.mixture[0]' = 3 is not a mapping: each item is a mapping {dataset, data_path"),
        (["data.mixture=all"], "'data.mixture' expects a list of mappings {dataset, data_path, weight, max_samples"),
        (["data.mixture=[{}]", "data.data_path=a.json"], "'data.mixture' and 'data.data_path' = 'a.json' are both set"),
        (["data.mixture=[{}]", "data.dataset=hf"], "'data.mixture' and 'data.dataset' = 'hf' are both set"),
        (["data.mixture=[{}]", "data.hf_split=test"], "'data.hf_split' = 'test' is set, but no data.mixture source"),
        (["data.mixture=[{}]", "data.image_root=img"], "'data.image_root' = 'img' is set, but every data.mixture"),
        (
            ["data.mixture=[{}]", "data.validation_split=0.1"],
            "'data.validation_split' = 0.1 is set together with data.mixture",
        ),
        (
            ["data.mixture=[{}]", "data.validation_path=v.jsonl"],
            "but the mixture has no file format (every source is synthetic)",
        ),
        (
            [
                "data.mixture=[{dataset: json, data_path: a.jsonl}, {dataset: hf, data_path: b}]",
                "data.validation_path=v",
            ],
            "but the mixture has hf and json. Give the mixture's sources one file format",
        ),
    ],
)
def test_mixture_keys_are_validated(overrides, expected):
    with pytest.raises(UserError) as info:
        load_config(None, overrides)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_a_mixture_reads_the_same_from_yaml_and_overrides(tmp_path):
    from glm45v_fsdp.config import mixture_names

    path = tmp_path / "c.yaml"
    path.write_text(
        "data:\n  mixture:\n    - {dataset: json, data_path: /d/ocr.jsonl, weight: 3}\n"
        "    - dataset: json\n      data_path: /e/ocr.jsonl\n      max_samples: 100\n    - {dataset: synthetic}\n"
        "  mixture_allow_change: true\n"
    )
    from_file = load_config(path)
    entries = "[{dataset: json, data_path: /d/ocr.jsonl, weight: 3}, {dataset: json, data_path: /e/ocr.jsonl, "
    entries += "max_samples: 100}, {dataset: synthetic}]"
    from_overrides = load_config(None, [f"data.mixture={entries}", "data.mixture_allow_change=on"])
    assert from_file.data.mixture == from_overrides.data.mixture
    assert from_file.data.mixture_allow_change is from_overrides.data.mixture_allow_change is True
    assert [source.weight for source in from_file.data.mixture] == [3.0, 1.0, 1.0]
    assert mixture_names(from_file.data.mixture) == ["ocr_0", "ocr_1", "synthetic"]
    assert load_config(path, ["training.train_iters=3"]).data.mixture == from_file.data.mixture
    again = yaml.safe_load(dump_yaml(from_file))
    assert again["data"]["mixture"][1] == {
        "dataset": "json",
        "data_path": "/e/ocr.jsonl",
        "weight": 1.0,
        "max_samples": 100,
        "name": None,
    }
