"""`deepspeed.ops`: DeepSpeed's optimizer classes (adam, adagrad, lion) as plain PyTorch optimizers.

DeepSpeed's versions are C++/CUDA kernels; these run the same update rules with torch's optimizers (fused or foreach
where the device has them) on whatever the engine hands them — FSDP2's sharded parameters, on the device or, with
optimizer offload, on the host. A script that builds one (the HF Trainer does when its optimizer meets
`offload_optimizer`) runs unchanged.
"""

from typing import Any

from ds_compat.alias import submodule_attributes

_submodule = submodule_attributes("deepspeed.ops")


def __getattr__(name: str) -> Any:
    if name == "__compatible_ops__":  # which ops exist, as DeepSpeed probes them (ds_compat/ops/op_builder.py)
        from ds_compat.ops.op_builder import compatible_ops

        return compatible_ops()
    return _submodule(name)
