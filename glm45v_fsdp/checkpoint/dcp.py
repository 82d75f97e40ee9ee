"""DCP checkpoints of a training run: layout, atomic publish, (background) saves and the strict, resharding load.

A save directory (training.save) holds:
    step_00000012/              one complete checkpoint
        .metadata, __R_0.distcp DCP files of {"model": model state dict, "optim": optimizer state dict}
        trainer_state.pt        rank 0: step, scheduler, consumed samples, config, world size (checkpoint/state.py)
        rng/rank{R}.pt          rank R's RNG states
        adapter/                LoRA runs: the adapters in PEFT's format (lora/peft_format.py), rank 0
        manifest.json           every file's size and xxh3-64 checksum (checkpoint/integrity.py)
    step_00000018.tmp/          a save in progress or an interrupted one: never resumed from, removed by the next save
    latest                      the name of the newest complete checkpoint
Every file is written into `step_N.tmp/`; each rank hashes the files it wrote; once all ranks are done, rank 0 writes
the manifest, renames the directory to `step_N/` and then rewrites `latest`, so an interrupted save never looks
complete. Loading verifies the manifest before anything is read. A save that fails for lack of space or permission
(ENOSPC, EDQUOT, EROFS, EACCES) removes its `.tmp` and stops the run with one paragraph; `latest` stays. The state
dicts come from torch.distributed.checkpoint.state_dict (FQN keys; DTensor shards or plain tensors), so a checkpoint
written by N ranks loads on M.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import os
import re
import secrets
import shutil
import socket
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from glm45v_fsdp.checkpoint.base_reference import BASE_FILE, holds_trainable_only, write_base
from glm45v_fsdp.checkpoint.deepspeed import locate, tag_dir_of
from glm45v_fsdp.checkpoint.digest_on_write import WrittenDigests, dcp_writer
from glm45v_fsdp.checkpoint.hf import detect_format, holds_weights, refuse_pickle_weights
from glm45v_fsdp.checkpoint.integrity import MANIFEST_FILE, has_manifest, merge_parts, verify, write_part
from glm45v_fsdp.checkpoint.layout import KeyDiff, compare_keys, describe_diff
from glm45v_fsdp.checkpoint.safe_load import UnsafeCheckpointFile, load_dcp, load_pt, metadata_of
from glm45v_fsdp.checkpoint.state import RNG_DIR, TRAINER_STATE_FILE, rng_file
from glm45v_fsdp.config import Config, TrainingConfig
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.log import get_logger
from glm45v_fsdp.metrics import check_writable_dir
from glm45v_fsdp.runtime.faults import Fault

TMP_SUFFIX = ".tmp"
SHARED_PROBE_PREFIX = ".shared-storage-probe-"
LATEST_FILE = "latest"
BEST_FILE = "best"  # training.save_best: the name of the checkpoint with the lowest eval loss
EXTRA_DIRS = ("adapter",)  # what a Checkpointer's `extra` writes, on rank 0
METADATA_FILE = ".metadata"
MODEL_KEY = "model"
OPTIM_KEY = "optim"
RESUME_AUTO = "training.resume=auto"  # how an error names the setting that chose the checkpoint
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def is_complete(path: Path) -> bool:
    """A published checkpoint: a `step_N` directory with the DCP metadata and the trainer state."""
    return (
        bool(_STEP_DIR.match(path.name)) and (path / METADATA_FILE).is_file() and (path / TRAINER_STATE_FILE).is_file()
    )


def complete_checkpoints(save_dir: Path) -> list[Path]:
    """The complete checkpoints of a save directory, lowest step first (`.tmp` directories never count)."""
    if not save_dir.is_dir():
        return []
    found = [path for path in save_dir.iterdir() if path.is_dir() and is_complete(path)]
    return sorted(found, key=lambda path: int(_STEP_DIR.match(path.name)[1]))


def _step_of(path: Path) -> int:
    match = _STEP_DIR.match(path.name)
    return int(match[1]) if match else -1


def _damage(checkpoint: Path) -> str | None:
    """What is wrong with a published checkpoint's files (their checksums when it has a manifest, then what the file
    system and the file headers tell); None when nothing is."""
    if has_manifest(checkpoint) and (problem := verify(checkpoint)) is not None:
        return problem
    for required in (METADATA_FILE, TRAINER_STATE_FILE):
        if not (checkpoint / required).is_file():
            return f"{checkpoint / required} is missing"
    try:
        metadata = metadata_of(checkpoint)
    except UnsafeCheckpointFile:
        raise
    except Exception as error:  # any unpickling failure: the file is not DCP metadata
        return f"{checkpoint / METADATA_FILE} is not readable DCP metadata ({type(error).__name__})"
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = checkpoint / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size < size:
            return f"{file} is truncated ({file.stat().st_size} bytes, the metadata needs {size})"
    for file in [checkpoint / TRAINER_STATE_FILE, *sorted((checkpoint / RNG_DIR).glob("*.pt"))]:
        try:
            load_pt(file)
        except UnsafeCheckpointFile:
            raise
        except Exception as error:
            return f"{file} cannot be read ({type(error).__name__})"
    return None


def check_checkpoint_files(checkpoint: Path, what: str = "Config key 'training.load'") -> None:
    """A checkpoint damaged after it was published (truncated, missing or foreign files): a UserError that names
    the file and the way out (the previous complete checkpoint), before any of it is loaded. Collective under a
    process group of several ranks (the checksums are split over the ranks: integrity.verify)."""
    problem = _damage(checkpoint)
    if problem is None:
        if has_manifest(checkpoint):
            get_logger().info("checkpoint %s: every file matches its checksum (%s)", checkpoint, MANIFEST_FILE)
        else:
            get_logger().info(
                "checkpoint %s: not verified, it has no %s (written before checksums)", checkpoint, MANIFEST_FILE
            )
        return
    earlier = [p for p in complete_checkpoints(checkpoint.parent) if _step_of(p) < _step_of(checkpoint)]
    earlier = [p for p in earlier if _damage(p) is None]
    way_out = (
        f"Resume from the previous checkpoint instead: training.load={earlier[-1]} (with training.resume=off)"
        if earlier
        else f"No earlier intact checkpoint is in {checkpoint.parent}: restore the files, or start over "
        "(training.load=null)"
    )
    raise UserError(f"{what}: checkpoint {checkpoint} is damaged: {problem}. {way_out}.")


def find_checkpoint(path: Path, what: str = "Config key 'training.load'") -> Path:
    """`locate_checkpoint`, its files verified (check_checkpoint_files): an offline tool's, or a single load's."""
    checkpoint = locate_checkpoint(path, what)
    check_checkpoint_files(checkpoint, what)
    return checkpoint


def locate_checkpoint(path: Path, what: str = "Config key 'training.load'") -> Path:
    """`path` itself when it is a checkpoint (a step directory); for a save directory the one `latest` names when it
    exists, else its highest complete step, without reading any file of it (a run verifies it once, after the process
    group is up: check_checkpoint_files). `what` names the setting in the error. A checkpoint that `latest` names, or
    `path` itself, with its files damaged is an error when verified, not a silent fallback."""
    if _STEP_DIR.match(path.name) and ((path / RNG_DIR).is_dir() or is_complete(path)):
        return path
    latest = path / LATEST_FILE
    named = path / latest.read_text().strip() if latest.is_file() else None
    if named is not None and _STEP_DIR.match(named.name) and named.is_dir():  # never a `.tmp` save
        return named
    found = complete_checkpoints(path)
    if found:
        return found[-1]
    unfinished = sorted(p.name for p in path.glob(f"step_*{TMP_SUFFIX}")) if path.is_dir() else []
    detail = (
        f"; it holds only unfinished saves ({', '.join(unfinished)}), which are never resumed from"
        if unfinished
        else ""
    )
    raise UserError(
        f"{what} = '{path}' holds no complete DCP checkpoint{detail}. A complete checkpoint is a step_NNNNNNNN "
        f"directory with {METADATA_FILE} and {TRAINER_STATE_FILE}. Point it at the training.save directory of a run "
        f"that finished a save, or at one of its step_NNNNNNNN directories."
    )


def is_weights_only(path: Path) -> bool:
    """A DCP checkpoint of model weights alone (as `tools.convert hf-to-dcp` writes): metadata, no trainer state."""
    return (
        not path.name.endswith(TMP_SUFFIX)
        and (path / METADATA_FILE).is_file()
        and not (path / TRAINER_STATE_FILE).is_file()
        and not (path / RNG_DIR).is_dir()  # a training checkpoint that lost its trainer state is damaged
    )


@dataclass(frozen=True)
class LoadSource:
    """What training.load resolves to: format 'hf' (a model directory), 'dcp' (one complete checkpoint: resume),
    'dcp-weights' (a weights-only DCP checkpoint: a fast sharded start at step 0) or 'deepspeed' (a tag directory
    of a DeepSpeed checkpoint: resume)."""

    format: str
    path: Path


def resolve_load(training: TrainingConfig) -> LoadSource | None:
    """training.load and load_format resolved on the file system alone (no collective); None: nothing to load."""
    if training.load is None:
        return None
    path = Path(training.load).expanduser()
    if not path.exists():
        raise UserError(
            f"Config key 'training.load' = '{training.load}' does not exist. Point it at a Hugging Face model "
            f"directory, a DCP save directory (an earlier run's training.save) or one of its step_NNNNNNNN "
            f"checkpoints, or set training.load=null to initialise from scratch."
        )
    deepspeed_tag = tag_dir_of(path)
    if training.load_format == "deepspeed" and deepspeed_tag is None:
        locate(path)  # the error that says what a DeepSpeed checkpoint directory holds
    if deepspeed_tag is not None and training.load_format in ("auto", "deepspeed"):
        return LoadSource("deepspeed", deepspeed_tag)
    fmt = detect_format(path) if training.load_format == "auto" else training.load_format
    if fmt == "hf":
        return LoadSource("hf", path)
    if is_weights_only(path):
        return LoadSource("dcp-weights", path)
    return LoadSource("dcp", locate_checkpoint(path))


def load_model_weights(config: Config) -> tuple[TrainingConfig, str | None]:
    """training.load unset and model.name_or_path holding safetensors weights: those weights are the start, loaded
    strictly (a Hugging Face model directory means its weights, as `from_pretrained` reads it), not a random
    initialisation with only the log to tell; -> (training, a line for the log, None when nothing changed)."""
    training, model_dir = config.training, config.model.name_or_path
    if training.load is not None or model_dir is None or not holds_weights(model_dir):
        return training, None
    refuse_pickle_weights(Path(model_dir).expanduser(), "Config key 'model.name_or_path'")
    loaded = dataclasses.replace(training, load=model_dir, load_format="hf")
    return loaded, (
        f"weights: training.load is unset and model.name_or_path ({model_dir}) holds safetensors weights: "
        f"training.load={model_dir} (set training.load to start from another checkpoint; model.preset without "
        f"model.name_or_path initialises from scratch)"
    )


def auto_resume(training: TrainingConfig) -> tuple[TrainingConfig, str | None]:
    """training.resume=auto: the save directory's latest complete checkpoint replaces training.load (everything
    restored); -> (training, a line for the log, None when resume is off)."""
    if training.resume != "auto":
        return training, None
    if training.save is None:
        raise UserError(
            "Config key 'training.resume' = 'auto' continues from training.save's latest checkpoint, but "
            "training.save is not set. Set training.save=<dir> (where the checkpoints go), or training.resume=off."
        )
    save = Path(training.save).expanduser()
    if not (save.is_dir() and complete_checkpoints(save)):
        start = f"training.load ({training.load})" if training.load else "scratch"
        return training, f"training.resume=auto: no complete checkpoint in {save} yet, starting from {start}"
    checkpoint = locate_checkpoint(save, what=RESUME_AUTO)  # verified once the process group is up
    resumed = dataclasses.replace(training, load=str(save), load_format="dcp", no_load_optim=False, no_load_rng=False)
    return resumed, f"training.resume=auto: continuing from {checkpoint} (replaces training.load={training.load})"


def verify_resume(source: LoadSource | None, training: TrainingConfig) -> None:
    """A resume's DCP checkpoint checked once, before anything of it is read (collective: every rank calls it).
    An HF directory or a DeepSpeed tag is checked where it is opened (hf.checkpoint_files, deepspeed.locate)."""
    if source is not None and source.format == "dcp":
        resumed = training.resume == "auto" and training.load == str(Path(training.save).expanduser())
        what = RESUME_AUTO if resumed else "Config key 'training.load'"
        check_checkpoint_files(source.path, what)


def check_save_targets(training: TrainingConfig) -> None:
    """Fail before any collective when training.save or training.save_hf cannot become a directory."""
    for key in ("save", "save_hf"):
        if getattr(training, key) is not None:
            check_writable_dir(f"training.{key}", getattr(training, key))


# --------------------------------------------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------------------------------------------


def _checkpoint_shapes(checkpoint: Path) -> dict[str, tuple[int, ...]]:
    """FQN -> global shape of the model tensors in the checkpoint, from its metadata alone."""
    metadata = metadata_of(checkpoint).state_dict_metadata
    prefix = f"{MODEL_KEY}."
    return {
        key[len(prefix) :]: tuple(item.size)
        for key, item in metadata.items()
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)
    }


@dataclass(frozen=True)
class LoadAdvice:
    """How a load error names the checkpoint and what it suggests: the trainer speaks of its config keys, the
    ds_compat engine of its load_checkpoint arguments. `source` may use {path}."""

    source: str
    mismatch_fix: str
    optimizer_fix: str


TRAINING_LOAD = LoadAdvice(
    source="Config key 'training.load' = '{path}'",
    mismatch_fix="Resume with the model settings the checkpoint was saved with (model.preset / model.name_or_path / "
    "model.config_overrides), or set training.load_strict=false to load only the matching tensors.",
    optimizer_fix="The optimizer state must cover the same trainable parameters (model.freeze); set "
    "training.no_load_optim=true to start the optimizer afresh, or training.load_strict=false to load what fits.",
)


def load_checkpoint(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    checkpoint: Path,
    strict: bool,
    advice: LoadAdvice = TRAINING_LOAD,
) -> KeyDiff:
    """Load the model (and the optimizer, unless None) from a DCP checkpoint, resharded to this run's layout.

    The model's keys and global shapes are checked against the checkpoint's metadata first: strict stops on any
    difference, naming the first 20; otherwise matching tensors load and the rest keep their values. Returns the
    difference (for the log).
    """
    source = advice.source.format(path=checkpoint)
    trainable_only = holds_trainable_only(checkpoint)  # a LoRA run's: the weights plan loaded the base it refers to
    model_state = _model_state(model, trainable_only)
    expected = {key: tuple(value.shape) for key, value in model_state.items()}
    found = _checkpoint_shapes(checkpoint)
    diff = compare_keys(expected, found)
    if strict and not diff.ok:
        raise UserError(
            f"{source} does not fit the model: {describe_diff(diff)} Nothing was loaded. {advice.mismatch_fix}"
        )
    skipped = {key for key, shape in expected.items() if found.get(key, shape) != shape}
    state: dict[str, Any] = {MODEL_KEY: {k: v for k, v in model_state.items() if k not in skipped}}
    if optimizer is not None:
        optim_state = get_optimizer_state_dict(model, optimizer)  # creates the (zero) state DCP loads into
        state[OPTIM_KEY] = {**optim_state, "state": {k: v for k, v in optim_state["state"].items() if k not in skipped}}
    try:
        load_dcp(state, checkpoint, partial=not strict)
    except CheckpointException as error:
        cause = next(iter(error.failures.values()))[0]
        raise UserError(f"{source} could not be loaded: {cause}. {advice.optimizer_fix}") from None
    options = StateDictOptions(strict=strict and not trainable_only)  # trainable_only: strict on its keys above
    set_model_state_dict(model, state[MODEL_KEY], options=options)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state[OPTIM_KEY], options=options)
    return diff


def read_model_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The full (unsharded) model tensors of a DCP checkpoint, read offline without a process group, on CPU, in
    their saved dtype; keys are the model's FQNs."""
    metadata = metadata_of(checkpoint).state_dict_metadata
    prefix = f"{MODEL_KEY}."
    state = {
        key: torch.empty(tuple(item.size), dtype=item.properties.dtype)
        for key, item in metadata.items()
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)
    }
    if not state:
        raise UserError(f"DCP checkpoint '{checkpoint}' holds no model tensors (no '{prefix}*' keys).")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        load_dcp(state, checkpoint, no_dist=True)
    return {key[len(prefix) :]: value for key, value in state.items()}


