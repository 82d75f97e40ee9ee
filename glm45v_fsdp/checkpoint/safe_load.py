"""Every checkpoint file we read and did not write in this process is opened here, and none of them can run code.

A pickle names the callables that rebuild its objects and `pickle.load` calls them, so a file from a stranger (a
downloaded checkpoint, shared storage that others can write) that names `os.system` runs it. What each reader admits:
- DCP `.metadata`: `SafeFileSystemReader` (our StorageReader; torch's uses plain `pickle.load`) unpickles through
  `MetadataUnpickler`, which admits only what DCP metadata is made of: torch.distributed.checkpoint's metadata
  dataclasses and `_StorageInfo`, torch.Size, dtypes, the layout lookup, pathlib paths and builtin containers.
- DCP's non-tensor values (the bytes items of the `.distcp` files: optimizer hyper-parameters, ...): our load
  planners read them with torch's weights-only unpickler (torch's planners use `weights_only=False`); DCP's tensor
  items are already read weights-only by torch.
- every `.pt` (trainer_state.pt, rng/rank{R}.pt, engine_state.pt, DeepSpeed's files, batch dumps): `load_pt`,
  torch's weights-only unpickler (tensors, containers, numbers, strings; DeepSpeed's classes as inert stand-ins).
- Hugging Face weights: safetensors only (no code at all); `*.bin` is refused with the conversion command.
A refused file raises UnsafeCheckpointFile, a UserError naming the file, what it tried to load and what to do.
There is no opt-in to unrestricted unpickling: every file we write loads under these rules (docs/checkpoints.md).
"""

from __future__ import annotations

import _compat_pickle
import argparse
import contextlib
import io
import pickle
import pickletools
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from glm45v_fsdp.errors import UserError

_DCP_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "StorageMeta",
        "MetadataIndex",
        "ChunkStorageMetadata",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
}
_ADMITTED = _DCP_METADATA_CLASSES | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name ("torch.strided")
    ("collections", "OrderedDict"),
    *((module, name) for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "PurePosixPath")),
    *((module, name) for module in ("pathlib", "pathlib._local") for name in ("WindowsPath", "PureWindowsPath")),
}
# Classes load_pt admits beyond torch's weights-only set: attribute bags whose construction runs no code of the file's
# choosing (scripts save their argparse args in a checkpoint's client state, as Megatron-DeepSpeed does).
PLAIN_CLASSES: list[type] = [argparse.Namespace]
RESAVE = (
    "Do not load it: a file that names such a callable can run any code. Use a checkpoint you or your team wrote "
    "with this backend (re-save it from the run that produced it), or get the original files again"
)


class UnsafeCheckpointFile(UserError):
    """A checkpoint file that names a callable its reader does not admit; nothing of it was executed."""


def refusal(path: Path | str, what: str, fix: str = RESAVE) -> UnsafeCheckpointFile:
    return UnsafeCheckpointFile(
        f"Refused to load '{path}': it tries to load {what}, which a checkpoint file never needs; nothing was "
        f"executed. {fix}."
    )


class _Refused(pickle.UnpicklingError):
    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


class MetadataUnpickler(pickle.Unpickler):
    """Builds a DCP Metadata object and nothing else: any other global, or a persistent id, is refused."""

    def find_class(self, module: str, name: str) -> Any:
        admitted = (module, name) in _ADMITTED or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        )
        if not admitted:
            raise _Refused(f"the global {module}.{name}")
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"a persistent id ({pid!r})")


def read_dcp_metadata(stream: IO[bytes], path: Path | str) -> Metadata:
    """Unpickle a DCP `.metadata` stream with MetadataUnpickler; UnsafeCheckpointFile for a refused global,
    pickle.UnpicklingError when the file is not DCP metadata at all."""
    try:
        metadata = MetadataUnpickler(stream).load()
    except _Refused as refused:
        raise refusal(path, refused.what) from None
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """torch's FileSystemReader with `.metadata` read by MetadataUnpickler (the same Metadata object reaches the
    planner; read_data is torch's, whose tensor reads are weights-only)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = read_dcp_metadata(stream, path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def metadata_of(checkpoint: Path | str) -> Metadata:
    """A DCP checkpoint directory's metadata, read safely."""
    return SafeFileSystemReader(str(checkpoint)).read_metadata()


class _WeightsOnlyBytes:
    """Mixin for DCP load planners: non-tensor values are read weights-only, then handed to the planner as
    torch's own code expects them (re-serialised here, in this process)."""

    checkpoint: Path | str = "a DCP checkpoint"

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        what = f"{self.checkpoint} (its value '{read_item.dest_index.fqn}' in the .distcp files)"
        plain = load_pt(value, what)
        buffer = io.BytesIO()
        torch.save(plain, buffer)
        buffer.seek(0)
        super().load_bytes(read_item, buffer)


