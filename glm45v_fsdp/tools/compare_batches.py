"""Compare two batch dumps token by token. Run as `python -m glm45v_fsdp.tools.compare-batches A B [--json]` (the
documented command, through compare-batches.py) or `python -m glm45v_fsdp.tools.compare_batches A B [--json]`.

A and B are dump directories (a run's output_dir, or its `batches/` folder) or two .pt files written by
glm45v_fsdp.data.dump. Files are matched by name; for each file and key the result is: equal, a dtype or shape
difference, or the first differing position (input_ids / labels / attention_mask / mm_token_type_ids: sample and
token; position_ids: row, sample and token) with both values and the count of differing elements. Files present on
one side only are reported. Exit status: 0 when everything is equal, 1 when anything differs, 2 on unusable input.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from glm45v_fsdp.errors import EXIT_USER_ERROR, UserError

if TYPE_CHECKING:  # torch (and glm45v_fsdp.data) are imported where used: --help and usage errors answer at once
    import torch

EXIT_DIFFERENT = 1
# Names of the dims of the [sample, token] keys and of position_ids [row, sample, token]; others use plain indices.
DIM_NAMES = {
    "input_ids": ("sample", "token"),
    "labels": ("sample", "token"),
    "attention_mask": ("sample", "token"),
    "mm_token_type_ids": ("sample", "token"),
    "position_ids": ("row", "sample", "token"),
}


def dump_files(path: Path) -> dict[str, Path]:
    """{file name: path} of a dump directory (its `batches/` folder when it has one)."""
    from glm45v_fsdp.data.dump import BATCH_DIR

    if not path.exists():
        raise UserError(f"'{path}' does not exist. Pass two dump directories or two .pt files.")
    if not path.is_dir():
        raise UserError(f"'{path}' is not a directory or a .pt file. Pass two dump directories or two .pt files.")
    folder = path / BATCH_DIR if (path / BATCH_DIR).is_dir() else path
    files = {p.name: p for p in sorted(folder.glob("*.pt"))}
    if not files:
        raise UserError(
            f"'{folder}' holds no .pt files. Point at a run's output_dir (or its {BATCH_DIR}/ folder) written with "
            f"training.dump_batches > 0."
        )
    return files


def load_batch(path: Path) -> dict[str, torch.Tensor]:
    import torch

    from glm45v_fsdp.checkpoint.safe_load import load_pt

    try:
        batch = load_pt(path)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as error:
        raise UserError(f"'{path}' cannot be read as a batch dump: {error}. Re-create it or remove it.") from None
    if not isinstance(batch, dict) or not all(isinstance(v, torch.Tensor) for v in batch.values()):
        raise UserError(f"'{path}' is not a batch dump (a dict of tensors). Pass files written by the batch dumper.")
    return batch


def _different(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise mask of differences; NaN equals NaN (a dump compared with itself is equal)."""
    if a.is_floating_point() or a.is_complex():
        return ~((a == b) | (a.isnan() & b.isnan()))
    return a != b


def compare_tensors(key: str, a: torch.Tensor, b: torch.Tensor) -> dict:
    """{key, status: equal | dtype | shape | values, ...details} for one key present on both sides."""
    import torch

    if a.dtype != b.dtype:
        return {"key": key, "status": "dtype", "a": str(a.dtype), "b": str(b.dtype)}
    if a.shape != b.shape:
        return {"key": key, "status": "shape", "a": list(a.shape), "b": list(b.shape)}
    mask = _different(a, b)
    count = int(mask.sum())
    if count == 0:
        return {"key": key, "status": "equal"}
    flat = int(mask.flatten().nonzero()[0])
    index = [int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)]
    names = DIM_NAMES.get(key)
    position = dict(zip(names, index, strict=True)) if names and len(names) == a.dim() else {"index": index}
    return {
        "key": key,
        "status": "values",
        "first_difference": position,
        "a_value": a.flatten()[flat].item(),
        "b_value": b.flatten()[flat].item(),
        "num_different": count,
        "numel": a.numel(),
    }