# --------------------------------------------------------------------------------------------------------------
# Save
# --------------------------------------------------------------------------------------------------------------


def model_and_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, trainable_only: bool = False
) -> dict[str, Any]:
    """What a DCP checkpoint holds: {"model": FQN state dict, "optim": FQN optimizer state} (sharded, collective);
    `trainable_only`: the model's trainable parameters only (a LoRA run's, whose base is a reference)."""
    state: dict[str, Any] = {MODEL_KEY: _model_state(model, trainable_only)}
    if optimizer is not None:
        state[OPTIM_KEY] = get_optimizer_state_dict(model, optimizer)
    return state


def _model_state(model: nn.Module, trainable_only: bool) -> dict[str, Any]:
    """The model's FQN state dict (sharded), or its trainable parameters' only."""
    state = get_model_state_dict(model)
    if not trainable_only:
        return state
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    return {key: value for key, value in state.items() if key in trainable}


def save_model_and_optimizer(
    checkpoint: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, written: WrittenDigests
) -> None:
    """DCP-save the model (and the optimizer, when given) into `checkpoint`, without the trainer's step layout
    (the ds_compat engine's checkpoints; collective); each file's checksum goes to `written` as it is written."""
    state = model_and_optimizer_state(model, optimizer)
    dcp.save(state, checkpoint_id=checkpoint, storage_writer=dcp_writer(checkpoint, written))


