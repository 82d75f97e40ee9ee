"""A LoRA run's checkpoints hold its trainable state only (the adapters, any modules_to_save, their optimizer state)
and a reference to the frozen base it trains on: `base.json`, the base's HF directory and the size of each of its
weight files. Resuming loads the base from there (after checking that its files are still the ones the run started
from), then the trainable state from the checkpoint. For 106B with LoRA r=8 a checkpoint is then megabytes of adapters
and their moments instead of the ~214 GB base written again at every save.
"""

from __future__ import annotations

import json
from pathlib import Path

from glm45v_fsdp.errors import UserError

BASE_FILE = "base.json"


def base_reference(directory: Path) -> dict:
    """The reference to an HF base directory: its absolute path and {weight file: bytes}."""
    directory = directory.expanduser().absolute()
    files = {path.name: path.stat().st_size for path in sorted(directory.glob("*.safetensors"))}
    return {"path": str(directory), "files": files}


def write_base(checkpoint: Path, reference: dict) -> None:
    (checkpoint / BASE_FILE).write_text(json.dumps(reference, indent=1) + "\n")


def holds_trainable_only(checkpoint: Path) -> bool:
    return (checkpoint / BASE_FILE).is_file()


def read_base(checkpoint: Path) -> Path:
    """The base directory a trainable-only checkpoint refers to, checked against the sizes recorded at save."""
    try:
        reference = json.loads((checkpoint / BASE_FILE).read_text())
        directory, recorded = Path(reference["path"]), dict(reference["files"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UserError(
            f"Checkpoint '{checkpoint}': its {BASE_FILE} (the reference to the frozen base a LoRA run trains on) is "
            f"not readable: {error}. The checkpoint holds the trainable state only, so it cannot be resumed without "
            f"it; restore the file from the run's other checkpoints (it is the same in each)."
        ) from None
    found = base_reference(directory)["files"] if directory.is_dir() else {}
    if found != recorded:
        changed = sorted(set(found.items()) ^ set(recorded.items()))
        raise UserError(
            f"Checkpoint '{checkpoint}' holds a LoRA run's trainable state only, trained on the base at '{directory}', "
            f"whose weight files are {'gone' if not found else 'not the ones the run started from'} "
            f"({', '.join(f'{name} {size} bytes' for name, size in changed[:3]) or 'no file'}). Put the base back at "
            f"that path (its {BASE_FILE} records each file's size), or start a new run."
        )
    return directory
