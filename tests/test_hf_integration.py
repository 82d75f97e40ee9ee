"""Unchanged DeepSpeed clients switched by the launch command (`ds-fsdp` instead of `deepspeed`).

- The switch (python -m ds_compat.run, one process): `import deepspeed` and the submodules transformers / accelerate
  import resolve to ds_compat, one module object under both names; package metadata and both libraries'
  availability checks answer, also in a virtualenv without DeepSpeed; what is not provided fails with a message;
  DS_FSDP_BACKEND=deepspeed keeps the real one.
- zero.Init / GatheredParameters on 2 spawned ranks: a rank keeps half the rows, a modifier rank's change reaches
  every rank, initialize() puts the partitions into the FSDP2 shards.
- ZeroParamStatus under the alias equals DeepSpeed's; `ds_status` on 2 ranks (zero.Init partitions, the engine's
  shards), and TRL 1.16's `maybe_gather_lm_head_ctx` around a fused LM-head loss trains as the module's own head.
- tests/hf_trainer_script.py (HF Trainer, "auto" ds_config, `from_pretrained` after TrainingArguments) launched by
  `deepspeed` and by `ds-fsdp` with the same flags, ZeRO 2 and 3 (ZeRO 3 in a virtualenv without DeepSpeed): losses,
  eval loss, the saved safetensors and a second train() equal DeepSpeed's; `resume_from_checkpoint` in a fresh
  launch continues exactly.
- tests/accelerate_loop_script.py (Accelerator(deepspeed_plugin=...), save_state / load_state) likewise, ZeRO 2, and
  with offload_optimizer (accelerate swaps the client AdamW for deepspeed.ops.adam.DeepSpeedCPUAdam).
Our second runs (the resumes at ZeRO 2, the offload run) are started by the switch alone on ranks the suite's zygote
forks (`relaunch`); the ZeRO 3 resume is ds-fsdp's again, in the virtualenv without DeepSpeed.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import EXTENSIONS_DIR, REPO, check_not_crashed, clean_env, end_worker, free_port, spawn
from conftest import python as forked_python
from torch.distributed.tensor import DTensor

from ds_compat.alias import SHIM_DIR

TRAINER_SCRIPT = REPO / "tests" / "hf_trainer_script.py"
LOOP_SCRIPT = REPO / "tests" / "accelerate_loop_script.py"
REFERENCE_RUNNER = REPO / "tests" / "ds_reference_runner.py"


def env(**extra: str) -> dict[str, str]:
    environ = clean_env()
    environ.update(DS_ACCELERATOR="cpu", **extra)
    return environ


@pytest.fixture(scope="module")
def venv_python(tmp_path_factory) -> str:
    """The python of a virtualenv without DeepSpeed: every other package of this environment linked in."""
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for entry in Path(site.getsitepackages()[0]).iterdir():
        if not entry.name.lower().startswith("deepspeed"):
            (root / "lib" / version / "site-packages" / entry.name).symlink_to(entry)
    python = str(root / "bin" / "python")
    check = "import importlib.metadata as m, importlib.util as u; print(u.find_spec('deepspeed'), m.version('torch'))"
    assert run([python, "-c", check], env()).stdout.split()[0] == "None"  # no DeepSpeed, but everything else
    return python


def mean_relative_error(test: list[float], reference: list[float]) -> float:
    assert len(test) == len(reference)
    return sum(abs(t - r) / abs(r) for t, r in zip(test, reference)) / len(reference)


def run(command: list[str], environ: dict[str, str], cwd: Path = REPO) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, env=environ, capture_output=True, text=True, timeout=600)
    check_not_crashed(result)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


# ----------------------------------------------------------------------------------------------------------------
# The switch
# ----------------------------------------------------------------------------------------------------------------

PROBE = """
import importlib, importlib.metadata, importlib.util, json, sys
import deepspeed
import deepspeed.comm
from deepspeed.runtime.zero import partition_parameters as pp
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from deepspeed.ops.adam import DeepSpeedCPUAdam
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import set_z3_leaf_modules
from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME
import ds_compat, ds_compat.comm
from accelerate.utils import is_deepspeed_available as accelerate_sees
from transformers.integrations.deepspeed import is_deepspeed_available as transformers_sees
refused = {}
for name in ("deepspeed.inference", "deepspeed.no_such_module"):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as error:
        refused[name] = str(error)
