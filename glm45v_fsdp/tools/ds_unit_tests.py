"""`python -m glm45v_fsdp.tools.ds_unit_tests DEEPSPEED_CHECKOUT`: DeepSpeed's own unit tests, run with `import
deepspeed` resolving to ds_compat and on the real DeepSpeed, side by side.

DEEPSPEED_CHECKOUT is a DeepSpeed repository (its tests are not in the PyPI package). Its `tests/` folder is copied to
a scratch folder, so that nothing is written into the checkout and the checkout's own `deepspeed/` package (which
DeepSpeed's tests/conftest.py puts on sys.path) stays out of both runs. Each test file of the list (TEST_FILES, the
DeepSpeed tests of the modules ds_compat provides, or --tests) runs in its own pytest process per backend: ds_compat
through `python -m ds_compat.run -m pytest`, with a `deepspeed` command that is ds-fsdp first on PATH; the installed
DeepSpeed through plain `python -m pytest`; both with DS_ACCELERATOR=cpu unless it is set. The output is one line per
test with both outcomes, the totals, and the share of the tests that pass on DeepSpeed that also pass on ds_compat.

Exit status: 0 when that share reaches --require (default 0: report only), 1 below it, 2 on unusable input.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

from ds_compat import alias
from glm45v_fsdp.errors import EXIT_USER_ERROR, UserError

# DeepSpeed's unit tests of the modules ds_compat provides (paths under the checkout's tests/): the runtime, ZeRO and
# precision configs, the lr schedules, the launcher and its multinode runners, the utils (groups, numa, zero_to_fp32)
# and deepspeed.comm, all through tests/unit/common.py's DistributedTest harness where they are distributed.
TEST_FILES = (
    "unit/runtime/test_ds_config_dict.py",
    "unit/runtime/test_ds_config_model.py",
    "unit/runtime/zero/test_zero_config.py",
    "unit/runtime/test_precision_config_loss_scale.py",
    "unit/runtime/test_precision_config_dynamic_scale.py",
    "unit/runtime/test_lr_schedulers.py",
    "unit/launcher/test_ds_arguments.py",
    "unit/launcher/test_multinode_runner.py",
    "unit/launcher/test_run.py",
    "unit/launcher/test_user_args.py",
    "unit/utils/test_groups.py",
    "unit/utils/test_get_optim_files.py",
    "unit/comm/test_dist.py",
)
BACKENDS = ("deepspeed", "ds_compat")
PASSED, FAILED, ERROR, SKIPPED, NOT_RUN = "passed", "failed", "error", "skipped", "not run"
OUTCOMES = (PASSED, FAILED, ERROR, SKIPPED, NOT_RUN)
TAG_OUTCOMES = (("error", ERROR), ("failure", FAILED), ("skipped", SKIPPED))  # JUnit's tags, the worst first
REPO_ROOT = Path(alias.__file__).resolve().parents[1]


@dataclass
class FileRun:
    """One test file on one backend: each test's outcome, and what the pytest process said when it ended."""

    outcomes: dict[str, str] = field(default_factory=dict)
    returncode: int | None = None
    log: str = ""


