"""`deepspeed.runtime`: attribute access to the submodules the ecosystem reaches through it (`lr_schedules`, `zero`,
`engine`, ...), resolved to their ds_compat modules by ds_compat/alias.py."""

from ds_compat.alias import submodule_attributes

__getattr__ = submodule_attributes("deepspeed.runtime")
