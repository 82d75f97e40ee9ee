"""Export the training model as a Hugging Face directory that `Glm4vMoeForConditionalGeneration.from_pretrained` loads.

Collective: every rank gathers one tensor at a time (`DTensor.full_tensor()`); rank 0 converts it to the Hub's
per-expert layout and writes shards of at most `max_shard_bytes` as they fill, so it holds one full tensor plus one
shard. Everything goes into a hidden sibling directory that is renamed to the target at the end: the target is
never half-written, and an existing one is replaced only once the new export is complete. The shards are written by
`write_safetensors` (the safetensors format, streamed tensor by tensor), which hashes them as it writes, so the
manifest reads back only the config and tokenizer files transformers wrote.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import struct
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from glm45v_fsdp.checkpoint.digest_on_write import WrittenDigests
from glm45v_fsdp.checkpoint.hf import INDEX_FILE
from glm45v_fsdp.checkpoint.integrity import write_manifest
from glm45v_fsdp.checkpoint.layout import checkpoint_pieces, model_tensors, model_to_hub_tensors
from glm45v_fsdp.errors import UserError

# torch dtype -> the safetensors format's name for it
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip


def write_safetensors(
    tensors: dict[str, torch.Tensor], path: str | Path, written: WrittenDigests | None = None
) -> None:
    """`tensors` (contiguous, on the CPU) as one file of the safetensors format, streamed tensor by tensor (no copy
    of the shard in memory): an 8-byte little-endian header length, the JSON header (each tensor's dtype, shape and
    byte range; metadata format=pt) padded with spaces to 8 bytes, then the tensors' bytes in the header's order.
    `written`: the file's checksum is taken as it is written. The file gets the mode every other output file gets
    (0666 minus the umask)."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, tensor in tensors.items():
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"safetensors has no dtype for {key}'s {tensor.dtype}")
        header[key] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + tensor.nbytes]}  # fmt: skip
        offset += tensor.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    digests = written if written is not None else WrittenDigests()
    with digests.open_file(path) as stream:
        stream.write(struct.pack("<Q", len(encoded)))
        stream.write(encoded)
        for tensor in tensors.values():
            assert tensor.is_contiguous() and tensor.device.type == "cpu", "write_safetensors takes CPU tensors"
            stream.write(tensor.detach().reshape(-1).view(torch.uint8).numpy().data)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _keeps_fp32(model: nn.Module) -> re.Pattern | None:
    """Tensors transformers keeps in fp32 whatever the dtype (the router's weight and score-correction bias)."""
    modules = getattr(model, "_keep_in_fp32_modules_strict", None) or []
    return re.compile("|".join(re.escape(m) for m in modules)) if modules else None


def _shard_plan(tensors: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype], limit: int) -> list[list[str]]:
    """Hub keys, in write order, grouped into shards of at most `limit` bytes (a bigger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        itemsize = dtypes[name].itemsize
        for piece in checkpoint_pieces(name, tuple(tensor.shape), "per-expert"):
            nbytes = itemsize * int(torch.Size(piece.shape).numel())
            if shards[-1] and size + nbytes > limit:
                shards.append([])
                size = 0
            shards[-1].append(piece.key)
            size += nbytes
    return shards


def _prepare(out: Path) -> Path:
    """Rank 0: an empty hidden sibling directory; the error (if any) reaches every rank before any collective."""
    tmp = out.parent / f".{out.name}.tmp"
    error = None
    if _is_main():
        try:
            shutil.rmtree(tmp, ignore_errors=True)  # left over from an interrupted export
            tmp.mkdir(parents=True)
        except OSError as exc:
            error = (
                f"The HF export directory '{out}' (training.save_hf, or the convert tool's OUT) cannot be written: "
                f"creating '{tmp}' failed with {exc}. Choose a path in a writable directory."
            )
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise UserError(error)
    return tmp


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished export into place, replacing an existing directory only after the new one is complete."""
    old = out.parent / f".{out.name}.old"
    if out.exists():
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


@torch.no_grad()
def export_hf(
    model: nn.Module,
    out_dir: str | Path,
    hf_config,
    tokenizer=None,
    image_processor=None,
    max_shard_bytes: int = 5 * 2**30,
    dtype: torch.dtype | None = None,
) -> None:
    """Write `model` (sharded or not) to `out_dir` as per-expert safetensors shards + index + config.json.

    A collective over all ranks of the model's meshes. `dtype` converts floating tensors (default: as trained), except
    those transformers keeps in fp32. Tokenizer and image processor files are added via `save_pretrained` when given.
    """
    out = Path(out_dir).expanduser().absolute()
    tensors, _ = model_tensors(model)
    fp32 = _keeps_fp32(model)
    dtypes = {
        name: dtype if dtype is not None and t.is_floating_point() and not (fp32 and fp32.search(name)) else t.dtype
        for name, t in tensors.items()
    }
    shards = _shard_plan(tensors, dtypes, max_shard_bytes)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    shard_of = {key: i for i, keys in enumerate(shards) for key in keys}
    tmp = _prepare(out)
    digests = WrittenDigests()  # the shards' checksums, taken as they are written
    pending: dict[int, dict[str, torch.Tensor]] = {}
    total = 0
    for name, tensor in tensors.items():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()
        if not _is_main():
            continue
        full = full.to("cpu", dtypes[name])
        for key, value in model_to_hub_tensors(name, full):
            index = shard_of[key]
            pending.setdefault(index, {})[key] = value.contiguous()
            total += value.nbytes
            if len(pending[index]) == len(shards[index]):
                write_safetensors(pending.pop(index), tmp / names[index], digests)
    if _is_main():
        assert not pending, sorted(pending)
        index = {"metadata": {"total_size": total}, "weight_map": {key: names[shard_of[key]] for key in shard_of}}
        digests.write_file(tmp / INDEX_FILE, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
        config = copy.deepcopy(hf_config)
        config.architectures = ["Glm4vMoeForConditionalGeneration"]
        written = dtype or next(model.parameters()).dtype
        for sub in (config, *(getattr(config, key) for key in config.sub_configs)):
            sub.dtype = written
        config.save_pretrained(tmp)
        for extra in (tokenizer, image_processor):
            if extra is not None:
                extra.save_pretrained(tmp)
        write_manifest(tmp, digests)
        _publish(tmp, out)
    if dist.is_initialized():
        dist.barrier()
