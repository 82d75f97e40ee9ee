"""The DeepSpeed engine API (`import ds_compat as deepspeed`) against the installed DeepSpeed.

- Parity: tests/ds_api_script.py, one DeepSpeed-API training script (`import deepspeed`), runs unchanged on both
  backends — under torchrun on the real DeepSpeed, under `ds-fsdp` on this one (2 gloo ranks, ZeRO 0, 2 and 3, 30
  optimizer steps with accumulation 2, WarmupLR, clipping active): per-step losses, lrs and global_steps must agree,
  and save/load must round-trip the client state on both.
- tests/ds_engine_worker.py: what needs real sharding (client optimizer kept, holding the FSDP2 parameters, client
  scheduler following it, zero_to_fp32 and save_16bit_model equal to the trained full state dict, load variants).
- In-process, one rank: initialize's argument errors (compared with DeepSpeed's own), add_config_arguments, the
  accumulation boundary, get_lr per param group, the skip on a non-finite norm, comm.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from conftest import check_not_crashed, free_port, python  # noqa: E402
from conftest import clean_env as train_env  # noqa: E402

import ds_compat  # noqa: E402
from ds_compat import comm  # noqa: E402
from ds_compat.engine_build import auto_fsdp_units  # noqa: E402
from glm45v_fsdp.errors import UserError  # noqa: E402
from glm45v_fsdp.log import get_logger  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "ds_api_script.py"
WORKER = REPO / "tests" / "ds_engine_worker.py"
REFERENCE_RUNNER = REPO / "tests" / "ds_reference_runner.py"
STAGES = ("0", "2", "3")
STEPS = 30
DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def clean_env(**extra: str) -> dict[str, str]:
    """test_train's clean child environment, on DeepSpeed's CPU accelerator, without the parent's backend choice."""
    env = train_env()
    env.pop("DS_API_BACKEND", None)
    env.update(DS_ACCELERATOR="cpu", **extra)
    return env


