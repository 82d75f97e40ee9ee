"""`deepspeed.pipe`: its names load, and using one is refused (ds_compat/refused.py). Pipeline parallelism is not
run by this backend; FSDP2 shards the whole model over the data-parallel ranks instead (ZeRO stage 3's layout)."""

from ds_compat.refused import refused_class

_INSTEAD = (
    "pipeline parallelism is not run here; the model trains whole, sharded by FSDP2 over the data-parallel ranks "
    "(zero_optimization.stage 3 for the least memory per rank)"
)

PipelineModule = refused_class(__name__, "PipelineModule", _INSTEAD)
LayerSpec = refused_class(__name__, "LayerSpec", _INSTEAD)
TiedLayerSpec = refused_class(__name__, "TiedLayerSpec", _INSTEAD)
DualPipeVModule = refused_class(__name__, "DualPipeVModule", _INSTEAD)

__all__ = ["DualPipeVModule", "LayerSpec", "PipelineModule", "TiedLayerSpec"]