from deepspeed.pipe import PipelineModule  # import-only: refused on use
from deepspeed.moe.layer import MoE
for name, refused_class in (("PipelineModule", PipelineModule), ("MoE", MoE)):
    try:
        refused_class(layers=[])
    except ValueError as error:
        refused[name] = str(error)
print(json.dumps({
    "module": deepspeed.__name__,
    "one_comm": deepspeed.comm is ds_compat.comm is sys.modules["deepspeed.comm"],
    "one_reduce_op": deepspeed.comm.ReduceOp is ds_compat.comm.ReduceOp,
    "zero_is_runtime_zero": deepspeed.zero is sys.modules["deepspeed.runtime.zero"],
    "pp": pp.__name__,
    "lr_schedules": deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES,
    "engine_class": deepspeed.runtime.engine.DeepSpeedEngine is deepspeed.DeepSpeedEngine,
    "accelerator": get_accelerator().device_name(),
    "version": importlib.metadata.version("deepspeed"),
    "version_attr": deepspeed.__version__,
    "accelerate_sees": accelerate_sees(),
    "transformers_sees": transformers_sees(),
    "environment_name": DEEPSPEED_ENVIRONMENT_NAME,
    "refused": refused,
}))
"""


@pytest.fixture(scope="module")
def probe_script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("probe") / "probe.py"
    path.write_text(textwrap.dedent(PROBE))
    return path


@pytest.mark.parametrize("without_deepspeed", [False, True], ids=["deepspeed-installed", "venv-without-deepspeed"])
def test_import_deepspeed_resolves_to_ds_compat(probe_script, without_deepspeed, request):
    python = request.getfixturevalue("venv_python") if without_deepspeed else sys.executable
    result = run([python, "-m", "ds_compat.run", str(probe_script)], env())
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen["module"] == "ds_compat" and seen["pp"] == "ds_compat.zero.partition_parameters"
    assert seen["one_comm"] and seen["one_reduce_op"] and seen["zero_is_runtime_zero"] and seen["engine_class"]
    assert seen["lr_schedules"] == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    assert seen["version"] == seen["version_attr"] == "0.19.8+fsdp2" and seen["accelerator"] == "cpu"
    assert seen["accelerate_sees"] is True and seen["transformers_sees"] is True
    assert seen["environment_name"] == ".deepspeed_env"
    assert "DeepSpeed inference kernels" in seen["refused"]["deepspeed.inference"]
    assert "`deepspeed.pipe.PipelineModule` is not provided" in seen["refused"]["PipelineModule"]
    assert "expert parallelism from the ds_config's `expert_parallel` section" in seen["refused"]["MoE"]
    assert "ds-fsdp --backend deepspeed" in seen["refused"]["deepspeed.no_such_module"]
    assert "import deepspeed -> ds_compat 0.19.8+fsdp2" in result.stderr  # the log says which backend runs


def test_the_real_deepspeed_can_be_kept(probe_script):
    script = "import deepspeed, json; print(json.dumps([deepspeed.__name__, deepspeed.__file__]))"
    probe = probe_script.parent / "real.py"
    probe.write_text(script)
    result = run([sys.executable, "-m", "ds_compat.run", str(probe)], env(DS_FSDP_BACKEND="deepspeed"))
    name, location = json.loads(result.stdout.splitlines()[-1])
    assert name == "deepspeed" and "site-packages" in location and str(SHIM_DIR) not in location
    wrong = subprocess.run(
        [sys.executable, "-m", "ds_compat.run", str(probe)], env=env(DS_FSDP_BACKEND="fast"), capture_output=True
    )
    assert wrong.returncode != 0 and b"DS_FSDP_BACKEND='fast' is not a backend" in wrong.stderr


# ----------------------------------------------------------------------------------------------------------------
# zero.Init and GatheredParameters (2 ranks)
# ----------------------------------------------------------------------------------------------------------------


def _tiny_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))


def _join_two_ranks(rank: int, port: int) -> None:
    """A spawned worker's process group (2 gloo ranks) and the launcher variables the engine reads."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    os.environ.update(MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)


