"""The conversions and the inspection behind `python -m glm45v_fsdp.tools.convert` (tools/convert.py parses the
command line; each command here takes its argparse namespace and returns the exit code)."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import socket
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from glm45v_fsdp.checkpoint import integrity
from glm45v_fsdp.checkpoint.dcp import MODEL_KEY, OPTIM_KEY, find_checkpoint
from glm45v_fsdp.checkpoint.deepspeed import describe, load_into, read_deepspeed, tag_dir_of
from glm45v_fsdp.checkpoint.deepspeed_write import FullState, write_deepspeed
from glm45v_fsdp.checkpoint.hf import (
    DCP_METADATA,
    INDEX_FILE,
    LoadReport,
    checkpoint_files,
    detect_format,
    load_hf_weights,
    pickle_weight_files,
    read_headers,
)
from glm45v_fsdp.checkpoint.hf_export import export_hf
from glm45v_fsdp.checkpoint.integrity import MANIFEST_FILE, has_manifest
from glm45v_fsdp.checkpoint.layout import Shape, check_keys, describe_diff, detect_expert_layout, summarize_keys
from glm45v_fsdp.checkpoint.safe_load import UnsafeCheckpointFile, load_dcp, load_pt, metadata_of, read_whole_dcp
from glm45v_fsdp.checkpoint.state import ENGINE_STATE_FILE, TRAINER_STATE_FILE, read_trainer_state
from glm45v_fsdp.config import Config, config_from_dict, load_config
from glm45v_fsdp.data import load_image_processor, load_tokenizer
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.model import build_meta_model, load_hf_config, materialize

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# --------------------------------------------------------------------------------------------------------------
# Reading either format
# --------------------------------------------------------------------------------------------------------------


def pick_checkpoint(path: Path, what: str) -> Path:
    """`path` when it is a DCP checkpoint (a weights-only one too), else the one a training run would resume from."""
    return path if (path / DCP_METADATA).is_file() else find_checkpoint(path, what)


def dcp_entries(checkpoint: Path) -> dict[str, tuple[Shape, str]]:
    """Key -> (shape, dtype) of every tensor in a DCP checkpoint, from its metadata alone."""
    try:
        metadata = metadata_of(checkpoint).state_dict_metadata
    except UnsafeCheckpointFile:
        raise
    except Exception as error:  # a truncated or foreign .metadata fails in pickle, torch or the file system
        raise UserError(
            f"DCP checkpoint '{checkpoint}': its {DCP_METADATA} file cannot be read ({error!r}); the checkpoint is "
            f"incomplete or damaged. Use another checkpoint of the save directory."
        ) from None
    return {
        key: (tuple(item.size), str(item.properties.dtype).removeprefix("torch."))
        for key, item in metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }


def model_shapes(entries: dict[str, tuple[Shape, str]]) -> dict[str, Shape]:
    """The DCP model tensors, keyed by parameter FQN (the "model." level stripped)."""
    prefix = f"{MODEL_KEY}."
    return {key[len(prefix) :]: shape for key, (shape, _) in entries.items() if key.startswith(prefix)}


def _torch_dtype_name(safetensors_dtype: str) -> str:
    """'BF16' -> 'bfloat16', 'F32' -> 'float32', 'I64' -> 'int64' (as DCP metadata names them)."""
    match = re.fullmatch(r"(BF|F|I|U)(\d+)(.*)", safetensors_dtype)
    if match is None:
        return safetensors_dtype.lower()
    kind = {"BF": "bfloat", "F": "float", "I": "int", "U": "uint"}[match[1]]
    return f"{kind}{match[2]}{match[3].lower()}"


def _ranges(numbers: set[int]) -> str:
    values, spans = sorted(numbers), []
    for value in values:
        if spans and value == spans[-1][1] + 1:
            spans[-1][1] = value
        else:
            spans.append([value, value])
    text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return text if len(values) == 1 else f"{{{text}}}"


def collapse(entries: dict[str, tuple[Shape, str]]) -> list[str]:
    """One line per key pattern (numeric components collapsed into ranges): name, shapes and dtypes, count."""
    groups: dict[tuple[str, ...], tuple[list[set[int]], Counter]] = {}
    for key, (shape, dtype) in entries.items():
        parts = key.split(".")
        pattern = tuple("#" if part.isdigit() else part for part in parts)
        numbers = [int(part) for part in parts if part.isdigit()]
        sets, kinds = groups.setdefault(pattern, ([set() for _ in numbers], Counter()))
        for seen, number in zip(sets, numbers):
            seen.add(number)
        kinds[f"{list(shape)} {dtype}"] += 1
    lines = []
    for pattern, (sets, kinds) in sorted(groups.items()):
        numbers = iter(sets)
        name = ".".join(_ranges(next(numbers)) if part == "#" else part for part in pattern)
        count = sum(kinds.values())
        lines.append(f"  {name}  {' | '.join(kinds)}" + (f"  ({count} tensors)" if count > 1 else ""))
    return lines


def _prefixes(keys: list[str]) -> str:
    roots = Counter(".".join(key.split(".")[:2]) + "." if key.count(".") >= 2 else key for key in keys)
    return ", ".join(f"{root} ({count})" for root, count in sorted(roots.items()))


# --------------------------------------------------------------------------------------------------------------
# Config and model
# --------------------------------------------------------------------------------------------------------------


def saved_config(source: Path) -> Config | None:
    """The config a checkpoint carries: a training checkpoint's trainer state, or an HF/DCP config.json."""
    if (source / TRAINER_STATE_FILE).is_file():
        return config_from_dict(yaml.safe_load(read_trainer_state(source)["config"]))
    if (source / "config.json").is_file():
        config = load_config()
        config.model.name_or_path = str(source)
        return config
    return None


