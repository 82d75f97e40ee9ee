"""`deepspeed.moe.layer`: `MoE` loads and is refused on use (ds_compat/refused.py)."""

from ds_compat.refused import refused_class

MoE = refused_class(
    __name__,
    "MoE",
    "DeepSpeed-MoE layers are not built; a model's own MoE blocks (GLM-4.5V's) train with expert parallelism from "
    "the ds_config's `expert_parallel` section (`enabled: true`, `autoep_size`: docs/expert_parallel.md)",
)

__all__ = ["MoE"]