class SafeLoadPlanner(_WeightsOnlyBytes, DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor values are read weights-only."""


class _SafeEmptyStateDictLoadPlanner(_WeightsOnlyBytes, _EmptyStateDictLoadPlanner):
    """torch's planner that rebuilds a whole state dict from the metadata (dcp_to_torch_save's), made safe."""


def load_dcp(state: dict[str, Any], checkpoint: Path | str, partial: bool = False, no_dist: bool = False) -> None:
    """dcp.load of `checkpoint` into `state` through SafeFileSystemReader and SafeLoadPlanner; a refused value
    raises UnsafeCheckpointFile (on every rank: DCP gathers each rank's failure)."""
    planner = SafeLoadPlanner(allow_partial_load=partial)
    planner.checkpoint = checkpoint
    with _refusal_unwrapped():
        dcp.load(state, storage_reader=SafeFileSystemReader(str(checkpoint)), planner=planner, no_dist=no_dist)


def read_whole_dcp(checkpoint: Path | str) -> dict[str, Any]:
    """Everything a DCP checkpoint holds ({"model": ..., "optim": ...}), full tensors on CPU, rebuilt from its
    metadata alone (no model, no process group), as torch's dcp_to_torch_save reads it."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    planner = _SafeEmptyStateDictLoadPlanner()
    planner.checkpoint = checkpoint
    state: dict[str, Any] = {}
    with _refusal_unwrapped():
        _load_state_dict(state, storage_reader=SafeFileSystemReader(str(checkpoint)), planner=planner, no_dist=True)
    return state


@contextlib.contextmanager
def _refusal_unwrapped() -> Iterator[None]:
    """DCP wraps what a rank raised in a CheckpointException: a refusal comes out as itself."""
    try:
        yield
    except CheckpointException as error:
        for failure in error.failures.values():
            cause = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(cause, UnsafeCheckpointFile):
                raise UnsafeCheckpointFile(str(cause)) from None
        raise


def load_pt(source: Path | str | io.BytesIO, what: str | None = None, stand_ins: list[type] | None = None) -> Any:
    """torch.load(weights_only=True) on the CPU; a file torch refuses because it names a callable raises
    UnsafeCheckpointFile naming it. Admitted beyond torch's weights-only set: argparse.Namespace (attributes only;
    scripts save their args in a checkpoint) and `stand_ins`, classes torch may build in place of the ones they are
    named as. Other failures (a truncated or foreign file) propagate as torch raises them, for the caller to word."""
    with torch.serialization.safe_globals([*PLAIN_CLASSES, *(stand_ins or [])]):
        try:
            return torch.load(source, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            if isinstance(source, io.BytesIO):
                source.seek(0)
            names = unsafe_globals(source)
            if not names:
                raise
    shown = ", ".join(names[:5])
    raise refusal(what or source, f"the global{'s' if len(names) > 1 else ''} {shown}") from None


def unsafe_globals(source: Path | str | io.BytesIO) -> list[str]:
    """The globals a torch.save file (its data.pkl) or a plain pickle names that the weights-only unpickler does not
    admit, read from the opcodes (nothing is unpickled); [] when it names none (a damaged file)."""
    from torch._weights_only_unpickler import _get_allowed_globals

    data = source.getvalue() if isinstance(source, io.BytesIO) else Path(source).read_bytes()
    if zipfile.is_zipfile(io.BytesIO(data)):
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            pickled = [name for name in archive.namelist() if name.endswith("data.pkl")]
            data = archive.read(pickled[0]) if pickled else b""
    allowed = set(_get_allowed_globals()) | {
        f"{cls.__module__}.{cls.__qualname__}"
        for cls in [*PLAIN_CLASSES, *torch.serialization.get_safe_globals()]
        if isinstance(cls, type)
    }
    return [name for name in map(_python3_name, _globals_named(data)) if name not in allowed]


def _python3_name(name: str) -> str:
    """A global as Python 3 names it: protocol 2 (torch.save's) writes builtins as `__builtin__.NAME`."""
    module, _, attribute = name.rpartition(".")
    module, attribute = _compat_pickle.NAME_MAPPING.get((module, attribute), (module, attribute))
    return f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{attribute}"


def _globals_named(data: bytes) -> list[str]:
    """GLOBAL / INST / STACK_GLOBAL names in the pickles at the start of `data` (one for a zip archive's data.pkl;
    torch's legacy format holds several, then raw storage bytes); STACK_GLOBAL's module and name are the last two
    strings pushed (directly or from the memo)."""
    names: list[str] = []
    stream = io.BytesIO(data)
    while stream.tell() < len(data):
        start = stream.tell()
        try:
            names += _globals_of_one_pickle(stream)
        except (ValueError, EOFError):  # damage, or the bytes after the last pickle
            break
        if stream.tell() == start:
            break
    return list(dict.fromkeys(names))


def _globals_of_one_pickle(stream: io.BytesIO) -> list[str]:
    names: list[str] = []
    strings: list[str] = []
    memo: dict[Any, Any] = {}
    top: Any = None  # the last object pushed, when it is a string
    for opcode, argument, _ in pickletools.genops(stream):
        kind = opcode.name
        if kind == "MEMOIZE":
            memo[len(memo)] = top
        elif kind in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[argument] = top
        elif kind in ("GET", "BINGET", "LONG_BINGET"):
            top = memo.get(argument)
            if isinstance(top, str):
                strings.append(top)
        elif "UNICODE" in kind or kind in ("STRING", "BINSTRING", "SHORT_BINSTRING"):
            top = str(argument)
            strings.append(top)
        else:
            if kind in ("GLOBAL", "INST"):
                names.append(str(argument).replace(" ", "."))
            elif kind == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
            top = None
    return names
