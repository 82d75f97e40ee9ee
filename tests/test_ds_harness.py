"""What DeepSpeed's own unit tests (run by glm45v_fsdp/tools/ds_unit_tests.py) found missing or wrong in ds_compat,
each checked here against the installed DeepSpeed 0.19.8: the modules its harness imports (git_version_info,
import-only pipe / moe), the CPU accelerator's seeding and rng state, groups._get_expert_parallel_ranks,
zero_to_fp32.get_optim_files; and the tool itself on a two-test stand-in checkout."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import python

import ds_compat
from ds_compat import accelerator as our_accelerator
from ds_compat import git_version_info as our_version_info
from ds_compat import zero_to_fp32 as our_zero_to_fp32
from ds_compat.utils import groups as our_groups
from glm45v_fsdp.errors import UserError

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402
from deepspeed import git_version_info as ds_version_info  # noqa: E402
from deepspeed.accelerator import get_accelerator as ds_get_accelerator  # noqa: E402
from deepspeed.utils import groups as ds_groups  # noqa: E402
from deepspeed.utils import zero_to_fp32 as ds_zero_to_fp32  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def test_git_version_info_has_deepspeeds_fields():
    public = {name for name in dir(ds_version_info) if not name.startswith("_") and name != "os"}
    assert public <= set(dir(our_version_info))
    assert set(our_version_info.torch_info) == set(ds_version_info.torch_info)
    assert our_version_info.torch_info["version"] == ".".join(torch.__version__.split(".")[:2])
    assert set(our_version_info.installed_ops) == set(ds_version_info.installed_ops)
    assert not any(our_version_info.installed_ops.values())
    compatible = {name for name, ok in our_version_info.compatible_ops.items() if ok}  # the optimizers, in PyTorch
    assert compatible == {"cpu_adagrad", "cpu_adam", "cpu_lion", "fused_adam"}
    assert all(deepspeed.ops.__compatible_ops__[name] for name in compatible)  # and DeepSpeed's are on this CPU
    assert ds_compat.ops.__compatible_ops__ == our_version_info.compatible_ops
    from ds_compat.ops.op_builder import FusedAdamBuilder

    with pytest.raises(UserError, match=r"FusedAdamBuilder.load\(\)` is not provided.*use deepspeed.ops.adam.FusedAd"):
        FusedAdamBuilder().load()
    assert our_version_info.version == ds_compat.__version__
    for name in ("__git_hash__", "__git_branch__", "__version_major__", "__version_minor__", "__version_patch__"):
        assert hasattr(deepspeed, name) and hasattr(ds_compat, name)


@pytest.mark.parametrize(
    "module, name, instead",
    [
        ("ds_compat.pipe", "PipelineModule", "pipeline parallelism is not run here"),
        ("ds_compat.pipe", "LayerSpec", "sharded by FSDP2"),
        ("ds_compat.moe.layer", "MoE", "the ds_config's `expert_parallel` section"),
    ],
)
def test_pipe_and_moe_load_and_refuse_on_use(module, name, instead):
    refused_class = getattr(__import__(module, fromlist=[name]), name)
    deepspeed_name = module.replace("ds_compat", "deepspeed")
    with pytest.raises(UserError, match=f"`{deepspeed_name}.{name}` is not provided by the FSDP2 backend.*{instead}"):
        refused_class(layers=[torch.nn.Linear(2, 2)], num_stages=2)


def test_the_cpu_accelerator_seeds_and_restores_torchs_generator():
    ours, theirs = our_accelerator.Accelerator(our_accelerator.device_layer()), ds_get_accelerator()
    draws = []
    for accelerator in (ours, theirs):
        for seed in (accelerator.manual_seed, accelerator.manual_seed_all):
            seed(1234)
            state = accelerator.get_rng_state()
            first = torch.rand(3)
            accelerator.set_rng_state(state)
            assert torch.equal(first, torch.rand(3))  # the state restores the draw
            draws.append(first)
    assert all(torch.equal(draws[0], draw) for draw in draws)  # each seeds torch's generator, as DeepSpeed's


def test_expert_parallel_ranks_equal_deepspeeds():
    layouts = [
        (world, tp, ep, pp, data_first)
        for world, tp, ep, pp, data_first in itertools.product((8, 16, 32), (1, 2), (1, 2, 4), (1, 2), (False, True))
        if world % (tp * pp) == 0 and (world // (tp * pp)) % ep == 0
    ]
    assert len(layouts) > 40
    for layout in layouts:
        assert our_groups._get_expert_parallel_ranks(*layout) == ds_groups._get_expert_parallel_ranks(*layout), layout
    for bad in ((12, 1, 8), (10, 4, 1)):
        with pytest.raises(AssertionError, match="is not divisible by"):
            ds_groups._get_expert_parallel_ranks(*bad)
        with pytest.raises(AssertionError, match="is not divisible by"):
            our_groups._get_expert_parallel_ranks(*bad)


def test_checkpoint_files_in_deepspeeds_order(tmp_path):
    for rank in (0, 1, 2, 10, 11, 100):
        (tmp_path / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").touch()
        (tmp_path / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt").touch()
    assert our_zero_to_fp32.get_optim_files(tmp_path) == ds_zero_to_fp32.get_optim_files(tmp_path)
    assert our_zero_to_fp32.get_model_state_files(tmp_path) == ds_zero_to_fp32.get_model_state_files(tmp_path)
    assert our_zero_to_fp32.get_optim_files(tmp_path)[-1].endswith("rank_100_mp_rank_00_optim_states.pt")
    with pytest.raises(FileNotFoundError):
        our_zero_to_fp32.get_optim_files(tmp_path / "missing")


STAND_IN_TEST = """
import deepspeed


