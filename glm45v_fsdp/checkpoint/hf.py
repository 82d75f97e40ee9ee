"""Load Hugging Face safetensors weights into the (FSDP2-sharded or plain) training model, each rank its own slices.

Every rank plans its reads from the checkpoint headers alone: for each parameter and persistent buffer, the box of
the global tensor its local shard holds (`compute_local_shape_and_global_offset`, as `materialize` does), and for
stacked experts stored per expert, only the experts and rows that box covers. Then it reads just those slices
(`safe_open(...).get_slice(key)[...]`) straight into `to_local()`, converting the dtype. No rank ever builds a full
tensor, let alone the full model. Key mismatches are found from the headers, before anything is copied.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from glm45v_fsdp.adapters import is_adapter
from glm45v_fsdp.checkpoint.integrity import check_manifest
from glm45v_fsdp.checkpoint.layout import (
    Piece,
    Shape,
    check_keys,
    checkpoint_pieces,
    describe_diff,
    detect_expert_layout,
    model_tensors,
)
from glm45v_fsdp.errors import UserError

INDEX_FILE = "model.safetensors.index.json"
DCP_METADATA = ".metadata"
PICKLE_WEIGHTS = ("pytorch_model*.bin", "pytorch_model.bin.index.json")


def pickle_weight_files(directory: Path) -> list[Path]:
    """The PyTorch-pickle weight files of an HF directory (pytorch_model*.bin and their index)."""
    return sorted(path for pattern in PICKLE_WEIGHTS for path in directory.glob(pattern))


def refuse_pickle_weights(directory: Path, what: str = "Config key 'training.load'") -> None:
    """An HF directory whose weights are pickles only: a UserError with the one-off conversion command."""
    found = pickle_weight_files(directory)
    if found and not any(directory.glob("*.safetensors")):
        raise UserError(
            f"{what} = '{directory}' holds its weights as PyTorch pickles ({', '.join(p.name for p in found[:3])}), "
            f"which this backend does not load: unpickling a file from someone else can run code. Convert them once "
            f"to safetensors (read weights-only, nothing in them runs): python -m glm45v_fsdp.tools.convert "
            f"bin-to-hf {directory} <new directory>, and use the new directory instead."
        )


def detect_format(path: str | Path, what: str = "Config key 'training.load'") -> str:
    """'hf' (config.json / *.safetensors / index) or 'dcp' (a `.metadata` file, or subdirectories that have one).

    `what` names the path's source in the error (a config key or a command-line argument).
    """
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise UserError(
            f"{what} = '{path}' is not a directory. Point it at a Hugging Face model directory (safetensors), a DCP "
            f"checkpoint directory or a save directory holding DCP checkpoints."
        )
    if (directory / DCP_METADATA).is_file() or any((sub / DCP_METADATA).is_file() for sub in _subdirs(directory)):
        return "dcp"
    if (
        (directory / INDEX_FILE).is_file()
        or (directory / "config.json").is_file()
        or any(directory.glob("*.safetensors"))
        or pickle_weight_files(directory)
    ):
        return "hf"
    scratch = ", or set training.load=null to initialise from scratch" if "training.load" in what else ""
    raise UserError(
        f"{what} = '{path}' holds neither Hugging Face weights (config.json, *.safetensors, {INDEX_FILE}) nor a DCP "
        f"checkpoint (a '{DCP_METADATA}' file, or subdirectories with one). Point it at one of those{scratch}."
    )


def holds_weights(path: str | Path) -> bool:
    """Whether a model directory holds HF weights (*.safetensors, their index, or pickles that the load refuses), not
    only config and tokenizer."""
    directory = Path(path).expanduser()
    return directory.is_dir() and (
        (directory / INDEX_FILE).is_file()
        or any(directory.glob("*.safetensors"))
        or bool(pickle_weight_files(directory))
    )


def _subdirs(directory: Path) -> Iterator[Path]:
    return (child for child in directory.iterdir() if child.is_dir())


@dataclass
class LoadReport:
    """What `load_hf_weights` read on this rank, and how the checkpoint's keys differ from the model's."""

    source: str
    files: int
    tensors_read: int
    bytes_read: int
    expert_layout: str  # "per-expert", "stacked" or "none" (no routed experts in the checkpoint)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    # Keys the model class declares ignorable (GLM-4.5V's MTP layer 46) and aliases of tied weights.
    ignored: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Read:
    """Copy `checkpoint[key][index]` into `dst` (a view of a local shard)."""

    key: str
    index: tuple[slice, ...]
    dst: torch.Tensor


def _open(path: Path):
    """safe_open, with an unreadable or corrupt file reported as the user's problem."""
    try:
        return safe_open(path, framework="pt")
    except (OSError, SafetensorError) as error:
        raise UserError(
            f"Config key 'training.load': '{path}' is not a readable safetensors file ({error}). Copy it again from "
            f"the original checkpoint."
        ) from None


