"""`deepspeed.launcher`: `runner` (ds_compat/launchers/runner.py: ds-fsdp's command line and main, the hostfile
and filter functions) and `multinode_runner`; ds_compat/alias.py maps the names."""

from ds_compat.alias import submodule_attributes

__getattr__ = submodule_attributes("deepspeed.launcher")