def test_same_on_both():
    assert deepspeed.__version__.startswith("0.19.8")


def test_real_deepspeed_only():
    assert deepspeed.__name__ == "deepspeed"
"""


def test_the_tool_runs_a_checkout_on_both_backends(tmp_path):
    unit = tmp_path / "checkout" / "tests" / "unit"
    unit.mkdir(parents=True)
    (unit / "common.py").write_text("")
    (unit / "test_stand_in.py").write_text(STAND_IN_TEST)
    out = tmp_path / "result.json"
    command = [sys.executable, "-m", "glm45v_fsdp.tools.ds_unit_tests", str(tmp_path / "checkout")]
    command += ["--tests", "unit/test_stand_in.py", "--json", str(out), "--require", "0.5"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "passed     passed     unit.test_stand_in::test_same_on_both" in done.stdout
    assert "passed     failed     unit.test_stand_in::test_real_deepspeed_only" in done.stdout
    assert "pass on ds_compat of those that pass on DeepSpeed: 1/2 = 50.0%" in done.stdout
    summary = json.loads(out.read_text())["summary"]
    assert summary["totals"]["ds_compat"]["failed"] == 1 and summary["share"] == 0.5
    assert sorted(path.name for path in unit.iterdir()) == ["common.py", "test_stand_in.py"]  # checkout untouched


def test_distributed_test_harness_workers_run_on_ds_compat():
    """The hang DeepSpeed's DistributedTest met on ds_compat: its forkserver workers import the test module, and with
    it deepspeed.git_version_info / pipe / moe; where they could not, each task was lost and the harness waited."""
    done = python(["-m", "ds_compat.run", str(REPO / "tests" / "ds_pool_script.py")], timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    version = ".".join(torch.__version__.split(".")[:2])
    assert json.loads(done.stdout.splitlines()[-1]) == [["ds_compat", 3.0, "cpu", "gloo", version, True]] * 2


# --------------------------------------------------------------------------------------------------------------
# The launcher's module API, as DeepSpeed's launcher tests call it
# --------------------------------------------------------------------------------------------------------------

POOL = {"worker-0": 4, "worker-1": 4}  # the hostfile's slot counts, which DeepSpeed's get_cmd also takes


def test_runners_take_a_pool_of_slot_counts_and_quote_exports_as_deepspeed():
    from deepspeed.launcher import multinode_runner as theirs
    from deepspeed.launcher.runner import parse_args as their_parse_args

    from ds_compat.launchers import multinode_runner as ours
    from ds_compat.launchers.runner import encode_world_info, parse_args

    world_info = encode_world_info(POOL)
    for name, program in (("PDSHRunner", "pdsh"), ("OpenMPIRunner", "mpirun"), ("SlurmRunner", "srun")):
        runners = []
        for module, parse in ((ours, parse_args), (theirs, their_parse_args)):
            args = parse(["train.py"])  # the default hostfile, /job/hostfile, does not exist here
            cls = getattr(module, name)
            runner = cls(args, world_info) if name == "PDSHRunner" else cls(args, world_info, POOL)
            for index, value in enumerate(("64(x2)", " plain ", "a b", "x=1,y:2")):
                runner.add_export(f"V{index}", value)
            runners.append(runner)
        assert runners[0].exports == runners[1].exports  # '"64(x2)"', 'plain', '"a b"', 'x=1,y:2'
        result = runners[0].get_cmd(dict(os.environ), POOL)
        command = result[0] if name == "PDSHRunner" else result
        assert command[0] == program
        if name == "OpenMPIRunner":  # the value itself reaches the ranks, not DeepSpeed's quotes
            assert "V0=64(x2)" in command and "V2=a b" in command


def test_runner_main_raises_a_bad_launch_as_deepspeed():
    from deepspeed.launcher import runner as theirs

    from ds_compat.launchers import runner as ours

    for argv in ("--num_nodes 1 -i localhost foo.py", "--num_gpus 1 -e localhost foo.py"):
        with pytest.raises(ValueError):
            theirs.main(args=argv.split())
        with pytest.raises(ValueError, match="mutually exclusive|include|exclude"):
            ours.main(args=argv.split())


# --------------------------------------------------------------------------------------------------------------
# Config models
# --------------------------------------------------------------------------------------------------------------


def _listed(value: object) -> list:
    return [value]  # DeepSpeed calls it on the default too


def test_a_section_marking_deprecated_fields_as_deepspeed_does():
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel as Theirs
    from pydantic import Field

    from ds_compat.runtime.config_utils import DeepSpeedConfigModel as Ours

    def section(base: type) -> type:
        class Section(base):
            old: str | None = Field(
                None, json_schema_extra={"deprecated": True, "new_param": "new", "new_param_fn": _listed}
            )
            new: list[str] | None = None
            gone: int | None = Field(None, json_schema_extra={"deprecated": True})

        return Section

    for base in (Theirs, Ours):
        assert section(base)(old="ab").new == ["ab"] and section(base)(gone=1).new is None
        with pytest.raises(AssertionError):
            section(base)(old="ab", new=["c"])


@pytest.mark.parametrize("loss_scale", [[], {}, True, float("inf"), -1])
def test_fp16_loss_scale_errors_say_what_deepspeeds_say(loss_scale):
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config as Theirs
    from pydantic import ValidationError

    from ds_compat.runtime.precision_config import DeepSpeedFP16Config as Ours

    with pytest.raises(ValidationError) as theirs:
        Theirs(loss_scale=loss_scale)
    with pytest.raises(ValidationError) as ours:
        Ours(loss_scale=loss_scale)
    said = theirs.value.errors()[0]["msg"].removeprefix("Value error, fp16.loss_scale ").split(",")[0].split(" (")[0]
    assert said in str(ours.value) and "write 0 (dynamic scaling)" in str(ours.value)


@pytest.mark.parametrize(
    "extra, said",
    [
        ({"gradient_allreduce_op": "max"}, "Invalid gradient_allreduce_op"),
        ({"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}}, "not supported with ZeRO stage 3"),
        (
            {"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 2, "zenflow": {}}},
            "not supported with ZenFlow",
        ),
        ({"gradient_allreduce_op": "SUM", "compile": {"deepcompile": True}}, "not supported with DeepCompile"),
    ],
)
def test_gradient_allreduce_op_refused_where_deepspeed_refuses_it(extra, said):
    from deepspeed.runtime.config import DeepSpeedConfig as Theirs

    from ds_compat.runtime.config import DeepSpeedConfig as Ours

    for config_class in (Theirs, Ours):
        with pytest.raises(ValueError, match=said):
            config_class({"train_batch_size": 1, **extra})
    assert Ours({"train_batch_size": 1, "gradient_allreduce_op": "SUM"}).gradient_allreduce_op == "sum"


def test_warmup_on_a_tensor_lr_updates_it_in_place_as_deepspeed():
    from deepspeed.runtime import lr_schedules as theirs

    from ds_compat import lr_schedules as ours

    seen = []
    for module in (theirs, ours):
        lr = torch.full((1,), 0.1, dtype=torch.float64)
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        schedule = module.WarmupLR(optimizer=optimizer, warmup_num_steps=10)
        schedule.step(1)  # the max lr is the group's 0.1 read at construction, not the tensor now written
        assert optimizer.param_groups[0]["lr"] is lr
        seen.append(lr.item())
    assert seen[0] == pytest.approx(0.1 * math.log(2) / math.log(10)) and seen[1] == pytest.approx(seen[0])