def _zero_init_worker(rank: int, port: int) -> None:
    _join_two_ranks(rank, port)
    import ds_compat
    from ds_compat import zero

    torch.manual_seed(0)
    reference = _tiny_mlp()
    torch.manual_seed(rank)  # the ranks draw different values: partitioning must keep rank 0's, as DeepSpeed
    with zero.Init():
        model = _tiny_mlp()
    weight = model[0].weight
    assert weight.numel() == 0 and tuple(weight.ds_shape) == (7, 5) and weight.ds_numel == 35
    assert weight._zero_rows.shape == ((4, 5) if rank == 0 else (3, 5))  # a rank holds its rows only
    with zero.GatheredParameters(list(model.parameters())):
        for mine, theirs in zip(model.parameters(), reference.parameters()):
            assert torch.equal(mine, theirs)
    assert weight.numel() == 0  # partitioned again
    with zero.GatheredParameters(model[2].bias, modifier_rank=1), torch.no_grad():
        if rank == 1:
            model[2].bias.fill_(3.0)
    with torch.no_grad():
        reference[2].bias.fill_(3.0)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    engine, *_ = ds_compat.initialize(model=model, config=config)
    state = engine.module_state_dict()  # full tensors on rank 0
    if rank == 0:
        assert state.keys() == reference.state_dict().keys()
        for name, value in reference.state_dict().items():
            assert torch.equal(state[name], value), name
    with pytest.raises(Exception, match="after deepspeed.initialize"):
        zero.GatheredParameters(list(engine.module.parameters()))
    end_worker()


def test_zero_init_partitions_and_initialize_places_them():
    spawn(_zero_init_worker, args=(free_port(),), nprocs=2)


def _zero2_worker(rank: int, port: int) -> None:
    _join_two_ranks(rank, port)
    import ds_compat
    from ds_compat.ops.adam import DeepSpeedCPUAdam
    from glm45v_fsdp.errors import UserError

    torch.manual_seed(0)
    model = _tiny_mlp()
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    client = DeepSpeedCPUAdam(model.parameters(), lr=1e-2, adamw_mode=False)
    engine, optimizer, *_ = ds_compat.initialize(model=model, optimizer=client, config=config)
    assert isinstance(next(engine.module.parameters()), DTensor)  # really sharded
    assert type(optimizer) is DeepSpeedCPUAdam and optimizer.param_groups[0]["decoupled_weight_decay"] is False
    engine.backward(engine(torch.randn(2, 5)).sum())
    engine.step()
    # ZeRO-2: DeepSpeed's parameters are whole, so are `state_dict()` and `load_state_dict()` (accelerate's
    # unwrap_model(engine).state_dict() on save); the engine's own checkpoints stay sharded
    state = engine.module.state_dict()
    full = engine.module_state_dict(full=True)
    assert all(not isinstance(value, DTensor) for value in state.values())
    assert all(isinstance(value, DTensor) for value in engine.module_state_dict(full=False).values())
    if rank == 0:
        assert all(torch.equal(value, full[key]) for key, value in state.items())
    changed = {key: value * 2.0 + 1.0 for key, value in state.items()}
    engine.module.load_state_dict(changed)
    assert all(torch.equal(value, changed[key]) for key, value in engine.module.state_dict().items())
    engine.destroy()
    assert engine.optimizer is None and engine.lr_scheduler is None
    # a second initialize on the same model (HF's second train()): its FSDP2 units are kept, training goes on
    kept = engine.module_state_dict(full=True)
    config3 = {**config, "zero_optimization": {"stage": 3}, "optimizer": {"type": "SGD", "params": {"lr": 0.5}}}
    again, *_ = ds_compat.initialize(model=engine.module, config=config3)
    same = again.module_state_dict()  # a collective: every rank calls it, rank 0 gets the tensors
    assert all(torch.equal(value, kept[key]) for key, value in same.items()) and (rank != 0 or len(same) == 4)
    assert all(isinstance(value, DTensor) for value in again.module.state_dict().values())  # ZeRO-3: shards
    again.backward(again(torch.ones(2, 5)).sum())
    again.step()
    stepped = again.module_state_dict()
    assert again.global_steps == 1 and (rank != 0 or not torch.equal(stepped["0.bias"], kept["0.bias"]))
    with pytest.raises(UserError, match="FSDP2 cannot change in place"):
        ds_compat.initialize(model=again.module, config={**config, "bf16": {"enabled": True}})
    end_worker()


def test_zero2_state_dicts_are_whole_and_a_destroyed_engines_model_trains_on():
    spawn(_zero2_worker, args=(free_port(),), nprocs=2)


# ----------------------------------------------------------------------------------------------------------------
# ZeroParamStatus and ds_status: TRL's fused LM-head loss gathers only what is not AVAILABLE
# ----------------------------------------------------------------------------------------------------------------

