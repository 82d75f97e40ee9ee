"""A pre-imported process that forks the test suite's trainer runs and multi-rank workers (`conftest.train`,
`trainer`, `train_many`, `python`, `spawn`).

A trainer run of the tiny model takes about 6 s on this machine, of which about 5 s is the interpreter start-up and
importing torch and transformers; the 20 steps of a parity run take about 1 s. The zygote imports everything the
trainer imports once, then forks each run's ranks from that state: every rank is still a real process with its own
environment, working directory, stdout/stderr, process group (env:// rendezvous with MASTER_ADDR/PORT, RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE as torchrun exports them) and exit status; only the imports are shared.
The zygote never runs a torch op or starts a thread before it forks, so no thread or OpenMP pool is inherited. What
the ranks do share, unlike fresh interpreters: str hashing's seed (a set of strings iterates in the same order on
every rank) and what the preloaded modules did at import (warnings already shown, variables already read: runs whose
environment differs from the zygote's outside GLM45V_* / DS_* start fresh interpreters instead, conftest.Zygote).
The suite's launcher tests run real interpreters per rank. A rank ends as the interpreter ends: an uncaught
exception goes through sys.excepthook, then non-daemon threads are joined and atexit functions run.

A job ends as torchrun ends one: when a rank exits non-zero the others get SIGTERM, then SIGKILL after 30 s. Its
status is the first failing rank's (0 when every rank succeeded; torchrun itself would exit 1). Tests of the
launchers themselves (torchrun, deepspeed, ds-fsdp, srun, mpirun, the console script) start real launchers and
interpreters and never come here.

Targets: `python` (`python SCRIPT ARGS` or `python -m MODULE ARGS`, as the interpreter runs them: `__main__`,
sys.argv, the script's folder on sys.path; the trainer and tests/multi_run.py run this way; its ranks get
torchrun's variables when the job has several ranks, or when the request says `ranked`) and
`call:MODULE:FUNCTION` (a test module's worker, called as torch.multiprocessing.spawn calls one:
`FUNCTION(rank, *args)`; the job sets no launcher variables then, as spawn does not). Modules a run imports beyond
the preloaded ones (DeepSpeed, for one) are imported by each rank after the fork, in its own environment.

Protocol: one JSON request per line on stdin, one JSON reply per line on the channel the client names.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import json
import os
import signal
import sys
import threading
import time

TERM_GRACE_S = 30.0  # torchrun's wait between SIGTERM and SIGKILL when it stops a failed job's workers
MONITOR_INTERVAL_S = 0.1  # torchrun's default --monitor-interval
PR_SET_PDEATHSIG = 1


def preload() -> None:
    """Import what a trainer run imports (the modules `glm45v_fsdp.train.run` imports lazily, and multi_run's)."""
    import multi_run  # noqa: F401
    import transformers.models.glm4v_moe.modeling_glm4v_moe  # noqa: F401
    from transformers import Glm4vImageProcessorPil  # noqa: F401

    import ds_compat.trainer_door  # noqa: F401
    import glm45v_fsdp.builders  # noqa: F401
    import glm45v_fsdp.checkpoint.dcp  # noqa: F401
    import glm45v_fsdp.checkpoint.deepspeed  # noqa: F401
    import glm45v_fsdp.checkpoint.hf_export  # noqa: F401
    import glm45v_fsdp.train  # noqa: F401
    import glm45v_fsdp.trainer  # noqa: F401


def child(request: dict, rank: int, replies_fd: int) -> None:
    """One rank: its environment, directory and output files, then the target; never returns."""
    code = 1
    try:
        os.close(replies_fd)
        os.setpgid(0, 0)  # its own process group: a timeout kills the rank with everything it started
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # no orphan ranks if the zygote dies
        os.environ.clear()
        os.environ.update(request["env"])
        if request["ranked"] and not request["target"].startswith("call:"):
            os.environ.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(request["nproc"]),
                LOCAL_WORLD_SIZE=str(request["nproc"]),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(request["port"]),
            )
        os.chdir(request["cwd"])
        for fd, path, flags in (
            (0, os.devnull, os.O_RDONLY),
            (1, request["stdout"], os.O_WRONLY | os.O_APPEND | os.O_CREAT),
            (2, request["stderr"], os.O_WRONLY | os.O_APPEND | os.O_CREAT),
        ):
            opened = os.open(path, flags, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        if request["target"] == "python":  # `python SCRIPT ARGS` or `python -m MODULE ARGS`
            from ds_compat.run import run_as_python

            run_as_python(request["argv"])
            code = 0
        else:  # "call": a test module's worker function, as torch.multiprocessing.spawn calls it
            module, function = request["target"].removeprefix("call:").split(":")
            getattr(importlib.import_module(module), function)(rank, *request["argv"])
            code = 0
    except SystemExit as stop:
        code = exit_status(stop)
    except BaseException:
        sys.excepthook(*sys.exc_info())  # what the interpreter does with an uncaught exception, then status 1
        code = 1
    finally:
        interpreter_exit(code)


def exit_status(stop: SystemExit) -> int:
    """The status the interpreter exits with for `stop` (a message is printed and gives 1)."""
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=sys.stderr)
    return 1


def interpreter_exit(code: int) -> None:
    """End the rank as the interpreter ends: join non-daemon threads, run atexit functions, flush, exit."""
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_job(request: dict, replies_fd: int) -> dict:
    """Fork the job's ranks and wait for them as torchrun would; {"returncode": int, "timed_out": bool}."""
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(request["nproc"]):
        pid = os.fork()
        if pid == 0:
            child(request, rank, replies_fd)
        try:
            os.setpgid(pid, pid)  # also here: a sibling may be signalled before the child ran its own setpgid
        except OSError:  # it has already ended, or already set it
            pass
        pids.append(pid)
    deadline = time.monotonic() + request["timeout"]
    running, first_failure, kill_at = set(pids), None, None
    while running:
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                running.discard(pid)
                code = os.waitstatus_to_exitcode(status)
                if code != 0 and first_failure is None:
                    first_failure = code
                    for other in running:
                        _signal_group(other, signal.SIGTERM)
                    kill_at = time.monotonic() + TERM_GRACE_S
        now = time.monotonic()
        if running and (now > deadline or (kill_at is not None and now > kill_at)):
            for pid in running:
                _signal_group(pid, signal.SIGKILL)
            for pid in running:
                os.waitpid(pid, 0)
            timed_out = now > deadline
            return {"returncode": -signal.SIGKILL if timed_out else first_failure, "timed_out": timed_out}
        time.sleep(MONITOR_INTERVAL_S)
    return {"returncode": first_failure or 0, "timed_out": False}


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def serve() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/: multi_run
    preload()
    replies_fd = int(sys.argv[1])
    replies = os.fdopen(replies_fd, "w")
    print(json.dumps({"ready": True}), file=replies, flush=True)
    for line in sys.stdin:
        print(json.dumps(run_job(json.loads(line), replies_fd)), file=replies, flush=True)


if __name__ == "__main__":
    serve()