@dataclass
class _Pending:
    step: int
    tmp: Path
    future: Future
    started: float
    best: bool


# What a save that runs out of space or permission raises; anything else is a bug and keeps its traceback.
STORAGE_ERRNOS = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded",
                  errno.EROFS: "read-only file system", errno.EACCES: "permission denied"}  # fmt: skip


def storage_failure(error: BaseException, directory: Path) -> OSError | None:
    """The OSError of a storage failure behind `error` (itself, its causes, or a rank's failure inside DCP's
    CheckpointException), else None. torch's zip writer (DCP writes its non-tensor items with torch.save) reports a
    full disk as a RuntimeError ("unexpected pos ..."): behind one, a small probe write into `directory` tells."""
    seen: list[BaseException] = []
    pending = [error]
    writer_failed = False
    while pending:
        current = pending.pop()
        if current is None or current in seen:
            continue
        seen.append(current)
        if isinstance(current, OSError) and current.errno in STORAGE_ERRNOS:
            return current
        if isinstance(current, CheckpointException):
            pending += [failure[0] if isinstance(failure, tuple) else failure for failure in current.failures.values()]
        writer_failed |= isinstance(current, RuntimeError) and "inline_container" in str(current)
        pending += [current.__cause__, current.__context__]
    return _probe_write(directory) if writer_failed else None


