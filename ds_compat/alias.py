"""`import deepspeed` resolved to this backend: the switch `ds-fsdp` turns on in the ranks it starts.

SHIM_DIR, put first on PYTHONPATH (ds-fsdp, `python -m ds_compat.run`), holds two things:
  - a `deepspeed` package whose import calls `take_over()`: ds_compat becomes `sys.modules["deepspeed"]` and
    `DeepSpeedAliasFinder` maps every `deepspeed.<sub>` the ecosystem imports onto its ds_compat module, so each
    module exists once under both names (one `deepspeed.comm.ReduceOp`, not a second copy);
  - a `deepspeed` distribution's metadata, so `importlib.metadata.version("deepspeed")` and the availability checks
    of transformers and accelerate answer whether or not the real DeepSpeed is installed.
`DS_FSDP_BACKEND=deepspeed` (or `ds-fsdp --backend deepspeed`) leaves the real DeepSpeed in place.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

ENV_BACKEND = "DS_FSDP_BACKEND"
BACKENDS = ("fsdp", "deepspeed")
SHIM_DIR = Path(__file__).with_name("shim")

# deepspeed module -> ds_compat module, where the names differ (longest prefix wins); any other deepspeed.<x.y> is
# ds_compat.<x.y>.
RENAMED = {
    "deepspeed": "ds_compat",
    "deepspeed.runtime.zero": "ds_compat.zero",
    "deepspeed.runtime.engine": "ds_compat.engine",
    "deepspeed.runtime.lr_schedules": "ds_compat.lr_schedules",
    "deepspeed.runtime.activation_checkpointing.checkpointing": "ds_compat.checkpointing",
    "deepspeed.launcher": "ds_compat.launchers",
    "deepspeed.utils.zero_to_fp32": "ds_compat.zero_to_fp32",
}
# deepspeed modules this backend deliberately does not provide, with the way out. (`deepspeed.pipe` and
# `deepspeed.moe` load, for code that only imports them, and refuse on use: ds_compat/pipe.py, ds_compat/moe/.)
REFUSED = {
    "deepspeed.inference": "DeepSpeed inference kernels",
}


def target_of(name: str) -> str:
    """The ds_compat module that stands for deepspeed module `name`."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in RENAMED:
            return ".".join([RENAMED[prefix], *parts[cut:]])
    raise AssertionError(f"{name} is not a deepspeed module")


def _refusal(name: str) -> str | None:
    for prefix, what in REFUSED.items():
        if name == prefix or name.startswith(prefix + "."):
            return (
                f"`{name}` is not provided by the FSDP2 backend (ds_compat, which `import deepspeed` resolves to "
                f"under ds-fsdp): {what}. To run this script on the real DeepSpeed, launch it with "
                f"`deepspeed`, or `ds-fsdp --backend deepspeed` ({ENV_BACKEND}=deepspeed)."
            )
    return None


class _AliasLoader(importlib.abc.Loader):
    """Hands the already imported ds_compat module to the import system under its deepspeed name."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self.spec = module.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self.module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.spec  # the import system set the alias spec; the module stays ds_compat's


class DeepSpeedAliasFinder(importlib.abc.MetaPathFinder):
    """`deepspeed.<sub>` -> the ds_compat module for it (see RENAMED); a clear error for what is not provided."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "deepspeed" and not fullname.startswith("deepspeed."):
            return None
        refusal = _refusal(fullname)
        if refusal is not None:
            raise ModuleNotFoundError(refusal, name=fullname)
        try:
            module = importlib.import_module(target_of(fullname))
        except ModuleNotFoundError as error:
            if error.name is None or not error.name.startswith("ds_compat"):
                raise
            raise ModuleNotFoundError(
                f"`{fullname}` is not provided by the FSDP2 backend (ds_compat, which `import deepspeed` resolves to "
                f"under ds-fsdp). Import it from the real DeepSpeed by launching with `deepspeed` or "
                f"`ds-fsdp --backend deepspeed` ({ENV_BACKEND}=deepspeed); docs/ds_compat.md lists what is provided.",
                name=fullname,
            ) from None
        spec = importlib.machinery.ModuleSpec(fullname, _AliasLoader(module), is_package=hasattr(module, "__path__"))
        if hasattr(module, "__path__"):
            spec.submodule_search_locations = list(module.__path__)
        return spec


def submodule(deepspeed_name: str) -> ModuleType:
    """The module `deepspeed_name` stands for, for attribute access such as `deepspeed.runtime.lr_schedules`."""
    return importlib.import_module(target_of(deepspeed_name))


def submodule_attributes(deepspeed_package: str) -> Callable[[str], ModuleType]:
    """A package's module `__getattr__`: `deepspeed.<package>.<name>` reached as an attribute, imported on first
    use, as DeepSpeed's packages have their submodules after `import deepspeed`."""

    def __getattr__(name: str) -> ModuleType:
        try:
            return submodule(f"{deepspeed_package}.{name}")
        except ModuleNotFoundError as error:
            raise AttributeError(str(error)) from None

    return __getattr__


def installed() -> bool:
    return any(isinstance(finder, DeepSpeedAliasFinder) for finder in sys.meta_path)


def take_over() -> ModuleType:
    """Make `deepspeed` (and every `deepspeed.<sub>`) this backend in this process; say so once, on rank 0."""
    import ds_compat

    if not installed():
        sys.meta_path.insert(0, DeepSpeedAliasFinder())
        if os.environ.get("RANK", "0") == "0" and os.environ.get("DS_FSDP_QUIET") != "1":
            print(
                f"[ds_compat] import deepspeed -> ds_compat {ds_compat.__version__}: the glm45v-fsdp FSDP2 backend "
                f"({ENV_BACKEND}=deepspeed keeps the real DeepSpeed)",
                file=sys.stderr,
                flush=True,
            )
    sys.modules["deepspeed"] = ds_compat
    return ds_compat


def backend_from_env(environ: dict[str, str] | os._Environ) -> str:
    value = environ.get(ENV_BACKEND, "fsdp") or "fsdp"
    if value not in BACKENDS:
        from glm45v_fsdp.errors import UserError

        raise UserError(
            f"{ENV_BACKEND}={value!r} is not a backend: use 'fsdp' (import deepspeed runs this backend, the default) "
            "or 'deepspeed' (the real DeepSpeed)."
        )
    return value


def with_shim(pythonpath: str | None) -> str:
    """PYTHONPATH with SHIM_DIR first (once)."""
    entries = [entry for entry in (pythonpath or "").split(os.pathsep) if entry and entry != str(SHIM_DIR)]
    return os.pathsep.join([str(SHIM_DIR), *entries])


if __name__ == "__main__":  # `python -m ds_compat.alias`: the PYTHONPATH entry that switches other launchers
    print(SHIM_DIR)
