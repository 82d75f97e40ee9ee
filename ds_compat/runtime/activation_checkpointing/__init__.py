"""`deepspeed.runtime.activation_checkpointing`: a package, as DeepSpeed's, whose `checkpointing` module is
ds_compat/checkpointing.py (ds_compat/alias.py maps the name)."""

from ds_compat.alias import submodule_attributes

__getattr__ = submodule_attributes("deepspeed.runtime.activation_checkpointing")
