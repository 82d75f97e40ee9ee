"""`deepspeed` under ds-fsdp / `python -m ds_compat.run`: this import hands over ds_compat (ds_compat/alias.py)."""

from ds_compat.alias import take_over

take_over()
