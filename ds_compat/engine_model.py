"""The model an engine runs, as initialize's build hands it to the engine (EngineModel), and what the build fixed in
place when it sharded it: a later engine on the same model (the HF Trainer's second train(), evaluate() then train())
keeps its FSDP2 units, or says why it cannot. Both doors (ds_compat/glm_door.py, ds_compat/engine_build.py) stand on
this module."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.fsdp import FSDPModule

from ds_compat.config import Translation
from ds_compat.ds_keys import EXTENSION_KEY
from glm45v_fsdp.config import Config, FsdpPlanConfig, to_dict
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.log import get_logger
from glm45v_fsdp.runtime import ParallelDims, ParallelMeshes

SHARDED_AS = "_ds_compat_sharded_as"  # module attribute: how an engine sharded it, so a later engine can reuse it


@dataclass
class EngineModel:
    """The script's model, built: `module` is the object the script passed (sharded in place), `core` the model the
    plans built (transformers' GLM-4.5V inside a PEFT model, else `module`)."""

    module: nn.Module
    core: nn.Module
    glm45v: bool  # built on the plan registry (GLM-4.5V, bare or in a PEFT model); else the module plans
    config: Config  # our config: the ds_config's translation and what the model decides
    dims: ParallelDims
    meshes: ParallelMeshes
    old_names: dict[int, str]  # id of each parameter the script's model held -> its name in the built model

    @property
    def plan(self) -> FsdpPlanConfig:
        return self.config.parallel.fsdp_plan

    def sharding(self) -> tuple:
        """What an engine fixed in place when it sharded the model; a later engine on the same model must agree."""
        ranks = tuple(self.meshes.dense_shard.mesh.flatten().tolist())
        sharding = (ranks, self.plan.param_dtype, self.plan.reduce_dtype, self.plan.cpu_offload)
        if not self.glm45v:
            return sharding
        tree = to_dict(self.config)  # the config the plans were applied with (features, parallel, ops)
        return (*sharding, tuple(f"{key}={tree[key]}" for key in ("model", "parallel", "features")))


def context_parallel_keys(translation: Translation) -> list[tuple[str, int]]:
    """The ds_config keys that split sequences, with their sizes."""
    return [
        ("sequence_parallel_size", translation.sequence_parallel_size),
        (f"{EXTENSION_KEY}.parallel.ring_attention_size", translation.ring_attention_size),
    ]


def reuse_sharded(built: EngineModel) -> bool:
    """An earlier engine's model: True when its FSDP2 units can be kept (resharded, reshard_after_forward as this
    config says); False for a plain model, which the door then builds. Anything else is refused."""
    model = built.module
    previous = getattr(model, SHARDED_AS, None)
    if previous is None:
        on_meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        if on_meta:
            raise UserError(
                "The model passed to initialize() has parameters on the meta device. Materialise them first "
                "(e.g. model.to_empty(device=...) and initialise the weights) — the engine shards real tensors."
            )
        if any(isinstance(module, FSDPModule) for module in model.modules()):
            raise UserError(
                "deepspeed.initialize was given a model already sharded with FSDP2 by something else than this "
                "engine. Pass the plain model."
            )
        return False
    sharding = built.sharding()
    if previous != sharding:
        raise UserError(
            f"deepspeed.initialize was given a model an earlier engine sharded with FSDP2 as (ranks, param "
            f"dtype, reduce dtype, cpu offload{', plans' if built.glm45v else ''}) = {previous}; this config needs "
            f"{sharding}, which FSDP2 cannot change in place. Use the same precision, offload, world and plans, "
            "or build the model again."
        )
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
            if module is not model:
                module.set_reshard_after_forward(built.plan.reshard_after_forward)
    get_logger().info("ds_compat: the model is already sharded by an earlier engine; its FSDP2 units are kept")
    return True


def mark_sharded(model: nn.Module, sharding: tuple) -> None:
    setattr(model, SHARDED_AS, sharding)


def sharded_before(model: nn.Module) -> bool:
    """An earlier engine sharded it (and took what the model decides then)."""
    return hasattr(model, SHARDED_AS)