def scratch_tests(checkout: Path, scratch: Path) -> Path:
    """Copy the checkout's tests/ into `scratch`; the copy's path."""
    tests = checkout / "tests"
    if not (tests / "unit" / "common.py").is_file():
        raise UserError(
            f"{checkout} is not a DeepSpeed checkout: {tests / 'unit' / 'common.py'} is missing. Pass the folder of "
            "a clone of https://github.com/deepspeedai/DeepSpeed (its tests are not in the PyPI package)."
        )
    copy = scratch / "tests"
    shutil.copytree(tests, copy, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    return copy


def launcher_bin(scratch: Path) -> Path:
    """A folder holding a `deepspeed` command that is ds-fsdp (`python -m ds_compat.launcher`), for the tests that
    start the launcher."""
    folder = scratch / "bin"
    folder.mkdir()
    command = folder / "deepspeed"
    command.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m ds_compat.launcher "$@"\n')
    command.chmod(0o755)
    return folder


def backend_env(backend: str, environ: dict[str, str], worker_timeout: int, bin_dir: Path) -> dict[str, str]:
    """The environment of one backend's pytest: our repository importable, the shim on PYTHONPATH and the
    `deepspeed` command being ds-fsdp for ds_compat only (`python -m ds_compat.run` puts the shim there),
    DeepSpeed's CPU accelerator, its hang timeout."""
    env = dict(environ)
    if backend == "ds_compat":
        env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    entries = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    entries = [entry for entry in entries if Path(entry).resolve() != alias.SHIM_DIR.resolve()]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *entries])
    env.setdefault("DS_ACCELERATOR", "cpu")
    env["DS_UNITTEST_TIMEOUT"] = str(worker_timeout)
    env["DS_FSDP_QUIET"] = "1"
    env[alias.ENV_BACKEND] = "fsdp" if backend == "ds_compat" else "deepspeed"
    return env


def pytest_command(backend: str, test_file: str, junit: Path, keyword: str | None) -> list[str]:
    door = ["-m", "ds_compat.run"] if backend == "ds_compat" else []
    command = [sys.executable, *door, "-m", "pytest", test_file, "-p", "no:cacheprovider", f"--junitxml={junit}"]
    return command + (["-k", keyword] if keyword else [])


def read_junit(path: Path) -> dict[str, str]:
    """{test id: outcome} from pytest's JUnit XML (a test with an error in setup or teardown counts as an error)."""
    outcomes: dict[str, str] = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        module, name = case.get("classname"), case.get("name")
        test_id = f"{module}::{name}" if module else f"{name}::<collection>"  # a file that failed to import
        tags = {child.tag for child in case}
        outcome = next((found for tag, found in TAG_OUTCOMES if tag in tags), PASSED)
        if outcomes.get(test_id) in (ERROR, FAILED):
            continue  # a teardown error reported after the test's own outcome
        outcomes[test_id] = outcome
    return outcomes


def run_file(backend: str, test_file: str, tests: Path, env: dict[str, str], args: argparse.Namespace) -> FileRun:
    junit = tests / f".junit-{backend}-{test_file.replace('/', '_')}.xml"
    command = pytest_command(backend, test_file, junit, args.keyword)
    try:
        done = subprocess.run(
            command, cwd=tests, env=env, capture_output=True, text=True, timeout=args.file_timeout, check=False
        )
        run = FileRun(returncode=done.returncode, log=done.stdout + done.stderr)
    except subprocess.TimeoutExpired as timeout:
        output = (timeout.stdout or b"") + (timeout.stderr or b"")
        run = FileRun(log=output.decode(errors="replace") + f"\n[killed after {args.file_timeout} s]")
    if junit.is_file():
        run.outcomes = read_junit(junit)
    return run


def compare(results: dict[str, dict[str, str]]) -> dict[str, object]:
    """Totals per backend and the share of DeepSpeed's passing tests that pass on ds_compat."""
    tests = sorted(set().union(*(outcomes.keys() for outcomes in results.values())))
    totals = {
        backend: {outcome: sum(results[backend].get(t, NOT_RUN) == outcome for t in tests) for outcome in OUTCOMES}
        for backend in BACKENDS
        if backend in results
    }
    summary: dict[str, object] = {"tests": len(tests), "totals": totals}
    if len(results) == len(BACKENDS):
        passing = [t for t in tests if results["deepspeed"].get(t) == PASSED]
        both = [t for t in passing if results["ds_compat"].get(t) == PASSED]
        summary.update(deepspeed_passed=len(passing), both_passed=len(both))
        summary["share"] = len(both) / len(passing) if passing else 0.0
    return summary


