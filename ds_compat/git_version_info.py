"""`deepspeed.git_version_info`: the build facts DeepSpeed's code and its test harness read.

DeepSpeed's setup.py writes these when it builds its C++/CUDA ops. This backend builds none: every op is reported
not installed, and compatible where ds_compat runs it in PyTorch (its optimizers, ds_compat/ops/op_builder.py).
`torch_info` holds the running torch's versions, so that checks such as DeepSpeed's bf16 version gate compare
against the torch that runs.
"""

from __future__ import annotations

import torch

from ds_compat import __git_branch__ as git_branch
from ds_compat import __git_hash__ as git_hash
from ds_compat import __version__ as version
from ds_compat.comm import device_layer
from ds_compat.ops import op_builder
from ds_compat.ops.op_builder import ALL_OPS

installed_ops: dict[str, bool] = dict.fromkeys(ALL_OPS, False)  # nothing is built
compatible_ops: dict[str, bool] = op_builder.compatible_ops()  # what ds_compat runs in PyTorch
accelerator_name = device_layer().type


def _major_minor(text: str | None) -> str:
    return ".".join((text or "0.0").split("+")[0].split(".")[:2])


def _nccl_version() -> str:
    if not torch.cuda.is_available():
        return "0.0"
    major, minor, *_ = torch.cuda.nccl.version()
    return f"{major}.{minor}"


torch_info: dict[str, object] = {
    "version": _major_minor(torch.__version__),
    "bf16_support": bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()),
    "cuda_version": _major_minor(torch.version.cuda),
    "nccl_version": _nccl_version(),
    "hip_version": _major_minor(getattr(torch.version, "hip", None)),
}

__all__ = [
    "accelerator_name",
    "compatible_ops",
    "git_branch",
    "git_hash",
    "installed_ops",
    "torch_info",
    "version",
]
