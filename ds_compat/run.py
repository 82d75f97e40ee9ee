"""`python -m ds_compat.run script.py [args]` (or `-m module`): an unchanged DeepSpeed script on this backend.

The opt-in for launchers other than ds-fsdp (torchrun, srun, mpirun, a Kubernetes entrypoint): every rank runs
`python -m ds_compat.run train.py ...` instead of `python train.py ...`. It puts ds_compat/shim first on sys.path and on
PYTHONPATH (child processes such as spawned data workers inherit the switch), makes `import deepspeed` resolve to
ds_compat (ds_compat/alias.py), then runs the script as __main__. Setting PYTHONPATH to `python -m ds_compat.alias`
does the same without this wrapper.
"""

from __future__ import annotations

import os
import runpy
import sys

from ds_compat import alias
from glm45v_fsdp.errors import UserError

USAGE = "usage: python -m ds_compat.run [-m module | script.py] [args ...]"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        print(f"{USAGE}\n\n{__doc__}", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        backend = alias.backend_from_env(os.environ)
    except UserError as error:
        print(f"ds_compat.run: error: {error}", file=sys.stderr)
        return 2
    if backend == "fsdp":
        os.environ["PYTHONPATH"] = alias.with_shim(os.environ.get("PYTHONPATH"))
        sys.path.insert(0, str(alias.SHIM_DIR))
        alias.take_over()
    run_as_python(argv)
    return 0


def run_as_python(argv: list[str]) -> None:
    """Run `argv` (`[script, ...]` or `["-m", module, ...]`) as `python ARGV` would in this process: as
    `__main__`, with its sys.argv, a script's folder first on sys.path."""
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
