"""`deepspeed.zero` (also `deepspeed.runtime.zero`): Init, GatheredParameters, ZeroParamStatus and the
external-parameter calls; see ds_compat/zero/partition_parameters.py."""

from ds_compat.alias import submodule_attributes
from ds_compat.zero.partition_parameters import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "register_external_parameter",
    "unregister_external_parameter",
]

__getattr__ = submodule_attributes("deepspeed.runtime.zero")  # config, offload_config on first use