def two_ranks(script: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node=2 SCRIPT ARGS`, forked by the zygote (conftest.python)."""
    result = python([str(script), *args], nproc=2, env=env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


# ----------------------------------------------------------------------------------------------------------------
# Parity with DeepSpeed (2 ranks)
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Both backends, ZeRO 0/2/3 each in one launch: {"deepspeed": {stage: result}, "ds_compat": {...}}. The two
    launches run at once (each keeps about one core of two busy)."""
    roots = {backend: tmp_path_factory.mktemp(backend) for backend in ("deepspeed", "ds_compat")}

    def run(backend: str) -> dict:
        root = roots[backend]
        out = root / "result.json"
        args = ("--zero", ",".join(STAGES), "--steps", str(STEPS), "--out", str(out), "--save_dir", str(root / "ck"))
        if backend == "deepspeed":  # without DeepSpeed's JIT-compiled shm all-reduce (see the runner's docstring)
            two_ranks(REFERENCE_RUNNER, str(SCRIPT), *args, env=clean_env(DS_API_BACKEND="deepspeed"))
        else:  # the same `import deepspeed` script, switched by the launcher alone
            launch = [sys.executable, "-m", "ds_compat.launcher", "--num_gpus", "2", "--master_port", str(free_port())]
            command = [*launch, str(SCRIPT), *args]
            result = subprocess.run(
                command,
                cwd=REPO,
                env=clean_env(DS_API_BACKEND="deepspeed"),
                capture_output=True,
                text=True,
                timeout=600,
            )
            check_not_crashed(result)
            assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
        return {**json.loads(out.read_text()), "save_dir": str(root / "ck")}

    with ThreadPoolExecutor(len(roots)) as pool:
        return dict(zip(roots, pool.map(run, roots)))


def mean_relative_error(test: list[float], ref: list[float]) -> float:
    return statistics.mean(abs(t - r) / (abs(r) + 1e-8) for t, r in zip(test, ref, strict=True))


@pytest.mark.parametrize("stage", STAGES)
def test_training_matches_deepspeed(runs, stage):
    assert runs["deepspeed"]["deepspeed_module"] == "deepspeed" and runs["ds_compat"]["deepspeed_module"] == "ds_compat"
    ours, ref = runs["ds_compat"][stage], runs["deepspeed"][stage]
    assert len(ours["records"]) == len(ref["records"]) == STEPS
    error = mean_relative_error([r["loss"] for r in ours["records"]], [r["loss"] for r in ref["records"]])
    assert error <= 1e-5, f"ZeRO {stage}: mean relative loss error {error:.3e}"
    for mine, theirs in zip(ours["records"], ref["records"]):
        assert mine["lr"] == pytest.approx(theirs["lr"], rel=1e-12, abs=0.0)
        assert mine["global_steps"] == theirs["global_steps"]
        if theirs["grad_norm"] is not None:  # DeepSpeed reports none at ZeRO 0 in fp32
            assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)
    assert [r["global_steps"] for r in ours["records"]] == list(range(1, STEPS + 1))
    assert min(r["grad_norm"] for r in ours["records"]) > 1.0  # the clipping at 1.0 was active
    assert ours["micro_steps"] == ref["micro_steps"] == 2 * STEPS
    assert ours["global_samples"] == ref["global_samples"] == STEPS * 8
    assert ours["records"][-1]["loss"] < 0.8 * ours["records"][0]["loss"]  # it learned something


@pytest.mark.parametrize("backend", ["deepspeed", "ds_compat"])
@pytest.mark.parametrize("stage", STAGES)
def test_checkpoint_round_trip(runs, backend, stage):
    checkpoint = runs[backend][stage]["checkpoint"]
    assert checkpoint["client_state_ok"] and checkpoint["latest"] == f"global_step{STEPS}"
    assert checkpoint["global_steps"] == STEPS and checkpoint["probe_close"]
    assert checkpoint["lr"] == runs[backend][stage]["records"][-1]["lr"]
    if backend == "ds_compat":
        tag_dir = Path(runs[backend]["save_dir"], f"zero{stage}", f"global_step{STEPS}")
        assert checkpoint["path"] == str(tag_dir)
        assert (tag_dir / ".metadata").is_file() and (tag_dir / "engine_state.pt").is_file()


def test_engine_checkpoints_carry_checksums_that_catch_a_flipped_bit(runs, tmp_path):
    """save_checkpoint writes manifest.json (each rank's shards, the metadata, engine_state.pt) before `latest`;
    load_checkpoint checks it first: one flipped bit in a shard is named before anything is read."""
    from glm45v_fsdp.checkpoint.integrity import MANIFEST_FILE, check_manifest, verify

    for stage in STAGES:
        tag = Path(runs["ds_compat"]["save_dir"], f"zero{stage}", f"global_step{STEPS}")
        files = json.loads((tag / MANIFEST_FILE).read_text())["files"]
        assert {".metadata", "engine_state.pt", "__0_0.distcp", "__1_0.distcp"} <= set(files), sorted(files)
        assert verify(tag) is None
    damaged = tmp_path / "tag"
    shutil.copytree(tag, damaged)
    shard = damaged / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x04
    shard.write_bytes(data)
    with pytest.raises(UserError, match="__1_0.distcp does not match its checksum"):
        check_manifest(damaged, "DeepSpeed-API checkpoint")


def test_zero_to_fp32_cli(runs, tmp_path):
    save_dir = Path(runs["ds_compat"]["save_dir"], "zero3")
    command = [sys.executable, "-m", "ds_compat.zero_to_fp32", str(save_dir), str(tmp_path / "out")]
    subprocess.run([*command, "-t", f"global_step{STEPS}"], cwd=REPO, env=clean_env(), check=True, timeout=120)
    state = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    from ds_compat.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    expected = get_fp32_state_dict_from_zero_checkpoint(save_dir)
    assert list(state) == list(expected) and all(torch.equal(state[k], expected[k]) for k in state)
    assert state["embed.weight"].dtype == torch.float32 and state["embed.weight"].shape == (64, 32)
    missing = subprocess.run(
        [*command[:3], str(tmp_path / "nothing"), str(tmp_path / "o")], env=clean_env(), capture_output=True, text=True
    )
    assert missing.returncode == 2 and "Unable to find 'latest' file" in missing.stderr


def test_sharded_engine_checks(tmp_path):
    out = tmp_path / "checks.json"
    two_ranks(WORKER, "--out", str(out), "--save_dir", str(tmp_path / "ck"), env=clean_env())
    checks = json.loads(out.read_text())
    for key in (
        "optimizer_kept",
        "unpassed_scheduler_drives",
        "groups_kept",
        "params_sharded",
        "scheduler_follows",
        "grad_norm_finite",
        "no_latest",
        "zero_to_fp32_equal",
        "zero_to_fp32_tag_equal",
        "save_16bit_fp32_equal",
    ):
        assert checks[key] is True, key
    assert checks["loader_len"] == 4 and checks["global_steps"] == 2
    assert checks["lr"] == pytest.approx([1e-3 / 3, 5e-4 / 3])
    assert checks["load_nothing"] == [None, None]
    assert checks["module_only"] == ["mine", {"k": 1}, 0, True]
    assert checks["full_load"] == ["global_step2", {"k": 2}, 2, pytest.approx([1e-3 / 3, 5e-4 / 3])]
    assert checks["save_16bit_bf16"] == "torch.bfloat16"
    assert (
        "'sequence_parallel_size' = 2 is not supported for a TinyLM by the engine API"
        in checks["sequence_parallel_refused"]
    )
    assert "'expert_parallel.autoep_size' = 2 is not supported for a TinyLM" in checks["expert_parallel_refused"]


# ----------------------------------------------------------------------------------------------------------------
# The API surface, in process (one rank)
# ----------------------------------------------------------------------------------------------------------------

ERROR_CASES = {
    "no_model": "dict(model=None, config=CONFIG)",
    "no_config": "dict(model=MODEL)",
    "config_twice": "dict(args=Namespace(deepspeed_config='x.json'), model=MODEL, config=CONFIG)",
    "deepscale_and_deepspeed": (
        "dict(args=Namespace(deepscale_config='a.json', deepspeed_config='b.json'), model=MODEL)"
    ),
}
ERROR_PROGRAM = """
import json, sys, torch
from argparse import Namespace
backend = sys.argv[1]
if backend == "deepspeed":
    import importlib
    import deepspeed
    # no JIT build of DeepSpeed's shm all-reduce (see tests/ds_reference_runner.py)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
else:
    import ds_compat as deepspeed
MODEL = torch.nn.Linear(2, 2)
CONFIG = {"train_batch_size": 1}
found = {}
for name, expression in json.loads(sys.argv[2]).items():
    try:
        deepspeed.initialize(**eval(expression))
        found[name] = None
    except Exception as error:
        found[name] = [type(error).__name__, str(error)]
print(json.dumps(found))
"""


def single_rank_env(port: int) -> dict[str, str]:
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def test_initialize_errors_match_deepspeed():
    processes = {
        backend: subprocess.Popen(
            [sys.executable, "-c", ERROR_PROGRAM, backend, json.dumps(ERROR_CASES)],
            cwd=REPO,
            env=clean_env(**single_rank_env(free_port())),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for backend in ("deepspeed", "ds_compat")
    }
    found = {}
    for backend, process in processes.items():
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr[-3000:]
        found[backend] = json.loads(stdout.strip().splitlines()[-1])
    assert found["ds_compat"] == found["deepspeed"]
    assert all(value is not None and value[0] == "AssertionError" for value in found["deepspeed"].values())


def test_add_config_arguments_match_deepspeed():
    import deepspeed

    def options(module) -> dict:
        parser = module.add_config_arguments(argparse.ArgumentParser())
        return {a.dest: (tuple(a.option_strings), a.default, a.type, a.nargs) for a in parser._actions[1:]}

    assert options(ds_compat) == options(deepspeed)
    args = ds_compat.add_config_arguments(argparse.ArgumentParser()).parse_args(
        ["--deepspeed", "--deepspeed_config", "ds.json"]
    )
    assert args.deepspeed is True and args.deepspeed_config == "ds.json" and args.deepscale_config is None


@pytest.fixture
def group(monkeypatch):
    """A one-rank gloo process group for the in-process engine tests, torn down afterwards."""
    for name in DIST_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in single_rank_env(free_port()).items():
        monkeypatch.setenv(name, value)
    ds_compat.init_distributed(dist_backend="gloo")
    yield
    torch.distributed.destroy_process_group()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.out(x).pow(2).mean()


def test_auto_fsdp_units():
    assert auto_fsdp_units(Net()) == ["blocks.{*}"]
    nested = nn.Module()
    nested.a = nn.ModuleList([nn.Sequential(nn.Linear(1, 1)), nn.ModuleList([nn.Linear(1, 1)])])
    nested.b = nn.Sequential(nn.ModuleList([nn.Linear(1, 1)]))
    assert auto_fsdp_units(nested) == ["a.{*}", "b.0.{*}"]
    assert auto_fsdp_units(nn.ModuleList([nn.Linear(1, 1)])) == ["{*}"]
    assert auto_fsdp_units(nn.Linear(1, 1)) == []
    from ds_compat.utils import set_z3_leaf_modules

    assert set_z3_leaf_modules(nested, [nn.Sequential]) == [nested.a[0], nested.b]  # accelerate's MoE leaves
    assert auto_fsdp_units(nested) == ["a.{*}"]  # nothing inside a leaf becomes a unit of its own
    with pytest.raises(ValueError, match="No modules of type"):
        set_z3_leaf_modules(nested, ["Conv2d"])


def test_boundary_counters_and_lr_per_group(group, capsys):
    torch.manual_seed(0)
    model = Net()
    groups = [{"params": list(model.inp.parameters())}, {"params": list(model.out.parameters()), "lr": 1e-4}]
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 3,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "steps_per_print": 2,
    }
    engine, optimizer, loader, scheduler = ds_compat.initialize(model=model, model_parameters=groups, config=config)
    assert loader is None and scheduler is None and isinstance(optimizer, torch.optim.AdamW)
    assert engine.get_batch_info() == (3, 1, 3) and engine.gradient_clipping() == 1.0  # DeepSpeed 0.19's default
    assert engine.get_lr() == [1e-3, 1e-4] and engine.module is model and engine.blocks is model.blocks
    before = model.blocks[0].weight.detach().clone()
    boundaries = []
    for _ in range(6):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        loss = engine(torch.randn(1, 4))
        assert torch.equal(engine.backward(loss), loss / 3)
        engine.step()
    assert boundaries == [False, False, True, False, False, True]
    assert (engine.global_steps, engine.micro_steps, engine.global_samples) == (2, 6, 6)
    progress = [line for line in capsys.readouterr().out.splitlines() if "step=" in line]
    assert len(progress) == 1 and progress[0].endswith(
        "step=2, skipped=0, lr=[0.001, 0.0001], mom=[(0.9, 0.999), (0.9, 0.999)]"
    )
    assert torch.equal(model.blocks[0].weight, before)  # not in the optimizer's groups
    engine.eval()
    assert not model.training
    engine.train()
    assert model.training


def test_scheduler_and_nonfinite_skip(group):
    model = Net()
    config = {
        "train_batch_size": 1,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.1, "warmup_num_steps": 4}},
    }
    engine, optimizer, _, scheduler = ds_compat.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    assert type(optimizer) is torch.optim.AdamW  # DeepSpeed's Adam is AdamW unless adam_w_mode is false
    assert engine.get_lr() == [0.0] and scheduler.get_lr() == [0.0]
    engine.backward(engine(torch.randn(2, 4)))
    engine.step()
    assert engine.get_global_grad_norm() > 0 and engine.was_step_applied()
    weights = [p.detach().clone() for p in model.parameters()]
    engine.backward(engine(torch.randn(2, 4)) * float("nan"))
    engine.step()
    assert not engine.was_step_applied() and engine.skipped_steps == 1 and engine.global_steps == 2
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    assert scheduler.last_batch_iteration == 0  # a skipped step does not advance the schedule, as in DeepSpeed
    assert all(p.grad is None for p in model.parameters())


def test_training_data_loader_and_callables(group):
    model = Net()
    data = [torch.full((4,), float(i)) for i in range(10)]
    seen = []

    def collate(items):
        seen.append(len(items))
        return torch.stack(items)

    engine, optimizer, loader, scheduler = ds_compat.initialize(
        model=model,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
        training_data=data,
        collate_fn=collate,
        config={"train_micro_batch_size_per_gpu": 4},
    )
    assert isinstance(optimizer, torch.optim.SGD) and scheduler.optimizer is optimizer
    assert len(loader) == 3 and loader.data_sampler.num_replicas == 1
    batches = list(loader)
    assert [len(b) for b in batches] == [4, 4, 2] and seen == [4, 4, 2]
    assert sorted(torch.cat(batches)[:, 0].tolist()) == list(map(float, range(10)))
    repeating = ds_compat.utils.RepeatingLoader(loader)
    assert len([next(repeating) for _ in range(7)]) == 7  # past the end of the 3-batch epoch
    for batch in batches:
        engine.backward(engine(batch))
        engine.step()
    assert engine.get_lr() == [pytest.approx(0.01 * 0.5**3)]


def test_no_optimizer_and_refused_configs(group, tmp_path):
    engine, optimizer, _, scheduler = ds_compat.initialize(model=Net(), config={"train_batch_size": 1})
    assert optimizer is None and scheduler is None and engine.get_lr() == []
    with pytest.raises(AssertionError, match="must provide optimizer"):
        engine.backward(engine(torch.randn(1, 4)))
    assert engine.load_checkpoint(tmp_path) == (None, None)
    with pytest.raises(ValueError, match="save_dir must be a non-empty string"):
        engine.save_checkpoint("")
    with pytest.raises(UserError, match="hybrid_engine"):
        ds_compat.initialize(model=Net(), config={"train_batch_size": 1, "hybrid_engine": {"enabled": True}})
    with pytest.raises(UserError, match="optimizer.type"):
        ds_compat.initialize(model=Net(), config={"train_batch_size": 1, "optimizer": {"type": "Lamb"}})
    with pytest.raises(UserError, match="not a parameter of the model"):
        ds_compat.initialize(
            model=Net(),
            model_parameters=[nn.Parameter(torch.ones(2))],
            config={"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
        )


def test_the_generic_path_says_so_and_refuses_plan_keys(group):
    """A module the door does not build on the plan registry: one log line naming it and what is off; an extension
    key that would switch a plan is refused (never logged as taken and dropped)."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    get_logger().addHandler(handler)
    try:
        ds_compat.initialize(model=Net(), config={"train_batch_size": 1})
    finally:
        get_logger().removeHandler(handler)
    line = next(r.getMessage() for r in records if "is not a model this backend builds" in r.getMessage())
    assert line.startswith("ds_compat: Net is not a model") and "the chunked loss, recompute" in line
    # built through the plan registry's module plans (plans.MODULE_PLANS), the fsdp plan saying what it did
    fsdp = next(r.getMessage() for r in records if r.getMessage().startswith("[plan fsdp]"))
    assert fsdp.startswith("[plan fsdp] 1 pattern(s); not sharded: the FSDP mesh has one rank") and "blocks.{*}" in fsdp
    extension = {"train_batch_size": 1, "glm45v_fsdp": {"features": {"chunk_loss": {"mode": "dynamic"}}}}
    with pytest.raises(UserError, match=r"'glm45v_fsdp.features.chunk_loss.mode' = 'dynamic' switches a plan"):
        ds_compat.initialize(model=Net(), config=extension)


def test_comm(group):
    assert comm.is_initialized() and comm.get_rank() == 0 and comm.get_world_size() == 1
    assert comm.get_local_rank() == 0 and comm.get_all_ranks_from_group() == [0]
    tensor = torch.tensor([2.0])
    comm.all_reduce(tensor, op=comm.ReduceOp.MAX)
    comm.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    gathered = [torch.zeros(1)]
    comm.all_gather(gathered, tensor)
    comm.broadcast(tensor, 0)
    comm.barrier()
    assert tensor.item() == 2.0 and gathered[0].item() == 2.0


def test_fp16_loss_scaling(group):
    torch.manual_seed(0)
    model = Net()
    config = {
        "train_batch_size": 1,
        "fp16": {"enabled": True, "initial_scale_power": 4, "hysteresis": 1},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, optimizer, _, _ = ds_compat.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert engine.fp16_enabled() and engine.cur_scale() == 16.0
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.float16):
        reference = model(x)
    reference.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    engine.zero_grad()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.backward(engine(x))
    assert torch.allclose(model.out.weight.grad, 16 * expected["out.weight"], rtol=1e-3)  # scaled by the loss scale
    engine.step()
    for name, param in model.named_parameters():  # the update uses the unscaled gradients (norm below clipping)
        assert torch.allclose(param, before[name] - 0.1 * expected[name], rtol=1e-3, atol=1e-6), name
    engine.backward(engine(x) * float("inf"))
    engine.step()
    assert engine.skipped_steps == 1 and engine.cur_scale() == 8.0  # overflow: skipped, scale halved


def test_activation_checkpointing(group):
    class Checkpointed(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.inp(x)
            for block in self.blocks:
                x = ds_compat.checkpointing.checkpoint(lambda y, b=block: torch.tanh(b(y)), x)
            return self.out(x).pow(2).mean()

    torch.manual_seed(0)
    plain, checkpointed = Net(), Checkpointed()
    checkpointed.load_state_dict(plain.state_dict())
    config = {"train_batch_size": 1, "activation_checkpointing": {"partition_activations": False}}
    config["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    get_logger().addHandler(handler)
    try:
        engine, *_ = ds_compat.initialize(model=checkpointed, model_parameters=checkpointed.parameters(), config=config)
    finally:
        get_logger().removeHandler(handler)
    assert any("activation_checkpointing has no effect on the engine" in r.getMessage() for r in records)
    x = torch.randn(3, 4)
    plain(x).backward()
    engine.backward(engine(x))
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        assert torch.allclose(a.grad, b.grad), name


def test_compile_and_deepspeed_optimizer_classes(group):
    """engine.compile (accelerate's torch_compile); DeepSpeed's optimizer classes as client optimizers, kept with
    their mode (test_hf_integration.py checks the sharded state dicts, destroy and a second engine on the model)."""
    from ds_compat.ops.adam import DeepSpeedCPUAdam
    from ds_compat.ops.lion import DeepSpeedCPULion

    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))

    def engine_with(optimizer_class, **kwargs):
        torch.manual_seed(0)
        model = Net()
        return ds_compat.initialize(model=model, optimizer=optimizer_class(model.parameters(), **kwargs), config=config)

    engine, optimizer, *_ = engine_with(DeepSpeedCPUAdam, lr=1e-2, weight_decay=0.1, adamw_mode=False)
    assert type(optimizer) is DeepSpeedCPUAdam and optimizer.param_groups[0]["decoupled_weight_decay"] is False
    reference, torch_adam, *_ = engine_with(torch.optim.Adam, lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        for run in (engine, reference):
            run.backward(run(x))
            run.step()
    assert engine(x).item() == reference(x).item()  # Adam with L2 decay, as DeepSpeed's adamw_mode=False

    before = engine(x).item()
    engine.compile(backend="eager")
    assert engine.is_compiled and engine(x).item() == before

    lion, lion_optimizer, *_ = engine_with(DeepSpeedCPULion, lr=0.1, betas=(0.5, 0.9), weight_decay=0.0)
    start = {key: value.clone() for key, value in lion.module_state_dict().items()}
    lion.backward(lion(x))
    lion.step()
    moved = [(lion.module_state_dict()[key] - value).abs() for key, value in start.items()]
    assert all(torch.allclose(delta[delta > 0], torch.tensor(0.1)) for delta in moved)  # sign updates of size lr
