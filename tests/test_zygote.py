"""The suite's process forker (tests/zygote.py): its runs end as interpreter processes under torchrun end, and it is
used exactly when a run's environment agrees with its imports."""

from __future__ import annotations

import os
import textwrap
import time

import pytest
from conftest import FATAL_REPORT, RankCrashed, Zygote, clean_env, python


def script(tmp_path, body: str) -> str:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_runs_with_the_session_environment_go_to_the_zygote():
    assert os.environ.get("PYTEST_CURRENT_TEST")  # differs from test to test, and is no reason for a fresh process
    assert Zygote.differing(clean_env()) == set()  # also after every earlier test of the session
    assert Zygote.accepts({**clean_env(), "GLM45V_FAULT": "1:2:sigkill", "DS_ACCELERATOR": "cpu"})
    assert not Zygote.accepts({**clean_env(), "HOME": "/elsewhere"})  # could be read at import: a fresh process
    assert not Zygote.accepts({k: v for k, v in clean_env().items() if k != "OMP_NUM_THREADS"})


def test_a_rank_ends_as_the_interpreter_ends(tmp_path):
    body = """
        import atexit, sys
        atexit.register(lambda: print("atexit ran"))
        print("out", sys.argv[1:])
        print("err", file=sys.stderr)
        {end}
    """
    ended = python([script(tmp_path, body.format(end="sys.exit(3)")), "a", "b"])
    assert ended.returncode == 3 and ended.stdout == "out ['a', 'b']\natexit ran\n" and ended.stderr == "err\n"
    raised = python([script(tmp_path, body.format(end="raise KeyError('boom')"))])
    assert raised.returncode == 1 and "Traceback" in raised.stderr and "KeyError: 'boom'" in raised.stderr
    assert "atexit ran" in raised.stdout
    message = python([script(tmp_path, body.format(end="sys.exit('stopped: a reason')"))])
    assert message.returncode == 1 and message.stderr.endswith("stopped: a reason\n")


def test_a_failing_rank_ends_its_job_as_torchrun_does(tmp_path):
    body = """
        import os, sys, time
        print(os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"], flush=True)
        if os.environ["RANK"] == "1":
            time.sleep(2)  # rank 0 has printed its line: the launcher ends it at once after this exit
            sys.exit(5)
        time.sleep(120)  # ended by the SIGTERM the failing rank's exit brings
    """
    started = time.monotonic()
    result = python([script(tmp_path, body)], nproc=2)
    assert result.returncode == 5 and time.monotonic() - started < 20
    assert sorted(result.stdout.split("\n")[:2]) == ["0 2 127.0.0.1", "1 2 127.0.0.1"]


def test_a_crashing_rank_shows_where_it_crashed(tmp_path):
    """A rank killed by SIGSEGV prints its Python stack (faulthandler) and the job raises RankCrashed, whose message
    starts with that report even when the other ranks' output fills the end of stderr."""
    body = """
        import ctypes, os, signal, sys, time
        def crash_here():
            ctypes.string_at(0)  # reads address 0: SIGSEGV
        if os.environ["RANK"] == "1":
            time.sleep(1)
            crash_here()
        # rank 0 writes a long message when the launcher's SIGTERM ends it, after rank 1's report
        signal.signal(signal.SIGTERM, lambda *_: sys.exit("rank 0's long message " + "x" * 20000))
        time.sleep(60)
    """
    with pytest.raises(RankCrashed) as crashed:
        python([script(tmp_path, body)], nproc=2)
    message = str(crashed.value)
    assert "exited -11, a process died beneath Python" in message.splitlines()[0]
    assert message.splitlines()[1].startswith(FATAL_REPORT) and "in crash_here" in message[:5000]
    assert message.endswith("x" * 100 + "\n")  # and the end of stderr: rank 0's message


def test_a_test_that_met_a_crash_runs_once_more(request):
    """Every test carries the rerun marker, for RankCrashed only (the plugin matches the exception's name)."""
    marker = request.node.get_closest_marker("flaky")
    assert marker is not None and marker.kwargs == {"reruns": 1, "only_rerun": ["RankCrashed"]}
