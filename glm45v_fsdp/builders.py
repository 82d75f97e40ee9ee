"""The builders every door shares (trainer, benchmarks, ds_compat, tools): runtime, model, data.

The model is built on the meta device and the plan registry (glm45v_fsdp/plans.py) applies every feature to it in
one fixed order, ending with FSDP and the weights. A DCP checkpoint is restored later, by the Trainer, once the
optimizer exists. docs/architecture.md describes the layering.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from glm45v_fsdp.config import Config
from glm45v_fsdp.data import GlobalBatchSampler, build_dataloader, build_dataset, load_image_processor, load_tokenizer
from glm45v_fsdp.data.mixture import (
    MixtureDataset,
    MixtureSampler,
    build_mixture_dataset,
    refuse_dropped_mixture,
    resume_stream,
)
from glm45v_fsdp.data.validation import EvalBatches, eval_micro_batches, read_validation_file, split_validation
from glm45v_fsdp.log import get_logger
from glm45v_fsdp.lora.apply import AdapterSpec
from glm45v_fsdp.model import build_meta_model, describe_model, load_hf_config
from glm45v_fsdp.model.hf_forward import Glm4vMoeForScripts
from glm45v_fsdp.module_patterns import PlanMatch
from glm45v_fsdp.plans import MODULE_PLANS, GivenWeights, PlanContext, apply_plans
from glm45v_fsdp.runtime import (
    DeviceLayer,
    DistEnv,
    ParallelDims,
    ParallelMeshes,
    build_parallel_dims,
    detect_dist_env,
    init_distributed,
    select_device,
    set_deterministic,
    set_seed,
)
from glm45v_fsdp.runtime.threads import configure_cpu_threads
from glm45v_fsdp.runtime.topology import NodeLayout, describe_placement, detect_layout


@dataclass
class Runtime:
    device: DeviceLayer
    env: DistEnv
    dims: ParallelDims
    meshes: ParallelMeshes
    cpu_threads: str  # what configure_cpu_threads chose, for the log
    network: str  # which interface the collectives bind to (runtime/network.py), for the log
    nodes: NodeLayout  # which node each rank runs on (runtime/topology.py)

    @property
    def torch_device(self) -> torch.device:
        return self.device.device(self.env.local_rank)

    @property
    def topology(self) -> str:
        """The node layout and which process groups stay inside a node, for the log."""
        return describe_placement(self.dims, self.nodes)

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    @property
    def dp_rank(self) -> int:
        return self.meshes.dp.get_local_rank()

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
    network = init_distributed(env, device, peer_timeout_s=config.training.peer_timeout_s)
    set_seed(config.training.seed, device)
    meshes = ParallelMeshes(dims, device.type)
    nodes = detect_layout()
    return Runtime(device, env, dims, meshes, cpu_threads=cpu_threads, network=network, nodes=nodes)


def build_model(config: Config, runtime: Runtime, hf_config: object | None = None) -> tuple[nn.Module, object]:
    """GLM-4.5V on the meta device -> every plan in order (FSDP, then the weights on the device) -> (model,
    hf_config); `hf_config` defaults to load_hf_config(config.model)."""
    hf_config = hf_config if hf_config is not None else load_hf_config(config.model)
    model = build_meta_model(hf_config)
    context = PlanContext(config, runtime.dims, hf_config, runtime.device, runtime.meshes, runtime.torch_device)
    apply_plans(model, context)
    get_logger().info(describe_model(model, hf_config))
    return model, hf_config


def adopt_model(
    model: nn.Module,
    config: Config,
    dims: ParallelDims,
    meshes: ParallelMeshes,
    device: DeviceLayer,
    torch_device: torch.device,
    weights: GivenWeights,
    adapters: AdapterSpec | None = None,
    own_units: tuple[str, ...] = (),
) -> dict[str, list[PlanMatch]]:
    """A transformers GLM-4.5V that a script built (its parameters on the meta device now, their values in
    `weights`), rebuilt in place through the same plans as `build_model`: the object the script holds becomes a
    `Glm4vMoeForScripts` (transformers' forward contract on the training forward) with every feature of `config`,
    the script's weights, requires_grad and parameter names. `adapters`: the LoRA adapters of the PEFT model it came
    in (their values in `weights`), for the lora plan; `own_units`: modules the script calls itself, each an FSDP
    unit of its own. Returns {plan name: matches}."""
    hf_config = model.config
    model.__class__ = Glm4vMoeForScripts
    context = PlanContext(config, dims, hf_config, device, meshes, torch_device, weights, adapters, own_units)
    matched = apply_plans(model, context)
    model.applied_plans = {name: sum(len(match.names) for match in matches) for name, matches in matched.items()}
    get_logger().info(describe_model(model, hf_config))
    return matched


def adopt_module(model: nn.Module, context: PlanContext) -> dict[str, list[PlanMatch]]:
    """Any other module a script built, sharded in place through the module plans (plans.MODULE_PLANS): FSDP2 with
    the units of context.config's fsdp plan, then context.weights, the values of the parameters it left on the meta
    device. Returns {plan name: matches}."""
    return apply_plans(model, context, MODULE_PLANS)


@dataclass
class TrainingData:
    """The data set and the tokenizer / image processor that encode it (built before the model: a bad data file
    stops the run before anything expensive)."""

    dataset: Dataset
    tokenizer: object
    image_processor: object
    validation: Dataset | None = None  # data.validation_path's or data.validation_split's samples


def build_training_data(config: Config, hf_config: object) -> TrainingData:
    """Tokenizer, image processor, the data set of data.dataset (or the sources of data.mixture) and the validation
    set, every record checked; logs what data is used. With data.validation_split the training set is what the
    split leaves."""
    tokenizer = load_tokenizer(config.model.name_or_path)
    image_processor = load_image_processor(config.model.name_or_path, hf_config.vision_config)
    build = build_dataset if config.data.mixture is None else build_mixture_dataset
    dataset = build(config.data, hf_config, tokenizer, image_processor)
    validation = None
    if config.data.validation_split:
        dataset, validation = split_validation(dataset, config.data.validation_split, config.training.seed)
    elif config.data.validation_path is not None:
        validation = read_validation_file(config.data, hf_config, tokenizer, image_processor)
    get_logger().info("data: %s", dataset.summary())
    if validation is not None:
        get_logger().info("validation data: %s", validation.summary())
    return TrainingData(dataset, tokenizer, image_processor, validation)


def build_loader(
    config: Config, runtime: Runtime, data: TrainingData, start_step: int = 0, saved_state: dict | None = None
):
    """This rank's loader of micro batches (in training order) over `data.dataset`. `saved_state`: the trainer state
    of the checkpoint the run resumes (None: a fresh run), whose mixture record a mixture resumes from and checks."""
    training = config.training
    split = dict(
        micro_batch_size=training.micro_batch_size,
        gradient_accumulation_steps=training.gradient_accumulation_steps,
        dp_rank=runtime.dp_rank,
        dp_size=runtime.dp_size,
        start_step=start_step,
    )
    if isinstance(data.dataset, MixtureDataset):
        global_batch = training.micro_batch_size * training.gradient_accumulation_steps * runtime.dp_size
        stream = resume_stream(data.dataset, config, saved_state, start_step * global_batch)
        sampler = MixtureSampler(stream, **split)
    else:
        refuse_dropped_mixture(saved_state, config.data)
        sampler = GlobalBatchSampler(len(data.dataset), seed=training.seed, shuffle=config.data.shuffle, **split)
    return build_dataloader(data.dataset, sampler, **_collation(config, data))


def build_eval_batches(config: Config, runtime: Runtime, data: TrainingData) -> EvalBatches | None:
    """This rank's eval micro batches over `data.validation` (data/validation.py), collated as the training's; None
    without validation data."""
    if data.validation is None:
        return None
    indices = eval_micro_batches(
        len(data.validation),
        config.training.micro_batch_size,
        runtime.dp_rank,
        runtime.dp_size,
        config.training.eval_iters,
    )
    return EvalBatches(data.validation, indices, **_collation(config, data))


def _collation(config: Config, data: TrainingData) -> dict[str, Any]:
    """How this run collates and loads its micro batches, the training's and the evals' alike: the pad token,
    data.packing and data.num_workers."""
    return {
        "pad_token_id": data.tokenizer.pad_token_id,
        "packing": config.data.packing,
        "num_workers": config.data.num_workers,
    }


def build_data(config: Config, runtime: Runtime, hf_config: object, start_step: int = 0):
    """build_training_data + build_loader: (loader, tokenizer)."""
    data = build_training_data(config, hf_config)
    return build_loader(config, runtime, data, start_step), data.tokenizer
