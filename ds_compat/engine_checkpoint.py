"""The engine's checkpoint API: save_checkpoint / load_checkpoint in DeepSpeed's layout (`save_dir/<tag>/` with DCP
shards and engine_state.pt, `save_dir/latest`; a checkpoint the real DeepSpeed wrote loads too), the full and 16-bit
state dicts and model saves (module_state_dict, save_16bit_model, `_zero3_consolidated_16bit_state_dict`), and the
module's state dicts whole under ZeRO 0-2, as DeepSpeed keeps its parameters (CheckpointAPI, a mixin of
DeepSpeedEngine over its module, optimizer, scheduler, loss scaler and counters)."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from glm45v_fsdp.checkpoint.dcp import (
    METADATA_FILE,
    LoadAdvice,
    load_checkpoint,
    save_model_and_optimizer,
    storage_error,
    storage_failure,
)
from glm45v_fsdp.checkpoint.deepspeed import load_into, read_deepspeed, tag_dir_of
from glm45v_fsdp.checkpoint.digest_on_write import WrittenDigests
from glm45v_fsdp.checkpoint.integrity import check_manifest, merge_parts, write_part
from glm45v_fsdp.checkpoint.safe_load import load_pt, unsafe_globals
from glm45v_fsdp.checkpoint.state import ENGINE_STATE_FILE
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.lora.peft_model import peft_names_of
from glm45v_fsdp.optim import RecipeSchedule
from glm45v_fsdp.parallel.fsdp import DTYPES

ENGINE_LOAD = LoadAdvice(
    source="Checkpoint '{path}'",
    mismatch_fix="Load it into the model it was saved from, or pass load_module_strict=False to take only the "
    "matching tensors.",
    optimizer_fix="The optimizer state must cover the same parameters; pass load_optimizer_states=False to start "
    "it afresh.",
)
LATEST_FILE = "latest"

WHOLE_STATE_DICT = "_ds_compat_whole_state_dict"  # module flag: state_dict() / load_state_dict() with full tensors


def _whole_state_dict_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """ZeRO 0-2 keep parameters whole in DeepSpeed, so `model.state_dict()` holds full tensors: the FSDP2 shards are
    gathered (a collective, as every rank calls state_dict in such code)."""
    if getattr(module, WHOLE_STATE_DICT, False):
        for key, value in state_dict.items():
            if isinstance(value, DTensor):
                state_dict[key] = value.full_tensor()


def _whole_load_state_dict_hook(module: nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
    """The other way: full tensors given to `load_state_dict` become this rank's shards (no communication)."""
    if not getattr(module, WHOLE_STATE_DICT, False):
        return
    targets = {prefix + name: t for name, t in [*module.named_parameters(), *module.named_buffers()]}
    for key, value in state_dict.items():
        target = targets.get(key)
        if isinstance(target, DTensor) and torch.is_tensor(value) and not isinstance(value, DTensor):
            full = value.to(device=target.device, dtype=target.dtype)
            state_dict[key] = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)


def keep_whole_state_dicts(module: nn.Module, whole: bool) -> None:
    """`module.state_dict()` / `load_state_dict()` with full tensors while `whole` (ZeRO 0-2), FSDP2's shards else."""
    if not hasattr(module, WHOLE_STATE_DICT):  # once per model (an earlier engine may have shared it)
        module.register_state_dict_post_hook(_whole_state_dict_hook)
        module.register_load_state_dict_pre_hook(_whole_load_state_dict_hook)
    setattr(module, WHOLE_STATE_DICT, whole)


