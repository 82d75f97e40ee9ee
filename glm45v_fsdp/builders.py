"""The builders every door shares (trainer, benchmarks, later ds_compat and tools): runtime, model, data.

Plans are applied to the meta-device model in one fixed order (DESIGN.md): freeze, then (as they land) recompute,
offload, chunk loss, EP, CP, then FSDP, then the weights are materialised and, for training.load of HF weights,
loaded. A DCP checkpoint is restored later, by the Trainer, once the optimizer exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import Dataset

from glm45v_fsdp.checkpoint.dcp import load_checkpoint, resolve_load
from glm45v_fsdp.checkpoint.hf import load_hf_weights
from glm45v_fsdp.checkpoint.layout import KeyDiff, describe_diff
from glm45v_fsdp.config import Config
from glm45v_fsdp.data import GlobalBatchSampler, build_dataloader, build_dataset, load_image_processor, load_tokenizer
from glm45v_fsdp.log import get_logger
from glm45v_fsdp.memory.chunk_loss import apply_chunk_loss
from glm45v_fsdp.memory.offload import apply_activation_offload, describe_offload
from glm45v_fsdp.memory.recompute import apply_recompute
from glm45v_fsdp.model import (
    REQUIRED_FSDP_UNITS,
    apply_freeze,
    build_meta_model,
    describe_model,
    load_hf_config,
    materialize,
)
from glm45v_fsdp.parallel.context import ContextParallel, apply_context_parallel, check_context_parallel
from glm45v_fsdp.parallel.fsdp import apply_fsdp, is_sharded
from glm45v_fsdp.parallel.plan import format_matches
from glm45v_fsdp.runtime import (
    DeviceLayer,
    DistEnv,
    ParallelDims,
    build_device_mesh,
    build_parallel_dims,
    detect_dist_env,
    flattened_mesh,
    fsdp_mesh,
    init_distributed,
    select_device,
    set_deterministic,
    set_seed,
)
from glm45v_fsdp.runtime.threads import configure_cpu_threads


@dataclass
class Runtime:
    device: DeviceLayer
    env: DistEnv
    dims: ParallelDims
    mesh: DeviceMesh
    dp_mesh: DeviceMesh  # the flattened (dp_replicate x dp_shard) mesh: data loading and loss reduction
    cpu_threads: str  # what configure_cpu_threads chose, for the log

    @property
    def torch_device(self) -> torch.device:
        return self.device.device(self.env.local_rank)

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.dims.dp


def build_runtime(config: Config, local_rank_arg: int | None = None) -> Runtime:
    """Device, process group, parallel dims and meshes. The layout is validated before the group starts."""
    env = detect_dist_env(local_rank_arg=local_rank_arg)
    dims = build_parallel_dims(config.parallel, env.world_size)
    cpu_threads = configure_cpu_threads(env.local_world_size)
    device = select_device(config.training.device)
    set_deterministic(config.training.deterministic, device)  # before init: HCCL reads its variable at init
    init_distributed(env, device)
    set_seed(config.training.seed, device)
    mesh = build_device_mesh(dims, device.type)
    return Runtime(
        device=device, env=env, dims=dims, mesh=mesh, dp_mesh=flattened_mesh(mesh, "dp"), cpu_threads=cpu_threads
    )


def build_model(config: Config, runtime: Runtime, hf_config: object | None = None) -> tuple[nn.Module, object]:
    """GLM-4.5V on the meta device -> plans -> FSDP2 -> weights on the device -> HF weights (training.load).
    Returns (model, hf_config); `hf_config` defaults to load_hf_config(config.model)."""
    log = get_logger()
    source = resolve_load(config.training)
    hf_config = hf_config if hf_config is not None else load_hf_config(config.model)
    model = build_meta_model(hf_config)
    if config.model.freeze:
        log.info(format_matches("freeze", apply_freeze(model, config.model.freeze)))
    if config.features.recompute.enabled:
        log.info(format_matches("recompute", apply_recompute(model, config.features.recompute)))
    if config.features.activation_offload.enabled:
        offload = config.features.activation_offload
        log.info(format_matches("activation_offload", apply_activation_offload(model, offload, runtime.device)))
        log.info(describe_offload(offload, runtime.device))
    if config.features.chunk_loss.mode != "off":
        log.info(format_matches("chunk_loss", apply_chunk_loss(model, config.features.chunk_loss)))
    if runtime.dims.ulysses > 1:
        check_context_parallel(hf_config, runtime.dims.ulysses, config.model.attn_implementation)
        cp = ContextParallel(
            group=runtime.mesh["cp"].get_group(),
            size=runtime.dims.ulysses,
            rank=runtime.mesh["cp"].get_local_rank(),
            kernel=config.model.attn_implementation,
        )
        log.info(format_matches("context_parallel", apply_context_parallel(model, cp)))
        log.info(cp.describe())
    matches = apply_fsdp(
        model,
        config.parallel.fsdp_plan,
        fsdp_mesh(runtime.mesh, runtime.dims),
        pin_memory=runtime.device.type != "cpu",
        required_units=REQUIRED_FSDP_UNITS,
    )
    log.info(format_matches("fsdp", matches))
    if not is_sharded(model):
        log.info(
            "[plan fsdp] not applied: the FSDP mesh has one rank, so there is nothing to shard; modules stay plain "
            "and param_dtype=%s runs %s",
            config.parallel.fsdp_plan.param_dtype,
            "under autocast" if config.parallel.fsdp_plan.param_dtype != "fp32" else "as is",
        )
    offloaded = is_sharded(model) and config.parallel.fsdp_plan.cpu_offload
    # FSDP2's CPU offload wants the sharded parameters on the host; buffers (rotary tables) compute on the device.
    materialize(model, torch.device("cpu") if offloaded else runtime.torch_device, config.training.seed)
    if offloaded:
        move_buffers(model, runtime.torch_device)
    if source is None:
        log.info("weights: initialised from scratch (seed %d); no checkpoint was loaded", config.training.seed)
    elif source.format == "hf":
        load_hf(model, source.path, config.training.load_strict)
    elif source.format == "dcp-weights":
        diff = load_checkpoint(model, None, source.path, strict=config.training.load_strict)
        log.info("weights: loaded from weights-only DCP checkpoint %s (training starts at step 0)", source.path)
        if not diff.ok:
            log.warning("weights: not loaded (training.load_strict=false): %s", describe_diff(diff))
    else:
        log.info("weights: restored from DCP checkpoint %s once the optimizer is built (resume)", source.path)
    log.info(describe_model(model, hf_config))
    return model, hf_config


def load_hf(model: nn.Module, directory: Path, strict: bool) -> None:
    """Load HF safetensors weights (this rank's slices) into the materialised model and log what was read."""
    report = load_hf_weights(model, directory, strict=strict)
    get_logger().info(
        "weights: loaded from HF checkpoint %s (source %s): %d file(s), %d tensor(s), %.1f MiB read on this rank, "
        "expert layout %s",
        directory,
        report.source,
        report.files,
        report.tensors_read,
        report.bytes_read / 2**20,
        report.expert_layout,
    )
    leftovers = KeyDiff(report.missing, report.unexpected, report.mismatched)
    if not leftovers.ok:
        get_logger().warning(
            "weights: not loaded (training.load_strict=false; these keep their initial values): %s",
            describe_diff(leftovers),
        )


def move_buffers(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            module._buffers[name] = buffer.to(device)


@dataclass
class TrainingData:
    """The data set and the tokenizer / image processor that encode it (built before the model: a bad data file
    stops the run before anything expensive)."""

    dataset: Dataset
    tokenizer: object
    image_processor: object


def build_training_data(config: Config, hf_config: object) -> TrainingData:
    """Tokenizer, image processor and the data set of data.dataset, every record checked; logs what data is used."""
    tokenizer = load_tokenizer(config.model.name_or_path)
    image_processor = load_image_processor(config.model.name_or_path, hf_config.vision_config)
    dataset = build_dataset(config.data, hf_config, tokenizer, image_processor)
    get_logger().info("data: %s", dataset.summary())
    return TrainingData(dataset, tokenizer, image_processor)


def build_loader(config: Config, runtime: Runtime, data: TrainingData, start_step: int = 0):
    """This rank's loader of micro batches (in training order) over `data.dataset`."""
    sampler = GlobalBatchSampler(
        dataset_size=len(data.dataset),
        micro_batch_size=config.training.micro_batch_size,
        gradient_accumulation_steps=config.training.gradient_accumulation_steps,
        dp_rank=runtime.dp_rank,
        dp_size=runtime.dp_size,
        seed=config.training.seed,
        shuffle=config.data.shuffle,
        start_step=start_step,
    )
    return build_dataloader(
        data.dataset,
        sampler,
        data.tokenizer.pad_token_id,
        packing=config.data.packing,
        num_workers=config.data.num_workers,
    )


def build_data(config: Config, runtime: Runtime, hf_config: object, start_step: int = 0):
    """build_training_data + build_loader: (loader, tokenizer)."""
    data = build_training_data(config, hf_config)
    return build_loader(config, runtime, data, start_step), data.tokenizer
