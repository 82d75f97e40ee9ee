"""DeepSpeed's AutoEP transport switch, answered: the environment variables DeepSpeed 0.20 reads to choose how the
expert all-to-all travels (deepspeedai/DeepSpeed#8213).

- `DEEPSPEED_AUTOEP_COMM_BACKEND`: `nccl` (DeepSpeed's default: the collective all-to-all of the expert-parallel
  process group) or `deepep` (DeepEP's kernels). `nccl` is what this backend does: its dispatcher sends the tokens
  with torch's `all_to_all_single` on the expert-parallel group (NCCL on GPUs, HCCL on NPUs, gloo on CPU), so it is
  taken. `deepep`, or any other value, is refused: DeepEP is not used here.
- `DEEPSPEED_AUTOEP_COMM_SMS`: the SMs DeepEP's kernels take; refused, as DeepEP is not used.

With expert parallelism off the variables have no effect, in DeepSpeed and here; the translation says so.
"""

from __future__ import annotations

from collections.abc import Mapping

from ds_compat._common import Report
from glm45v_fsdp.errors import ConfigError

COMM_BACKEND = "DEEPSPEED_AUTOEP_COMM_BACKEND"
COMM_SMS = "DEEPSPEED_AUTOEP_COMM_SMS"
TAKEN_BACKEND = "nccl"


def check(environ: Mapping[str, str], ep_size: int, report: Report) -> None:
    """Take, note or refuse the AutoEP transport variables for a translation whose expert-parallel size is
    `ep_size` (1: off). A refusal is a ConfigError naming the variable, its value and the fix."""
    backend = environ.get(COMM_BACKEND)
    sms = environ.get(COMM_SMS)
    if ep_size == 1:
        for name, value in ((COMM_BACKEND, backend), (COMM_SMS, sms)):
            if value is not None:
                report.note(
                    f"{name}={value}: expert parallelism is off (expert_parallel), so it has no effect, as in "
                    "DeepSpeed."
                )
        return
    if backend is not None:
        if backend.strip().lower() != TAKEN_BACKEND:
            raise ConfigError(
                f"{COMM_BACKEND}={backend!r} asks AutoEP's expert all-to-all to travel by "
                f"{'DeepEP' if backend.strip().lower() == 'deepep' else 'an unknown transport'}; the FSDP2 backend "
                "does not use DeepEP: its tokens travel by torch's all_to_all_single on the expert-parallel process "
                f"group, DeepSpeed's default ({TAKEN_BACKEND}). Unset {COMM_BACKEND} or set it to {TAKEN_BACKEND}."
            )
        report.note(
            f"{COMM_BACKEND}={backend}: taken: the expert all-to-all runs on the expert-parallel process group "
            "(torch's all_to_all_single), as DeepSpeed's nccl transport."
        )
    if sms is not None:
        raise ConfigError(
            f"{COMM_SMS}={sms!r} sets the SMs of DeepEP's kernels, which the FSDP2 backend does not use (its expert "
            f"all-to-all is torch's all_to_all_single). Unset {COMM_SMS}."
        )