def resolve_config(path: str | None, source: Path) -> tuple[Config, str]:
    """--config when given, else the checkpoint's own config, else the default tiny config; and where it came from."""
    if path is not None:
        return load_config(path), f"--config {path}"
    config = saved_config(source)
    return (config, f"the config saved in '{source}'") if config else (load_config(), "the default tiny config")


def build_model(config: Config) -> tuple[nn.Module, object]:
    """The training model on CPU, one process, initialised (every tensor is overwritten by the load)."""
    hf_config = load_hf_config(config.model)
    model = build_meta_model(hf_config)
    materialize(model, torch.device("cpu"), config.training.seed)
    return model, hf_config


@contextmanager
def single_process_group() -> Iterator[None]:
    """A gloo group of one process (DCP and the export's collectives want one), unless one exists."""
    if dist.is_initialized():
        yield
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _fresh_output(path: str, what: str) -> Path:
    """The command's output path, which must not exist yet or be an empty directory."""
    out = Path(path).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(
            f"{what} = '{out}' already exists and is not an empty directory. Choose a new path, or remove it first."
        )
    return out


# --------------------------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------------------------


def inspect_deepspeed(tag_dir: Path) -> int:
    info = describe(tag_dir)
    print(
        f"DeepSpeed checkpoint {info['tag_dir']}: ZeRO stage {info['zero_stage']}, written by {info['world_size']} "
        f"rank(s), {info['dtype']}, DeepSpeed {info['ds_version']}, global step {info['global_steps']}"
    )
    print(f"files: {', '.join(info['files'])}")
    print(f"parameters: {info['parameters']} ({info['parameter_numel'] / 1e6:.2f}M elements)")
    print(f"client state keys: {', '.join(info['client_state_keys']) or 'none'}")
    entries = {key: (tuple(shape), info["dtype"]) for key, shape in info["keys"].items()}
    print(f"expert layout: {detect_expert_layout(model_shapes(entries)) or 'none (no routed experts)'}")
    print(f"key prefixes: {_prefixes(list(entries))}")
    print("parameters (numeric key components collapsed):")
    print("\n".join(collapse(entries)))
    return 0


