"""`deepspeed.moe`: DeepSpeed-MoE's layer loads (ds_compat/moe/layer.py) and is refused on use. Mixture-of-experts
models train with their own MoE blocks here, split over ranks by the ds_config's `expert_parallel` section."""

from ds_compat.alias import submodule_attributes

__getattr__ = submodule_attributes("deepspeed.moe")
