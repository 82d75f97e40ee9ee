"""The non-tensor part of a DCP checkpoint: the trainer's state (written by rank 0) and every rank's RNG states.

`trainer_state.pt` holds step, skipped steps, the LR scheduler's state, consumed samples, the global batch size,
the world size, the resolved config YAML and a data.mixture run's sources and positions (data/mixture.py).
`rng/rank{R}.pt` holds rank R's Python, NumPy, torch CPU and device generator states. Both are plain containers
(lists, dicts, tensors), so they load with `weights_only=True`.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from glm45v_fsdp.checkpoint.safe_load import load_pt
from glm45v_fsdp.log import get_logger
from glm45v_fsdp.runtime import DeviceLayer

TRAINER_STATE_FILE = "trainer_state.pt"
ENGINE_STATE_FILE = "engine_state.pt"  # the ds_compat engine's counterpart (DeepSpeed's counters, client state)
RNG_DIR = "rng"


def rng_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / RNG_DIR / f"rank{rank}.pt"


def read_trainer_state(checkpoint: Path) -> dict[str, Any]:
    return load_pt(checkpoint / TRAINER_STATE_FILE)


def capture_rng(device: DeviceLayer) -> dict[str, Any]:
    """This rank's generator states; NumPy's key array becomes a list so the file loads with weights_only."""
    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"] = {**numpy_state["state"], "key": numpy_state["state"]["key"].tolist()}
    return {
        "python": random.getstate(),
        "numpy": numpy_state,
        "torch_cpu": torch.get_rng_state(),
        "device_type": device.type,
        "device": device.rng_state(),
    }


def set_rng(state: dict[str, Any], device: DeviceLayer) -> None:
    """Restore `capture_rng`'s states; a device state saved on another device type is skipped with a warning."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = dict(state["numpy"])
    numpy_state["state"] = {**numpy_state["state"], "key": np.asarray(numpy_state["state"]["key"], dtype=np.uint32)}
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch_cpu"])
    if state["device_type"] == device.type:
        device.set_rng_state(state["device"])
    else:
        get_logger().warning(
            "rng: the checkpoint's device generator state is for %s, this run uses %s; it keeps its seeded state",
            state["device_type"],
            device.type,
        )


def restore_rng(checkpoint: Path, rank: int, device: DeviceLayer) -> bool:
    """Restore this rank's RNG states from the checkpoint; False (after one warning) when it saved none for this
    rank, i.e. the checkpoint was written by fewer ranks: the rank then keeps its seeded generators."""
    path = rng_file(checkpoint, rank)
    if not path.is_file():
        get_logger().warning(
            "rng: '%s' does not exist (the checkpoint was saved by fewer ranks): rank %d keeps its seeded RNG states",
            path,
            rank,
        )
        return False
    set_rng(load_pt(path), device)
    return True


def data_start_step(state: dict[str, Any], global_batch_size: int) -> int:
    """The sampler step that continues after the checkpoint's consumed samples.

    The data order is a pure function of seed and step (stream items [k*G, (k+1)*G) for step k), so with an unchanged
    global batch G this is the saved step; with another G, the last step boundary at or before the consumed samples
    (the Trainer warns about the change).
    """
    return state["consumed_samples"] // global_batch_size