def _probe_write(directory: Path) -> OSError | None:
    """The storage error a 1 MiB write into `directory` meets, if any."""
    probe = directory / f".write-probe-{secrets.token_hex(4)}"
    try:
        with probe.open("wb") as stream:
            stream.write(bytes(1 << 20))
            stream.flush()
            os.fsync(stream.fileno())
    except OSError as error:
        return error if error.errno in STORAGE_ERRNOS else None
    finally:
        probe.unlink(missing_ok=True)
    return None


def storage_error(
    cause: OSError, what: str, directory: Path, previous: Path | None, partial: str, resumes: str
) -> UserError:
    """The one paragraph of a save that ran out of space or permission: `what` failed and why, the bytes it needs
    (the size of the `previous` checkpoint) against the bytes free, that `previous` stays the latest (and
    `resumes`), and that the `partial` directory was removed."""
    needed = (
        f"about {directory_bytes(previous):,} bytes (the size of {previous.name})"
        if previous is not None
        else "unknown bytes (no earlier checkpoint to size it)"
    )
    try:
        free = f"{shutil.disk_usage(directory).free:,} bytes free"
    except OSError:
        free = "free space unknown"
    kept = (
        f"The previous checkpoint {previous} stays `latest` {resumes}"
        if previous is not None
        else "No checkpoint of this run is complete yet"
    )
    return UserError(
        f"{what}: {STORAGE_ERRNOS[cause.errno]} ({errno.errorcode[cause.errno]}: {cause.strerror}"
        f"{f' on {cause.filename}' if cause.filename else ''}). It needs {needed}; the file system has {free}. "
        f"{kept}; the partial {partial} was removed. Free space (or quota), make the directory writable, or point "
        f"the checkpoints at storage that can hold them."
    )


