"""`deepspeed.runtime`: attribute access to the submodules the ecosystem reaches through it (`lr_schedules`, `zero`,
`engine`, ...), resolved to their ds_compat modules by ds_compat/alias.py."""

from __future__ import annotations

from types import ModuleType


def __getattr__(name: str) -> ModuleType:
    from ds_compat.alias import submodule

    try:
        return submodule(f"deepspeed.runtime.{name}")
    except ModuleNotFoundError as error:
        raise AttributeError(str(error)) from None
