"""Runtime layer: launcher environments, device selection (npu through a stand-in torch_npu), process group, device
mesh (1 rank and 4 gloo ranks), seeding, deterministic mode and the peak-memory meter."""

import os
import random
import time
import types

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import free_port, spawn

from glm45v_fsdp.config import ParallelConfig
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.runtime import (
    DistEnv,
    MemoryMeter,
    ParallelDims,
    ParallelMeshes,
    build_parallel_dims,
    detect_dist_env,
    expand_slurm_nodelist,
    init_distributed,
    select_device,
    set_deterministic,
    set_seed,
    shutdown,
)
from glm45v_fsdp.runtime.device import _cpu_fused_adamw_runs
from glm45v_fsdp.runtime.memory_meter import _ORIGINAL_RESIZE

MiB = 2**20
DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# ---------------------------------------------------------------------------------------------------------------
# Launcher environments
# ---------------------------------------------------------------------------------------------------------------


def test_torchrun_env():
    env = {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "n0",
        "MASTER_PORT": "29400",
        "TORCHELASTIC_RUN_ID": "abc",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
    }
    assert detect_dist_env(env) == DistEnv(5, 1, 8, 4, "n0", 29400, "torchrun")


def test_deepspeed_env_and_local_rank_argument():
    env = {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_SIZE": "2",
        "CROSS_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }
    assert detect_dist_env(env, local_rank_arg=1) == DistEnv(3, 1, 4, 2, "10.0.0.1", 29500, "deepspeed")
    without_local_rank = {k: v for k, v in env.items() if k != "LOCAL_RANK"}
    assert detect_dist_env(without_local_rank, local_rank_arg=1).local_rank == 1
    with pytest.raises(UserError, match=r"--local_rank=0 disagrees with LOCAL_RANK=1"):
        detect_dist_env(env, local_rank_arg=0)


def test_slurm_env_with_nodelist_and_tasks_per_node():
    env = {
        "SLURM_PROCID": "9",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "11",
        "SLURM_NODEID": "2",
        "SLURM_TASKS_PER_NODE": "4(x2),3",
        "SLURM_JOB_NODELIST": "node[01-04,07],gpu5",
    }
    assert detect_dist_env(env) == DistEnv(9, 1, 11, 3, "node01", 29500, "slurm")
    env_with_master = {**env, "SLURM_NTASKS_PER_NODE": "4", "MASTER_ADDR": "head", "MASTER_PORT": "1234"}
    assert detect_dist_env(env_with_master) == DistEnv(9, 1, 11, 4, "head", 1234, "slurm")
    step = {**env, "SLURM_STEP_NODELIST": "gpu[7-8]"}
    assert detect_dist_env(step).master_addr == "gpu7"
    with pytest.raises(UserError, match="SLURM_JOB_NODELIST='node\\[01-04'"):
        detect_dist_env({**env, "SLURM_JOB_NODELIST": "node[01-04"})


def test_slurm_nodelist_forms():
    assert expand_slurm_nodelist("node[01-04,07],gpu5") == ["node01", "node02", "node03", "node04", "node07", "gpu5"]
    assert expand_slurm_nodelist("a[1-2]-b[8-9]") == ["a1-b8", "a1-b9", "a2-b8", "a2-b9"]
    assert expand_slurm_nodelist("solo") == ["solo"]
    assert expand_slurm_nodelist("x[098-101]") == ["x098", "x099", "x100", "x101"]
    for bad in ("node[4-2]", "node[a]", "node]1[", "node[[1]]", ""):
        with pytest.raises(UserError, match="SLURM_JOB_NODELIST"):
            expand_slurm_nodelist(bad)


def test_openmpi_env_needs_master_for_several_processes():
    env = {
        "OMPI_COMM_WORLD_RANK": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    with pytest.raises(UserError, match="MASTER_ADDR and MASTER_PORT must be set for a 4-process openmpi job"):
        detect_dist_env(env)
    full = {**env, "MASTER_ADDR": "h1", "MASTER_PORT": "6000"}
    assert detect_dist_env(full) == DistEnv(2, 0, 4, 2, "h1", 6000, "openmpi")
    assert (
        detect_dist_env(
            {**full, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1"}
        ).launcher
        == "slurm"
    )


def test_no_launcher_is_one_process():
    assert detect_dist_env({}) == DistEnv(0, 0, 1, 1, "127.0.0.1", 0, "none")
    with pytest.raises(UserError, match="--local_rank=2 disagrees with LOCAL_RANK=0 from the none environment"):
        detect_dist_env({}, local_rank_arg=2)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {
                "RANK": "4",
                "LOCAL_RANK": "0",
                "WORLD_SIZE": "4",
                "LOCAL_WORLD_SIZE": "4",
                "MASTER_ADDR": "h",
                "MASTER_PORT": "1",
            },
            r"RANK=4 is outside \[0, WORLD_SIZE=4\)",
        ),
        ({"RANK": "0"}, "WORLD_SIZE is not set"),
        ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
        (
            {
                "RANK": "0",
                "LOCAL_RANK": "3",
                "WORLD_SIZE": "8",
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "h",
                "MASTER_PORT": "1",
            },
            r"LOCAL_RANK=3 is outside \[0, LOCAL_WORLD_SIZE=2\)",
        ),
        (
            {
                "RANK": "0",
                "LOCAL_RANK": "0",
                "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "h",
                "MASTER_PORT": "70000",
            },
            "MASTER_PORT=70000",
        ),
        (
            {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "1"},
            "MASTER_ADDR must be set",
        ),
        ({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2"}, "SLURM_TASKS_PER_NODE"),
        (
            {
                "SLURM_PROCID": "0",
                "SLURM_LOCALID": "0",
                "SLURM_NTASKS": "2",
                "SLURM_NTASKS_PER_NODE": "4",
                "SLURM_NODELIST": "n1",
            },
            "SLURM_NTASKS_PER_NODE=4 is not between 1 and SLURM_NTASKS=2",
        ),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}, "OMPI_COMM_WORLD_LOCAL_RANK is not set"),
    ],
)
def test_inconsistent_launcher_env_is_a_user_error(env, message):
    with pytest.raises(UserError, match=message):
        detect_dist_env(env)


