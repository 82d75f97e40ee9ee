"""Shared helpers and fixtures of the test suite: a free port, the clean environment of child processes, running
the trainer and multi-rank workers as real processes forked from a pre-imported one (tests/zygote.py), reading
metrics, the parity error, and ending spawned gloo workers. Test modules import the helpers with
`from conftest import ...` (pytest puts tests/ on sys.path)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# DeepSpeed JIT-builds its CPU ops (e.g. deepspeed_shm_comm) into TORCH_EXTENSIONS_DIR, by default the user-wide
# ~/.cache/torch_extensions that every other DeepSpeed on the machine shares: another version's build there crashed
# the reference runs. The suite gets a directory of its own (DeepSpeed's CPU fused_adam is built there once per
# session); the shm all-reduce op is never built (tests/ds_reference_runner.py), which test_hf_integration checks.
# A process the session starts that imports this module again (a torch.multiprocessing spawn child unpickling a
# test module's worker) uses the session's directory instead of making one that nothing removes.
_SESSION_DIR_VARIABLE = "GLM45V_TEST_EXTENSIONS_DIR"
_OWNS_EXTENSIONS_DIR = _SESSION_DIR_VARIABLE not in os.environ
if _OWNS_EXTENSIONS_DIR:
    os.environ[_SESSION_DIR_VARIABLE] = tempfile.mkdtemp(prefix="glm45v-test-torch-extensions-")
EXTENSIONS_DIR = Path(os.environ[_SESSION_DIR_VARIABLE])
os.environ["TORCH_EXTENSIONS_DIR"] = str(EXTENSIONS_DIR)


# The CPU ops the real DeepSpeed JIT-builds into that directory on their first use, by the module that uses them first:
# bench parity's DeepSpeed runs all-reduce over its shared-memory op, the HF Trainer's references step its fused_adam
# (~40 and ~60 CPU-s to build).
_JIT_OPS = {"test_bench_parity.py": "ShareMemCommBuilder", "test_hf_integration.py": "FusedAdamBuilder"}
_jit_build: subprocess.Popen | None = None


def pytest_collection_finish(session) -> None:
    """The session builds the ops its tests will use at its start, in the order they need them, in the background
    at the lowest priority: the builds take the cores the tests before leave idle instead of holding up the first run
    that uses them (which waits for a build in progress on torch's build lock). None after test_hf_integration's: it
    checks that its references build no shm op, and a build under way would look like theirs."""
    global _jit_build
    users = list(dict.fromkeys(item.path.name for item in session.items if item.path.name in _JIT_OPS))
    if "test_hf_integration.py" in users:
        users = users[: users.index("test_hf_integration.py") + 1]
    if session.config.option.collectonly or not users:
        return
    build = "import sys, deepspeed.ops.op_builder as ops\nfor name in sys.argv[1:]:\n    getattr(ops, name)().load()"
    _jit_build = subprocess.Popen(
        ["nice", "-n", "19", sys.executable, "-c", build, *(_JIT_OPS[user] for user in users)],
        env={**clean_env(), "DS_ACCELERATOR": "cpu"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        process_group=0,  # its compiler processes end with it
    )


def pytest_sessionfinish(session, exitstatus) -> None:
    if _jit_build is not None and _jit_build.poll() is None:
        os.killpg(_jit_build.pid, signal.SIGKILL)
        _jit_build.wait()
    if _OWNS_EXTENSIONS_DIR:
        shutil.rmtree(EXTENSIONS_DIR, ignore_errors=True)


# Identical global batches, fp32, every memory switch off: the reference run of the parity tests.
PARITY = [
    "training.train_iters=20",
    "parallel.fsdp_plan.param_dtype=fp32",
    "parallel.fsdp_plan.reduce_dtype=fp32",
    "data.synthetic_samples=64",
    "training.lr=1e-3",
    "training.log_interval=20",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env() -> dict[str, str]:
    """The environment of a child process: the parent's launcher variables must not leak into it; one CPU thread;
    faulthandler on, so that a rank killed by a fatal signal (SIGSEGV, SIGABRT...) prints every thread's Python
    stack to its stderr (`failure_output` keeps it in a test's message)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_", "WORLD_", "MASTER_", "SLURM_"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    return env


FATAL_REPORT = "Fatal Python error:"


def failure_output(stdout: str, stderr: str, tail: int = 5000) -> str:
    """A failed job's output for an assertion message: the ends of stdout and stderr and, first, the report of any
    rank that died of a fatal signal (faulthandler's), which the other ranks' tracebacks would push out of the end."""
    start = stderr.find(FATAL_REPORT)
    fatal = stderr[start : start + tail] + "\n[...]\n" if start >= 0 else ""
    return f"{fatal}{stdout[-3000:]}\n{stderr[-tail:]}"


class RankCrashed(AssertionError):
    """A job's process died beneath Python (SIGSEGV, SIGABRT...: faulthandler's report is in its stderr). The
    project's code is all Python, so this is a crash inside a library's C/C++ code (on CPU under torch 2.13: heap
    corruption in a gloo all-gather's wait, a SIGSEGV in an expert-parallel worker; README, "Layout"). A test that
    meets one is run once more (pytest_collection_modifyitems) and listed with the report after the run
    (pytest_terminal_summary); a second crash fails it."""


def check_not_crashed(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """`result`, unless one of its processes died beneath Python: then RankCrashed with the crash report first."""
    if FATAL_REPORT in result.stderr:
        raise RankCrashed(
            f"{result.args[0]} exited {result.returncode}, a process died beneath Python:\n"
            f"{failure_output(result.stdout, result.stderr)}"
        )
    return result


def pytest_collection_modifyitems(config, items) -> None:
    """Every test is run once more if it failed by RankCrashed, and only then (see RankCrashed)."""
    if not config.pluginmanager.hasplugin("rerunfailures"):
        raise pytest.UsageError(
            "the suite needs pytest-rerunfailures (the test extras: pip install -e '.[test]'), which runs a test "
            "once more when a process of it crashed beneath Python (tests/conftest.py RankCrashed)"
        )
    for item in items:
        item.add_marker(pytest.mark.flaky(reruns=1, only_rerun=[RankCrashed.__name__]))


def pytest_terminal_summary(terminalreporter) -> None:
    """Each test that a crash beneath Python made run once more, with the crashed process's report: a crash the
    rerun absorbed is still seen (pytest -q shows it only as an `R`)."""
    reruns = terminalreporter.stats.get("rerun", [])
    if not reruns:
        return
    terminalreporter.section("crashes beneath Python, each absorbed by a rerun of its test")
    for report in reruns:
        text = str(report.longrepr)
        start = text.find(FATAL_REPORT)
        terminalreporter.line(f"{report.nodeid} ({report.when}):")
        terminalreporter.line(text[start : start + 3000] if start >= 0 else text[-3000:])


def torchrun(nproc: int, *target: str) -> list[str]:
    """torchrun on `nproc` local ranks with a free rendezvous port, running `target` (a script or -m module)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{free_port()}",
        *target,
    ]


class Zygote:
    """The client of tests/zygote.py: one pre-imported process per session that forks the runs of `train`,
    `trainer`, `train_many`, `python` and `spawn` (each rank a real process; the interpreter start-up and imports,
    ~5 s of a ~6 s run, are paid once). It starts with the session's clean environment (`base_env`, taken before
    the first test); a run whose environment differs from it outside RUNTIME_PREFIXES starts a fresh interpreter."""

    # variables read when a run uses them, never at import (pytest sets PYTEST_CURRENT_TEST per test); the last two
    # are written into this process's environment by libraries a test uses here (the real DeepSpeed's import sets
    # PYTORCH_NVML_BASED_CUDA_CHECK, inductor's cache_dir() TORCHINDUCTOR_CACHE_DIR), which torch reads when called
    RUNTIME_PREFIXES = ("GLM45V_", "DS_", "PYTEST_", "PYTORCH_NVML_BASED_CUDA_CHECK", "TORCHINDUCTOR_CACHE_DIR")
    base_env: dict[str, str] | None = None
    _session: Zygote | None = None
    _starting = threading.Lock()

    def __init__(self) -> None:
        read_fd, write_fd = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "zygote.py"), str(write_fd)],
            cwd=REPO,
            env=self.environment(),
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            pass_fds=(write_fd,),
            text=True,
        )
        os.close(write_fd)
        self.replies = os.fdopen(read_fd)
        self.lock = threading.Lock()
        if not self.replies.readline():
            raise RuntimeError(f"tests/zygote.py did not start (exit status {self.process.wait()})")

    @classmethod
    def environment(cls) -> dict[str, str]:
        return cls.base_env if cls.base_env is not None else clean_env()

    @classmethod
    def session(cls) -> Zygote:
        with cls._starting:
            if cls._session is None or cls._session.process.poll() is not None:
                cls._session = cls()
            return cls._session

    @classmethod
    def stop(cls) -> None:
        if cls._session is not None and cls._session.process.poll() is None:
            cls._session.process.stdin.close()
            cls._session.process.wait(timeout=30)
        cls._session = None

    @classmethod
    def differing(cls, env: dict[str, str]) -> set[str]:
        """The variables of `env` that differ from the zygote's (added, removed or changed), run-time ones aside."""
        base = cls.environment()
        keys = {key for key in env.keys() | base.keys() if env.get(key) != base.get(key)}
        return {key for key in keys if not key.startswith(cls.RUNTIME_PREFIXES)}

    @classmethod
    def accepts(cls, env: dict[str, str]) -> bool:
        """Whether a run in `env` sees what the zygote's imports saw: the same variables, but for run-time ones."""
        return not cls.differing(env)

    def run(
        self,
        target: str,
        argv: list[str],
        nproc: int,
        env: dict[str, str],
        timeout: float,
        args: list[str],
        cwd: Path = REPO,
        ranked: bool = False,
    ):
        """Run `target` on `nproc` forked ranks in `cwd`; `ranked`: torchrun's variables even on one rank."""
        with tempfile.TemporaryDirectory() as scratch:
            out, err = Path(scratch) / "stdout", Path(scratch) / "stderr"
            request = dict(target=target, argv=argv, nproc=nproc, env=env, cwd=str(cwd), port=free_port())
            request.update(stdout=str(out), stderr=str(err), timeout=timeout, ranked=ranked or nproc > 1)
            with self.lock:
                self.process.stdin.write(json.dumps(request) + "\n")
                self.process.stdin.flush()
                line = self.replies.readline()
            if not line:
                raise RuntimeError(f"tests/zygote.py ended (exit status {self.process.wait()})")
            reply = json.loads(line)
            stdout = out.read_text() if out.exists() else ""
            stderr = err.read_text() if err.exists() else ""
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(args, timeout, output=stdout, stderr=stderr)
        return check_not_crashed(subprocess.CompletedProcess(args, reply["returncode"], stdout, stderr))


def train(output_dir: Path, overrides: list[str], nproc: int = 1, env: dict | None = None):
    """`python -m glm45v_fsdp.train` (under torchrun when nproc > 1) writing to output_dir."""
    return trainer([f"training.output_dir={output_dir}", "training.progress_bar=false", *overrides], nproc, env)


def trainer(argv: list[str], nproc: int = 1, env: dict | None = None, timeout: float = 600):
    """`python -m glm45v_fsdp.train ARGV` (under torchrun when nproc > 1), as `python` runs it."""
    return python(["-m", "glm45v_fsdp.train", *argv], nproc, env, timeout)


def python(
    argv: list[str],
    nproc: int = 1,
    env: dict | None = None,
    timeout: float = 600,
    cwd: Path = REPO,
    ranked: bool = False,
):
    """`python ARGV` (`[script, ...]` or `["-m", module, ...]`; under torchrun when nproc > 1 or `ranked`) in `cwd`,
    forked by the zygote when `env` agrees with its imports, else a fresh interpreter; a CompletedProcess either
    way."""
    env = env or clean_env()
    command = [sys.executable, *argv] if nproc == 1 and not ranked else torchrun(nproc, *argv)
    if Zygote.accepts(env):
        return Zygote.session().run("python", list(argv), nproc, env, timeout, command, cwd, ranked)
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return check_not_crashed(result)


def spawn(worker: Callable[..., None], args: tuple = (), nprocs: int = 1, timeout: float = 600) -> None:
    """`torch.multiprocessing.spawn(worker, args, nprocs)` from the zygote: `worker(rank, *args)` in `nprocs`
    forked processes (a module-level function of a test module; `args` JSON values), in the clean environment
    (one CPU thread) rather than the test process's. A failing rank fails the test with its output."""
    target = f"call:{worker.__module__}:{worker.__name__}"
    command = [f"spawn {worker.__module__}.{worker.__name__} x{nprocs}"]
    result = Zygote.session().run(target, list(args), nprocs, clean_env(), timeout, command)
    assert result.returncode == 0, (
        f"{command[0]} exited {result.returncode}:\n{failure_output(result.stdout, result.stderr)}"
    )


def train_many(root: Path, runs: dict[str, list[str]], nproc: int) -> dict[str, tuple[str, list[dict]]]:
    """Several training runs on `nproc` ranks in ONE job (tests/multi_run.py, forked by the zygote): {name:
    overrides} -> {name: (rank 0's log, metrics records)}; run `name` writes to root/name."""
    root.mkdir(parents=True, exist_ok=True)
    items = []
    for name, overrides in runs.items():
        output_dir = root / name.replace(" ", "_")
        output_dir.mkdir(parents=True, exist_ok=True)
        argv = [f"training.output_dir={output_dir}", "training.progress_bar=false", *overrides]
        items.append({"argv": argv, "log": str(output_dir / "train.log")})
    spec = root / "runs.json"
    spec.write_text(json.dumps(items))
    result = python([str(REPO / "tests" / "multi_run.py"), str(spec)], nproc, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {
        name: (
            (root / name.replace(" ", "_") / "train.log").read_text(),
            read_metrics(root / name.replace(" ", "_")),
        )
        for name in runs
    }


@contextlib.contextmanager
def bench_runs_forked(real: Callable[[list[str]], bool] = lambda command: False):
    """Within: the runs a bench starts (glm45v_fsdp/bench/runner.py `execute`: `python -m MODULE ...` on one rank,
    `torchrun --nproc_per_node N ... -m MODULE ...` above) are forked by the zygote instead of started as fresh
    interpreters: the same module and arguments on as many ranks, the bench's environment (PYTHONPATH as
    clean_env's), its timeout, the output appended to the run's log after the command line `execute` writes. A run
    whose command `real` picks starts as the runner starts it. For tests whose subject is the bench's runs, not how a
    process is started (tests/test_bench.py's three benches run the runner's real processes)."""
    from types import SimpleNamespace

    from glm45v_fsdp.bench import runner

    def run(command: list[str], cwd, env: dict[str, str], stdout, stderr, timeout: float | None):
        if real(command):
            return subprocess.run(command, cwd=cwd, env=env, stdout=stdout, stderr=stderr, timeout=timeout)
        assert command[0] == sys.executable and command[1] == "-m" and stderr == subprocess.STDOUT, command
        argv, nproc = command[1:], 1
        if command[2] == "torch.distributed.run":
            nproc = int(next(arg for arg in command if arg.startswith("--nproc_per_node=")).split("=", 1)[1])
            argv = command[command.index("-m", 3) :]
        env = {**env, "PYTHONPATH": str(REPO)}
        result = python(argv, nproc, env, timeout=timeout or 600, cwd=Path(cwd))
        stdout.write(result.stdout + result.stderr)
        stdout.flush()
        return result

    forked = SimpleNamespace(run=run, STDOUT=subprocess.STDOUT, TimeoutExpired=subprocess.TimeoutExpired)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner, "subprocess", forked)
        yield


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def mean_relative_error(test: list[float], reference: list[float], steps: int = 20) -> float:
    """The reference report's metric: mean over steps of |test - reference| / (|reference| + 1e-8); its runs are 20
    steps long, shorter runs name their length."""
    assert len(test) == len(reference) == steps
    return sum(abs(t - r) / (abs(r) + 1e-8) for t, r in zip(test, reference)) / len(reference)


def end_worker() -> None:
    """End a torch.multiprocessing worker that finished its checks: wait for the other ranks, then exit without the
    gloo teardown, which aborts now and then ("terminate called without an active exception"; the trainer ends the
    same way, see runtime/dist.py shutdown)."""
    import torch.distributed as dist

    from glm45v_fsdp.runtime.watchdog import current_watchdog

    watchdog = current_watchdog()
    if watchdog is not None:  # before the barrier: rank 0, the store's host, may exit first (runtime.dist.shutdown)
        watchdog.finish()
    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="session", autouse=True)
def zygote_session():
    """Takes the zygote's environment before the first test (a test may change os.environ) and ends the zygote
    (if a test started it) with the session."""
    Zygote.base_env = clean_env()
    yield
    Zygote.stop()


@pytest.fixture(autouse=True)
def restore_environment():
    """No test's change to os.environ reaches the next one (in-process trainer code exports variables, e.g. the
    deterministic mode's CUBLAS_WORKSPACE_CONFIG); pytest's own PYTEST_CURRENT_TEST is left to pytest."""
    saved = {key: value for key, value in os.environ.items() if key != "PYTEST_CURRENT_TEST"}
    yield
    for key in [key for key in os.environ if key not in saved and key != "PYTEST_CURRENT_TEST"]:
        del os.environ[key]
    os.environ.update(saved)


@pytest.fixture(scope="session")
def parity_off(tmp_path_factory) -> Callable[[int], list[dict]]:
    """The metrics of the plain PARITY run (every memory switch off) on `nproc` ranks, trained once per session:
    the chunk-loss, recompute, offload and context-parallel parity tests all compare against it."""
    cache: dict[int, list[dict]] = {}

    def records(nproc: int) -> list[dict]:
        if nproc not in cache:
            out = tmp_path_factory.mktemp(f"parity_off_{nproc}")
            result = train(out, PARITY, nproc=nproc)
            assert result.returncode == 0, result.stderr[-3000:]
            cache[nproc] = read_metrics(out)
        return cache[nproc]

    return records


@pytest.fixture(scope="session")
def hf_config():
    """A tiny GLM-4.5V (test_data, test_video): head_dim 16, rotary dim 8, so mrope_section sums to 4."""
    from transformers import Glm4vMoeConfig

    from glm45v_fsdp import vocab

    return Glm4vMoeConfig(
        text_config={
            "vocab_size": vocab.TINY_VOCAB_SIZE,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "moe_intermediate_size": 32,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "max_position_embeddings": 1024,
            "pad_token_id": vocab.PAD_TOKEN_ID,
            "eos_token_id": vocab.EOS_TOKEN_ID,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 1, 1],
                "partial_rotary_factor": 0.5,
            },
        },
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "num_heads": 2,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "image_size": 56,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
        },
        image_token_id=vocab.IMAGE_TOKEN_ID,
        video_token_id=vocab.VIDEO_TOKEN_ID,
        image_start_token_id=vocab.IMAGE_START_TOKEN_ID,
        image_end_token_id=vocab.IMAGE_END_TOKEN_ID,
        video_start_token_id=vocab.VIDEO_START_TOKEN_ID,
        video_end_token_id=vocab.VIDEO_END_TOKEN_ID,
    )


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A real single-node Slurm cluster (tests/slurm_cluster.py) for the session; fails, never skips, when the
    packages or root are missing."""
    from slurm_cluster import SlurmCluster

    reason = SlurmCluster.unavailable()
    if reason is not None:
        pytest.fail(f"cannot start a Slurm cluster: {reason}")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
