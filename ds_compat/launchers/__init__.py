"""`deepspeed.launcher`: its `runner` (the `deepspeed` command, DEEPSPEED_ENVIRONMENT_NAME) is ds-fsdp,
ds_compat/launcher.py; ds_compat/alias.py maps the names."""

from __future__ import annotations

from types import ModuleType


def __getattr__(name: str) -> ModuleType:
    from ds_compat.alias import submodule

    try:
        return submodule(f"deepspeed.launcher.{name}")
    except ModuleNotFoundError as error:
        raise AttributeError(str(error)) from None