# ---------------------------------------------------------------------------------------------------------------
# Device layer
# ---------------------------------------------------------------------------------------------------------------


class StandInNpu:
    """The slice of torch_npu.npu the device layer calls, with the reference semantics, recording each call."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.allocated = self.peak = 0
        self.state = torch.zeros(16, dtype=torch.uint8)

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 2

    def set_device(self, index: int) -> None:
        self.calls.append(("set_device", index))

    def synchronize(self) -> None:
        self.calls.append(("synchronize",))

    def allocate(self, nbytes: int) -> None:  # what the allocator would see; not part of torch_npu
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)

    def reset_peak_memory_stats(self) -> None:
        self.peak = self.allocated

    def max_memory_allocated(self) -> int:
        return self.peak

    def manual_seed_all(self, seed: int) -> None:
        self.calls.append(("manual_seed_all", seed))
        self.state = torch.full((16,), seed % 256, dtype=torch.uint8)

    def get_rng_state(self) -> torch.Tensor:
        return self.state.clone()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.state = state.clone()


@pytest.fixture
def npu():
    """select_device("npu") through a stand-in torch_npu; like `import torch_npu`, loading names the npu device type."""
    accel = StandInNpu()

    def loader():
        if torch._C._get_privateuse1_backend_name() != "npu":
            torch.utils.rename_privateuse1_backend("npu")
        return types.SimpleNamespace(npu=accel)

    return select_device("npu", npu_module_loader=loader), accel


def _missing_torch_npu():
    raise ModuleNotFoundError("No module named 'torch_npu'", name="torch_npu")


def test_auto_picks_cpu_here():
    layer = select_device("auto")
    assert (layer.type, layer.backend) == ("cpu", "gloo")
    assert layer.device(3) == torch.device("cpu")
    assert select_device("auto", npu_module_loader=_missing_torch_npu).type == "cpu"
    assert layer.rng_state() is None
    with pytest.raises(AssertionError):
        layer.peak_allocated_bytes()


def test_npu_path_goes_through_the_stand_in(npu):
    layer, accel = npu
    assert (layer.type, layer.backend) == ("npu", "hccl")
    assert layer.device(1) == torch.device("npu", 1)
    layer.set_device(1)
    layer.synchronize()
    layer.manual_seed_all(7)
    assert accel.calls == [("set_device", 1), ("synchronize",), ("manual_seed_all", 7)]
    state = layer.rng_state()
    layer.manual_seed_all(8)
    layer.set_rng_state(state)
    assert torch.equal(accel.state, torch.full((16,), 7, dtype=torch.uint8))
    assert layer.has_fused_adamw()
    with pytest.raises(UserError, match="Local rank 2 has no npu device: only 2 .*ASCEND_RT_VISIBLE_DEVICES"):
        layer.set_device(2)
    accel.allocate(100)
    meter = MemoryMeter(layer, None)
    assert meter.kind == "allocator"
    with meter.track():
        accel.allocate(50)
        accel.allocate(-120)
    assert meter.peak_bytes() == 150
    with meter.track():
        accel.allocate(10)
    assert meter.peak_bytes() == 40


def test_unusable_device_requests_are_user_errors():
    with pytest.raises(UserError, match="training.device' = 'npu' but torch_npu is not installed"):
        select_device("npu", npu_module_loader=_missing_torch_npu)
    no_npu = types.SimpleNamespace(npu=types.SimpleNamespace(is_available=lambda: False, device_count=lambda: 0))
    with pytest.raises(UserError, match="torch_npu sees no NPU"):
        select_device("npu", npu_module_loader=lambda: no_npu)
    assert select_device("auto", npu_module_loader=lambda: no_npu).type == "cpu"

    def broken():
        raise ImportError("libhccl.so: cannot open shared object file")

    with pytest.raises(UserError, match="installed but failed to import .*libhccl.so.*set_env.sh"):
        select_device("auto", npu_module_loader=broken)
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="training.device' = 'cuda' but torch.cuda.is_available\\(\\) is False"):
            select_device("cuda")
    with pytest.raises(UserError, match="'tpu' is not one of"):
        select_device("tpu")


def test_cpu_fused_adamw_support_matches_torch():
    """The probe is cached per process; the npu fixture renames torch's privateuse1 backend for good, after which
    torch's CPU fused AdamW refuses to run: probe afresh, as a process that imported torch_npu would."""
    _cpu_fused_adamw_runs.cache_clear()
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    error = None
    try:
        torch.optim.AdamW([param], fused=True).step()
    except (RuntimeError, NotImplementedError) as raised:
        error = raised
    assert select_device("cpu").has_fused_adamw() is (error is None), error


