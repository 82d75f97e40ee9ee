"""Writing a checkpoint of this backend in DeepSpeed's layout, so that the real DeepSpeed resumes it.

`write_deepspeed(state, out, stage, world_size)` writes `out/latest` and `out/global_step<N>/` with the files DeepSpeed
0.19 writes at that ZeRO stage for `world_size` data-parallel ranks (the layouts are described in
checkpoint/deepspeed.py, which reads them): the weights, the fp32 master partitions, the Adam moments and step, the
schedule's position, the counters and the client state. DeepSpeed then resumes with
`deepspeed.initialize(...)` + `engine.load_checkpoint(out)` on `world_size` ranks, with the same ZeRO stage and an
optimizer built over the parameters in the same groups and order (DeepSpeed checks the group count and sizes).

Stage 3 files hold DeepSpeed's LossScaler object (its loader indexes and uses it): it is pickled under DeepSpeed's
class path, so DeepSpeed unpickles its own class (fp32 / bf16: scale 1.0, static).
"""

from __future__ import annotations

import contextlib
import math
import sys
import types
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from glm45v_fsdp.checkpoint.digest_on_write import WrittenDigests
from glm45v_fsdp.checkpoint.integrity import write_manifest
from glm45v_fsdp.errors import UserError

DS_VERSION = "0.19.8"  # the layout written; DeepSpeed checks only that it is >= 0.3.17
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
_SCALER_MODULE = "deepspeed.runtime.fp16.loss_scaler"


@dataclass
class FullState:
    """A run's state as full tensors by name: what a DeepSpeed checkpoint is written from."""

    model: dict[str, torch.Tensor]  # parameters and persistent buffers
    groups: list[list[str]]  # the optimizer's parameter names per param group, in order
    hyperparameters: list[dict[str, Any]]  # per group: lr, betas, eps, weight_decay, ...
    moments: dict[str, dict[str, torch.Tensor]]  # name -> {"exp_avg", "exp_avg_sq"}
    step: float
    global_steps: int
    global_samples: int
    skipped_steps: int
    lr_scheduler: dict[str, Any] | None  # DeepSpeed's scheduler state ({"last_batch_iteration": n}) or None
    ds_config: dict[str, Any]
    client_state: dict[str, Any]


class _LossScalerStandIn:
    """Pickled as DeepSpeed's `LossScaler` when DeepSpeed is not importable here (see loss_scaler)."""

    def __init__(self, scale: float) -> None:
        self.cur_scale = scale
        self.dynamic = False


@contextmanager
def _pickled_as_deepspeed(cls: type):
    """Register `cls` as deepspeed.runtime.fp16.loss_scaler.LossScaler for the duration of a save, so that pickle
    records DeepSpeed's class path; only when DeepSpeed's own module is absent."""
    module = types.ModuleType(_SCALER_MODULE)
    module.LossScaler = cls
    cls.__module__, cls.__qualname__ = _SCALER_MODULE, "LossScaler"
    sys.modules[_SCALER_MODULE] = module
    try:
        yield
    finally:
        sys.modules.pop(_SCALER_MODULE, None)


def loss_scaler(scale: float = 1.0) -> tuple[Any, Any]:
    """(DeepSpeed's static LossScaler at `scale`, the context to save it in)."""
    # The library's one import of DeepSpeed (docs/architecture.md, "Floors"): its own class where it is installed, so
    # that DeepSpeed unpickles the checkpoint's scaler as its own object; else a stand-in pickled under its class path.
    try:
        from deepspeed.runtime.fp16.loss_scaler import LossScaler  # noqa: PLC0415  (optional: the real class)

        return LossScaler(scale), contextlib.nullcontext()
    except ImportError:
        return _LossScalerStandIn(scale), _pickled_as_deepspeed(_LossScalerStandIn)


def _group_params(state: FullState, group: int) -> list[tuple[str, torch.Tensor]]:
    return [(name, state.model[name].float()) for name in state.groups[group]]


def _adam_group(state: FullState, group: int, params: list[int]) -> dict[str, Any]:
    saved = state.hyperparameters[group]
    return {**{key: saved[key] for key in _ADAM_KEYS if key in saved}, "params": params}


