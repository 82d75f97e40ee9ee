"""Jobs that survive the cluster, shown by injecting the fault (GLM45V_FAULT, glm45v_fsdp/runtime/faults.py).

- Preemption: SIGTERM (then SIGUSR1, ignored) on rank 1 of 2 after step 4, async saves on: every rank finishes
  step 5, a synchronous checkpoint of step 5 is published as `latest`, the ranks exit 143; `training.resume=auto`
  then continues and steps 6-10 equal the straight run's.
- Auto-resume: `torchrun --max-restarts 1` with rank 1 SIGKILLed after step 5 and a checkpoint every 4 steps: the
  job restarts, resumes from step 4 by itself and ends at step 10 with exit 0; metrics.jsonl holds each step once
  and every loss equals the straight run's.
- Integrity: `kill -9` of the whole job in the middle of a save (sync and async): the previous checkpoint stays
  `latest` and resumes exactly. Damaged files of a published checkpoint (truncated, missing, not a checkpoint):
  an error that names the file and the previous checkpoint, exit 2, no traceback.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import PARITY, REPO, check_not_crashed, clean_env, free_port, read_metrics, train

STEPS = 10
BASE = [*[o for o in PARITY if not o.startswith("training.train_iters")], f"training.train_iters={STEPS}"]


def losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records}


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict[int, float]:
    out = tmp_path_factory.mktemp("straight")
    result = train(out, BASE, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return losses(read_metrics(out))


def test_preemption_saves_and_resume_continues_exactly(tmp_path, straight):
    save, out = tmp_path / "save", tmp_path / "out"
    overrides = [*BASE, f"training.save={save}", "training.save_interval=3", "training.async_save=true"]
    overrides.append("training.resume=auto")
    preempted = train(out, overrides, nproc=2, env={**clean_env(), "GLM45V_FAULT": "1:4:sigterm"})
    assert preempted.returncode != 0  # the ranks exit 143; torchrun reports the failed group
    log = preempted.stdout + preempted.stderr
    assert "SIGTERM received: finishing the step in flight" in log
    assert "SIGUSR1 received while already stopping for SIGTERM: ignored" in log
    assert "preemption signal on rank(s) [1]: stopping after step 5" in log
    assert "glm45v-train: preempted at step 5 of 10" in log
    assert (save / "latest").read_text().strip() == "step_00000005"
    assert (save / "step_00000005" / ".metadata").is_file()  # complete, though async saves were on
    assert not list(save.glob("*.tmp"))
    resumed = train(out, overrides, nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "training.resume=auto: continuing from" in resumed.stdout + resumed.stderr
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for step, loss in losses(records).items():
        assert loss == pytest.approx(straight[step], rel=1e-6), step


def test_torchrun_restart_resumes_by_itself(tmp_path, straight):
    save, out, marker = tmp_path / "save", tmp_path / "out", tmp_path / "fired"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=1"]
    # static rendezvous: on CPU, the c10d backend's second attempt now and then fails gloo's connectFullMesh
    command += [f"--master_port={free_port()}", "-m", "glm45v_fsdp.train"]
    command += [f"training.output_dir={out}", "training.progress_bar=false", *BASE]
    command += [f"training.save={save}", "training.save_interval=4", "training.resume=auto"]
    env = {**clean_env(), "GLM45V_FAULT": f"1:5:sigkill:{marker}"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    check_not_crashed(result)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    assert marker.exists() and "injecting sigkill on rank 1 at step 5" in log
    assert "training.resume=auto: continuing from" in log and "step_00000004" in log
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # each step once
    for step, loss in losses(records).items():
        assert loss == pytest.approx(straight[step], rel=1e-6), step
    assert json.loads((out / "summary.json").read_text())  # the restarted run finished the job


def test_fault_knob_is_checked():
    from glm45v_fsdp.errors import UserError
    from glm45v_fsdp.runtime.faults import Fault

    assert Fault.from_env({}) is None
    assert Fault.from_env({"GLM45V_FAULT": "1:5:sigkill:/tmp/m"}) == Fault(1, 5, "sigkill", Path("/tmp/m"))
    with pytest.raises(UserError, match="RANK:STEP:KIND"):
        Fault.from_env({"GLM45V_FAULT": "1:five:sigkill"})


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_kill_during_a_save_keeps_the_previous_checkpoint(tmp_path, straight, async_save):
    save, out = tmp_path / "save", tmp_path / "out"
    overrides = [*BASE, f"training.save={save}", "training.save_interval=3", f"training.async_save={async_save}"]
    overrides.append("training.resume=auto")
    killed = train(out, overrides, nproc=2, env={**clean_env(), "GLM45V_FAULT": "*:6:sigkill_save"})
    assert killed.returncode != 0 and "injecting sigkill_save" in killed.stdout + killed.stderr
    assert (save / "latest").read_text().strip() == "step_00000003"
    assert (save / "step_00000006.tmp").is_dir() and not (save / "step_00000006").exists()
    resumed = train(out, overrides, nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "continuing from" in resumed.stdout + resumed.stderr and "step_00000003" in resumed.stdout + resumed.stderr
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for step, loss in losses(records).items():
        assert loss == pytest.approx(straight[step], rel=1e-6), step
    assert not list(save.glob("*.tmp"))  # the next save removed the interrupted one


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> Path:
    """A save directory with complete checkpoints at steps 2 and 4 (one process)."""
    root = tmp_path_factory.mktemp("two")
    result = train(
        root / "out", [*BASE, "training.train_iters=4", f"training.save={root / 'save'}", "training.save_interval=2"]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "save"


@pytest.mark.parametrize(
    "damage, named",
    [
        ("truncate", "__0_0.distcp is truncated"),
        ("remove", "__0_0.distcp is missing"),
        ("metadata", ".metadata is not readable DCP metadata"),
        ("state", "trainer_state.pt cannot be read"),
        ("rng", "rank0.pt cannot be read"),
    ],
)
def test_damaged_checkpoint_names_the_file_and_the_way_out(tmp_path, two_checkpoints, damage, named):
    """In process for each kind of damage (find_checkpoint, what training.load and resume=auto go through); the
    truncated shard also through the trainer: exit 2, one paragraph, no traceback."""
    from glm45v_fsdp.checkpoint.dcp import find_checkpoint
    from glm45v_fsdp.errors import UserError

    save = tmp_path / "save"
    shutil.copytree(two_checkpoints, save)
    newest = save / "step_00000004"
    # a checkpoint without checksums (written before them): the file checks name the damage; with the manifest its
    # checksum names it first (tests/test_checkpoint_integrity.py)
    (newest / "manifest.json").unlink()
    data = newest / "__0_0.distcp"
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[:100])
    elif damage == "remove":
        data.unlink()
    elif damage == "metadata":
        (newest / ".metadata").write_text("not a checkpoint")
    elif damage == "state":
        (newest / "trainer_state.pt").write_bytes(b"\x00" * 10)
    else:
        (newest / "rng" / "rank0.pt").write_bytes(b"")
    with pytest.raises(UserError) as error:
        find_checkpoint(save)
    message = str(error.value)
    assert f"checkpoint {newest} is damaged: {newest}" in message and named in message
    assert f"training.load={save / 'step_00000002'}" in message
    if damage == "truncate":
        result = train(tmp_path / "out", [*BASE, "training.train_iters=6", f"training.load={save}"])
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert message in result.stderr


def test_a_nonfinite_step_never_reaches_a_checkpoint(tmp_path):
    """NaN loss at step 3 (GLM45V_FAULT=0:3:nan) with a checkpoint every step: skipped, its checkpoint holds step 2's
    weights; with training.on_nonfinite=stop the run ends (exit 3) and step 2 stays the latest checkpoint."""
    from glm45v_fsdp.checkpoint.dcp import read_model_tensors

    env = {**clean_env(), "GLM45V_FAULT": "0:3:nan"}
    save = tmp_path / "save"
    common = [*BASE, "training.train_iters=4", "training.save_interval=1"]
    skipped = train(tmp_path / "skip", [*common, f"training.save={save}"], env=env)
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    assert [r["skipped"] for r in read_metrics(tmp_path / "skip")] == [False, False, True, False]
    before, nan_step = read_model_tensors(save / "step_00000002"), read_model_tensors(save / "step_00000003")
    assert before.keys() == nan_step.keys()
    assert all(torch.equal(before[key], nan_step[key]) and torch.isfinite(nan_step[key]).all() for key in before)
    stop = tmp_path / "stop_save"
    stopped = train(tmp_path / "stop", [*common, f"training.save={stop}", "training.on_nonfinite=stop"], env=env)
    assert stopped.returncode == 3 and "non-finite loss nan" in stopped.stderr
    assert (stop / "latest").read_text().strip() == "step_00000002" and not (stop / "step_00000003").exists()