def inspect(args: argparse.Namespace) -> int:
    path = Path(args.path).expanduser()
    tag_dir = tag_dir_of(path) if path.is_dir() else None
    if tag_dir is not None:
        return inspect_deepspeed(tag_dir)
    fmt = detect_format(path, "inspect PATH")
    if fmt == "hf":
        source, files = checkpoint_files(path)
        entries = {key: (shape, _torch_dtype_name(dtype)) for key, (shape, dtype) in read_headers(files).items()}
        shapes = {key: shape for key, (shape, _) in entries.items()}
        file_list = sorted(set(files.values()))
        print(f"HF checkpoint {path} ({source.name}): {len(file_list)} files, {len(entries)} tensors, ", end="")
    else:
        source = pick_checkpoint(path, "inspect PATH")
        entries = dcp_entries(source)
        shapes = model_shapes(entries)
        file_list = [p for p in source.iterdir() if p.is_file()]
        print(f"DCP checkpoint {source}: {len(file_list)} files, {len(entries)} tensors, ", end="")
    print(f"{sum(p.stat().st_size for p in file_list) / 2**20:.1f} MiB")
    layout = detect_expert_layout(shapes)
    print(f"expert layout: {layout or 'none (no routed experts)'}")
    print(f"key prefixes: {_prefixes(list(entries))}")
    print("tensors (numeric key components collapsed):")
    print("\n".join(collapse(entries)))
    if args.config is None:
        return 0
    model = build_meta_model(load_hf_config(load_config(args.config).model))
    diff, ignored = check_keys(model, shapes, layout)
    note = f" ({len(ignored)} tensors skipped as transformers does: {summarize_keys(ignored)})" if ignored else ""
    if diff.ok:
        print(f"fits --config {args.config}: every model tensor is there with its shape{note}.")
        return 0
    print(f"does not fit --config {args.config}: {describe_diff(diff)}{note}")
    return 1


def dcp_to_hf(args: argparse.Namespace) -> int:
    checkpoint = pick_checkpoint(Path(args.checkpoint).expanduser(), "dcp-to-hf CKPT")
    out = _fresh_output(args.out, "dcp-to-hf OUT")
    config, origin = resolve_config(args.config, checkpoint)
    with single_process_group():
        model, hf_config = build_model(config)
        diff, _ = check_keys(model, model_shapes(dcp_entries(checkpoint)), "stacked")
        if not diff.ok:
            raise UserError(
                f"dcp-to-hf CKPT = '{checkpoint}' does not fit the model built from {origin}: {describe_diff(diff)} "
                f"Pass --config with the model settings the checkpoint was trained with."
            )
        load_dcp({MODEL_KEY: model.state_dict()}, checkpoint)
        _export(model, out, hf_config, config, args.dtype)
    print(f"dcp-to-hf: {checkpoint} -> {out} (model from {origin})")
    return 0


def _export(model: nn.Module, out: Path, hf_config: object, config: Config, dtype: str | None) -> None:
    """The model as an HF directory, with the config's tokenizer and image processor when it has them."""
    name_or_path = config.model.name_or_path
    export_hf(
        model,
        out,
        hf_config,
        tokenizer=load_tokenizer(name_or_path) if _has_tokenizer(name_or_path) else None,
        image_processor=load_image_processor(name_or_path, hf_config.vision_config),
        dtype=DTYPES[dtype] if dtype else None,
    )


def _deepspeed_model(args: argparse.Namespace, what: str) -> tuple[nn.Module, object, Config, str, Path]:
    """The model built from --config (else the default tiny config) with a DeepSpeed checkpoint's weights (strict)."""
    state = read_deepspeed(Path(args.deepspeed).expanduser(), with_optimizer=False)
    config, origin = resolve_config(args.config, state.layout.tag_dir)
    model, hf_config = build_model(config)
    try:
        load_into(model, None, state, strict=True)
    except UserError as error:
        raise UserError(f"{what}: {error} Pass --config with the model settings DeepSpeed trained.") from None
    return model, hf_config, config, origin, state.layout.tag_dir


def _hf_model(source: Path, config_path: str | None) -> tuple[nn.Module, object, Config, str, LoadReport]:
    """The model built from --config (else the HF directory's own config) with the directory's weights (strict)."""
    config, origin = resolve_config(config_path, source)
    model, hf_config = build_model(config)
    report = load_hf_weights(model, source, strict=True)
    return model, hf_config, config, origin, report


def ds_to_hf(args: argparse.Namespace) -> int:
    out = _fresh_output(args.out, "ds-to-hf OUT")
    with single_process_group():
        model, hf_config, config, origin, tag_dir = _deepspeed_model(args, "ds-to-hf DS_DIR")
        _export(model, out, hf_config, config, args.dtype)
    print(f"ds-to-hf: {tag_dir} -> {out} (model from {origin})")
    return 0


