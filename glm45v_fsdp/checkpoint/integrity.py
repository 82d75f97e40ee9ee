"""Checksums of the checkpoint files we write: a manifest written before a checkpoint is published, verified before
anything of it is used.

`manifest.json` lists every file of the checkpoint (relative path, bytes, xxh3-64 of its bytes). While a sharded
checkpoint is saved, each rank takes the checksums of the files it wrote and leaves its part in
`checksums/rank{R}.json`; rank 0 merges the parts into the manifest (waiting for every rank's part) before it renames
the checkpoint into place and points `latest` at it. A directory written by one process (an HF export, a DeepSpeed
checkpoint) gets its manifest from `write_manifest` after its last file. Our writers hash the bytes as they write them
(checkpoint/digest_on_write.py: DCP's shards and metadata, torch.save files, safetensors shards, JSON), so a save reads
back only the files others wrote (transformers' config and tokenizer files, PEFT's adapter). xxh3-64 (the `xxhash`
library) hashes at about 28 GB/s on one core here.

A load verifies a directory once, before anything of it is read: under a process group the listed files are split
over the ranks by bytes, each rank hashes its share (a thread pool), and one collective agrees on the verdict, so
the job reads each file once to verify it, not once per rank.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch.distributed as dist
import xxhash

from glm45v_fsdp.checkpoint.digest_on_write import WrittenDigests, digest_of
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.log import get_logger

MANIFEST_FILE = "manifest.json"
PARTS_DIR = "checksums"
ALGORITHM = "xxh3_64"
_CHUNK = 8 << 20
HASH_THREADS = 8  # per rank: enough to keep a parallel file system's reads in flight


def file_digest(path: Path) -> str:
    """xxh3-64 of the file's bytes, read in 8 MiB chunks."""
    digest = xxhash.xxh3_64()
    with path.open("rb") as stream:
        while chunk := stream.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def checksums(root: Path, files: list[Path], written: WrittenDigests | None = None) -> dict[str, dict]:
    """{path relative to root: {"bytes", ALGORITHM}} of `files`: the digest taken as a file was written (`written`)
    where there is one, else the file read back and hashed (the same digest: of the same bytes)."""
    entries = {}
    for file in sorted(files):
        size, digest = digest_of(file, written) or (file.stat().st_size, file_digest(file))
        entries[file.relative_to(root).as_posix()] = {"bytes": size, ALGORITHM: digest}
    return entries


def _write_json(path: Path, data: dict) -> None:
    """Written whole, then renamed into place: a reader sees the complete file or none."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(partial, path)


def write_part(checkpoint: Path, rank: int, files: list[Path], written: WrittenDigests | None = None) -> int:
    """This rank's checksums of the files it wrote into `checkpoint` (a save in progress); returns their bytes.
    Once the part is written, rank 0 may merge the parts and rename `checkpoint`: the caller must not touch its
    files after this."""
    (checkpoint / PARTS_DIR).mkdir(exist_ok=True)
    entries = checksums(checkpoint, files, written)
    _write_json(checkpoint / PARTS_DIR / f"rank{rank}.json", entries)
    return sum(entry["bytes"] for entry in entries.values())


def merge_parts(checkpoint: Path, world_size: int, timeout_s: float = 600.0) -> None:
    """Rank 0: wait for every rank's part, then write the manifest and remove the parts."""
    parts = [checkpoint / PARTS_DIR / f"rank{rank}.json" for rank in range(world_size)]
    deadline = time.monotonic() + timeout_s
    while missing := [part for part in parts if not part.is_file()]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"checkpoint {checkpoint}: no checksums from {len(missing)} rank(s) in {timeout_s} s")
        time.sleep(0.01)
    files: dict[str, dict] = {}
    for part in parts:
        files.update(json.loads(part.read_text()))
    _write_json(checkpoint / MANIFEST_FILE, {"algorithm": ALGORITHM, "files": files})
    for part in parts:
        part.unlink()
    (checkpoint / PARTS_DIR).rmdir()


def write_manifest(directory: Path, written: WrittenDigests | None = None) -> None:
    """The manifest of every file under `directory` (written by this process alone; `written`: the digests taken
    as some of them were written)."""
    files = [path for path in directory.rglob("*") if path.is_file() and path.name != MANIFEST_FILE]
    _write_json(directory / MANIFEST_FILE, {"algorithm": ALGORITHM, "files": checksums(directory, files, written)})


