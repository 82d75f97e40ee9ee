"""`deepspeed.runtime.fp16`: its `loss_scaler` module (ds_compat/runtime/fp16/loss_scaler.py)."""

from ds_compat.alias import submodule_attributes

__getattr__ = submodule_attributes("deepspeed.runtime.fp16")