# ---------------------------------------------------------------------------------------------------------------
# Process group and mesh
# ---------------------------------------------------------------------------------------------------------------


def test_parallel_dims():
    dims = build_parallel_dims(ParallelConfig(), 1)
    assert dims == ParallelDims(world_size=1, dp_replicate=1, dp_shard=1, cp_ring=1, cp_ulysses=1, ep=1)
    assert not (dims.hsdp_enabled or dims.cp_enabled or dims.ep_enabled)
    dims = build_parallel_dims(ParallelConfig(data_parallel_replicate_size=2), 8)
    assert (dims.dp_shard, dims.cp, dims.dp, dims.fsdp_size, dims.efsdp) == (4, 1, 8, 4, 4) and dims.hsdp_enabled
    dims = ParallelDims(world_size=16, dp_replicate=2, dp_shard=2, cp_ring=2, cp_ulysses=2, ep=2)
    assert (dims.cp, dims.dp, dims.fsdp_size, dims.efsdp) == (4, 4, 8, 4)
    assert dims.cp_ring_enabled and dims.cp_ulysses_enabled and dims.ep_enabled
    with pytest.raises(
        UserError, match="'parallel.data_parallel_replicate_size' = 3 needs a multiple of 3 .* world size 4"
    ):
        build_parallel_dims(ParallelConfig(data_parallel_replicate_size=3), 4)
    # Ulysses 2 on one process: the key the user set is named, not one left at its default
    with pytest.raises(UserError, match="^Config key 'parallel.ulysses_parallel_size' = 2 needs a multiple of 2") as e:
        build_parallel_dims(ParallelConfig(ulysses_parallel_size=2), 1)
    assert "data_parallel_replicate_size" not in str(e.value)
    with pytest.raises(UserError, match="'parallel.data_parallel_replicate_size' = 3 needs a multiple of 6 "):
        build_parallel_dims(ParallelConfig(data_parallel_replicate_size=3, ring_attention_size=2), 4)
    with pytest.raises(ValueError, match="inconsistent"):
        ParallelDims(world_size=4, dp_replicate=1, dp_shard=2, cp_ring=1, cp_ulysses=1, ep=1)
    with pytest.raises(ValueError, match="inconsistent"):
        ParallelDims(world_size=4, dp_replicate=1, dp_shard=4, cp_ring=1, cp_ulysses=1, ep=3)