def _common(state: FullState, stage: int, world: int) -> dict[str, Any]:
    """The top-level keys of a model-states file (client state merged in, as DeepSpeed does)."""
    trainable = {name for group in state.groups for name in group}
    shapes = [OrderedDict((name, state.model[name].shape) for name in group) for group in state.groups]
    common = {
        "buffer_names": [name for name in state.model if name not in trainable],
        "optimizer": None,
        "param_shapes": shapes if stage > 0 else None,
        "frozen_param_shapes": OrderedDict() if stage >= 2 else None,
        "frozen_param_fragments": {} if stage >= 2 else None,
        "shared_params": {} if stage > 0 else None,
        "lr_scheduler": state.lr_scheduler,
        "data_sampler": None,
        "random_ltd": None,
        "sparse_tensor_module_names": set(),
        "skipped_steps": state.skipped_steps,
        "global_steps": state.global_steps,
        "global_samples": state.global_samples,
        "dp_world_size": world,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": state.ds_config,
        "ds_version": DS_VERSION,
    }
    common.update(state.client_state)
    return common


def _stage0(state: FullState) -> dict[str, Any]:
    """Stage 0 fp32: torch AdamW's own state dict, parameters numbered over the groups."""
    optim_state, groups, index = {}, [], 0
    for group, names in enumerate(state.groups):
        numbers = []
        for name in names:
            moments = state.moments[name]
            optim_state[index] = {"step": torch.tensor(state.step), **{k: v.float() for k, v in moments.items()}}
            numbers.append(index)
            index += 1
        groups.append(_adam_group(state, group, numbers))
    return {"state": optim_state, "param_groups": groups}


def _stage12_files(state: FullState, stage: int, world: int) -> list[dict[str, Any]]:
    """Per rank: its partitions of each group's flat fp32 weights and moments (padded to 2 x world size)."""
    files = [
        {"fp32": [], "state": {}, "groups": [], "paddings": [], "mappings": []} for _ in range(world)
    ]  # fmt: skip
    for group in range(len(state.groups)):
        params = _group_params(state, group)
        flats = {
            "weights": torch.cat([tensor.flatten() for _, tensor in params]),
            **{key: torch.cat([state.moments[n][key].float().flatten() for n, _ in params])
               for key in ("exp_avg", "exp_avg_sq")},
        }  # fmt: skip
        numel = flats["weights"].numel()
        padded = math.ceil(numel / (2 * world)) * 2 * world
        part = padded // world
        flats = {key: torch.nn.functional.pad(flat, (0, padded - numel)) for key, flat in flats.items()}
        for rank, file in enumerate(files):
            start = rank * part
            padding = min(max(start + part - numel, 0), part)
            file["fp32"].append(flats["weights"][start : start + part - padding].clone())
            file["paddings"].append(padding)
            file["state"][group] = {
                "step": torch.tensor(state.step),
                "exp_avg": flats["exp_avg"][start : start + part].clone(),
                "exp_avg_sq": flats["exp_avg_sq"][start : start + part].clone(),
            }
            file["groups"].append(_adam_group(state, group, [group]))
    return [
        {
            "optimizer_state_dict": {
                "dynamic_loss_scale": False,
                "overflow": False,
                "clip_grad": float(state.ds_config.get("gradient_clipping", 0.0)),
                "base_optimizer_state": {"state": file["state"], "param_groups": file["groups"]},
                "single_partition_of_fp32_groups": file["fp32"],
                "zero_stage": stage,
                "group_paddings": file["paddings"],
                "param_alignment_paddings": [[0] * len(group) for group in state.groups],
                "partition_count": [world] * len(state.groups),
                "ds_version": DS_VERSION,
            },
            "ds_config": state.ds_config,
            "ds_version": DS_VERSION,
        }
        for file in files
    ]