def save_pt(obj: Any, path: Path, written: WrittenDigests | None = None) -> None:
    """torch.save through memory: a full disk raises the OSError (ENOSPC) instead of torch's writer's RuntimeError;
    `written`: the file's checksum is taken from the buffer as it is written."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    if written is not None:
        written.write_file(path, buffer.getbuffer())
        return
    with path.open("wb") as stream:
        stream.write(buffer.getbuffer())


def directory_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def own_files(checkpoint: Path, rank: int) -> list[Path]:
    """The files rank `rank` wrote into a checkpoint: its DCP shards and RNG states, and rank 0's metadata and
    trainer state."""
    files = [*checkpoint.glob(f"__{rank}_*.distcp"), rng_file(checkpoint, rank)]
    if rank == 0:
        files += [checkpoint / METADATA_FILE, checkpoint / TRAINER_STATE_FILE]
        files += [checkpoint / BASE_FILE] if (checkpoint / BASE_FILE).is_file() else []
        files += sorted(file for name in EXTRA_DIRS for file in (checkpoint / name).glob("*") if file.is_file())
    return files


def check_shared_save_dir(save_dir: Path, rank: int) -> None:
    """Every rank must see the directory rank 0 sees: a checkpoint is one directory that every rank writes its shard
    into and rank 0 publishes, so a path that is local to each node (a local disk, /tmp, a per-node tmpfs) would
    split it across the nodes. Rank 0 writes a probe file with a fresh token, every rank reads it back; any rank
    that does not see it stops the job (on every rank) before the first step. Collective; nothing with one rank."""
    from glm45v_fsdp.runtime.dist import gather_objects, rank_and_world

    if rank_and_world()[1] == 1:
        return
    token = secrets.token_hex(8) if rank == 0 else None
    if rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        (save_dir / f"{SHARED_PROBE_PREFIX}{token}").write_text(token)
    token = gather_objects(token)[0]  # also the barrier after rank 0's write
    probe = save_dir / f"{SHARED_PROBE_PREFIX}{token}"
    try:
        seen = probe.read_text() == token
    except OSError:
        seen = False
    views = gather_objects((socket.gethostname(), seen))
    if rank == 0:
        probe.unlink(missing_ok=True)
    blind: dict[str, list[int]] = {}
    for other, (host, ok) in enumerate(views):
        if not ok:
            blind.setdefault(host, []).append(other)
    if blind:
        where = "; ".join(f"rank(s) {', '.join(map(str, ranks))} on {host}" for host, ranks in blind.items())
        raise UserError(
            f"Config key 'training.save' = '{save_dir}' is not one directory shared by every node: rank 0 on "
            f"{views[0][0]} wrote {probe.name} there and {where} do not see it. Every rank writes its shard of a "
            f"checkpoint into that directory and rank 0 publishes it, so on storage local to each node (a local "
            f"disk, /tmp, a per-node tmpfs) it would be split across the nodes and could not be resumed. Point "
            f"training.save at storage every node mounts at the same path (NFS, Lustre, GPFS, a shared volume)."
        )


class Checkpointer:
    """Writes a run's checkpoints into training.save: cadence, atomic publish, keep-last pruning, background writes.

    Every rank calls `save` at the same steps (it holds collectives); only rank 0 renames, prunes and writes
    `latest`. With async_save the tensors are staged to host memory in the call and written by a background thread
    over a gloo group of its own (its collectives must never interleave with the training's); the previous save is
    waited for before the next one starts and at the end (`wait`), and rank 0 publishes it as soon as it is done.
    """

    def __init__(
        self,
        training: TrainingConfig,
        rank: int,
        fault: Fault | None = None,
        extra: Callable[[Path], None] | None = None,
        base: dict | None = None,
    ) -> None:
        assert training.save is not None
        self.extra = extra  # writes more of a checkpoint into its directory (collective; rank 0's files: EXTRA_DIRS)
        self.base = base  # a LoRA run's base reference: checkpoints hold the trainable state only (base_reference.py)
        self.fault = fault  # GLM45V_FAULT's sigkill_save fires between writing and publishing
        self.save_dir = Path(training.save).expanduser()
        self.interval = training.save_interval
        self.keep_last = training.save_keep_last
        self.final_step = training.train_iters
        self.async_save = training.async_save
        self.rank = rank
        check_shared_save_dir(self.save_dir, rank)
        self.group = dist.new_group(backend="gloo") if training.async_save else None
        self.world_size = dist.get_world_size()
        self.last_step: int | None = None  # the step whose state is on disk (set by a save or a resume)
        self.blocked_s = 0.0
        self._pending: _Pending | None = None
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-checksums")
        self.hashed = (0, 0.0)  # (bytes, seconds) of this rank's checksums at its last save, after its write
        self.log = get_logger()

    def due(self, step: int) -> bool:
        """Every save_interval steps (0: never in between) and at the last step."""
        if step == self.last_step:
            return False
        return step == self.final_step or (self.interval > 0 and step % self.interval == 0)

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
        rng_state: dict[str, Any],
        sync: bool = False,
        best: bool = False,
    ) -> float:
        """Write checkpoint `step` (collective; `sync`: in the call even with async_save, e.g. before a preemption
        exit; `best`: it becomes the one `best` names, once published); returns the seconds the caller was blocked."""
        start = time.perf_counter()
        self.wait()
        tmp = self.save_dir / f"{checkpoint_name(step)}{TMP_SUFFIX}"
        self._warn_if_short_of_space()
        background = self.async_save and not sync
        written = WrittenDigests()  # this save's checksums, taken as its files are written
        try:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # an interrupted earlier attempt at this step
                (tmp / RNG_DIR).mkdir(parents=True)
                save_pt(trainer_state, tmp / TRAINER_STATE_FILE, written)
                if self.base is not None:
                    write_base(tmp, self.base)
            dist.barrier()
            if self.extra is not None:
                self.extra(tmp)
            save_pt(rng_state, rng_file(tmp, self.rank), written)
            state = model_and_optimizer_state(model, optimizer, trainable_only=self.base is not None)
            writer = dcp_writer(tmp, written)
            if background:
                stored = dcp.async_save(state, checkpoint_id=tmp, storage_writer=writer, process_group=self.group)
                future = self._hasher.submit(self._checksums, tmp, written, stored)
                self._pending = _Pending(step, tmp, future, start, best)
                if self.fault is not None:
                    self.fault.maybe_fire(self.rank, step, in_save=True)
            else:
                # DCP's final step is the barrier: rank 0 writes .metadata only after every rank reported its files.
                dcp.save(state, checkpoint_id=tmp, storage_writer=writer)
                if self.fault is not None:
                    self.fault.maybe_fire(self.rank, step, in_save=True)
                self._checksums(tmp, written)
                self._publish(step, tmp, start, background=False, best=best)
        except (Exception, CheckpointException) as error:  # DCP's is a BaseException
            self._fail(error, step, tmp)
        blocked = time.perf_counter() - start
        self.blocked_s += blocked
        self.last_step = step
        if background:
            self.log.info(
                "checkpoint step %d: staged, writing in the background; step loop blocked %.3f s", step, blocked
            )
        return blocked

    def poll(self) -> None:
        """Publish a finished background save; never blocks."""
        if self._pending is not None and self._pending.future.done():
            self._complete()

    def wait(self) -> float:
        """Wait for the background save in flight, if any, and publish it; returns the seconds waited."""
        start = time.perf_counter()
        if self._pending is not None:
            self._complete()
        return time.perf_counter() - start

    def _complete(self) -> None:
        pending, self._pending = self._pending, None
        try:
            pending.future.result()  # rank 0's ends after every rank's files are written and hashed
        except (Exception, CheckpointException) as error:
            self._fail(error, pending.step, pending.tmp)
        self._publish(pending.step, pending.tmp, pending.started, background=True, best=pending.best)

    def _checksums(self, tmp: Path, written: WrittenDigests, stored: Future | None = None) -> None:
        """The checksums of the files this rank wrote (after an async write finished): those taken as they were
        written, the others (a LoRA run's adapter and base reference) read back; rank 0 then waits for every rank's
        part and writes the manifest."""
        if stored is not None:
            stored.result()
        started = time.perf_counter()
        hashed_bytes = write_part(tmp, self.rank, own_files(tmp, self.rank), written)
        self.hashed = (hashed_bytes, time.perf_counter() - started)  # not from `tmp`: rank 0 may have published it
        if self.rank == 0:
            merge_parts(tmp, self.world_size)

    def _warn_if_short_of_space(self) -> None:
        """Before a save: less free space than the last checkpoint took is a warning now, not a failure later."""
        if self.rank != 0 or not (previous := complete_checkpoints(self.save_dir)):
            return
        needed, free = directory_bytes(previous[-1]), shutil.disk_usage(self.save_dir).free
        if free < needed:
            self.log.warning(
                "checkpoint: %s has %s bytes free, less than the last checkpoint (%s, %s bytes): the next save may "
                "fail; free space or point training.save elsewhere",
                self.save_dir,
                f"{free:,}",
                previous[-1].name,
                f"{needed:,}",
            )

    def _fail(self, error: BaseException, step: int, tmp: Path) -> None:
        """A save that ran out of space or permission: remove its `.tmp` and stop with one paragraph; anything
        else keeps its traceback."""
        cause = storage_failure(error, tmp if tmp.is_dir() else self.save_dir)
        if cause is None:
            raise error
        shutil.rmtree(tmp, ignore_errors=True)
        previous = complete_checkpoints(self.save_dir)
        raise storage_error(
            cause,
            f"Checkpoint step {step} could not be written to '{self.save_dir}' (training.save)",
            self.save_dir,
            previous[-1] if previous else None,
            tmp.name,
            "and resumes the run (training.resume=auto)",
        ) from None

    def _publish(self, step: int, tmp: Path, started: float, background: bool, best: bool) -> None:
        """Rank 0: rename `step_N.tmp` to `step_N`, then point `latest` (and, for the best, `best`) at it and prune."""
        if self.rank != 0:
            return
        final = self.save_dir / checkpoint_name(step)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        for pointer in (LATEST_FILE, BEST_FILE) if best else (LATEST_FILE,):
            pointer_tmp = self.save_dir / f"{pointer}{TMP_SUFFIX}"
            pointer_tmp.write_text(final.name + "\n")
            os.replace(pointer_tmp, self.save_dir / pointer)
        removed = self._prune(final)
        hashed_bytes, hashed_s = self.hashed
        self.log.info(
            "checkpoint saved: %s (%.3f s%s; checksums of rank 0's %s bytes %.4f s)%s",
            final,
            time.perf_counter() - started,
            ", background write" if background else "",
            f"{hashed_bytes:,}",
            hashed_s,
            f"; removed {', '.join(removed)}" if removed else "",
        )

    def _prune(self, newest: Path) -> list[str]:
        """Remove stale `.tmp` directories and, with save_keep_last=K, all but the newest K checkpoints (and the one
        `best` names)."""
        doomed = [path for path in self.save_dir.glob(f"step_*{TMP_SUFFIX}") if path.is_dir()]
        if self.keep_last:
            best = self.save_dir / BEST_FILE
            kept = {newest, self.save_dir / best.read_text().strip()} if best.is_file() else {newest}
            older = [path for path in complete_checkpoints(self.save_dir) if path not in kept]
            doomed += older[: max(0, len(older) - (self.keep_last - 1))]
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)
        return sorted(path.name for path in doomed)