@pytest.fixture
def clean_dist_env(monkeypatch):
    for name in DIST_VARS:
        monkeypatch.delenv(name, raising=False)
    yield
    shutdown()


def test_single_process_group_and_mesh(clean_dist_env):
    env = detect_dist_env({})
    layer = select_device("cpu")
    init_distributed(env, layer)
    assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_backend() == "gloo"
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and int(os.environ["MASTER_PORT"]) > 0
    assert os.environ["RANK"] == "0" and os.environ["LOCAL_WORLD_SIZE"] == "1"
    init_distributed(env, layer)  # idempotent
    with pytest.raises(RuntimeError, match="already exists as rank 0 of 1"):
        init_distributed(DistEnv(1, 0, 2, 2, "h", 1, "torchrun"), layer)

    meshes = ParallelMeshes(build_parallel_dims(ParallelConfig(), 1), "cpu")
    assert meshes.world.mesh_dim_names == ("dp_replicate", "dp_shard", "cp_ring", "cp_ulysses")
    assert meshes.world.shape == (1, 1, 1, 1)  # one-rank dims stay in the mesh
    for name in ("dp", "fsdp", "cp", "cp_ring", "cp_ulysses", "dp_replicate", "efsdp", "ep", "dense_shard"):
        view = getattr(meshes, name)
        assert view.ndim == 1 and dist.get_process_group_ranks(view.get_group()) == [0], name
    assert meshes.expert.mesh_dim_names == ("dp_replicate", "efsdp", "ep")

    shutdown()
    assert not dist.is_initialized()
    shutdown()


# (dp_replicate, dp_shard, cp_ring, cp_ulysses, ep) on 4 ranks -> the ranks of this rank's group in each view
MESH_LAYOUTS = {
    "hsdp 2x2, ep 2": (
        (2, 2, 1, 1, 2),
        {"dp": "0123", "fsdp": "01|23", "cp": "0|1|2|3", "dp_replicate": "02|13", "ep": "01|23", "efsdp": "0|1|2|3"},
    ),
    "ring 2 x ulysses 2": (
        (1, 1, 2, 2, 1),
        {"dp": "0|1|2|3", "fsdp": "0123", "cp": "0123", "cp_ring": "02|13", "cp_ulysses": "01|23", "efsdp": "0123"},
    ),
    "dp 2 x ulysses 2, ep 4": (
        (1, 2, 1, 2, 4),
        {"dp": "02|13", "fsdp": "0123", "cp": "01|23", "cp_ulysses": "01|23", "ep": "0123", "efsdp": "0|1|2|3"},
    ),
}


