"""Hostile data (issue 17, part 6): every kind of bad record stops the run before step 1 naming the record and the
file, or is skipped with data.on_bad_record=skip; never a traceback, never a hang, no out-of-memory decode.

In process: a corpus of bad records, each placed between two good ones (so the message must name record 1), read
with `stop` and with `skip`; file-level damage that no skip can mend; a 20000x20000 JPEG decoded at a reduced scale
in a child process whose peak memory is measured. As real runs: 2 ranks (plain processes, so no launcher ends one rank
for the other), where the only records that fail to encode sit at positions that rank 1 checks, so rank 0 must learn
of them through the gathered check.
"""

from __future__ import annotations

import json
import logging
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, clean_env, free_port, read_metrics
from PIL import Image
from transformers import Glm4vMoeVisionConfig

from glm45v_fsdp.config import DataConfig
from glm45v_fsdp.data import JsonImageTextDataset, build_image_processor, build_tiny_tokenizer
from glm45v_fsdp.data.images import BadImage, load_image
from glm45v_fsdp.errors import UserError

HUGE = 20_000  # pixels per side of the oversized images


def turns(question: str = "<image>\nWhat is it?", answer: str = "A square.") -> list[dict]:
    return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]


def good_record() -> dict:
    return {"image": "good.png", "conversations": turns()}


