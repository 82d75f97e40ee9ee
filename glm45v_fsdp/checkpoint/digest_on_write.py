"""Checksums taken from the bytes as they are written, so that a save need not read its files back to hash them.

A `WrittenDigests` (one per save) collects, for every file a writer of ours wrote through it, the file's size and
the xxh3-64 of the bytes written. Three ways in:
- `open_file` / `stream`: a file object whose `write` hashes what it writes (torch.save, our safetensors writer);
- `write_file`: a whole file from memory (trainer state, RNG states, JSON);
- `DigestingFileSystem`: DCP's file system with `create_stream` wrapped, so DCP's FileSystemWriter hashes its
  shards and `.metadata` as it writes them (and `rename` carries the digest of `.metadata.tmp` over).
A digest counts only for a file written front to back in one pass (no seek, no truncate, no reopen): anything else
drops it, and `integrity.checksums` then reads the file back, as it does for files written by others
(transformers' config and tokenizer files, PEFT's adapter). It also reads back a file whose size on disk is not the
size hashed.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import xxhash
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

Digest = tuple[int, str]  # (bytes, xxh3-64 hex digest)


def _key(path: str | os.PathLike) -> str:
    return os.path.abspath(path)


class WrittenDigests:
    """{file: (bytes, xxh3-64)} of the files written through it; thread-safe (DCP writes from its own threads, an
    async save from a background thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._digests: dict[str, Digest] = {}

    def record(self, path: str | os.PathLike, digest: Digest | None) -> None:
        """`digest` of the file at `path` (None: the file was not written in one pass, forget it)."""
        with self._lock:
            if digest is None:
                self._digests.pop(_key(path), None)
            else:
                self._digests[_key(path)] = digest

    def rename(self, source: str | os.PathLike, target: str | os.PathLike) -> None:
        with self._lock:
            digest = self._digests.pop(_key(source), None)
            self._digests.pop(_key(target), None)
            if digest is not None:
                self._digests[_key(target)] = digest

    def get(self, path: str | os.PathLike) -> Digest | None:
        with self._lock:
            return self._digests.get(_key(path))

    def stream(self, path: str | os.PathLike, raw: Any) -> HashingWriter:
        """`raw` (a file opened for writing at `path`, empty) wrapped: what is written through it is hashed."""
        return HashingWriter(raw, lambda digest: self.record(path, digest))

    @contextmanager
    def open_file(self, path: str | os.PathLike) -> Generator[HashingWriter, None, None]:
        """`path` opened "wb", written through a HashingWriter."""
        with open(path, "wb") as raw, self.stream(path, raw) as stream:
            yield stream

    def write_file(self, path: str | os.PathLike, data: bytes | memoryview) -> None:
        """Write `data` as the whole file at `path`, its digest recorded."""
        with self.open_file(path) as stream:
            stream.write(data)


class HashingWriter(io.RawIOBase):
    """A write-only file object over `raw` that hashes every byte it passes on; on close it reports (bytes, digest),
    or None when the file was not written front to back (a seek or truncate)."""

    def __init__(self, raw: Any, report: Any) -> None:
        super().__init__()
        self.raw = raw
        self._report = report
        self._hash = xxhash.xxh3_64()
        self._written = 0
        self._in_one_pass = raw.tell() == 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self.raw.write(view)
        written = len(view) if written is None else written
        self._hash.update(view[:written])
        self._written += written
        return written

    def tell(self) -> int:
        return self.raw.tell()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        position = self.raw.seek(offset, whence)
        self._in_one_pass &= position == self._written
        return position

    def truncate(self, size: int | None = None) -> int:
        self._in_one_pass = False
        return self.raw.truncate(size)

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()

    def __exit__(self, *failure: Any) -> None:
        if failure[0] is not None:  # a write that failed part way: no digest for what reached the file
            self._in_one_pass = False
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self._report((self._written, self._hash.hexdigest()) if self._in_one_pass else None)
        super().close()  # flushes `raw` first
        self.raw.close()


class DigestingFileSystem(FileSystem):
    """DCP's local file system, its write streams hashing as they write into `digests`."""

    def __init__(self, digests: WrittenDigests) -> None:
        super().__init__()
        self.digests = digests

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        with super().create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            with self.digests.stream(path, raw) as stream:
                yield stream

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        self.digests.rename(path, new_path)


def dcp_writer(checkpoint: str | os.PathLike, digests: WrittenDigests) -> FileSystemWriter:
    """The writer `dcp.save(..., checkpoint_id=checkpoint)` uses by default, its files hashed as written."""
    writer = FileSystemWriter(checkpoint)
    writer.fs = DigestingFileSystem(digests)
    return writer


def digest_of(path: Path, digests: WrittenDigests | None) -> Digest | None:
    """The digest taken while `path` was written, when it still describes the file (same size on disk)."""
    found = digests.get(path) if digests is not None else None
    return found if found is not None and path.stat().st_size == found[0] else None
