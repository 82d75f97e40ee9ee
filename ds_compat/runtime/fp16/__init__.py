"""`deepspeed.runtime.fp16`: its `loss_scaler` module (ds_compat/runtime/fp16/loss_scaler.py)."""
