"""data.dataset=hf: the same records as a JSON file, a save_to_disk directory (images as the datasets.Image feature's
bytes) and a parquet file (images as paths) give identical samples; splits; bad rows stopped or skipped; the errors
of a wrong path, column or split; a 2-step training run with the same losses as from the JSON file."""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from conftest import read_metrics, train
from datasets import Dataset, DatasetDict, List
from datasets import Image as ImageFeature
from PIL import Image

from glm45v_fsdp.config import Config, ConfigError, DataConfig, load_config
from glm45v_fsdp.data import HfImageTextDataset, build_dataset, build_image_processor, build_tiny_tokenizer
from glm45v_fsdp.data import records as records_module
from glm45v_fsdp.data.hf_datasets import load_image_bytes
from glm45v_fsdp.data.images import BadImage, load_image
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.log import get_logger
from glm45v_fsdp.model import load_hf_config

KEYS = (
    "input_ids",
    "labels",
    "mm_token_type_ids",
    "position_ids",
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "num_valid_tokens",
)


def user_assistant(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


# the records, JSON style (paths relative to the data directory): text only, ShareGPT with an image, LLaVA with two,
# a frame-folder video with its fps, an image and a video
RECORDS = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            *user_assistant("Hello there.", "Hi."),
            *user_assistant("And again?", "Hi again."),
        ]
    },
    {"messages": user_assistant("<image>\nWhat color?", "Blue."), "images": ["a.png"]},
    {
        "conversations": [{"from": "human", "value": "<image><image>Compare."}, {"from": "gpt", "value": "Blue, red."}],
        "images": ["a.png", "b.png"],
    },
    {"messages": user_assistant("<video>\nWhat happens?", "A square moves."), "videos": ["clip"], "video_fps": 4.0},
    {
        "messages": user_assistant("<image> then <video>: same colour?", "No."),
        "images": ["b.png"],
        "videos": ["clip"],
        "video_fps": 4.0,
    },
]


def table(rows: list[dict]) -> Dataset:
    """The rows as a Dataset, one column per key of any row (null where a row lacks it: from_list would keep only
    the first row's keys)."""
    keys = list(dict.fromkeys(key for row in rows for key in row))
    return Dataset.from_dict({key: [row.get(key) for row in rows] for key in keys})


@pytest.fixture(autouse=True)
def hf_cache(tmp_path_factory, monkeypatch):
    """The library's Arrow cache (parquet is converted into it) in a temporary directory, not the user's."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.getbasetemp() / "hf_cache")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """a.png, b.png, clip/ (6 frames at 4 fps), data.json (RECORDS), disk/ (save_to_disk, images as bytes whose
    recorded paths exist nowhere), data.parquet (images as paths)."""
    root = tmp_path_factory.mktemp("hf_data")
    Image.new("RGB", (56, 56), (0, 128, 255)).save(root / "a.png")
    Image.effect_noise((84, 56), 50).convert("RGB").save(root / "b.png")
    (root / "clip").mkdir()
    for i in range(6):
        frame = Image.new("RGB", (56, 56), (20, 20, 20))
        frame.paste((250, 250, 0), (8 * i, 8, 8 * i + 12, 20))
        frame.save(root / "clip" / f"{i:04d}.png")
    (root / "data.json").write_text(json.dumps(RECORDS))
    with_bytes = [
        {
            **record,
            "images": [{"bytes": (root / name).read_bytes(), "path": f"missing-{name}"} for name in record["images"]],
        }
        if "images" in record
        else record
        for record in RECORDS
    ]
    disk = table(with_bytes).cast_column("images", List(ImageFeature()))
    assert isinstance(disk.features["images"].feature, ImageFeature)
    disk.save_to_disk(str(root / "disk"))
    table(RECORDS).to_parquet(str(root / "data.parquet"))
    return root


@pytest.fixture(scope="module")
def hf_config():
    return load_hf_config(Config().model)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def image_processor(hf_config):
    return build_image_processor(hf_config.vision_config)


def build(hf_config, tokenizer, image_processor, **keys):
    return build_dataset(DataConfig(**keys), hf_config, tokenizer, image_processor)


def assert_same_samples(ours, reference) -> None:
    assert len(ours) == len(reference) == len(RECORDS)
    for position in range(len(reference)):
        a, b = ours[position], reference[position]
        assert sorted(a) == sorted(b), (position, sorted(a), sorted(b))
        for key in KEYS:
            if key in b:
                assert torch.equal(a[key], b[key]), (position, key)


@pytest.fixture(scope="module")
def reference(folder, hf_config, tokenizer, image_processor):
    json_data = build(hf_config, tokenizer, image_processor, dataset="json", data_path=str(folder / "data.json"))
    keys = set().union(*(json_data[i] for i in range(len(json_data))))
    assert keys == set(KEYS)  # every tensor key is compared somewhere
    return json_data


@contextlib.contextmanager
def logged(level: int):
    """The glm45v_fsdp logger's messages at `level` and above while the block runs (a handler of its own: the
    trainer's logging setup in an earlier test of the session may have stopped the logger's propagation)."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger, handler = get_logger(), Collect(level)
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(min(level, previous or level))
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


