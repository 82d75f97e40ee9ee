"""Reading DeepSpeed checkpoints (ZeRO 0-3, fp32 / bf16 / fp16, any saved world size) without DeepSpeed installed.

A DeepSpeed save directory holds `latest` (the tag) and `<tag>/` with:
    mp_rank_00_model_states.pt                      stages 0-2, written by dp rank 0: `module` (the model's state
                                                    dict in the training dtype), `param_shapes` (names and shapes in
                                                    the optimizer's flattening order), steps, scheduler, client state
                                                    merged into the top level; stage 0 also `optimizer`
    zero_pp_rank_R_mp_rank_00_model_states.pt       stage 3, every rank: the same keys, `module` holds empty tensors
    [bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt  stages 1-3, every rank: its partition of the fp32 master
                                                    weights and of the Adam moments
The layouts (DeepSpeed 0.19's stage_1_and_2.py / stage3.py, as its zero_to_fp32 reads them):
  - stages 1-2: per param group, the trainable parameters flattened in `param_shapes` order, zero-padded at the end
    to a multiple of 2 x world size and cut into equal partitions, one per rank; the saved fp32 partition has its
    padding removed, the moments keep it;
  - stage 3: every parameter padded on its own to world size x ceil(numel / world size) and cut into equal chunks;
    a rank's flat fp32 group (and its moments) is the concatenation of its chunks in `param_shapes` order.
`read_deepspeed` consolidates all of it into full fp32 tensors by parameter name: weights, Adam moments, the step.
The files pickle a few DeepSpeed classes (the loss scaler, the ZeRO stage enum, fragment addresses); they are read
through stand-ins with torch's weights-only unpickler, so DeepSpeed need not be installed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from glm45v_fsdp.checkpoint.integrity import check_manifest
from glm45v_fsdp.checkpoint.layout import checkpoint_pieces, compare_keys, describe_diff, detect_expert_layout
from glm45v_fsdp.checkpoint.safe_load import UnsafeCheckpointFile, load_pt
from glm45v_fsdp.errors import UserError

LATEST_FILE = "latest"
MODEL_STATES = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
OPTIM_STATES = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
# Top-level keys of a model-states file that are DeepSpeed's own; the rest is the client state (DeepSpeed returns
# every key but these from load_checkpoint).
ENGINE_KEYS = (
    "module",
    "skipped_steps",
    "global_steps",
    "dp_world_size",
    "mp_world_size",
    "data_sampler",
    "random_ltd",
)


class _StandIn:
    """A DeepSpeed object in a checkpoint (loss scaler, fragment address): its attributes, nothing else."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


def _stand_in(module: str, name: str, base: type = _StandIn) -> type:
    """A class named like DeepSpeed's `module.name`, for torch's weights-only unpickler to build instead."""
    return type(name, (base,), {"__module__": module, "__qualname__": name})


class _ZeroStage(int):
    """DeepSpeed's ZeroStageEnum (an int enum) as a plain int."""

    def __new__(cls, value: int = 0) -> _ZeroStage:
        return int.__new__(cls, value)


