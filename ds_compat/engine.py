"""The DeepSpeed engine API on the FSDP2 core: `deepspeed.initialize(...)` -> an engine with forward, backward,
step, save_checkpoint and load_checkpoint, for any nn.Module. DeepSpeedEngine, the class scripts see, is here; its
parts stand in their own modules:

- ds_compat/engine_build.py: initialize's build, the model recognised and sent down its door (GLM-4.5V onto the plan
  registry, ds_compat/glm_door.py; any other module onto the FSDP-only module plans), into an EngineModel
  (ds_compat/engine_model.py); the script's weights and zero.Init partitions at the side (ds_compat/script_weights.py);
- ds_compat/engine_step.py: the optimizer and scheduler from initialize's arguments, backward, step and the
  accumulation boundary around the trainer's `glm45v_fsdp.step.OptimizerStep`;
- ds_compat/engine_checkpoint.py: save_checkpoint / load_checkpoint, the 16-bit model saves, whole state dicts;
- ds_compat/engine_queries.py: the DeepSpeed-named accessors (batch sizes, ZeRO stage, lr, ...).

Nothing here re-implements training: the ds_config goes through `ds_compat.config.translate` (batch triple, ZeRO
layout, precision, clipping, optimizer and scheduler specs), the meshes through `glm45v_fsdp.runtime`, the model
through `glm45v_fsdp.builders` and the plan registry, the end of each step (norm, clipping, skip, optimizer, schedule,
loss scaler) through the trainer's step, and the checkpoint tensors through `glm45v_fsdp.checkpoint.dcp`. The engine
adds DeepSpeed's bookkeeping around them: micro steps, the accumulation boundary, global steps and samples, skipped
steps, the `latest` file and the client state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DistributedSampler, IterableDataset

from ds_compat.alst import alst_sequence_parallel_size
from ds_compat.comm import device_layer, get_local_rank
from ds_compat.config import Translation, translate
from ds_compat.dataloader import DeepSpeedDataLoader
from ds_compat.engine_build import build_engine_model
from ds_compat.engine_checkpoint import CheckpointAPI, keep_whole_state_dicts
from ds_compat.engine_model import mark_sharded
from ds_compat.engine_queries import EngineQueries
from ds_compat.engine_step import EngineSteps, param_groups
from ds_compat.step_watch import watch_steps, watched
from ds_compat.utils import groups
from glm45v_fsdp.log import get_logger, setup_logging
from glm45v_fsdp.parallel.fsdp import compute_precision


class DeepSpeedEngine(EngineQueries, EngineSteps, CheckpointAPI, nn.Module):
    """DeepSpeed's engine on FSDP2; built by `ds_compat.initialize`. See docs/ds_compat.md "Engine API"."""

    def __init__(
        self,
        args: Any = None,
        model: nn.Module | None = None,
        optimizer: Any = None,
        model_parameters: Any = None,
        training_data: Any = None,
        lr_scheduler: Any = None,
        mpu: Any = None,
        collate_fn: Callable | None = None,
        config: dict | str | None = None,
    ) -> None:
        super().__init__()
        self.log = get_logger()
        if not self.log.handlers:
            setup_logging(dist.get_rank())
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_rank = get_local_rank()
        self.device_layer = device_layer()
        self.device = self.device_layer.device(self.local_rank)
        self.alst = mpu is not None  # DeepSpeed's ALST: the adapter slices the targets, the loss is the slice's
        alst_size = alst_sequence_parallel_size(mpu) if self.alst else None
        self.translation: Translation = translate(config, self.world_size, alst_sequence_parallel=alst_size)
        self.config = self.translation.ds_config  # DeepSpeed's engine.config: the config dict
        # read now: a generator (model.parameters()) read after the model is rebuilt would yield the new parameters,
        # whose ids may be those of freed old ones
        given_groups = None if model_parameters is None else param_groups(model_parameters)
        built = build_engine_model(model, self.translation, self.alst, self.device_layer, self.device)
        mark_sharded(built.module, built.sharding())  # a later engine on the same model reuses its units
        self.module, self.core, self.glm45v = built.module, built.core, built.glm45v
        self._config, self.plan, self.dims, self.meshes = built.config, built.plan, built.dims, built.meshes
        groups.use_meshes(self.meshes)  # deepspeed.utils.groups answers from this engine's meshes
        self.dp_world_size = self.dims.dp
        self.mp_world_size = 1
        self.client_optimizer = optimizer
        self.client_lr_scheduler = lr_scheduler
        self.collate_fn = collate_fn
        self.training_data = training_data
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._global_grad_norm: float | None = None
        self._step_applied = False
        self._is_gradient_accumulation_boundary: bool | None = None
        keep_whole_state_dicts(self.module, self.translation.zero_stage <= 2)
        self.loss_scaler = None
        if self.translation.precision == "fp16":
            from glm45v_fsdp.loss_scale import LossScaler  # the trainer's scaler, DeepSpeed's rules

            self.loss_scaler = LossScaler(self._config.training.loss_scale)
            self.log.info("ds_compat: fp16 with %s", self.loss_scaler.describe())
        self.precision = compute_precision(self.core, self.plan, self.device_layer.type)
        self.training_dataloader = self.deepspeed_io(training_data) if training_data is not None else None
        self._configure_step(optimizer, lr_scheduler, given_groups, built.old_names)
        self.log.info(
            "ds_compat engine: ZeRO stage %d -> FSDP2 %s over %d rank(s); units %s + root; precision %s; "
            "clipping %s; batch %d = micro %d x accumulation %d x dp %d; optimizer %s; lr scheduler %s",
            self.translation.zero_stage,
            "replicated (HSDP, shard groups of one rank)"
            if self.dims.dp_replicate > 1
            else f"sharded, reshard after forward {self.plan.reshard_after_forward}",
            self.world_size,
            self.plan.apply_modules or "none",
            self.translation.precision,
            self.gradient_clipping() or "off",
            self.train_batch_size(),
            self.train_micro_batch_size_per_gpu(),
            self.gradient_accumulation_steps(),
            self.dp_world_size,
            type(self.optimizer).__name__ if self.optimizer is not None else None,
            self.lr_scheduler,
        )
        watch_steps(self._config.training, self.global_rank, self.world_size)  # a stuck job ends (step_watch.py)

    def deepspeed_io(
        self,
        dataset: Any,
        batch_size: int | None = None,
        route: str = "train",
        pin_memory: bool = True,
        data_sampler: Any = None,
        collate_fn: Callable | None = None,
        num_local_io_workers: int | None = None,
    ) -> DeepSpeedDataLoader:
        if not (
            (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")) or isinstance(dataset, IterableDataset)
        ):
            raise ValueError("Training data must be a torch Dataset")
        if data_sampler is None and route in ("predict", "eval") and not isinstance(dataset, IterableDataset):
            data_sampler = DistributedSampler(
                dataset, num_replicas=self.dp_world_size, rank=self.get_data_parallel_rank(), shuffle=False
            )
        return DeepSpeedDataLoader(
            dataset,
            batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
            dp_world_size=self.dp_world_size,
            dp_rank=self.get_data_parallel_rank(),
            collate_fn=collate_fn or self.collate_fn,
            drop_last=bool(self.config.get("dataloader_drop_last", False)),
            pin_memory=pin_memory and self.device.type != "cpu",
            data_sampler=data_sampler,
        )

    def __getattr__(self, name: str) -> Any:
        """Attributes the engine lacks come from the wrapped module, as in DeepSpeed."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is not None and hasattr(module, name):
                return getattr(module, name)
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'") from None

    def train(self, mode: bool = True) -> DeepSpeedEngine:
        self.module.train(mode)
        self.training = mode
        return self

    def eval(self) -> DeepSpeedEngine:
        return self.train(False)

    @watched
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if isinstance(self.core, FSDPModule):
            # FSDP2 takes the first sharded module run as its root: a script's pre-hook may run one of the model's
            # own units before the model (the root) starts
            self.core._get_fsdp_state()._lazy_init()
        with self.precision:
            return self.module(*inputs, **kwargs)

    def compile(self, backend: str | None = None, compile_kwargs: dict | None = None, **_: Any) -> None:
        """DeepSpeed's engine.compile: `torch.compile` of the module in place (nn.Module.compile), with `backend`
        (None: torch's default) and `compile_kwargs`; accelerate calls it when the HF run sets torch_compile."""
        kwargs = dict(compile_kwargs or {})
        if backend is not None:
            kwargs["backend"] = backend
        self.module.compile(**kwargs)
        self._is_compiled = True
        self.log.info("ds_compat: module compiled with torch.compile(%s)", kwargs or "")

    @property
    def is_compiled(self) -> bool:
        return getattr(self, "_is_compiled", False)

    def destroy(self) -> None:
        """Release what the engine holds for training (optimizer and its state, scheduler, step runner, data
        loader), as DeepSpeed's destroy() does before accelerate's free_memory. The module stays sharded by FSDP2
        (as DeepSpeed's stays partitioned): a new deepspeed.initialize on it keeps its units and builds the rest."""
        self.optimizer = self.basic_optimizer = self.client_optimizer = None
        self.lr_scheduler = self.client_lr_scheduler = None
        self.step_runner = None
        self.training_dataloader = self.training_data = None