STATUS_PROBE = """
import json, deepspeed
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
print(json.dumps({
    "module": ZeroParamStatus.__module__,
    "members": {member.name: member.value for member in ZeroParamStatus},
    "zero_has_it": deepspeed.zero.ZeroParamStatus is ZeroParamStatus,
}))
"""


def test_zero_param_status_imports_under_the_alias_with_deepspeeds_members(probe_script):
    probe = probe_script.parent / "status.py"
    probe.write_text(textwrap.dedent(STATUS_PROBE))
    ours, theirs = (
        json.loads(run([sys.executable, "-m", "ds_compat.run", str(probe)], env(**extra)).stdout.splitlines()[-1])
        for extra in ({}, {"DS_FSDP_BACKEND": "deepspeed"})
    )
    assert ours["module"] == "ds_compat.zero.partition_parameters"
    assert theirs["module"] == "deepspeed.runtime.zero.partition_parameters"
    assert ours["members"] == theirs["members"] == {"AVAILABLE": 1, "NOT_AVAILABLE": 2, "INFLIGHT": 3}
    assert ours["zero_has_it"] and theirs["zero_has_it"]


def _maybe_gather_lm_head_ctx(*params: torch.nn.Parameter):
    """TRL 1.16.0's `maybe_gather_lm_head_ctx` (trl/trainer/utils.py), line for line: gather the given parameters
    unless ZeRO-3 is off or they are AVAILABLE already."""
    from contextlib import nullcontext

    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        return nullcontext()

    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    to_gather = {id(p): p for p in params if p is not None and p.ds_status != ZeroParamStatus.AVAILABLE}
    if not to_gather:
        return nullcontext()
    return deepspeed.zero.GatheredParameters(list(to_gather.values()))


class _HeadLoss(torch.autograd.Function):
    """Cross-entropy through the LM head from its weight and bias, as TRL's `_ChunkedLogProbFunction`: the backward
    recomputes from the saved weight inside `maybe_gather_lm_head_ctx` again."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels):  # type: ignore[override]
        ctx.save_for_backward(hidden, weight, bias, labels)
        return torch.nn.functional.cross_entropy(torch.nn.functional.linear(hidden, weight, bias), labels)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        hidden, weight, bias, labels = ctx.saved_tensors
        with _maybe_gather_lm_head_ctx(weight, bias):
            probs = torch.softmax(torch.nn.functional.linear(hidden, weight, bias), dim=-1)
            probs[torch.arange(len(labels)), labels] -= 1.0
            dlogits = probs * grad / len(labels)
            return dlogits @ weight, dlogits.t() @ hidden, dlogits.sum(0), None


class _TinyLM(torch.nn.Module):
    """A backbone of layers (each an FSDP2 unit of its own) and an LM head in the root unit, as a causal LM's."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)])
        self.lm_head = torch.nn.Linear(8, 11)
        self.seen: list = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor, fused_lm_head: bool = False) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if not fused_lm_head:
            return torch.nn.functional.cross_entropy(self.lm_head(x), labels)
        # TRL 1.16.0's add_fused_lm_head `_fused_forward`: the head's parameters read directly, never calling it
        weight, bias = self.lm_head.weight, self.lm_head.bias
        if isinstance(weight, DTensor):
            weight = weight.full_tensor()
            if bias is not None:
                bias = bias.full_tensor()
        self.seen.append(weight.ds_status.name)
        with _maybe_gather_lm_head_ctx(weight, bias):
            return _HeadLoss.apply(x, weight, bias, labels)