def _stage3_files(state: FullState, world: int, scaler: Any) -> list[dict[str, Any]]:
    """Per rank: each parameter's chunk (padded to world x ceil(numel / world)), concatenated per group."""
    files = []
    for rank in range(world):
        flat_groups, optim_state, groups = [], {}, []
        for group in range(len(state.groups)):
            chunks = {"weights": [], "exp_avg": [], "exp_avg_sq": []}
            for name, tensor in _group_params(state, group):
                numel = tensor.numel()
                part = math.ceil(numel / world)
                sources = {"weights": tensor, **state.moments[name]}
                for key, source in sources.items():
                    padded = torch.nn.functional.pad(source.float().flatten(), (0, part * world - numel))
                    chunks[key].append(padded[rank * part : (rank + 1) * part])
            flat_groups.append(torch.cat(chunks["weights"]))
            optim_state[group] = {
                "step": torch.tensor(state.step),
                "exp_avg": torch.cat(chunks["exp_avg"]),
                "exp_avg_sq": torch.cat(chunks["exp_avg_sq"]),
            }
            groups.append(_adam_group(state, group, [group]))
        files.append(
            {
                "optimizer_state_dict": {
                    "zero_stage": 3,
                    "loss_scaler": scaler,
                    "dynamic_loss_scale": False,
                    "overflow": False,
                    "partition_count": world,
                    "optimizer_state_dict": {"state": optim_state, "param_groups": groups},
                    "fp32_flat_groups": flat_groups,
                },
                "ds_config": state.ds_config,
                "ds_version": DS_VERSION,
            }
        )
    return files


def write_deepspeed(state: FullState, out: str | Path, stage: int, world: int) -> Path:
    """Write `state` as DeepSpeed's ZeRO-`stage` checkpoint of `world` ranks under `out` (a new save_dir); returns
    the tag directory."""
    if stage not in (0, 1, 2, 3) or world < 1:
        raise UserError(f"dcp-to-ds: --zero-stage must be 0-3 and --world-size >= 1, got {stage} and {world}.")
    missing = [name for group in state.groups for name in group if name not in state.moments]
    if missing:
        raise UserError(
            f"dcp-to-ds: the checkpoint has no Adam moments for {missing[:10]} ({len(missing)} parameter(s)); "
            "DeepSpeed resumes only a full optimizer state. Convert a checkpoint saved after at least one step."
        )
    precision = next((key for key in ("bf16", "fp16") if (state.ds_config.get(key) or {}).get("enabled")), "fp32")
    if precision == "fp16":
        raise UserError(
            "dcp-to-ds: the ds_config enables fp16; writing DeepSpeed's fp16 loss-scaler state is not supported yet. "
            "Convert an fp32 or bf16 run."
        )
    if stage == 0 and precision != "fp32":
        raise UserError("dcp-to-ds: ZeRO stage 0 is written for fp32 runs only (bf16 needs DeepSpeed's fp16 wrapper).")
    tag = f"global_step{state.global_steps}"
    tag_dir = Path(out) / tag
    tag_dir.mkdir(parents=True)
    prefix = "bf16_" if precision == "bf16" else ""
    trainable = {name for group in state.groups for name in group}
    # DeepSpeed's module holds its parameters in the training dtype (buffers as they are); the fp32 masters of the
    # partitions come from state.model, untouched
    module = {
        name: tensor.to(torch.bfloat16) if precision == "bf16" and name in trainable else tensor
        for name, tensor in state.model.items()
    }
    common = _common(state, stage, world)
    scaler, context = loss_scaler()
    written = WrittenDigests()  # the files' checksums, taken as torch.save writes them

    def save(obj: dict[str, Any], name: str) -> None:
        with written.open_file(tag_dir / name) as stream:
            torch.save(obj, stream)

    with context:
        if stage == 0:
            states = {"module": module, **common, "optimizer": _stage0(state)}
            save(states, "mp_rank_00_model_states.pt")
        elif stage in (1, 2):
            save({"module": module, **common}, "mp_rank_00_model_states.pt")
            for rank, file in enumerate(_stage12_files(state, stage, world)):
                file["optimizer_state_dict"]["loss_scaler"] = scaler
                save(file, f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        else:
            module = {name: torch.empty(0, dtype=t.dtype) if name in trainable else t for name, t in module.items()}
            for rank, file in enumerate(_stage3_files(state, world, scaler)):
                save({"module": module, **common}, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
                save(file, f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    write_manifest(tag_dir, written)
    (Path(out) / "latest").write_text(tag)
    return tag_dir
