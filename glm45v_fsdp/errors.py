"""The one exception type for mistakes a user can fix (config, paths, data, layout).

Entry points catch it, print its message as one paragraph (`report_user_error`) and exit non-zero without a
traceback. Anything else that escapes is a bug and keeps its traceback.
"""

import os
import sys
from collections.abc import Mapping
from types import TracebackType

EXIT_USER_ERROR = 2
_user_error_hook_installed = False


class UserError(ValueError):
    """A problem in the user's input: the message names the key or path, the value and the fix."""


class ConfigError(UserError):
    """A problem of the configuration itself (a key, a value, the layout, a plan pattern). Every rank finds the same
    one, so entry points print it on rank 0 only."""


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (e.g. the non-finite loss policy); the message says why and what to change."""


class Preempted(RuntimeError):
    """A preemption signal ended the run at a step boundary, after a checkpoint (runtime/preemption.py)."""


def launcher_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's global rank as the launcher variables give it (same precedence as
    `runtime.dist.detect_dist_env`); 0 when none is set or it is not a number. For deciding who prints, never for
    building the job. Here, not in runtime/, so that errors.py stays on the ground floor."""
    env = os.environ if environ is None else environ
    for name in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        if name in env:
            return int(env[name]) if env[name].strip().isdigit() else 0
    return 0


def report_user_error(program: str, error: UserError) -> None:
    """Print `error` as one paragraph on stderr; a ConfigError only on rank 0 (every rank has the same one)."""
    if isinstance(error, ConfigError) and launcher_rank() != 0:
        return
    print(f"{program}: error: {error}", file=sys.stderr)


def install_user_error_hook(program: str) -> None:
    """For scripts we do not own (a DeepSpeed-API training script): an uncaught UserError is reported as
    `report_user_error` does and ends the process with EXIT_USER_ERROR, without a traceback; any other exception
    goes on to the hook that was installed before. Installed once per process."""
    global _user_error_hook_installed
    if _user_error_hook_installed:
        return
    _user_error_hook_installed = True
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
        if not isinstance(error, UserError):
            previous(kind, error, trace)
            return
        sys.stderr = sys.__stderr__  # torch's init_process_group hook buffers stderr until the hook returns
        report_user_error(program, error)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_USER_ERROR)  # an uncaught exception would end with status 1

    sys.excepthook = hook
