"""Names of DeepSpeed features this backend does not run, importable so that a module that merely imports them
loads, and refusing on use with one sentence: what is not provided, what to do here instead, and the way to the
real DeepSpeed (`ds-fsdp --backend deepspeed`)."""

from __future__ import annotations

from typing import Any, NoReturn

from glm45v_fsdp.errors import UserError


def refusal(deepspeed_name: str, instead: str) -> str:
    return (
        f"`{deepspeed_name}` is not provided by the FSDP2 backend (ds_compat, which `import deepspeed` resolves to "
        f"under ds-fsdp): {instead}; to run this code on the real DeepSpeed, launch it with `deepspeed` or "
        "`ds-fsdp --backend deepspeed` (DS_FSDP_BACKEND=deepspeed)."
    )


def refused_class(module: str, name: str, instead: str) -> type:
    """A class named `name` (module `module`, DeepSpeed's path) whose construction raises UserError(refusal)."""
    message = refusal(f"{module.replace('ds_compat', 'deepspeed', 1)}.{name}", instead)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
        raise UserError(message)

    return type(name, (), {"__init__": __init__, "__module__": module, "__doc__": message})
