"""`deepspeed.ops`: DeepSpeed's optimizer classes (adam, adagrad, lion) as plain PyTorch optimizers.

DeepSpeed's versions are C++/CUDA kernels; these run the same update rules with torch's optimizers (fused or foreach
where the device has them) on whatever the engine hands them — FSDP2's sharded parameters, on the device or, with
optimizer offload, on the host. A script that builds one (the HF Trainer does when its optimizer meets
`offload_optimizer`) runs unchanged.
"""

from ds_compat.alias import submodule_attributes

__getattr__ = submodule_attributes("deepspeed.ops")
