"""`deepspeed.checkpoint`: the helpers the HF / accelerate integrations use (`utils.clone_tensors_for_torch_save`).

DeepSpeed's own checkpoint formats are read and written by glm45v_fsdp.checkpoint.deepspeed(_write) and the engine's
load_checkpoint; see docs/checkpoints.md.
"""

from ds_compat.checkpoint.utils import clone_tensors_for_torch_save

__all__ = ["clone_tensors_for_torch_save"]