_STAND_INS = [
    _stand_in("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    _stand_in("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    _stand_in("deepspeed.utils.tensor_fragment", "fragment_address"),
    _stand_in("deepspeed.runtime.zero.config", "ZeroStageEnum", _ZeroStage),
]


def load_file(path: Path) -> dict[str, Any]:
    """One DeepSpeed checkpoint file, tensors on the CPU, DeepSpeed's classes read as stand-ins."""
    try:
        return load_pt(path, stand_ins=_STAND_INS)
    except UnsafeCheckpointFile:
        raise
    except Exception as error:  # torch raises UnpicklingError or RuntimeError for a file it cannot read
        raise UserError(
            f"Cannot read the DeepSpeed checkpoint file '{path}': {str(error).splitlines()[0]}. If the file is "
            "truncated or from another tool, use an earlier tag (the step directories next to it)."
        ) from None


@dataclass
class DeepSpeedLayout:
    """Where a DeepSpeed checkpoint's files are, and what wrote them."""

    tag_dir: Path
    stage: int
    world_size: int
    bf16_prefix: bool
    model_files: list[Path]  # stage 3: one per rank, in rank order; else the one mp_rank_00 file
    optim_files: list[Path]  # in rank order; none at stage 0
    head: dict[str, Any] = field(repr=False)  # the first model-states file, read once


def tag_dir_of(path: str | Path, tag: str | None = None) -> Path | None:
    """The tag directory of a DeepSpeed checkpoint at `path` (a save dir with `latest`, or a tag dir), else None."""
    path = Path(path)
    if tag is not None:
        path = path / str(tag)
    elif (path / LATEST_FILE).is_file() and not any(MODEL_STATES.match(p.name) for p in path.iterdir()):
        path = path / (path / LATEST_FILE).read_text().strip()
    if path.is_dir() and any(MODEL_STATES.match(p.name) for p in path.iterdir()):
        return path
    return None


def locate(path: str | Path, tag: str | None = None) -> DeepSpeedLayout:
    """The layout of the DeepSpeed checkpoint at `path` (save dir or tag dir); a clear error when there is none or
    when a rank's file is missing."""
    tag_dir = tag_dir_of(path, tag)
    if tag_dir is None:
        raise UserError(
            f"'{path}' is not a DeepSpeed checkpoint: no `latest` file naming a tag directory with "
            "mp_rank_00_model_states.pt or zero_pp_rank_0_mp_rank_00_model_states.pt. Pass DeepSpeed's save_dir or "
            "one of its global_stepN directories."
        )
    check_manifest(tag_dir, "DeepSpeed checkpoint")
    names = [p.name for p in tag_dir.iterdir()]
    stage3 = sorted(int(m.group(1)) for m in map(MODEL_STATES.match, names) if m and m.group(1) is not None)
    optim = sorted((int(m.group(2)), bool(m.group(1))) for m in map(OPTIM_STATES.match, names) if m)
    if stage3:
        model_files = [tag_dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(len(stage3))]
    else:
        model_files = [tag_dir / "mp_rank_00_model_states.pt"]
    head = load_file(model_files[0])
    world = int(head["dp_world_size"])
    if not optim:
        return DeepSpeedLayout(tag_dir, 0, world, False, model_files, [], head)
    prefix = optim[0][1]
    optim_files = [tag_dir / f"{'bf16_' if prefix else ''}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in
                   range(world)]  # fmt: skip
    missing = [p.name for p in optim_files + (model_files if stage3 else []) if not p.is_file()]
    if missing:
        raise UserError(
            f"The DeepSpeed checkpoint '{tag_dir}' was written by {world} ranks but lacks {missing}: it is "
            "incomplete. Use an earlier tag."
        )
    # DeepSpeed writes frozen_param_shapes from stage 2 on (None at stage 1): the stage without reading a partition
    stage = 3 if stage3 else 2 if head.get("frozen_param_shapes") is not None else 1
    return DeepSpeedLayout(tag_dir, stage, world, prefix, model_files, optim_files, head)


@dataclass
class DeepSpeedState:
    """A DeepSpeed checkpoint consolidated to full tensors by parameter name."""

    layout: DeepSpeedLayout
    weights: dict[str, torch.Tensor]  # trainable parameters (fp32 masters where saved), frozen ones and buffers
    moments: dict[str, dict[str, torch.Tensor]]  # name -> {"exp_avg", "exp_avg_sq"} (fp32, full shape)
    step: float | None  # Adam's step count, None without optimizer state
    hyperparameters: list[dict[str, Any]]  # the saved optimizer param groups, without their params
    model_states: dict[str, Any]  # rank 0's model-states file without `module` and `optimizer`
    loss_scale: dict[str, Any] | None  # fp16: the scaler's state (cur_scale, ...)

    @property
    def global_steps(self) -> int:
        return int(self.model_states.get("global_steps", 0))

    def client_state(self) -> dict[str, Any]:
        """What DeepSpeed's load_checkpoint returns as client_state: every top-level key that is not its own."""
        return {k: v for k, v in self.model_states.items() if k not in (*ENGINE_KEYS, "lr_scheduler")}


def _param_order(model_states: dict[str, Any]) -> list[list[tuple[str, torch.Size]]]:
    shapes = model_states.get("param_shapes")
    if not shapes:
        raise UserError(
            "The DeepSpeed checkpoint has no param_shapes (written by a DeepSpeed older than 0.3, or a stage-0 "
            "checkpoint): the order of its flat partitions is unknown. Resume it with the DeepSpeed that wrote it."
        )
    return [list(group.items()) for group in shapes]


def _stage12(files: list[dict[str, Any]], order: list[list[tuple[str, torch.Size]]]) -> tuple[dict, dict, float]:
    """Full fp32 weights and moments from stage 1/2 partitions (see the module docstring)."""
    weights, moments, step = {}, {}, None
    for group, params in enumerate(order):
        states = [f["optimizer_state_dict"] for f in files]
        flat = torch.cat([s["single_partition_of_fp32_groups"][group] for s in states])
        base = [s["base_optimizer_state"] for s in states]
        pieces = {"exp_avg": [], "exp_avg_sq": []}
        for state, optim in zip(states, base):
            kept = state["single_partition_of_fp32_groups"][group].numel()
            slot = optim["state"].get(group)
            if slot is None:
                continue
            step = float(slot["step"])
            for key in pieces:
                pieces[key].append(slot[key][:kept])
        offset = 0
        for name, shape in params:
            numel = math.prod(shape)
            weights[name] = flat[offset : offset + numel].view(shape).clone()
            if pieces["exp_avg"]:
                moments[name] = {
                    key: torch.cat(parts)[offset : offset + numel].view(shape).clone() for key, parts in pieces.items()
                }
            offset += numel
        assert offset == flat.numel(), f"group {group}: {offset} parameter elements, {flat.numel()} saved"
    return weights, moments, step


def _stage3(files: list[dict[str, Any]], order: list[list[tuple[str, torch.Size]]]) -> tuple[dict, dict, float]:
    """Full fp32 weights and moments from stage 3 per-parameter chunks."""
    world = len(files)
    states = [f["optimizer_state_dict"] for f in files]
    flats = [torch.cat(list(s["fp32_flat_groups"])) for s in states]
    optim = [s["optimizer_state_dict"]["state"] for s in states]
    have_moments = bool(optim[0])
    moment_flats = {
        key: [torch.cat([slots[g][key] for g in sorted(slots)]) for slots in optim] for key in ("exp_avg", "exp_avg_sq")
    } if have_moments else {}  # fmt: skip
    step = float(next(iter(optim[0].values()))["step"]) if have_moments else None
    weights, moments, offset = {}, {}, 0
    for name, shape in (item for group in order for item in group):
        numel = math.prod(shape)
        chunk = math.ceil(numel / world)
        weights[name] = torch.cat([flat[offset : offset + chunk] for flat in flats])[:numel].view(shape).clone()
        if have_moments:
            moments[name] = {
                key: torch.cat([flat[offset : offset + chunk] for flat in parts])[:numel].view(shape).clone()
                for key, parts in moment_flats.items()
            }
        offset += chunk
    return weights, moments, step


def _frozen(model_files: list[dict[str, Any]], stage: int) -> dict[str, torch.Tensor]:
    """Parameters the optimizer did not own (frozen), full: stage 3 keeps per-rank fragments, stage 2 whole ones."""
    head = model_files[0]
    shapes = head.get("frozen_param_shapes") or {}
    fragments = [f.get("frozen_param_fragments") or {} for f in model_files]
    frozen = {}
    for name, shape in shapes.items():
        if stage == 3:
            frozen[name] = torch.cat([f[name].flatten() for f in fragments])[: math.prod(shape)].view(shape).float()
        elif name in fragments[0]:
            frozen[name] = fragments[0][name].float().view(shape)
    return frozen


def _stage0_optimizer(head: dict[str, Any], module: dict[str, torch.Tensor]) -> tuple[dict, dict, float | None, list]:
    """Stage 0: torch's optimizer state dict (fp32) or DeepSpeed's unfused fp16/bf16 wrapper around it; parameters by
    index in the model's parameter order (the order DeepSpeed's optimizer was given them)."""
    optimizer = head.get("optimizer") or {}
    masters = optimizer.get("fp32_groups")  # the unfused fp16 / bf16 wrapper's fp32 copies, per group
    flat_masters = [tensor for group in masters for tensor in group] if masters is not None else None
    torch_state = optimizer.get("optimizer_state_dict", optimizer)
    groups = torch_state.get("param_groups", [])
    buffers = set(head.get("buffer_names") or [])
    names = [name for name in module if name not in buffers]
    weights, moments, step, index_names = {}, {}, None, []
    for group in groups:
        index_names += [(index, names[index] if index < len(names) else None) for index in group["params"]]
    for position, (index, name) in enumerate(index_names):
        if name is None:
            raise UserError(
                f"The stage-0 DeepSpeed checkpoint's optimizer holds parameter #{index}, but the model state has "
                f"{len(names)} tensors: its optimizer was not built over model.parameters(). Load the weights only "
                "(load_module_only=True / training.no_load_optim=true)."
            )
        slot = torch_state.get("state", {}).get(index)
        if flat_masters is not None:
            weights[name] = flat_masters[position].float().clone()
        if slot:
            step = float(slot["step"])
            moments[name] = {key: slot[key].float().clone() for key in ("exp_avg", "exp_avg_sq")}
    return weights, moments, step, [{k: v for k, v in g.items() if k != "params"} for g in groups]


def read_deepspeed(path: str | Path, tag: str | None = None, with_optimizer: bool = True) -> DeepSpeedState:
    """Consolidate the DeepSpeed checkpoint at `path` (save dir or tag dir; `tag` picks one) into full tensors."""
    layout = locate(path, tag)
    head = layout.head
    model_files = [head, *(load_file(p) for p in layout.model_files[1:])]
    module = head["module"]
    weights = {name: tensor.float() if tensor.is_floating_point() else tensor for name, tensor in module.items()}
    if layout.stage == 3:
        weights = {name: t for name, t in weights.items() if name in set(head.get("buffer_names") or [])}
    moments, step, hyperparameters, loss_scale = {}, None, [], None
    if layout.stage == 0:
        masters, moments, step, hyperparameters = _stage0_optimizer(head, module)
        weights.update(masters)
        optimizer = head.get("optimizer") or {}
        if "cur_scale" in optimizer and optimizer.get("dynamic_loss_scale"):
            loss_scale = {k: optimizer[k] for k in ("cur_scale", "cur_iter", "last_overflow_iter") if k in optimizer}
    else:
        order = _param_order(head)
        optim_files = [load_file(p) for p in layout.optim_files]
        merged, moments, step = (_stage3 if layout.stage == 3 else _stage12)(optim_files, order)
        weights.update(merged)
        weights.update(_frozen(model_files, layout.stage))
        for alias, stored in (head.get("shared_params") or {}).items():
            if stored in weights:
                weights[alias] = weights[stored]
        first = optim_files[0]["optimizer_state_dict"]
        torch_state = first.get("base_optimizer_state") or first.get("optimizer_state_dict") or {}
        hyperparameters = [{k: v for k, v in g.items() if k != "params"} for g in torch_state.get("param_groups", [])]
        scaler = first.get("loss_scaler")
        if scaler is not None and getattr(scaler, "dynamic", False):
            loss_scale = {k: v for k, v in vars(scaler).items() if k in ("cur_scale", "cur_iter", "last_overflow_iter")}
    if not with_optimizer:
        moments, step = {}, None
    states = {k: v for k, v in head.items() if k not in ("module", "optimizer")}
    return DeepSpeedState(layout, weights, moments, step, hyperparameters, states, loss_scale)


def describe(path: str | Path, tag: str | None = None) -> dict[str, Any]:
    """What `convert inspect` prints about a DeepSpeed checkpoint."""
    layout = locate(path, tag)
    head = layout.head
    module = head["module"]
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in module.values() if t.is_floating_point()})
    shapes = head.get("param_shapes")
    params = {name: list(shape) for group in shapes for name, shape in group.items()} if shapes else {
        name: list(t.shape) for name, t in module.items()}  # fmt: skip
    return {
        "format": "deepspeed",
        "tag_dir": str(layout.tag_dir),
        "zero_stage": layout.stage,
        "world_size": layout.world_size,
        "dtype": "bf16" if layout.bf16_prefix else ("fp16" if "float16" in dtypes else (dtypes[0] if dtypes else "?")),
        "ds_version": head.get("ds_version"),
        "global_steps": head.get("global_steps"),
        "files": [p.name for p in layout.model_files + layout.optim_files],
        "parameters": len(params),
        "parameter_numel": sum(math.prod(shape) for shape in params.values()),
        "client_state_keys": sorted(k for k in head if k not in (*ENGINE_KEYS, "lr_scheduler", "optimizer")),
        "keys": params,
    }