def checkpoint_files(directory: str | Path) -> tuple[Path, dict[str, Path]]:
    """(source file, key -> safetensors file) from the index, or from the directory's single *.safetensors file."""
    directory = Path(directory).expanduser()
    check_manifest(directory, "HF checkpoint")
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise UserError(
                f"Config key 'training.load': '{index}' is not a valid safetensors index (JSON with a 'weight_map'): "
                f"{error!r}. Restore the file from the original checkpoint."
            ) from None
        files = {key: directory / name for key, name in weight_map.items()}
        absent = sorted({str(path) for path in files.values() if not path.is_file()})
        if absent:
            raise UserError(
                f"Config key 'training.load' = '{directory}': {INDEX_FILE} names {len(absent)} shard files that do "
                f"not exist ({', '.join(absent[:5])}). Copy the complete checkpoint."
            )
        return index, files
    refuse_pickle_weights(directory)
    singles = sorted(directory.glob("*.safetensors"))
    if len(singles) != 1:
        found = "no *.safetensors file" if not singles else f"{len(singles)} *.safetensors files but no {INDEX_FILE}"
        raise UserError(
            f"Config key 'training.load' = '{directory}' holds {found}. A Hugging Face checkpoint is one "
            f"*.safetensors file, or several with {INDEX_FILE}; point training.load at such a directory."
        )
    with _open(singles[0]) as handle:
        return singles[0], dict.fromkeys(handle.keys(), singles[0])


def read_headers(files: dict[str, Path]) -> dict[str, tuple[Shape, str]]:
    """Key -> (shape, safetensors dtype such as 'BF16') from the headers (no tensor data is read)."""
    by_file: dict[Path, list[str]] = defaultdict(list)
    for key, path in files.items():
        by_file[path].append(key)
    headers = {}
    for path, keys in by_file.items():
        with _open(path) as handle:
            present = set(handle.keys())
            lost = [key for key in keys if key not in present]
            if lost:
                raise UserError(
                    f"Config key 'training.load': the index maps {len(lost)} keys to '{path}' that the file does not "
                    f"hold (e.g. '{lost[0]}'). The index and the shard files come from different checkpoints; copy "
                    f"a consistent checkpoint."
                )
            for key in keys:
                item = handle.get_slice(key)
                headers[key] = (tuple(item.get_shape()), item.get_dtype())
    return headers


def local_box(tensor: torch.Tensor) -> tuple[Shape, Shape] | None:
    """(global offset, local size) of this rank's shard; None when the placements are not one box."""
    if not isinstance(tensor, DTensor):
        return (0,) * tensor.dim(), tuple(tensor.shape)
    if not all(type(p) in (Shard, Replicate) for p in tensor.placements):
        return None
    size, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(offset), tuple(size)