class CheckpointAPI:
    """DeepSpeed's checkpoint methods on the engine."""

    def _engine_state(self, client_state: dict) -> dict[str, Any]:
        return {
            "global_steps": self.global_steps,
            "global_samples": self.global_samples,
            "skipped_steps": self.skipped_steps,
            "micro_steps": self.micro_steps,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
            "dp_world_size": self.dp_world_size,
            "world_size": self.world_size,
            "zero_stage": self.translation.zero_stage,
            "ds_config": self.config,
            "client_state": dict(client_state),
        }

    def save_checkpoint(
        self,
        save_dir: str | os.PathLike,
        tag: Any = None,
        client_state: dict | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """DeepSpeed's layout: `save_dir/<tag>/` (default tag `global_step<N>`) and `save_dir/latest` naming the tag.
        Inside the tag: DCP shards of {"model", "optim"} (any world size loads them) and `engine_state.pt`."""
        if not save_dir:
            raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
        if exclude_frozen_parameters:
            raise UserError(
                "save_checkpoint(exclude_frozen_parameters=True) is not supported by the FSDP2 backend: the DCP "
                "checkpoint always holds the whole model. Drop the argument."
            )
        save_dir = Path(save_dir)
        if self.global_rank == 0:
            save_dir.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        tag = str(f"global_step{self.global_steps}" if tag is None else tag)
        engine_state = self._plain_engine_state(client_state or {})
        self._check_tag(tag)
        path = save_dir / tag
        written = WrittenDigests()  # the checksums (checkpoint/integrity.py), taken as the files are written
        try:
            with self._sharded_state_dicts():
                save_model_and_optimizer(path, self.module, self.optimizer, written)
            # each rank's shards, rank 0's metadata and engine state, merged into the manifest before `latest` names
            # the tag
            mine = list(path.glob(f"__{self.global_rank}_*.distcp"))
            if self.global_rank == 0:
                written.write_file(path / ENGINE_STATE_FILE, engine_state)
                mine += [path / METADATA_FILE, path / ENGINE_STATE_FILE]
            write_part(path, self.global_rank, mine, written)
            if self.global_rank == 0:
                merge_parts(path, self.world_size)
        except (Exception, CheckpointException) as error:  # DCP's is a BaseException
            self._save_failed(error, save_dir, path)
        if self.global_rank == 0 and save_latest:
            (save_dir / LATEST_FILE).write_text(tag)
        dist.barrier()
        self.log.info("ds_compat: checkpoint saved to %s", path)
        return True

    def _save_failed(self, error: BaseException, save_dir: Path, path: Path) -> None:
        """A save that ran out of space or permission (ENOSPC, EDQUOT, EROFS, EACCES): the tag's partial directory is
        removed and `latest` keeps naming the previous tag, in one paragraph; anything else keeps its traceback."""
        cause = storage_failure(error, path if path.is_dir() else save_dir)
        if cause is None:
            raise error
        shutil.rmtree(path, ignore_errors=True)
        latest = save_dir / LATEST_FILE
        previous = save_dir / latest.read_text().strip() if latest.is_file() else None
        raise storage_error(
            cause,
            f"save_checkpoint('{save_dir}', tag '{path.name}') could not write the checkpoint",
            save_dir,
            previous if previous is not None and previous.is_dir() else None,
            path.name,
            "(load_checkpoint resumes from it)",
        ) from None

    @contextlib.contextmanager
    def _sharded_state_dicts(self) -> Iterator[None]:
        """The engine's own checkpoint code wants FSDP2's sharded state dicts, whatever the ZeRO stage."""
        whole = getattr(self.module, WHOLE_STATE_DICT, False)
        setattr(self.module, WHOLE_STATE_DICT, False)
        names = peft_names_of(self.module)  # a PEFT model's state dicts in our names meanwhile
        if names is not None:
            names.active = False
        try:
            yield
        finally:
            setattr(self.module, WHOLE_STATE_DICT, whole)
            if names is not None:
                names.active = True

    def _plain_engine_state(self, client_state: dict) -> bytes:
        """engine_state.pt's bytes; a client_state that would not load weights-only (it names a class or function
        beyond plain values and tensors) is refused on every rank before anything is written."""
        buffer = io.BytesIO()
        torch.save(self._engine_state(client_state), buffer)
        foreign = unsafe_globals(buffer)
        problems: list[Any] = [None] * self.world_size
        dist.all_gather_object(problems, ", ".join(foreign) or None)
        named = next((problem for problem in problems if problem), None)
        if named:
            raise UserError(
                f"save_checkpoint(client_state=...) holds objects pickled as {named}: a checkpoint is loaded "
                "weights-only (a file that names a class or function could run code), so this one could not be "
                "loaded back. Pass plain values: dicts, lists, tuples, strings, numbers, booleans, None and tensors "
                "(e.g. vars(args) for an argparse.Namespace). Nothing was written."
            )
        return buffer.getvalue()

    def _check_tag(self, tag: str) -> None:
        tags: list[Any] = [None] * self.world_size
        dist.all_gather_object(tags, tag)
        if len(set(tags)) != 1:
            raise UserError(
                f"save_checkpoint: the tag differs between ranks ({sorted(set(tags))}); every rank must pass the "
                "same tag (DeepSpeed checks this too)."
            )

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike,
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Callable | None = None,
    ) -> tuple[str | None, dict | None]:
        """Returns (checkpoint path, client_state); (None, None) when `load_dir/latest` is missing and no tag is
        given, as DeepSpeed."""
        if custom_load_fn is not None:
            raise UserError("load_checkpoint(custom_load_fn=...) is not supported by the FSDP2 backend.")
        load_dir = Path(load_dir)
        if tag is None:
            latest = load_dir / LATEST_FILE
            if not latest.is_file():
                self.log.warning(
                    "Unable to find latest file at %s, if trying to load latest checkpoint please ensure this file "
                    "exists or pass an explicit checkpoint tag when loading a checkpoint.",
                    latest,
                )
                return None, None
            tag = latest.read_text().strip()
        path = load_dir / str(tag)
        state_file = path / ENGINE_STATE_FILE
        with_optimizer = load_optimizer_states and not load_module_only and self.optimizer is not None
        if not state_file.is_file() and tag_dir_of(path) is not None:
            with self._sharded_state_dicts():
                return self._load_deepspeed_checkpoint(
                    path, load_module_strict, with_optimizer, load_lr_scheduler_states, load_module_only
                )
        if not state_file.is_file():
            raise UserError(
                f"load_checkpoint: '{path}' is not a checkpoint of this engine (no {ENGINE_STATE_FILE}) nor one "
                "written by DeepSpeed (no mp_rank_00_model_states.pt / zero_pp_rank_0_mp_rank_00_model_states.pt). "
                "Pass the save_dir given to save_checkpoint and one of its tags."
            )
        check_manifest(path, "DeepSpeed-API checkpoint")  # before anything of it is read
        state = load_pt(state_file)  # before the weights: a refused file leaves the engine as it was
        with self._sharded_state_dicts():
            optimizer = self.optimizer if with_optimizer else None
            load_checkpoint(self.module, optimizer, path, strict=load_module_strict, advice=ENGINE_LOAD)
        if not load_module_only:
            if load_lr_scheduler_states and self.lr_scheduler is not None and state["lr_scheduler"] is not None:
                self.lr_scheduler.load_state_dict(state["lr_scheduler"])
            if self.loss_scaler is not None and state.get("loss_scaler") is not None:
                self.loss_scaler.load_state_dict(state["loss_scaler"])
            self.global_steps = state["global_steps"]
            self.global_samples = state["global_samples"]
            self.skipped_steps = state["skipped_steps"]
        self.log.info(
            "ds_compat: loaded %s (global step %d, optimizer %s)",
            path,
            self.global_steps,
            "restored" if with_optimizer else "not restored",
        )
        return str(path), state["client_state"]

    def _load_deepspeed_checkpoint(
        self, path: Path, strict: bool, with_optimizer: bool, with_scheduler: bool, module_only: bool
    ) -> tuple[str, dict]:
        """A checkpoint the real DeepSpeed wrote (any ZeRO stage and world size): weights, Adam moments and step,
        the schedule's position, the counters; returns the client state as DeepSpeed does."""
        state = read_deepspeed(path, with_optimizer=with_optimizer)
        load_into(self.module, self.optimizer if with_optimizer else None, state, strict=strict)
        if not module_only:
            saved = state.model_states.get("lr_scheduler")
            if with_scheduler and self.lr_scheduler is not None and saved is not None:
                if isinstance(self.lr_scheduler, RecipeSchedule) and "last_batch_iteration" in saved:
                    self.lr_scheduler.step(last_batch_iteration=int(saved["last_batch_iteration"]))
                else:
                    self.lr_scheduler.load_state_dict(saved)
            if self.loss_scaler is not None and state.loss_scale is not None:
                self.loss_scaler.scale = float(state.loss_scale["cur_scale"])
            self.global_steps = int(state.model_states.get("global_steps", 0))
            self.global_samples = int(state.model_states.get("global_samples", 0))
            self.skipped_steps = int(state.model_states.get("skipped_steps", 0))
        self.log.info(
            "ds_compat: loaded DeepSpeed checkpoint %s (ZeRO %d, written by %d rank(s), global step %d, optimizer %s)",
            path,
            state.layout.stage,
            state.layout.world_size,
            self.global_steps,
            "restored" if with_optimizer and state.moments else "not restored",
        )
        return str(path), state.client_state()

    def module_state_dict(self, full: bool = True) -> dict[str, torch.Tensor]:
        """The model's full state dict (collective under FSDP2; every rank gets the tensors, on CPU)."""
        with self._sharded_state_dicts():
            return get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=full, cpu_offload=True))

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """The ds_config's zero_optimization.stage3_gather_16bit_weights_on_model_save (accelerate asks before
        `_zero3_consolidated_16bit_state_dict`)."""
        zero = self.config.get("zero_optimization") or {}
        return bool(
            zero.get("stage3_gather_16bit_weights_on_model_save", zero.get("gather_16bit_weights_on_model_save", False))
        )

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """The full state dict in the training dtype on rank 0 (None elsewhere), as DeepSpeed's. Collective."""
        state = self.module_state_dict(full=True)
        if exclude_frozen_parameters:
            frozen = {name for name, p in self.module.named_parameters() if not p.requires_grad}
            state = {key: value for key, value in state.items() if key not in frozen}
        names = peft_names_of(self.module)
        if names is not None:  # a PEFT model's, in PEFT's keys (save_pretrained filters its adapters from them)
            state = names.to_peft(state)
        if self.global_rank != 0:
            return None
        dtype = DTYPES[self.plan.param_dtype]
        return {key: value.to(dtype) if value.is_floating_point() else value for key, value in state.items()}

    def save_16bit_model(
        self, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters=False
    ) -> bool:
        """The full state dict in the training dtype (bf16 when bf16 is on, else fp32), written by rank 0 with
        torch.save as `save_dir/save_filename`. Collective: every rank must call it."""
        state = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if state is not None:
            os.makedirs(save_dir, exist_ok=True)
            torch.save(state, os.path.join(save_dir, save_filename))
            self.log.info("ds_compat: saved the %s model to %s", self.plan.param_dtype, Path(save_dir, save_filename))
        dist.barrier()
        return True

    def save_fp16_model(self, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin") -> bool:
        return self.save_16bit_model(save_dir, save_filename)