@pytest.mark.parametrize("source", ["disk", "data.parquet"])
def test_hf_samples_equal_the_json_ones(folder, hf_config, tokenizer, image_processor, reference, source):
    # relative paths are relative to data.image_root, by default the directory data_path names or the file's directory
    root = str(folder) if source == "disk" else None
    with logged(logging.INFO) as messages:
        data = build(
            hf_config, tokenizer, image_processor, dataset="hf", data_path=str(folder / source), image_root=root
        )
    assert isinstance(data, HfImageTextDataset) and data.split is None
    assert_same_samples(data, reference)
    assert data.summary().startswith(f"Hugging Face data set '{folder / source}' (data.dataset=hf), 5 rows with ")
    assert "5 rows with 4 image(s) and 2 video(s)" in data.summary()
    assert "5 records with 4 image(s) and 2 video(s)" in reference.summary()
    assert any("holds 5 rows" in line for line in messages), messages
    assert any("checked 5 of 5 rows" in line for line in messages), messages


def test_the_image_bytes_are_read_not_the_paths(folder, hf_config, tokenizer, image_processor):
    """The saved rows' image paths exist nowhere: the samples come from the bytes."""
    rows = datasets.load_from_disk(str(folder / "disk")).with_format("arrow")
    assert rows[1].to_pylist()[0]["images"][0]["path"] == "missing-a.png"
    assert not list(folder.rglob("missing-*"))
    data = build(
        hf_config, tokenizer, image_processor, dataset="hf", data_path=str(folder / "disk"), image_root=str(folder)
    )
    assert data[1]["image_grid_thw"].tolist() == [[1, 4, 4]]


def test_a_single_image_column(folder, tmp_path, hf_config, tokenizer, image_processor, reference):
    """A hub-style row: LLaVA turns and one datasets.Image value under "image" (not a list)."""
    row = {
        "conversations": [{"from": "human", "value": "<image>\nWhat color?"}, {"from": "gpt", "value": "Blue."}],
        "image": {"bytes": (folder / "a.png").read_bytes(), "path": None},
    }
    table([row]).cast_column("image", ImageFeature()).save_to_disk(str(tmp_path / "d"))
    data = build(hf_config, tokenizer, image_processor, dataset="hf", data_path=str(tmp_path / "d"))
    sample, expected = data[0], reference[1]
    assert sorted(sample) == sorted(expected) and all(torch.equal(sample[key], expected[key]) for key in expected)


def test_a_split_of_a_dataset_dict(folder, tmp_path, hf_config, tokenizer, image_processor, reference):
    full = datasets.load_from_disk(str(folder / "disk"))
    DatasetDict({"train": full.select([0]), "validation": full}).save_to_disk(str(tmp_path / "dict"))
    path = str(tmp_path / "dict")
    data = build(
        hf_config,
        tokenizer,
        image_processor,
        dataset="hf",
        data_path=path,
        hf_split="validation",
        image_root=str(folder),
    )
    assert data.split == "validation" and "(data.dataset=hf, split 'validation')" in data.summary()
    assert_same_samples(data, reference)
    assert len(build(hf_config, tokenizer, image_processor, dataset="hf", data_path=path)) == 1  # "train"
    with pytest.raises(UserError, match=r"'data.hf_split' = 'test'.*splits are \['train', 'validation'\]"):
        build(hf_config, tokenizer, image_processor, dataset="hf", data_path=path, hf_split="test")
    with pytest.raises(UserError, match=r"'data.hf_split' = 'validation'.*without splits. Remove data.hf_split"):
        build(
            hf_config, tokenizer, image_processor, dataset="hf", data_path=str(folder / "disk"), hf_split="validation"
        )