def _zero_param_status_worker(rank: int, port: int) -> None:
    _join_two_ranks(rank, port)
    os.environ["DS_FSDP_QUIET"] = "1"
    from ds_compat.alias import take_over

    take_over()  # TRL's `import deepspeed`, as under ds-fsdp
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from transformers.integrations import HfDeepSpeedConfig

    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}}
    config["optimizer"] = {"type": "SGD", "params": {"lr": 0.5}}
    hf_config = HfDeepSpeedConfig(config)  # noqa: F841 - is_deepspeed_zero3_enabled() while it lives
    available, not_available = ZeroParamStatus.AVAILABLE, ZeroParamStatus.NOT_AVAILABLE

    # zero.Init: a partition is NOT_AVAILABLE, and AVAILABLE inside GatheredParameters, where TRL's context gathers
    torch.manual_seed(0)
    reference = _TinyLM()
    torch.manual_seed(0)
    with deepspeed.zero.Init():
        built = _TinyLM()
    head = built.lm_head.weight
    assert head.ds_status is not_available and torch.ones(2).ds_status is available
    with _maybe_gather_lm_head_ctx(head, built.lm_head.bias, head) as gathered:
        assert gathered.params == [head, built.lm_head.bias]  # each once
        assert head.ds_status is available and torch.equal(head, reference.lm_head.weight)
    assert head.ds_status is not_available

    # the engine's FSDP2 model: shards are NOT_AVAILABLE; in the forward the root unit's (the head's) parameters are
    # whole, so TRL's context gathers nothing, and the fused loss trains as the module's own head does
    losses: dict[bool, list[float]] = {}
    states = {}
    for fused in (False, True):
        torch.manual_seed(0)
        engine, *_ = deepspeed.initialize(model=_TinyLM(), config=config)
        model = engine.module
        assert isinstance(model.lm_head.weight, DTensor) and model.lm_head.weight.ds_status is not_available
        assert model.layers[0].weight.full_tensor().ds_status is available
        torch.manual_seed(1 + rank)  # each rank its own data: the gradients must be reduced
        losses[fused] = []
        for _ in range(3):
            x, labels = torch.randn(4, 8), torch.randint(0, 11, (4,))
            loss = engine(x, labels, fused_lm_head=fused)
            engine.backward(loss)
            engine.step()
            losses[fused].append(loss.item())
        assert model.lm_head.weight.ds_status is not_available
        states[fused] = engine.module_state_dict()
        assert model.seen == (["AVAILABLE"] * 3 if fused else [])
    assert losses[True] == pytest.approx(losses[False], rel=1e-6)
    if rank == 0:
        for name, value in states[False].items():
            assert torch.allclose(states[True][name], value, rtol=1e-6, atol=1e-7), name
    end_worker()


def test_ds_status_answers_and_trls_fused_lm_head_context_trains_as_the_head():
    spawn(_zero_param_status_worker, args=(free_port(),), nprocs=2)


# ----------------------------------------------------------------------------------------------------------------
# HF Trainer and accelerate, launched by deepspeed and by ds-fsdp
# ----------------------------------------------------------------------------------------------------------------


def launch(launcher: str, script: Path, out: Path, *args: str, python: str = sys.executable) -> str:
    """`deepspeed` or `ds-fsdp` (as `python -m` their runner modules) on 2 CPU ranks with the same flags; under
    `deepspeed` the script runs through tests/ds_reference_runner.py (no JIT build of DeepSpeed's shm op)."""
    runner = {"deepspeed": "deepspeed.launcher.runner", "ds-fsdp": "ds_compat.launcher"}[launcher]
    target = [str(REFERENCE_RUNNER), str(script)] if launcher == "deepspeed" else [str(script)]
    shm_op = EXTENSIONS_DIR / "deepspeed_shm_comm"  # other tests' real DeepSpeed runs may build it; this one must not
    built_before = shm_op.exists()
    command = [python, "-m", runner, "--num_gpus", "2", "--master_port", str(free_port()), *target]
    result = run([*command, "--out", str(out), *args], env(), cwd=out.parent)
    if launcher == "deepspeed":  # its optimizer op (fused_adam) it may build, into the suite's own directory
        assert built_before or not shm_op.exists(), "the DeepSpeed reference JIT-built its shm op"
    return result.stdout + result.stderr