def _stacked(tensors: dict[str, torch.Tensor], model_shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Tensors of a per-expert checkpoint (a DeepSpeed run of transformers 4.x: `experts.{e}.gate_proj.weight`, ...)
    assembled into the model's stacked experts, as the HF loader maps them (checkpoint/layout.py); others as they
    are."""
    if detect_expert_layout(tensors) != "per-expert":
        return tensors
    result = dict(tensors)
    for name, shape in model_shapes.items():
        pieces = checkpoint_pieces(name, shape, "per-expert")
        if pieces[0].key == name or not all(piece.key in tensors for piece in pieces):
            continue  # not an expert stack, or incomplete: the key comparison names what is missing
        full = torch.empty(shape, dtype=tensors[pieces[0].key].dtype)
        for piece in pieces:
            box = full[tuple(slice(o, o + n) for o, n in zip(piece.offset, piece.size))]
            box.copy_(tensors[piece.key].unsqueeze(0) if piece.squeeze else tensors[piece.key])
            del result[piece.key]
        result[name] = full
    return result


def load_into(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, state: DeepSpeedState, strict: bool = True
) -> None:
    """Put a consolidated DeepSpeed checkpoint into `model` (plain or FSDP2-sharded; names as DeepSpeed saved them)
    and, when given and the checkpoint has them, the Adam moments and step into `optimizer` (every rank passes the
    full tensors; each keeps its shard). Missing or unexpected keys stop before anything is copied (`strict`)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    expected = get_model_state_dict(model)
    model_shapes = {name: tuple(tensor.shape) for name, tensor in expected.items()}
    weights = _stacked(state.weights, model_shapes)
    moments = {
        key: _stacked({name: slots[key] for name, slots in state.moments.items()}, model_shapes)
        for key in ("exp_avg", "exp_avg_sq")
    } if state.moments else {}  # fmt: skip
    diff = compare_keys(model_shapes, {name: tuple(tensor.shape) for name, tensor in weights.items()})
    if diff.mismatched or (strict and not diff.ok):
        raise UserError(
            f"The DeepSpeed checkpoint '{state.layout.tag_dir}' does not fit the model: {describe_diff(diff)} Nothing "
            "was loaded. Load it into the model that wrote it (the same class and config)."
        )
    weights = {name: weights[name] for name in expected if name in weights}
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=strict))
    if optimizer is None or not state.moments:
        return
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise UserError(
            f"The DeepSpeed checkpoint '{state.layout.tag_dir}' holds Adam moments (exp_avg, exp_avg_sq), but this "
            f"run's optimizer is torch.optim.{type(optimizer).__name__}: they do not map onto it. Train with Adam / "
            "AdamW, or load the weights only (load_optimizer_states=False / training.no_load_optim=true)."
        )
    names = {id(param): name for name, param in model.named_parameters()}
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]}
        for group in optimizer.param_groups
    ]
    wanted = [name for group in groups for name in group["params"]]
    lacking = [name for name in wanted if name not in moments["exp_avg"]]
    if lacking:
        raise UserError(
            f"The DeepSpeed checkpoint '{state.layout.tag_dir}' has no optimizer state for {lacking[:10]} "
            f"({len(lacking)} parameter(s)): its optimizer did not train them. Load the weights only "
            "(load_optimizer_states=False / training.no_load_optim=true)."
        )
    step = torch.tensor(float(state.step), dtype=torch.float32)
    full = {
        "state": {name: {"step": step.clone(), **{key: moments[key][name] for key in moments}} for name in wanted},
        "param_groups": groups,
    }
    set_optimizer_state_dict(model, optimizer, full, options=StateDictOptions(full_state_dict=True))