def test_parquet_splits_by_file_name(folder, tmp_path, hf_config, tokenizer, image_processor):
    (tmp_path / "data").mkdir()
    table(RECORDS).select([0, 1]).to_parquet(str(tmp_path / "data" / "train-00000-of-00001.parquet"))
    table(RECORDS).select([1, 2, 3, 4]).to_parquet(str(tmp_path / "data" / "test-00000-of-00001.parquet"))
    for name in ("a.png", "b.png"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    (tmp_path / "clip").symlink_to(folder / "clip")
    lengths = {
        split: len(build(hf_config, tokenizer, image_processor, dataset="hf", data_path=str(tmp_path), hf_split=split))
        for split in ("train", "test")
    }
    assert lengths == {"train": 2, "test": 4}


def bad_rows(tmp_path: Path) -> Path:
    """Row 1 of 3 holds bytes that are no image."""
    good = {"messages": user_assistant("Hi.", "Hello."), "images": []}
    bad = {
        "messages": user_assistant("<image>What?", "A square."),
        "images": [{"bytes": b"not an image", "path": None}],
    }
    table([good, bad, good]).cast_column("images", List(ImageFeature())).save_to_disk(str(tmp_path / "d"))
    return tmp_path / "d"


def test_a_bad_row_stops_naming_the_row(tmp_path, hf_config, tokenizer, image_processor):
    path = bad_rows(tmp_path)
    with pytest.raises(UserError) as error:
        build(hf_config, tokenizer, image_processor, dataset="hf", data_path=str(path))
    text = str(error.value)
    assert f"Hugging Face data set '{path}' (data.data_path) has 1 bad row(s) of 3" in text, text
    assert f"The first: Row 1 (0-based) of Hugging Face data set '{path}': image 'image 0 (bytes in the row)'" in text
    assert "cannot be decoded as an image" in text and "data.on_bad_record=skip" in text


def test_a_bad_row_is_skipped_when_asked(tmp_path, hf_config, tokenizer, image_processor):
    path = bad_rows(tmp_path)
    with logged(logging.WARNING) as messages:
        data = build(hf_config, tokenizer, image_processor, dataset="hf", data_path=str(path), on_bad_record="skip")
    assert (len(data), data.skipped_records, data.total_records, list(data.indices)) == (2, 1, 3, [0, 2])
    assert data.describe(1) == f"Row 2 (0-based) of Hugging Face data set '{path}'"
    assert "2 rows with 0 image(s) and 0 video(s)" in data.summary() and "1 bad row(s) skipped" in data.summary()
    assert any(f"Row 1 (0-based) of Hugging Face data set '{path}'" in line for line in messages)
    assert any("skipped 1 bad row(s) of 3" in line for line in messages), messages


def test_each_rank_reads_only_its_rows(tmp_path, monkeypatch, hf_config, tokenizer, image_processor):
    """2 ranks, simulated: rank 1 reads rows 1 only and finds it bad; rank 0 reads rows 0 and 2 only and still stops
    naming row 1, from the gathered findings."""
    path = bad_rows(tmp_path)
    read: list[int] = []
    row = HfImageTextDataset.row
    monkeypatch.setattr(HfImageTextDataset, "row", lambda self, index: read.append(index) or row(self, index))
    parts: dict[int, tuple] = {}  # each rank's contribution to the gather

    def as_rank(rank: int) -> list[int]:
        """The rows rank `rank` of 2 reads while it builds the data set (which stops on the gathered bad row)."""

        def gather(value: tuple) -> list[tuple]:
            parts[rank] = value
            return [parts.get(0, ({}, 0, 0)), parts.get(1, ({}, 0, 0))]

        monkeypatch.setattr(records_module, "rank_and_world", lambda: (rank, 2))
        monkeypatch.setattr(records_module, "gather_objects", gather)
        read.clear()
        with pytest.raises(UserError, match=r"has 1 bad row\(s\) of 3.*The first: Row 1 \(0-based\)"):
            build(hf_config, tokenizer, image_processor, dataset="hf", data_path=str(path))
        return list(read)

    assert as_rank(1) == [1] and list(parts[1][0]) == [1]
    assert as_rank(0) == [0, 2] and parts[0] == ({}, 0, 0)  # rank 0 stops on rank 1's finding


def test_the_data_set_pickles_small_for_loader_workers(folder, hf_config, tokenizer, image_processor):
    """A DataLoader worker gets the memory-mapped table by reference, not its rows."""
    data = build(
        hf_config, tokenizer, image_processor, dataset="hf", data_path=str(folder / "disk"), image_root=str(folder)
    )
    copy = pickle.loads(pickle.dumps(data))
    assert len(pickle.dumps(data.rows)) < 4096 < (folder / "disk" / "data-00000-of-00001.arrow").stat().st_size
    assert all(torch.equal(copy[4][key], data[4][key]) for key in data[4])


def test_row_errors_reuse_the_record_checks(tmp_path, hf_config, tokenizer, image_processor):
    """The JSON reader's checks on rows: roles, tag counts, reserved tokens, a missing image file."""
    cases = [
        ({"messages": user_assistant("Hi", "x")[::-1], "images": []}, "must alternate"),
        ({"messages": user_assistant("<image>", "x"), "images": []}, r"1 '<image>' tag\(s\) but 0 image"),
        ({"messages": user_assistant("<|image|>", "x"), "images": []}, "reserved"),
        ({"messages": user_assistant("<image>", "x"), "images": ["gone.png"]}, r"gone\.png' does not exist"),
    ]
    for number, (row, message) in enumerate(cases):
        table([row]).save_to_disk(str(tmp_path / f"d{number}"))
        with pytest.raises(UserError, match=message) as error:
            build(hf_config, tokenizer, image_processor, dataset="hf", data_path=str(tmp_path / f"d{number}"))
        assert "Row 0 (0-based) of Hugging Face data set" in str(error.value)


def test_path_and_column_errors(tmp_path, hf_config, tokenizer, image_processor):
    def error_of(path) -> str:
        with pytest.raises(UserError) as error:
            build(hf_config, tokenizer, image_processor, dataset="hf", data_path=str(path))
        return str(error.value)

    table([{"text": "hi", "label": 1}]).save_to_disk(str(tmp_path / "columns"))
    text = error_of(tmp_path / "columns")
    assert "no 'messages' or 'conversations' column; its columns are ['text', 'label']" in text, text
    assert "data.data_path" in text and "rename_column" in text
    text = error_of(tmp_path / "missing")
    assert f"'data.data_path' = '{tmp_path / 'missing'}' does not exist" in text and "save_to_disk" in text
    (tmp_path / "empty").mkdir()
    assert "is not a Hugging Face data set" in error_of(tmp_path / "empty")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is no parquet file")
    text = error_of(tmp_path / "broken.parquet")
    assert f"'data.data_path' = '{tmp_path / 'broken.parquet'}' cannot be read as a Hugging Face data set" in text


def test_missing_library_names_the_install(monkeypatch, folder, hf_config, tokenizer, image_processor):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(UserError, match=r"pip install datasets"):
        build(hf_config, tokenizer, image_processor, dataset="hf", data_path=str(folder / "disk"))


def test_config_keys():
    with pytest.raises(ConfigError, match=r"'data.data_path' = None .* data.dataset is 'hf'"):
        load_config(None, ["data.dataset=hf"])
    with pytest.raises(ConfigError, match=r"'data.hf_split' = 'test' .* data.dataset is 'json'"):
        load_config(None, ["data.dataset=json", "data.data_path=d.json", "data.hf_split=test"])
    config = load_config(None, ["data.dataset=hf", "data.data_path=d", "data.hf_split=test"])
    assert (config.data.dataset, config.data.hf_split) == ("hf", "test")


def test_image_bytes_get_the_bounded_decode(folder):
    data = (folder / "b.png").read_bytes()
    assert np.array_equal(
        np.asarray(load_image_bytes(data, 10**6, 10**8)), np.asarray(load_image(folder / "b.png", 10**6, 10**8))
    )
    assert load_image_bytes(data, 1000, 10**8).size == load_image(folder / "b.png", 1000, 10**8).size == (38, 25)
    with pytest.raises(BadImage, match=r"84x56 pixels \(PNG\).*over data.max_image_pixels=1,000"):
        load_image_bytes(data, 1000, 1000)
    with pytest.raises(BadImage, match="empty"):
        load_image_bytes(b"", 1000, 1000)
    with pytest.raises(BadImage, match="cannot be decoded"):
        load_image_bytes(data[: len(data) // 2], 10**6, 10**8)


def test_training_losses_equal_the_json_run(folder, tmp_path):
    common = ["training.train_iters=2", "training.micro_batch_size=2", "data.shuffle=false"]
    losses = {}
    for name, keys in {
        "json": ["data.dataset=json", f"data.data_path={folder / 'data.json'}"],
        "hf": ["data.dataset=hf", f"data.data_path={folder / 'disk'}", f"data.image_root={folder}"],
    }.items():
        result = train(tmp_path / name, [*keys, *common])
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        losses[name] = [record["loss"] for record in read_metrics(tmp_path / name)]
        if name == "hf":
            assert "Hugging Face data set" in result.stdout + result.stderr
    print(f"losses {losses}")
    assert len(losses["json"]) == 2 and all(loss > 0 for loss in losses["json"])
    for ours, reference in zip(losses["hf"], losses["json"], strict=True):
        assert abs(ours - reference) <= 1e-6 * abs(reference), losses