def _group_of(rank: int, groups: str) -> list[int]:
    return next([int(r) for r in group] for group in groups.split("|") if str(rank) in group)


def _mesh_worker(rank: int, port: int) -> None:
    """One of 4 gloo ranks: every mesh view of several layouts, the HSDP shard mesh, and one FSDP2 step on it
    under the memory meter."""
    from conftest import end_worker
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    for name in DIST_VARS:
        os.environ.pop(name, None)
    layer = select_device("cpu")
    init_distributed(DistEnv(rank, rank, 4, 4, "127.0.0.1", port, "torchrun"), layer)
    for sizes, views in MESH_LAYOUTS.values():
        meshes = ParallelMeshes(ParallelDims(4, *sizes), "cpu")
        assert meshes.world.shape == sizes[:4]
        for name, groups in views.items():
            ranks = dist.get_process_group_ranks(getattr(meshes, name).get_group())
            assert ranks == _group_of(rank, groups), (sizes, name, ranks)
        total = torch.ones(1)
        dist.all_reduce(total, group=meshes.ep.get_group())  # the groups work, not only exist
        assert total.item() == sizes[4]

    meshes = ParallelMeshes(ParallelDims(4, 2, 2, 1, 1, 1), "cpu")
    hsdp = meshes.dense_shard
    assert hsdp.mesh_dim_names == ("dp_replicate", "fsdp") and hsdp.mesh.tolist() == [[0, 1], [2, 3]]
    assert meshes.expert_shard.mesh_dim_names == ("dp_replicate", "efsdp")
    set_seed(0, layer)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    for layer_module in (model[0], model[2], model):
        fully_shard(layer_module, mesh=hsdp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meter = MemoryMeter(layer, True)
    params = list(model.parameters())
    with meter.track(params):
        model(torch.randn(4, 16)).square().mean().backward()
        optimizer.step()
    sharded_param_bytes = sum(p.to_local().nbytes for p in params)
    # unsharded parameters, gradients and Adam's two states all appear during the step
    assert meter.peak_bytes() > 3 * sharded_param_bytes
    end_worker()


def test_four_gloo_ranks_meshes_and_hsdp():
    spawn(_mesh_worker, args=(free_port(),), nprocs=4)


# ---------------------------------------------------------------------------------------------------------------
# Seeding and deterministic mode
# ---------------------------------------------------------------------------------------------------------------


def _draw() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_set_seed_reproduces_every_generator(npu):
    layer, accel = npu
    set_seed(11, layer)
    first = _draw()
    set_seed(11, layer)
    assert _draw() == first
    set_seed(12, layer)
    assert _draw() != first
    assert accel.calls[-3:] == [("manual_seed_all", 11), ("manual_seed_all", 11), ("manual_seed_all", 12)]


def test_set_deterministic(npu, monkeypatch):
    layer, _ = npu
    monkeypatch.delenv("HCCL_DETERMINISTIC", raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    try:
        set_deterministic(True, layer)
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["HCCL_DETERMINISTIC"] == "true"
    finally:
        set_deterministic(False, layer)
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic


# ---------------------------------------------------------------------------------------------------------------
# Memory meter (cpu: tracked tensor storages)
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def meter():
    return MemoryMeter(select_device("cpu"), True)


def _bytes(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def test_meter_exact_sequence(meter):
    assert meter.kind == "tracked-tensors"
    with meter.track():
        first = _bytes(MiB)
        second = _bytes(2 * MiB)
        del first
        third = _bytes(MiB // 2)
    assert meter.peak_bytes() == 3 * MiB
    del second, third
    with meter.track():
        first = _bytes(MiB)
        second = _bytes(2 * MiB)
        del first
        third = _bytes(3 * MiB // 2)  # fits in what `first` gave back: 2 + 1.5, not 1 + 2 + 1.5
    assert meter.peak_bytes() == 2 * MiB + 3 * MiB // 2
    del second, third
    with meter.track():
        from_data = torch.tensor([1.0] * 1024)  # built outside the dispatcher, then handed to it by lift_fresh
    assert meter.peak_bytes() == 4 * 1024
    del from_data


def test_meter_views_do_not_double_count_and_resize_frees(meter):
    with meter.track():
        base = _bytes(2 * MiB)
        views = [base.view(2, -1), base[: MiB // 4], base.view(torch.int32), base.as_strided((4,), (1,)), base.t()]
        views.append(views[0].transpose(0, 1).detach())
        assert sum(v.untyped_storage().nbytes() for v in views) > 2 * MiB
        base.untyped_storage().resize_(0)  # how FSDP2 frees unsharded parameters
        later = _bytes(MiB)
    assert meter.peak_bytes() == 2 * MiB
    del views, later


def test_meter_counts_roots_but_not_other_earlier_tensors(meter):
    root = _bytes(MiB)
    bystander = _bytes(4 * MiB)
    with meter.track([root, root.view(2, -1)]):
        doubled = root * 2
        bystander.add_(1)  # in place on a tensor from before the step: not an allocation
        window = bystander[:10]
    assert meter.peak_bytes() == 2 * MiB
    with meter.track():
        doubled = root * 2
    assert meter.peak_bytes() == MiB
    del doubled, window


class ScratchWrapper(torch.Tensor):
    """A wrapper subclass like DTensor: its ops unwrap, run on the inner tensor and use a 1 MiB scratch buffer."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    def __init__(self, inner):
        self.inner = inner

    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return ScratchWrapper(inner_tensors["inner"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        scratch = _bytes(MiB)
        del scratch
        unwrapped = [a.inner if isinstance(a, ScratchWrapper) else a for a in args]
        return ScratchWrapper(func(*unwrapped, **(kwargs or {})))


def test_meter_sees_inside_wrapper_subclasses(meter):
    wrapped = ScratchWrapper(torch.zeros(1024, dtype=torch.uint8))
    with meter.track([wrapped]):
        result = wrapped + 1
    assert meter.peak_bytes() == 1024 + MiB
    assert isinstance(result, ScratchWrapper) and result.inner.untyped_storage().nbytes() == 1024


def test_meter_keeps_autograd_saved_activations_until_backward(meter):
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128))
    params = list(mlp.parameters())
    param_bytes = sum(p.nbytes for p in params)
    x = torch.randn(256, 128)
    activation_bytes = 2 * 256 * 512 * 4  # the first Linear's output and GELU's output, saved for backward
    assert activation_bytes > param_bytes  # so that the gradients alone cannot explain the peak below
    with meter.track(params):
        mlp(x).square().mean().backward()
    assert meter.peak_bytes() >= param_bytes + activation_bytes

    big = 4 * MiB  # larger than anything the forward or backward allocates
    for keep_graph in (True, False):
        for p in params:
            p.grad = None
        with meter.track(params):
            with torch.set_grad_enabled(keep_graph):
                loss = mlp(x).square().mean()
            held = _bytes(big)  # allocated while the graph (if any) holds the activations
            del held
            if keep_graph:
                loss.backward()  # frees the activations; the gradients (smaller) take their place
            del loss
            after = _bytes(big)
        expected = param_bytes + big + (activation_bytes if keep_graph else 0)
        assert expected <= meter.peak_bytes() < expected + 256 * 1024
        del after


def test_meter_off_and_no_nesting(meter):
    off = MemoryMeter(select_device("cpu"), None)
    assert off.kind == "off"
    with off.track():
        _bytes(MiB)
    assert off.peak_bytes() == 0
    inner = MemoryMeter(select_device("cpu"), True)
    with meter.track(), pytest.raises(RuntimeError, match="does not nest"), inner.track():
        pass
    with meter.track():  # the failed inner entry left nothing behind
        _bytes(MiB)
    assert meter.peak_bytes() == MiB and torch.UntypedStorage.resize_ is _ORIGINAL_RESIZE


def test_cpu_threads_leave_a_core_and_split_the_rest_over_local_ranks(monkeypatch):
    from glm45v_fsdp.runtime.threads import configure_cpu_threads, default_threads

    assert [default_threads(cores, ranks) for cores, ranks in [(1, 1), (2, 1), (2, 2), (16, 8), (128, 8), (64, 1)]] == [
        1,
        1,
        1,
        1,
        15,
        63,
    ]
    before = torch.get_num_threads()
    try:
        assert configure_cpu_threads(1, {"OMP_NUM_THREADS": "3"}).endswith("(OMP_NUM_THREADS=3)")
        assert torch.get_num_threads() == before  # the user's setting is left alone
        monkeypatch.setattr("glm45v_fsdp.runtime.threads.usable_cores", lambda: 9)
        assert configure_cpu_threads(2, {}).startswith("CPU threads: 4 per process (9 usable core(s), 2 process(es)")
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)


def test_a_failed_collective_that_names_a_peer_address_is_named_by_node(monkeypatch):
    """gloo's error names the peer's address; the trainer logs which node and ranks that is (runtime/topology.py)."""
    import socket

    from glm45v_fsdp.runtime import topology

    here = socket.gethostname()
    peers = {"10.214.16.11": (here, [0, 1]), "10.214.16.12": ("node1", [2, 3])}
    monkeypatch.setattr(topology, "_peers", peers)
    gloo = "[../gloo/transport/tcp/pair.cc:537] Read error [10.214.16.12]:57984: Connection reset by peer."
    assert topology.lost_peer(gloo) == (
        "lost the connection to node1 (10.214.16.12, rank(s) 2-3): that node's processes died or its network went down"
    )
    assert topology.lost_peer("Read error [10.214.16.11]:1: Connection reset by peer") is None  # this node
    assert topology.lost_peer("Read error [10.214.16.1234]:1") is None and topology.lost_peer("no address") is None


def test_an_attempt_is_named_alike_on_every_rank_and_never_by_a_dead_attempts_keys():
    """torchrun's store outlives a restarted job: the dead attempt left its token and its echoes there (and a rank
    that reads the store before the new rank 0 does sees that token first); every rank of the new attempt still
    agrees on the new token, which differs from the old one."""
    import threading
    from datetime import timedelta

    from glm45v_fsdp.runtime.attempt import TOKEN_KEY, attempt_prefix

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=30)
    server.set(TOKEN_KEY, "deadbeef")  # the dead attempt's token and echoes
    for rank in (1, 2):
        server.set(f"glm45v/deadbeef/ready/{rank}", "old")
        server.set(f"glm45v/deadbeef/echo/{rank}", "old")
    prefixes: dict[int, str] = {}

    def join(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", port, is_master=False)
        prefixes[rank] = attempt_prefix(client, rank, 3, timeout)

    late = [threading.Thread(target=join, args=(rank,)) for rank in (1, 2)]
    for thread in late:
        thread.start()
    time.sleep(1.0)  # ranks 1 and 2 have read the dead attempt's token by now
    prefixes[0] = attempt_prefix(server, 0, 3, timeout)
    for thread in late:
        thread.join(60)
    assert len(prefixes) == 3 and len(set(prefixes.values())) == 1, prefixes
    assert prefixes[0] != "glm45v/deadbeef"
    assert attempt_prefix(server, 0, 1, timeout) != prefixes[0]  # the next attempt gets a key space of its own