def _plan(local: torch.Tensor, box: tuple[Shape, Shape], pieces: list[Piece]) -> list[_Read]:
    """The reads that fill the local box from the pieces that overlap it."""
    offset, size = box
    reads = []
    for piece in pieces:
        low = [max(o, p) for o, p in zip(offset, piece.offset)]
        high = [min(o + s, p + q) for o, s, p, q in zip(offset, size, piece.offset, piece.size)]
        if any(h <= lo for lo, h in zip(low, high)):
            continue
        src = tuple(slice(lo - p, h - p) for lo, h, p in zip(low, high, piece.offset))
        dst = local[tuple(slice(lo - o, h - o) for lo, h, o in zip(low, high, offset))]
        reads.append(_Read(piece.key, src[1:] if piece.squeeze else src, dst))
    return reads


@torch.no_grad()
def load_hf_weights(model: nn.Module, directory: str | Path, strict: bool = True) -> LoadReport:
    """Read this rank's slices of an HF checkpoint (per-expert or stacked experts) into the materialised model.

    strict: any missing, unexpected or shape-mismatched key raises UserError before a single value is copied.
    Otherwise the matching keys load and the report lists the rest.
    """
    source, files = checkpoint_files(directory)
    found = {key: shape for key, (shape, _) in read_headers(files).items()}
    layout = detect_expert_layout(found)
    diff, ignored = check_keys(model, found, layout)
    if strict and not diff.ok:
        raise UserError(
            f"Config key 'training.load' = '{directory}' does not fit the model: {describe_diff(diff)} Nothing was "
            f"loaded. Point training.load at a checkpoint of this architecture (model.preset / model.name_or_path / "
            f"model.config_overrides must describe it), or set training.load_strict=false to load only the matching "
            f"keys (the rest keep their initial values)."
        )
    targets, _ = model_tensors(model)
    targets = {name: tensor for name, tensor in targets.items() if not is_adapter(name)}  # LoRA's: not the base's
    assert not any(t.is_meta for t in targets.values()), "load_hf_weights needs a materialised model"
    reads: list[_Read] = []
    fallback = []
    for name, tensor in targets.items():
        pieces = [p for p in checkpoint_pieces(name, tuple(tensor.shape), layout) if found.get(p.key) == p.shape]
        box = local_box(tensor)
        if box is None:
            fallback.append((tensor, pieces))
        else:
            reads += _plan(tensor.to_local() if isinstance(tensor, DTensor) else tensor, box, pieces)
    tensors_read, bytes_read = _execute(reads, files)
    for tensor, pieces in fallback:  # e.g. strided shards: stage the full tensor, let DTensor slice it locally
        full = tensor.full_tensor().cpu()
        count, size = _execute(_plan(full, ((0,) * full.dim(), tuple(full.shape)), pieces), files)
        tensors_read, bytes_read = tensors_read + count, bytes_read + size
        tensor.copy_(
            distribute_tensor(full.to(tensor.device), tensor.device_mesh, tensor.placements, src_data_rank=None)
        )
    return LoadReport(
        source=str(source),
        files=len(set(files.values())),
        tensors_read=tensors_read,
        bytes_read=bytes_read,
        expert_layout=layout or "none",
        missing=diff.missing,
        unexpected=diff.unexpected,
        mismatched=diff.mismatched,
        ignored=ignored,
    )


def _execute(reads: list[_Read], files: dict[str, Path]) -> tuple[int, int]:
    """Run the reads; returns (checkpoint tensors touched, bytes read).

    Each read opens its file anew: safetensors memory-maps the file, and the pages a read touches stay resident
    until the map closes, so one long-lived handle would grow to this rank's share of the whole file.
    """
    keys, nbytes = set(), 0
    for read in reads:
        with _open(files[read.key]) as handle:
            values = handle.get_slice(read.key)[read.index]
        read.dst.copy_(values.reshape(read.dst.shape))
        keys.add(read.key)
        nbytes += values.nbytes
    return len(keys), nbytes
