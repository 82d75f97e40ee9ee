"""Checksums taken as the files are written (checkpoint/digest_on_write.py) are the ones a read-back takes: DCP's
writer hooked through its file system, our safetensors writer, torch.save through a hashing stream; a file not
written front to back is read back instead. The manifests of real saves are checked end to end, with every bit-flip,
truncation and missing-file case, by tests/test_checkpoint_integrity.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file

from glm45v_fsdp.checkpoint import integrity
from glm45v_fsdp.checkpoint.digest_on_write import WrittenDigests, dcp_writer, digest_of
from glm45v_fsdp.checkpoint.hf_export import SAFETENSORS_DTYPES, write_safetensors


def manifest_both_ways(directory: Path, written: WrittenDigests) -> tuple[dict, dict]:
    """(checksums from the write-time digests, checksums read back) of every file under `directory`."""
    files = [file for file in directory.rglob("*") if file.is_file()]
    return integrity.checksums(directory, files, written), integrity.checksums(directory, files)


def test_dcp_writer_digests_are_the_read_back_ones(tmp_path):
    written = WrittenDigests()
    state = {"model": {"w": torch.randn(300, 70), "b": torch.arange(5)}, "extra": {"note": "bytes item"}}
    dcp.save(state, storage_writer=dcp_writer(tmp_path / "ckpt", written), no_dist=True)
    files = sorted(file.name for file in (tmp_path / "ckpt").iterdir())
    assert files == [".metadata", "__0_0.distcp"]
    for name in files:  # every file DCP wrote was hashed as written (.metadata through its rename)
        assert digest_of(tmp_path / "ckpt" / name, written) is not None, name
    on_write, read_back = manifest_both_ways(tmp_path / "ckpt", written)
    assert on_write == read_back
    loaded = {"model": {"w": torch.zeros(300, 70), "b": torch.zeros(5, dtype=torch.long)}, "extra": {"note": ""}}
    dcp.load(loaded, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])


def test_safetensors_writer_is_read_by_safetensors(tmp_path):
    tensors = {
        "a.weight": torch.randn(7, 3),
        "b.bias": torch.randn(5).to(torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "ids": torch.arange(11, dtype=torch.int32),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5, dtype=torch.float16),
    }
    written = WrittenDigests()
    write_safetensors(tensors, tmp_path / "model.safetensors", written)
    loaded = load_file(tmp_path / "model.safetensors")
    assert loaded.keys() == tensors.keys()
    for key, tensor in tensors.items():
        assert loaded[key].dtype == tensor.dtype and torch.equal(loaded[key], tensor), key
    with safe_open(tmp_path / "model.safetensors", "pt") as opened:
        assert opened.metadata() == {"format": "pt"}
    on_write, read_back = manifest_both_ways(tmp_path, written)
    assert on_write == read_back and digest_of(tmp_path / "model.safetensors", written) is not None
    assert torch.float8_e4m3fn in SAFETENSORS_DTYPES


def test_torch_save_through_the_stream_and_whole_files(tmp_path):
    written = WrittenDigests()
    with written.open_file(tmp_path / "state.pt") as stream:
        torch.save({"x": torch.randn(1000), "step": 3}, stream)
    written.write_file(tmp_path / "index.json", json.dumps({"a": 1}).encode())
    assert torch.load(tmp_path / "state.pt", weights_only=True)["step"] == 3
    on_write, read_back = manifest_both_ways(tmp_path, written)
    assert on_write == read_back
    assert all(digest_of(tmp_path / name, written) for name in ("state.pt", "index.json"))


def test_a_file_not_written_in_one_pass_is_read_back(tmp_path, monkeypatch):
    written = WrittenDigests()
    with written.open_file(tmp_path / "patched.bin") as stream:
        stream.write(b"0123456789")
        stream.seek(2)
        stream.write(b"xx")  # a writer that patches a header afterwards: the running hash is not the file's
    assert written.get(tmp_path / "patched.bin") is None
    written.write_file(tmp_path / "grown.bin", b"abc")
    with (tmp_path / "grown.bin").open("ab") as stream:  # changed after its digest was taken: another size
        stream.write(b"def")
    assert digest_of(tmp_path / "grown.bin", written) is None
    read = []
    real = integrity.file_digest
    monkeypatch.setattr(integrity, "file_digest", lambda path: read.append(path.name) or real(path))
    on_write = integrity.checksums(tmp_path, sorted(tmp_path.iterdir()), written)
    assert sorted(read) == ["grown.bin", "patched.bin"]
    monkeypatch.undo()
    assert on_write == integrity.checksums(tmp_path, sorted(tmp_path.iterdir()))
    assert (tmp_path / "patched.bin").read_bytes() == b"01xx456789"


def test_a_rank_leaves_the_checkpoint_alone_once_its_checksums_part_is_written(tmp_path, monkeypatch):
    """Rank 0 merges the parts and publishes (renames) the checkpoint as soon as the last rank's part is written:
    that rank's save must not read the directory again (a loaded CI machine caught rank 1 stat-ing its RNG file after
    the rename)."""
    from glm45v_fsdp.checkpoint import dcp as dcp_checkpoint

    tmp = tmp_path / "step_00000004.tmp"
    rng = dcp_checkpoint.rng_file(tmp, 1)
    rng.parent.mkdir(parents=True)
    rng.write_bytes(b"r" * 10)
    (tmp / "__1_0.distcp").write_bytes(b"s" * 20)
    write_part = dcp_checkpoint.write_part

    def write_part_then_publish(*args, **kwargs):
        hashed = write_part(*args, **kwargs)
        tmp.rename(tmp_path / "step_00000004")  # what rank 0 does once every part is there
        return hashed

    monkeypatch.setattr(dcp_checkpoint, "write_part", write_part_then_publish)
    checkpointer = object.__new__(dcp_checkpoint.Checkpointer)  # rank 1's: no process group needed here
    checkpointer.rank, checkpointer.world_size = 1, 2
    checkpointer._checksums(tmp, WrittenDigests())
    assert checkpointer.hashed[0] == 30
    part = json.loads((tmp_path / "step_00000004" / integrity.PARTS_DIR / "rank1.json").read_text())
    assert sorted(part) == ["__1_0.distcp", "rng/rank1.pt"]