def ds_to_dcp(args: argparse.Namespace) -> int:
    out = _fresh_output(args.out, "ds-to-dcp OUT")
    with single_process_group():
        model, hf_config, _, origin, tag_dir = _deepspeed_model(args, "ds-to-dcp DS_DIR")
        dcp.save({MODEL_KEY: model.state_dict()}, checkpoint_id=str(out))
        hf_config.save_pretrained(out)
    print(f"ds-to-dcp: {tag_dir} -> {out} (weights-only DCP checkpoint; model from {origin})")
    return 0


def _run_state(checkpoint: Path) -> dict[str, Any]:
    """The counters, schedule, ds_config and client state of one of our checkpoints in DeepSpeed's terms: from the
    ds_compat engine's engine_state.pt or the trainer's trainer_state.pt."""
    if (checkpoint / ENGINE_STATE_FILE).is_file():
        engine = load_pt(checkpoint / ENGINE_STATE_FILE)
        schedule = engine.get("lr_scheduler")
        if schedule is not None and "steps" in schedule:  # the engine's RecipeSchedule: steps taken
            schedule = {"last_batch_iteration": schedule["steps"] - 1}
        return {
            "global_steps": engine["global_steps"],
            "global_samples": engine["global_samples"],
            "skipped_steps": engine["skipped_steps"],
            "lr_scheduler": schedule,
            "ds_config": engine.get("ds_config") or {},
            "client_state": engine.get("client_state") or {},
        }
    trainer = read_trainer_state(checkpoint)
    return {
        "global_steps": trainer["step"],
        "global_samples": trainer["consumed_samples"],
        "skipped_steps": trainer["skipped_steps"],
        "lr_scheduler": {"last_batch_iteration": trainer["scheduler"]["steps"] - 1},
        "ds_config": {},
        "client_state": {},
    }


def dcp_to_ds(args: argparse.Namespace) -> int:
    path = Path(args.checkpoint).expanduser()
    latest = path / "latest"
    tag = path / latest.read_text().strip() if latest.is_file() else path
    if (tag / ENGINE_STATE_FILE).is_file():  # the engine API's save_dir (its `latest` tag) or one tag
        checkpoint = tag
    else:  # a trainer checkpoint, or a training.save directory (its newest complete one)
        checkpoint = pick_checkpoint(path, "dcp-to-ds CKPT")
    out = _fresh_output(args.out, "dcp-to-ds OUT")
    full = read_whole_dcp(checkpoint)
    optim = full.get(OPTIM_KEY)
    if not optim or not optim.get("state"):
        raise UserError(
            f"dcp-to-ds CKPT = '{checkpoint}' holds no optimizer state (a weights-only checkpoint, or saved before "
            "the first step): DeepSpeed resumes only a full optimizer state."
        )
    groups = [list(group["params"]) for group in optim["param_groups"]]
    state = FullState(
        model=full[MODEL_KEY],
        groups=groups,
        hyperparameters=[{k: v for k, v in group.items() if k != "params"} for group in optim["param_groups"]],
        moments={name: {k: slot[k] for k in ("exp_avg", "exp_avg_sq")} for name, slot in optim["state"].items()},
        step=float(next(iter(optim["state"].values()))["step"]),
        **_run_state(checkpoint),
    )
    tag_dir = write_deepspeed(state, out, args.zero_stage, args.world_size)
    print(f"dcp-to-ds: {checkpoint} -> {tag_dir} (ZeRO stage {args.zero_stage}, {args.world_size} rank(s))")
    return 0


def lora_merge(args: argparse.Namespace) -> int:
    """An HF base + a PEFT LoRA adapter -> the merged model as HF safetensors (transformers' from_pretrained)."""
    from glm45v_fsdp.lora.merge import adapter_deltas, merge_into

    base, adapter = Path(args.base).expanduser(), Path(args.adapter).expanduser()
    if detect_format(base, "lora-merge BASE") != "hf":
        raise UserError(f"lora-merge BASE = '{base}' is not an HF model directory (config.json + safetensors).")
    out = _fresh_output(args.out, "lora-merge OUT")
    with single_process_group():
        model, hf_config, config, origin, _ = _hf_model(base, args.config)
        deltas = adapter_deltas(adapter, model)
        merge_into(model, deltas)
        _export(model, out, hf_config, config, args.dtype)
    print(f"lora-merge: {base} + {adapter} ({len(deltas)} adapted weight(s)) -> {out} (model from {origin})")
    return 0


def _has_tokenizer(name_or_path: str | None) -> bool:
    """The tiny tokenizer always exists; a model directory may come without tokenizer files."""
    return name_or_path is None or any(Path(name_or_path).glob("tokenizer*"))