def write_images(folder: Path) -> None:
    """good.png, truncated.jpg, empty.png, text.png (not an image), huge.png (20000x20000, 1-bit: small on disk)."""
    Image.new("RGB", (56, 56), (0, 128, 255)).save(folder / "good.png")
    Image.effect_noise((64, 64), 60).convert("RGB").save(folder / "whole.jpg", quality=90)
    whole = (folder / "whole.jpg").read_bytes()
    (folder / "truncated.jpg").write_bytes(whole[: len(whole) // 2])
    (folder / "empty.png").write_bytes(b"")
    (folder / "text.png").write_bytes(b"this is not an image\n")
    Image.new("1", (HUGE, HUGE), 1).save(folder / "huge.png")


# (name, the bad record, what the message must say)
CORPUS = [
    ("truncated jpeg", {"image": "truncated.jpg", "conversations": turns()}, r"truncated\.jpg.*(truncated|broken)"),
    ("zero-byte image", {"image": "empty.png", "conversations": turns()}, r"empty\.png.*the file is empty"),
    ("not an image", {"image": "text.png", "conversations": turns()}, r"text\.png.*cannot be decoded as an image"),
    (
        "20000x20000 png",
        {"image": "huge.png", "conversations": turns()},
        r"huge\.png.*20000x20000 pixels \(PNG\).*data\.max_image_pixels",
    ),
    ("image tag without image", {"conversations": turns()}, r"1 '<image>' tag\(s\) but 0 image"),
    ("image without tag", {"image": "good.png", "conversations": turns("Hi")}, r"0 '<image>' tag\(s\) but 1 image"),
    ("no assistant turn", {"conversations": turns()[:1]}, "ending with assistant"),
    ("missing image file", {"image": "gone.png", "conversations": turns()}, r"gone\.png' does not exist"),
    ("not utf-8 line", b'{"conversations": "caf\xe9"}', "line 2 is not UTF-8"),
    ("not json line", b"{oops", "line 2 is not valid JSON"),
]


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hostile")
    write_images(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def image_processor():
    return build_image_processor(Glm4vMoeVisionConfig(patch_size=14, temporal_patch_size=2, spatial_merge_size=2))


def write_jsonl(path: Path, records: list) -> Path:
    lines = [record if isinstance(record, bytes) else json.dumps(record).encode() for record in records]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def dataset(path: Path, tokenizer, image_processor, on_bad_record: str = "stop") -> JsonImageTextDataset:
    data = DataConfig(dataset="json", data_path=str(path), cutoff_len=512, on_bad_record=on_bad_record)
    return JsonImageTextDataset(data, tokenizer, image_processor, 2)


@pytest.mark.parametrize(("name", "bad", "message"), CORPUS, ids=[case[0] for case in CORPUS])
def test_a_bad_record_stops_naming_record_and_file(corpus_dir, tokenizer, image_processor, name, bad, message):
    path = write_jsonl(corpus_dir / f"{name.replace(' ', '_')}.jsonl", [good_record(), bad, good_record()])
    with pytest.raises(UserError, match=message) as error:
        dataset(path, tokenizer, image_processor)
    text = str(error.value)
    assert "Record 1 (0-based)" in text and str(path) in text and "1 bad record(s) of 3" in text, text
    assert "data.on_bad_record=skip" in text


@pytest.mark.parametrize(("name", "bad", "message"), CORPUS, ids=[case[0] for case in CORPUS])
def test_a_bad_record_is_skipped_when_asked(corpus_dir, tokenizer, image_processor, caplog, name, bad, message):
    path = write_jsonl(corpus_dir / f"skip_{name.replace(' ', '_')}.jsonl", [good_record(), bad, good_record()])
    with caplog.at_level(logging.WARNING, logger="glm45v_fsdp"):
        data = dataset(path, tokenizer, image_processor, on_bad_record="skip")
    assert (len(data), data.skipped_records, data.total_records) == (2, 1, 3)
    assert data[0]["image_grid_thw"].tolist() == data[1]["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert "1 bad record(s) skipped" in data.summary()
    assert any("Record 1 (0-based)" in line for line in caplog.messages), caplog.messages
    assert any("skipped 1 bad record(s) of 3" in line for line in caplog.messages), caplog.messages


def test_every_kind_at_once_counts_each(corpus_dir, tokenizer, image_processor):
    records = [good_record()] + [bad for _, bad, _ in CORPUS] + [good_record()]
    path = write_jsonl(corpus_dir / "all.jsonl", records)
    with pytest.raises(UserError, match=f"{len(CORPUS)} bad record\\(s\\) of {len(records)}.*The first: Record 1 "):
        dataset(path, tokenizer, image_processor)
    data = dataset(path, tokenizer, image_processor, on_bad_record="skip")
    assert (len(data), data.skipped_records) == (2, len(CORPUS))


def test_file_level_damage_stops_even_with_skip(corpus_dir, tokenizer, image_processor):
    (corpus_dir / "empty.json").write_bytes(b"")
    (corpus_dir / "empty.jsonl").write_bytes(b"")
    (corpus_dir / "latin1.json").write_bytes(json.dumps([good_record()]).encode()[:-2] + b', "caf\xe9"]')
    cases = [
        ("empty.json", r"empty\.json' \(data.data_path\) is empty"),
        ("empty.jsonl", r"empty\.jsonl' \(data.data_path\) is empty"),
        ("latin1.json", r"latin1\.json' \(data.data_path\) is not UTF-8.*cannot skip part of a \.json file"),
    ]
    for name, message in cases:
        for policy in ("stop", "skip"):
            with pytest.raises(UserError, match=message):
                dataset(corpus_dir / name, tokenizer, image_processor, on_bad_record=policy)
    only_bad = write_jsonl(corpus_dir / "only_bad.jsonl", [CORPUS[0][1], CORPUS[1][1]])
    with pytest.raises(UserError, match=r"Every record .*only_bad\.jsonl.*is bad \(2 of 2\)"):
        dataset(only_bad, tokenizer, image_processor, on_bad_record="skip")


def test_bad_records_inside_a_json_list_are_named_by_position(corpus_dir, tokenizer, image_processor):
    path = corpus_dir / "list.json"
    path.write_text(json.dumps([good_record(), good_record(), {"image": "empty.png", "conversations": turns()}]))
    with pytest.raises(UserError, match=r"Record 2 \(0-based\) of data file .*list\.json.*empty\.png"):
        dataset(path, tokenizer, image_processor)


HUGE_JPEG_CHILD = """
import resource, sys, time
from pathlib import Path
from glm45v_fsdp.data.images import load_image
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
image = load_image(Path(sys.argv[1]), max_pixels=int(sys.argv[2]), max_decode_pixels=89_478_485)
print(image.width, image.height, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024,
      round(time.perf_counter() - start, 2))
"""


def test_a_20000px_jpeg_is_decoded_small_and_resized(tmp_path, tokenizer, image_processor):
    """Decoded at 1/8 scale and resized to the pixel budget: the load raises the child's peak memory far less than
    the 1.2 GB that a full RGB decode of 20000x20000 needs; as a record it trains like any image within the budget."""
    huge = tmp_path / "huge.jpg"
    Image.new("L", (HUGE, HUGE), 200).save(huge, quality=50)
    budget = 56 * 56 * 4  # pixels: the processor then makes a 4x4 patch grid
    child = subprocess.run(
        [sys.executable, "-c", HUGE_JPEG_CHILD, str(huge), str(budget)],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=120,
    )
    assert child.returncode == 0, child.stderr
    width, height, peak_mib, seconds = child.stdout.split()
    print(f"20000x20000 JPEG -> {width}x{height}: peak RSS +{peak_mib} MiB, {seconds} s")
    assert int(width) * int(height) <= budget and int(width) == int(height)
    assert int(peak_mib) < 100, peak_mib  # a full decode: 1144 MiB of RGB pixels alone

    image_processor = build_image_processor(Glm4vMoeVisionConfig(patch_size=14, temporal_patch_size=2))
    image_processor.size = {"shortest_edge": image_processor.size["shortest_edge"], "longest_edge": budget}
    path = write_jsonl(tmp_path / "huge.jsonl", [{"image": "huge.jpg", "conversations": turns()}])
    sample = dataset(path, tokenizer, image_processor)[0]
    assert sample["image_grid_thw"].prod() * 14 * 14 <= budget


def test_load_image_refuses_what_it_cannot_decode(corpus_dir):
    assert load_image(corpus_dir / "good.png", 10**7, 10**8).size == (56, 56)
    with pytest.raises(BadImage, match="the file is empty"):
        load_image(corpus_dir / "empty.png", 10**7, 10**8)
    with pytest.raises(BadImage, match="20000x20000 pixels"):
        load_image(corpus_dir / "huge.png", 10**7, 10**8)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(BadImage, match="over data.max_image_pixels=1,000"):
        load_image(corpus_dir / "good.png", 10**7, 1000)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss == peak_before


# ---------------------------------------------------------------------------------------------------------------
# Real runs: 2 ranks, the trainer
# ---------------------------------------------------------------------------------------------------------------


def run_trainer(
    tmp_path: Path, data: Path, *extra: str, env: dict[str, str] | None = None
) -> tuple[list[int], list[str], float]:
    """Both ranks as plain processes (RANK / WORLD_SIZE / MASTER_*: no launcher ends one for the other):
    (exit codes, outputs, seconds until both ended)."""
    command = [
        sys.executable,
        "-m",
        "glm45v_fsdp.train",
        "data.dataset=json",
        f"data.data_path={data}",
        "training.train_iters=2",
        "training.micro_batch_size=1",
        f"training.output_dir={tmp_path / 'run'}",
        "training.progress_bar=false",
        *extra,
    ]
    port = str(free_port())
    start = time.perf_counter()
    ranks = [
        subprocess.Popen(
            command,
            cwd=REPO,
            env={
                **clean_env(),
                **(env or {}),
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outputs = [rank.communicate(timeout=300)[0] for rank in ranks]
    return [rank.returncode for rank in ranks], outputs, time.perf_counter() - start


@pytest.fixture(scope="module")
def run_data(corpus_dir) -> Path:
    """Good records at even positions (rank 0 checks those) and every kind of bad record at odd ones (rank 1's)."""
    records = []
    for _, bad, _ in CORPUS:
        records += [good_record(), bad]
    return write_jsonl(corpus_dir / "run.jsonl", records)


def test_trainer_stops_before_step_one_on_every_rank(tmp_path, run_data):
    codes, outputs, seconds = run_trainer(tmp_path, run_data)
    print(f"stop: exit codes {codes} after {seconds:.1f} s")
    assert codes == [2, 2], outputs  # a user error on both ranks, rank 0 included: it learnt of rank 1's finding
    for output in outputs:
        assert "Traceback" not in output, output[-3000:]
        assert f"has {len(CORPUS)} bad record(s) of {2 * len(CORPUS)}" in output, output[-3000:]
        assert f"Record 1 (0-based) of data file '{run_data}'" in output
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text()  # stopped before step 1


def test_trainer_skips_and_reports_the_count(tmp_path, run_data):
    codes, outputs, seconds = run_trainer(tmp_path, run_data, "data.on_bad_record=skip")
    print(f"skip: exit codes {codes} after {seconds:.1f} s")
    assert codes == [0, 0] and not any("Traceback" in output for output in outputs), outputs
    assert f"skipped {len(CORPUS)} bad record(s) of {2 * len(CORPUS)}" in outputs[0]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["skipped_records"] == len(CORPUS)
    assert f"{len(CORPUS)} bad record(s) skipped" in outputs[0]  # the end-of-run summary line


def test_a_data_error_inside_a_step_stops_every_rank_after_that_step(tmp_path, corpus_dir):
    """Rank 1's first fetch after step 2 fails (GLM45V_FAULT=1:2:data_error): step 3 fetches step 4's batches after
    its backward, and the failure rides in step 3's last all-reduce (trainer.py NextStep). Both ranks record step 3,
    then stop with a user error, rank 0 pointing at rank 1."""
    data = write_jsonl(corpus_dir / "good.jsonl", [good_record() for _ in range(16)])
    env = {"GLM45V_FAULT": "1:2:data_error"}
    codes, outputs, seconds = run_trainer(tmp_path, data, "training.train_iters=4", env=env)
    print(f"stop: exit codes {codes} after {seconds:.1f} s")
    assert codes == [2, 2], outputs
    assert not any("Traceback" in output for output in outputs), outputs
    assert "Another data-parallel rank stopped on a data error" in outputs[0], outputs[0][-3000:]
    assert "an injected data error on rank 1 after step 2" in outputs[1], outputs[1][-3000:]
    assert [record["step"] for record in read_metrics(tmp_path / "run")] == [1, 2, 3]