def compare_files(name: str, a: Path, b: Path) -> dict:
    batch_a, batch_b = load_batch(a), load_batch(b)
    keys = []
    for key in sorted(set(batch_a) | set(batch_b)):
        if key not in batch_b:
            keys.append({"key": key, "status": "only_in_a"})
        elif key not in batch_a:
            keys.append({"key": key, "status": "only_in_b"})
        else:
            keys.append(compare_tensors(key, batch_a[key], batch_b[key]))
    equal = all(k["status"] == "equal" for k in keys)
    return {"file": name, "status": "equal" if equal else "different", "keys": keys}


def compare(path_a: Path, path_b: Path) -> dict:
    """Compare two dump directories or two .pt files; `equal` is true when every file and key matches."""
    if path_a.suffix == ".pt" and path_b.suffix == ".pt" and path_a.is_file() and path_b.is_file():
        name = path_a.name if path_a.name == path_b.name else f"{path_a.name} vs {path_b.name}"
        files = [compare_files(name, path_a, path_b)]
    else:
        files_a, files_b = dump_files(path_a), dump_files(path_b)
        files = []
        for name in sorted(set(files_a) | set(files_b), key=_natural):
            if name not in files_b:
                files.append({"file": name, "status": "only_in_a", "keys": []})
            elif name not in files_a:
                files.append({"file": name, "status": "only_in_b", "keys": []})
            else:
                files.append(compare_files(name, files_a[name], files_b[name]))
    return {
        "a": str(path_a),
        "b": str(path_b),
        "equal": all(f["status"] == "equal" for f in files),
        "files": files,
    }


def _natural(name: str) -> list:
    """rank2_micro10 after rank2_micro9."""
    digits = "".join(c if c.isdigit() else " " for c in name).split()
    return [int(d) for d in digits] + [name]


def _describe_key(entry: dict) -> str:
    status = entry["status"]
    if status == "values":
        where = ", ".join(f"{k} {v}" for k, v in entry["first_difference"].items())
        return (
            f"first difference at {where}: A={entry['a_value']!r} B={entry['b_value']!r} "
            f"({entry['num_different']} of {entry['numel']} elements differ)"
        )
    if status in ("dtype", "shape"):
        return f"{status} differs: A {entry['a']} vs B {entry['b']}"
    return {"only_in_a": "only in A", "only_in_b": "only in B"}[status]


def format_result(result: dict) -> str:
    lines = [f"compare-batches: A = {result['a']}, B = {result['b']}"]
    for entry in result["files"]:
        if entry["status"] == "equal":
            lines.append(f"{entry['file']}: equal ({len(entry['keys'])} keys)")
        elif entry["status"] in ("only_in_a", "only_in_b"):
            lines.append(f"{entry['file']}: {_describe_key(entry)}")
        else:
            lines.append(f"{entry['file']}: DIFFERENT")
            lines += [f"  {k['key']}: {_describe_key(k) if k['status'] != 'equal' else 'equal'}" for k in entry["keys"]]
    different = sum(f["status"] != "equal" for f in result["files"])
    lines.append(
        "result: all equal"
        if result["equal"]
        else f"result: {different} of {len(result['files'])} file(s) differ or are missing on one side"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m glm45v_fsdp.tools.compare-batches",
        description="Compare two batch dumps (directories or .pt files) token by token.",
    )
    parser.add_argument("a", type=Path, help="dump directory or .pt file")
    parser.add_argument("b", type=Path, help="dump directory or .pt file")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        result = compare(args.a, args.b)
    except UserError as error:
        print(f"compare-batches: error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(json.dumps(result, indent=1) if args.json else format_result(result))
    return 0 if result["equal"] else EXIT_DIFFERENT


if __name__ == "__main__":
    sys.exit(main())