def hf_to_dcp(args: argparse.Namespace) -> int:
    source = Path(args.hf).expanduser()
    if detect_format(source, "hf-to-dcp HF") != "hf":
        raise UserError(f"hf-to-dcp HF = '{source}' is a DCP checkpoint, not an HF directory. Use dcp-to-hf for it.")
    out = _fresh_output(args.out, "hf-to-dcp OUT")
    with single_process_group():
        model, hf_config, _, origin, report = _hf_model(source, args.config)
        dcp.save({MODEL_KEY: model.state_dict()}, checkpoint_id=str(out))
        hf_config.save_pretrained(out)  # so that dcp-to-hf rebuilds the same model without --config
    print(
        f"hf-to-dcp: {source} ({report.expert_layout} experts, {report.tensors_read} tensors) -> {out} "
        f"(model from {origin})"
    )
    return 0


_NOT_COPIED = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".py")  # pickles, and remote code we never run


def bin_to_hf(args: argparse.Namespace) -> int:
    """An HF directory whose weights are pytorch_model*.bin pickles -> the same directory with safetensors weights,
    each .bin read weights-only (tensors and containers; a file naming any other callable is refused)."""
    source = Path(args.hf).expanduser()
    bins = [path for path in pickle_weight_files(source) if path.suffix == ".bin"] if source.is_dir() else []
    if not bins:
        raise UserError(
            f"bin-to-hf HF = '{source}' holds no pytorch_model*.bin files. Point it at a Hugging Face directory with "
            f"PyTorch-pickle weights; a directory with *.safetensors needs no conversion."
        )
    out = _fresh_output(args.out, "bin-to-hf OUT")
    shards: list[tuple[str, dict[str, torch.Tensor]]] = []
    for number, path in enumerate(bins, start=1):
        state = load_pt(path)
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise UserError(f"bin-to-hf: '{path}' is not a state dict (a dict of tensors). Nothing was written.")
        name = "model.safetensors" if len(bins) == 1 else f"model-{number:05d}-of-{len(bins):05d}.safetensors"
        shards.append((name, {key: value.detach().contiguous().clone() for key, value in state.items()}))
    out.mkdir(parents=True, exist_ok=True)
    for name, tensors in shards:
        save_file(tensors, out / name, metadata={"format": "pt"})
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for _, tensors in shards for t in tensors.values())},
            "weight_map": {key: name for name, tensors in shards for key in tensors},
        }
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    skipped = []
    for path in sorted(source.iterdir()):
        if path.is_file() and path.suffix not in _NOT_COPIED and path.name != "pytorch_model.bin.index.json":
            shutil.copy2(path, out / path.name)
        elif path.is_file() and path not in bins:
            skipped.append(path.name)
    left = f"; not copied: {', '.join(skipped)}" if skipped else ""
    print(
        f"bin-to-hf: {source} ({len(bins)} .bin file(s), read weights-only) -> {out} ({len(shards)} safetensors){left}"
    )
    return 0


def verify(args: argparse.Namespace) -> int:
    """`verify PATH`: PATH itself when it holds a manifest, else every directory below it that does (a save
    directory's checkpoints, a DeepSpeed save_dir's tags); each checked against its manifest."""
    path = Path(args.path)
    if not path.is_dir():
        raise UserError(f"'{path}' is not a directory. Pass a checkpoint directory or a directory holding several.")
    checkpoints = [path] if has_manifest(path) else sorted(p.parent for p in path.glob(f"*/{MANIFEST_FILE}"))
    if not checkpoints:
        print(f"{path}: NOT VERIFIED: no {MANIFEST_FILE} in it or in its subdirectories (written before checksums)")
        return 1
    damaged = 0
    for checkpoint in checkpoints:
        started = time.perf_counter()
        problem = integrity.verify(checkpoint)
        files = json.loads((checkpoint / MANIFEST_FILE).read_text())["files"] if problem is None else {}
        if problem is None:
            size = sum(entry["bytes"] for entry in files.values())
            print(f"{checkpoint}: intact ({len(files)} files, {size:,} bytes, {time.perf_counter() - started:.2f} s)")
        else:
            damaged += 1
            print(f"{checkpoint}: DAMAGED: {problem}")
    return 1 if damaged else 0
