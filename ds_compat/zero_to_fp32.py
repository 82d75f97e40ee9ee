"""`deepspeed.utils.zero_to_fp32` for the engine's checkpoints: one consolidated fp32 state dict from the DCP shards,
offline (no process group, no GPU), whatever the world size that saved them.

    python -m ds_compat.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--safe_serialization] [--max_shard_size 5GB]

CHECKPOINT_DIR is the `save_dir` given to `engine.save_checkpoint` (it holds `latest` and the tag folders). As in
DeepSpeed 0.19 the output is a directory with `pytorch_model.bin` (or `model.safetensors`, sharded with an index
file above max_shard_size when huggingface_hub is installed). An OUTPUT ending in .bin / .pt / .pth /
.safetensors that is not a directory is written as that one file (the pre-0.14 `output_file` form).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from collections import OrderedDict
from pathlib import Path

import torch

from glm45v_fsdp.checkpoint.hf_export import write_safetensors
from glm45v_fsdp.errors import UserError

LATEST_FILE = "latest"
_FILE_SUFFIXES = (".bin", ".pt", ".pth", ".safetensors")


def _tag_dir(checkpoint_dir: str | os.PathLike, tag: str | None) -> Path:
    if tag is None:
        latest = os.path.join(checkpoint_dir, LATEST_FILE)
        if not os.path.isfile(latest):
            raise ValueError(f"Unable to find 'latest' file at {latest}")
        with open(latest) as handle:
            tag = handle.read().strip()
    path = Path(checkpoint_dir, tag)
    if not path.is_dir():
        raise FileNotFoundError(f"Directory '{path}' doesn't exist")
    return path


def _natural_order(path: str) -> list[int | str]:
    """`zero_pp_rank_10_...` after `zero_pp_rank_9_...`: digit runs compare as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def _checkpoint_files(checkpoint_dir: str | os.PathLike, pattern: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(checkpoint_dir, pattern)), key=_natural_order)
    if not files:
        raise FileNotFoundError(f"No {pattern} files in directory '{checkpoint_dir}'")
    return files


def get_optim_files(checkpoint_dir: str | os.PathLike) -> list[str]:
    """A DeepSpeed checkpoint's optimizer-state files in rank order, as DeepSpeed lists them."""
    return _checkpoint_files(checkpoint_dir, "*_optim_states.pt")


def get_model_state_files(checkpoint_dir: str | os.PathLike) -> list[str]:
    """A DeepSpeed checkpoint's model-state files in rank order, as DeepSpeed lists them."""
    return _checkpoint_files(checkpoint_dir, "*_model_states.pt")


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike, tag: str | None = None, exclude_frozen_parameters: bool = False, **_: object
) -> OrderedDict[str, torch.Tensor]:
    """The model's full state dict from `checkpoint_dir/<tag>` (tag from `latest` when None): floating tensors in
    fp32, others (integer buffers) as saved; on CPU. Keys are the module's state_dict keys."""
    from glm45v_fsdp.checkpoint.dcp import read_model_tensors

    if exclude_frozen_parameters:
        raise UserError(
            "exclude_frozen_parameters is not supported: the engine's DCP checkpoint does not record which "
            "parameters were frozen. Drop the frozen keys from the returned state dict yourself."
        )
    tensors = read_model_tensors(_tag_dir(checkpoint_dir, tag))
    return OrderedDict((key, value.float() if value.is_floating_point() else value) for key, value in tensors.items())


def _save(state: dict[str, torch.Tensor], path: str, safe_serialization: bool) -> None:
    if safe_serialization:
        write_safetensors({k: v.contiguous() for k, v in state.items()}, path)
    else:
        torch.save(state, path)


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    max_shard_size: str | int | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """Write the fp32 state dict of `checkpoint_dir/<tag>` under `output_dir` as DeepSpeed 0.19 does."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    output = str(output_dir)
    if output.endswith(_FILE_SUFFIXES) and not os.path.isdir(output):
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        _save(state, output, safe_serialization or output.endswith(".safetensors"))
        return
    os.makedirs(output, exist_ok=True)
    weights_name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    split = None
    if max_shard_size is not None:
        try:
            from huggingface_hub import split_torch_state_dict_into_shards
        except ImportError:
            split = None
        else:
            pattern = weights_name.replace(".bin", "{suffix}.bin").replace(".safetensors", "{suffix}.safetensors")
            split = split_torch_state_dict_into_shards(state, filename_pattern=pattern, max_shard_size=max_shard_size)
    if split is None or not split.is_sharded:
        _save(dict(state), os.path.join(output, weights_name), safe_serialization)
        return
    for shard_file, names in split.filename_to_tensors.items():
        _save({name: state[name] for name in names}, os.path.join(output, shard_file), safe_serialization)
    index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    index_name = "model.safetensors.index.json" if safe_serialization else "pytorch_model.bin.index.json"
    with open(os.path.join(output, index_name), "w", encoding="utf-8") as handle:
        handle.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str, tag: str | None = None):
    """Load the checkpoint's fp32 weights into a plain (unsharded) `model`, moved to CPU first; returns it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ds_compat.zero_to_fp32",
        description="Consolidate a ds_compat engine checkpoint (DCP shards) into one fp32 state dict.",
    )
    parser.add_argument("checkpoint_dir", help="the save_dir of engine.save_checkpoint (holds 'latest' and the tags)")
    parser.add_argument("output_dir", help="output directory (or a .bin/.pt/.safetensors file path)")
    parser.add_argument("--max_shard_size", default="5GB", help="shard above this size (needs huggingface_hub)")
    parser.add_argument("--safe_serialization", action="store_true", help="write safetensors instead of torch.save")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag, e.g. global_step14 (default: latest)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="not supported (an error)")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted for compatibility")
    args = parser.parse_args(argv)
    try:
        convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir,
            args.output_dir,
            max_shard_size=args.max_shard_size,
            safe_serialization=args.safe_serialization,
            tag=args.tag,
            exclude_frozen_parameters=args.exclude_frozen_parameters,
        )
    except (UserError, ValueError, FileNotFoundError) as error:
        print(f"ds_compat.zero_to_fp32: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