def _read_manifest(directory: Path) -> dict[str, dict] | None:
    """The manifest's {relative path: {"bytes", ALGORITHM}}; None when it is not a readable manifest of ours."""
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
        files = manifest["files"]
        assert manifest["algorithm"] == ALGORITHM and isinstance(files, dict)
        assert all(isinstance(entry["bytes"], int) for entry in files.values())
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        return None
    return files


def shares(sizes: list[int], ranks: int) -> list[list[int]]:
    """The indices of `sizes` split over `ranks`, balanced by bytes: largest first (ties by index), each to the
    rank with the fewest bytes so far (ties to the lowest rank). Deterministic: every rank computes the same split."""
    assigned: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        assigned[rank].append(index)
        load[rank] += sizes[index]
    return [sorted(indices) for indices in assigned]


def _file_problem(file: Path, expected: dict) -> str | None:
    """What is wrong with one listed file (missing, another size, other bytes); None when it is intact."""
    if not file.is_file():
        return f"{file} is missing (the manifest lists it)"
    size = file.stat().st_size
    if size != expected["bytes"]:
        return f"{file} has {size} bytes, the manifest says {expected['bytes']}: it is truncated or was replaced"
    try:
        digest = file_digest(file)
    except OSError as error:  # a verdict, not an exception on one rank while the others wait in the collective
        return f"{file} cannot be read ({error.strerror or error})"
    if digest != expected[ALGORITHM]:
        return (
            f"{file} does not match its checksum ({ALGORITHM} {digest}, the manifest says "
            f"{expected[ALGORITHM]}): its bytes changed after it was written (a bad copy, bit rot or an edit)"
        )
    return None


def hash_threads(files: int) -> int:
    """Threads that hash one rank's share: reads and xxh3 release the GIL, so a few overlap I/O with hashing."""
    return max(1, min(HASH_THREADS, files, os.cpu_count() or 1))


def _first_problem(directory: Path, entries: list[tuple[str, dict]], indices: list[int]) -> tuple[int, str] | None:
    """(index, problem) of the first damaged file among `indices` (manifest order), hashed by a thread pool."""
    if not indices:
        return None
    with ThreadPoolExecutor(hash_threads(len(indices)), thread_name_prefix="checksum") as pool:
        found = pool.map(lambda i: _file_problem(directory / entries[i][0], entries[i][1]), indices)
        return next(((i, problem) for i, problem in zip(indices, found) if problem is not None), None)


def _world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one (a single-process load)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def verify(directory: Path) -> str | None:
    """What is wrong with `directory`'s files against its manifest (the first damaged file in the manifest's sorted
    order, and how); None when every listed file is intact. A directory without a manifest is not verified:
    `has_manifest` tells.

    Under a process group of several ranks this is collective: each file is hashed once, by one rank (the files
    split by bytes, `shares`), and one all_gather agrees on the verdict, so every rank names the same file (the one
    a serial check names). Alone, the files are hashed by a thread pool."""
    files = _read_manifest(directory)
    if files is None:  # every rank reads the same manifest: all return here, no rank waits in the collective
        return f"{directory / MANIFEST_FILE} is not a readable checksum manifest"
    entries = sorted(files.items())
    rank, world = _world()
    mine = shares([entry["bytes"] for _, entry in entries], world)[rank]
    found = _first_problem(directory, entries, mine)
    if world > 1:
        everyone: list[tuple[int, str] | None] = [None] * world
        dist.all_gather_object(everyone, found)
        found = min((item for item in everyone if item is not None), default=None)
    return None if found is None else found[1]


def has_manifest(directory: Path) -> bool:
    return (directory / MANIFEST_FILE).is_file()


def check_manifest(directory: Path, kind: str) -> None:
    """A directory with a manifest must match it (a UserError naming the damaged file); one without is logged as not
    verified (DeepSpeed's, the hub's, or ours from before checksums). Collective under a process group of several
    ranks (`verify`): every rank calls it for the same directory."""
    if not has_manifest(directory):
        get_logger().info("%s %s: not verified, it has no %s", kind, directory, MANIFEST_FILE)
        return
    problem = verify(directory)
    if problem is not None:
        raise UserError(
            f"{kind} '{directory}' is damaged: {problem}. Nothing of it was loaded. Restore the file from a good copy, "
            f"or load an earlier checkpoint (`python -m glm45v_fsdp.tools.convert verify DIR` checks one offline)."
        )