def relaunch(script: Path, out: Path, *args: str) -> None:
    """A second run of `script` on our backend after its `ds-fsdp` launch (the resume, the offload variant): the same
    flags on 2 ranks forked by the suite's zygote through `python -m ds_compat.run`, the switch ds-fsdp's single-node
    launch turns on; what the launcher does is the first launch's to show."""
    argv = ["-m", "ds_compat.run", str(script), "--out", str(out), *args]
    result = forked_python(argv, 2, env(), cwd=out.parent, ranked=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """A tiny Llama saved as an HF checkpoint, the scripts' `from_pretrained` source."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    path = tmp_path_factory.mktemp("pretrained")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory, pretrained, venv_python) -> dict[int, dict]:
    """Per ZeRO stage: DeepSpeed's run, ours (ZeRO 3 in a virtualenv without DeepSpeed) and ours resumed (ZeRO 2:
    `relaunch`; ZeRO 3: ds-fsdp again, in the virtualenv). The two stages run at once: a launch of 2 ranks keeps about
    one core of two busy."""
    roots = {zero: tmp_path_factory.mktemp(f"trainer_zero{zero}") for zero in (2, 3)}

    def stage(zero: int) -> dict:
        root = roots[zero]
        flags = ["--zero", str(zero), "--pretrained", str(pretrained)]
        launch("deepspeed", TRAINER_SCRIPT, root / "deepspeed", *flags)
        python = venv_python if zero == 3 else sys.executable
        log = launch("ds-fsdp", TRAINER_SCRIPT, root / "ours", *flags, python=python)
        if zero == 3:
            launch("ds-fsdp", TRAINER_SCRIPT, root / "ours", *flags, "--resume", python=python)
        else:
            relaunch(TRAINER_SCRIPT, root / "ours", *flags, "--resume")
        return {
            "root": root,
            "log": log,
            **{name: json.loads((root / name / "result.json").read_text()) for name in ("deepspeed", "ours")},
            "resumed": json.loads((root / "ours" / "resumed.json").read_text()),
        }

    with ThreadPoolExecutor(len(roots)) as pool:
        return dict(zip(roots, pool.map(stage, roots)))


@pytest.mark.parametrize("zero", [2, 3])
def test_hf_trainer_matches_deepspeed_through_ds_fsdp(trainer_runs, zero):
    from safetensors.torch import load_file

    run_ = trainer_runs[zero]
    ours, reference = run_["ours"], run_["deepspeed"]
    assert "import deepspeed -> ds_compat" in run_["log"] and "ds_compat engine: ZeRO stage" in run_["log"]
    assert len(ours["losses"]) == len(reference["losses"]) == 10
    assert mean_relative_error(ours["losses"], reference["losses"]) <= 1e-5
    assert ours["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)
    saved = {name: load_file(run_["root"] / name / "final" / "model.safetensors") for name in ("ours", "deepspeed")}
    assert saved["ours"].keys() == saved["deepspeed"].keys() and len(saved["ours"]) == 21
    for key, value in saved["deepspeed"].items():
        assert saved["ours"][key].dtype == value.dtype == torch.float32
        torch.testing.assert_close(saved["ours"][key], value, rtol=1e-5, atol=1e-5)
    if zero == 3:  # from_pretrained after TrainingArguments went through zero.Init
        assert "21 zero.Init parameter(s) put in their FSDP2 shards" in run_["log"]
    # a second train() in the same process: destroy(), a new engine on the same (sharded) model
    assert len(ours["second_losses"]) == 10 and ours["second_losses"] != ours["losses"]
    assert mean_relative_error(ours["second_losses"], reference["second_losses"]) <= 1e-5
    # resume_from_checkpoint (checkpoint-5) in a fresh launch: steps 6-10 as the straight run
    assert run_["resumed"]["losses"] == pytest.approx(ours["losses"][5:], rel=1e-6)
    assert run_["resumed"]["eval_loss"] == pytest.approx(ours["eval_loss"], rel=1e-6)


def test_accelerate_loop_matches_deepspeed_through_ds_fsdp(tmp_path, pretrained):
    flags = ["--zero", "2", "--pretrained", str(pretrained)]
    with ThreadPoolExecutor(1) as pool:  # DeepSpeed's run, then the offload one, beside ours and its resume
        reference_run = pool.submit(launch, "deepspeed", LOOP_SCRIPT, tmp_path / "deepspeed", *flags)
        log = launch("ds-fsdp", LOOP_SCRIPT, tmp_path / "ours", *flags)
        offload_run = pool.submit(relaunch, LOOP_SCRIPT, tmp_path / "offload", *flags, "--offload")
        relaunch(LOOP_SCRIPT, tmp_path / "ours", *flags, "--resume")
        reference_run.result(), offload_run.result()
    reference = json.loads((tmp_path / "deepspeed" / "result.json").read_text())["losses"]
    ours = json.loads((tmp_path / "ours" / "result.json").read_text())["losses"]
    resumed = json.loads((tmp_path / "ours" / "resumed.json").read_text())["losses"]
    assert "import deepspeed -> ds_compat" in log
    assert len(ours) == len(reference) == 10 and mean_relative_error(ours, reference) <= 1e-5
    assert resumed == pytest.approx(ours[5:], rel=1e-6)  # save_state after step 5, load_state in a fresh launch
    # offload_optimizer with a client AdamW: accelerate swaps in deepspeed.ops.adam.DeepSpeedCPUAdam
    offload = json.loads((tmp_path / "offload" / "result.json").read_text())
    assert offload["optimizer"] == "DeepSpeedCPUAdam" and mean_relative_error(offload["losses"], reference) <= 1e-5