def report_lines(results: dict[str, dict[str, str]], summary: dict[str, object]) -> list[str]:
    backends = [backend for backend in BACKENDS if backend in results]
    tests = sorted(set().union(*(outcomes.keys() for outcomes in results.values())))
    lines = [f"{'  '.join(f'{backend:<9}' for backend in backends)}  test"]
    for test in tests:
        lines.append(f"{'  '.join(f'{results[b].get(test, NOT_RUN):<9}' for b in backends)}  {test}")
    lines.append("")
    for backend, counts in summary["totals"].items():
        lines.append(f"{backend}: " + ", ".join(f"{count} {outcome}" for outcome, count in counts.items()))
    if "share" in summary:
        lines.append(
            f"pass on ds_compat of those that pass on DeepSpeed: {summary['both_passed']}/{summary['deepspeed_passed']}"
            f" = {summary['share']:.1%}"
        )
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m glm45v_fsdp.tools.ds_unit_tests",
        description="Run DeepSpeed's unit tests on ds_compat and on the real DeepSpeed, side by side.",
    )
    parser.add_argument("checkout", type=Path, help="a DeepSpeed repository checkout (its tests/ folder is read)")
    parser.add_argument("--tests", nargs="+", default=list(TEST_FILES), help="test files under tests/ (default: list)")
    parser.add_argument("--backend", choices=("both", *BACKENDS), default="both", help="run one side only")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression, passed through")
    parser.add_argument("--file-timeout", type=int, default=1800, help="seconds per test file and backend")
    parser.add_argument("--worker-timeout", type=int, default=300, help="DeepSpeed's DS_UNITTEST_TIMEOUT (seconds)")
    parser.add_argument("--json", type=Path, help="also write every outcome and the totals to this JSON file")
    parser.add_argument("--logs", type=Path, help="write each pytest run's output into this folder")
    parser.add_argument("--require", type=float, default=0.0, help="exit 1 when the share is below this (0..1)")
    parser.add_argument(
        "--deepspeed-results",
        type=Path,
        help="take DeepSpeed's outcomes from an earlier --json of the same tests instead of running them again",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    backends = BACKENDS if args.backend == "both" else (args.backend,)
    if args.deepspeed_results:
        backends = tuple(backend for backend in backends if backend != "deepspeed")
    try:
        with tempfile.TemporaryDirectory(prefix="ds-unit-tests-") as scratch:
            tests = scratch_tests(args.checkout.resolve(), Path(scratch))
            bin_dir = launcher_bin(Path(scratch))
            missing = [name for name in args.tests if not (tests / name.split("::")[0]).exists()]
            if missing:
                raise UserError(f"--tests: not in {args.checkout / 'tests'}: {', '.join(missing)}.")
            results: dict[str, dict[str, str]] = {backend: {} for backend in backends}
            for test_file in args.tests:
                for backend in backends:
                    env = backend_env(backend, dict(os.environ), args.worker_timeout, bin_dir)
                    run = run_file(backend, test_file, tests, env, args)
                    results[backend].update(run.outcomes)
                    counts = {o: sum(v == o for v in run.outcomes.values()) for o in OUTCOMES[:-1]}
                    print(f"[{backend}] {test_file}: exit {run.returncode}, {counts}", file=sys.stderr, flush=True)
                    if args.logs:
                        args.logs.mkdir(parents=True, exist_ok=True)
                        (args.logs / f"{backend}-{test_file.replace('/', '_')}.log").write_text(run.log)
    except UserError as error:
        print(f"ds_unit_tests: error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    if args.deepspeed_results:  # read now: it may be written while ds_compat's side runs; this run's files only
        earlier = json.loads(args.deepspeed_results.read_text())["results"]["deepspeed"]
        modules = tuple(name.split("::")[0].removesuffix(".py").replace("/", ".") for name in args.tests)
        results["deepspeed"] = {test: outcome for test, outcome in earlier.items() if test.startswith(modules)}
    summary = compare(results)
    print("\n".join(report_lines(results, summary)))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "results": results}, indent=2, sort_keys=True))
    return 1 if summary.get("share", 1.0) < args.require else 0


if __name__ == "__main__":
    sys.exit(main())
