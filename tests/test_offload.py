"""Activation offload plan: pack/unpack round trip, what stays on the device, statistics, prefetch order (also through
a stand-in accelerator layer with streams and events), composition with recompute, and OFF/ON training parity (alone
and combined with chunk loss and recompute; 1 and 2 ranks)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import PARITY, mean_relative_error, read_metrics, train
from torch import nn

from glm45v_fsdp.config import ActivationOffloadConfig, ModelConfig, RecomputeConfig, load_config
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.memory.offload import OffloadRuntime, apply_activation_offload, find_offload_runtime
from glm45v_fsdp.memory.recompute import apply_recompute
from glm45v_fsdp.model import build_meta_model, load_hf_config, materialize
from glm45v_fsdp.runtime.device import DeviceLayer

CPU = DeviceLayer("cpu", "gloo")


def runtime(min_bytes: int = 0, device=CPU) -> OffloadRuntime:
    return OffloadRuntime(ActivationOffloadConfig(enabled=True, min_tensor_bytes=min_bytes), device)


def finish(rt: OffloadRuntime, group) -> None:
    """End a module call and start the next one: the finished call's tensors go to host memory."""
    rt.end(group, None)
    rt.begin("next")


def test_pack_unpack_round_trip_is_bit_identical():
    rt = runtime()
    group = rt.begin("m")
    tensors = (torch.randn(6, 10), torch.randn(10, 6).t(), torch.randn(4, 8).to(torch.bfloat16), torch.arange(9))
    handles = [rt.pack(group, set(), tensor) for tensor in tensors]
    finish(rt, group)
    for tensor, handle in zip(tensors, handles):
        assert not isinstance(handle, torch.Tensor) and handle.record.host is not None, "moved to host memory"
        assert handle.record.pending is None
        back = rt.unpack(handle)
        assert back.data_ptr() != tensor.data_ptr()
        assert back.dtype == tensor.dtype and back.shape == tensor.shape and back.stride() == tensor.stride()
        assert torch.equal(back, tensor)


def test_parameters_views_casts_buffers_and_small_tensors_stay():
    rt = runtime(min_bytes=1024)
    group = rt.begin("m")
    weight = nn.Parameter(torch.randn(32, 32))
    unsharded = torch.randn(32, 32)  # FSDP2's gathered parameter: the module holds its storage during forward
    storages = {unsharded.untyped_storage().data_ptr()}
    kept = [
        weight,
        weight.t(),  # what linear saves
        weight.to(torch.bfloat16).t(),  # autocast's cached cast
        unsharded[:, :16],
        torch.randn(16),  # 64 bytes < 1024
        torch.randn(0, 512),
    ]
    for tensor in kept:
        assert rt.pack(group, storages, tensor) is tensor
    activation = torch.randn(32, 32, requires_grad=True) * 2
    handle = rt.pack(group, storages, activation)  # autograd would hold it until backward
    assert not isinstance(handle, torch.Tensor)
    finish(rt, group)
    stats = rt.take()
    assert stats["offload_kept_tensors"] == len(kept) and stats["offload_tensors"] == 1


def test_statistics_count_bytes_once_per_tensor_and_reset():
    rt = runtime()
    group = rt.begin("m")
    tensor = torch.randn(100, 10)  # 4000 bytes
    first, second = rt.pack(group, set(), tensor), rt.pack(group, set(), tensor)  # saved twice: one copy
    assert first.record is second.record
    other = rt.pack(group, set(), torch.randn(50))
    finish(rt, group)
    rt.unpack(first)
    rt.unpack(second)
    rt.unpack(other)
    stats = rt.take()
    assert stats["offload_tensors"] == 2
    assert stats["offload_bytes_out"] == stats["offload_bytes_in"] == 4000 + 200
    assert stats["offload_prefetched"] == 2 and stats["offload_late"] == 0
    assert rt.take()["offload_tensors"] == 0


def test_the_last_call_before_backward_keeps_its_tensors_in_place():
    rt = runtime()
    group = rt.begin("m")
    tensor = torch.randn(100, 10)
    handle = rt.pack(group, set(), tensor)
    rt.end(group, None)
    assert rt.unpack(handle) is tensor  # backward came before another planned call: never copied
    stats = rt.take()
    assert stats["offload_tensors"] == 0 and stats["offload_stayed_tensors"] == 1


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x)) * x


class Chain(nn.Module):
    def __init__(self, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def chain_with_offload(device=CPU, depth: int = 2, recompute: RecomputeConfig | None = None):
    torch.manual_seed(0)
    model = Chain(depth)
    if recompute is not None:
        apply_recompute(model, recompute)
    cfg = ActivationOffloadConfig(enabled=True, apply_modules=["blocks.{*}"], min_tensor_bytes=0)
    matches = apply_activation_offload(model, cfg, device)
    assert [m.names for m in matches] == [tuple(f"blocks.{i}" for i in range(depth))]
    return model, find_offload_runtime(model)


def test_prefetch_brings_back_the_previous_module_when_a_modules_backward_starts():
    model, rt = chain_with_offload(depth=3)
    rt.trace = []
    x = torch.randn(8, 16, requires_grad=True)
    model(x * 1).sum().backward()
    events = rt.trace
    first = {e: events.index(e) for e in dict.fromkeys(events)}
    last = {e: i for i, e in enumerate(events)}
    b0, b1, b2 = "blocks.0", "blocks.1", "blocks.2"
    # forward: a call's tensors go to the host when the next planned call starts; the last call's stay
    assert last["pack", b0] < first["copy_out", b0] <= last["copy_out", b0] < first["pack", b1]
    assert last["pack", b1] < first["copy_out", b1] <= last["copy_out", b1] < first["pack", b2]
    assert ("copy_out", b2) not in first and ("fetch", b2) not in first
    # backward: block 2's backward starts -> block 1 comes back before block 2 needs anything; block 1's backward
    # starts (after block 2's) -> block 0 comes back before block 1 unpacks
    assert last["pack", b2] < first["fetch", b1] <= last["fetch", b1] < first["unpack", b2]
    assert last["unpack", b2] < first["fetch", b0] <= last["fetch", b0] < first["unpack", b1]
    assert last["unpack", b1] < first["unpack", b0]
    stats = rt.take()
    assert stats["offload_tensors"] > 0 and stats["offload_late"] == 0 and stats["offload_stayed_tensors"] > 0
    assert stats["offload_prefetched"] == stats["offload_tensors"]


class FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait_event", self.name))


class FakeEvent:
    def __init__(self, timing: bool) -> None:
        self.timing = timing

    def record(self, stream: FakeStream) -> None:
        self.stream = stream

    def query(self) -> bool:
        return False  # every copy is "still running" when it is needed: each unpack stalls

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: FakeEvent) -> float:
        return 1.5


class FakeAccelerator:
    """The DeviceLayer's stream/event surface over cpu tensors: runs the accelerator branch of the plan."""

    type = "cpu"
    has_streams = True
    pin_memory = False

    def __init__(self) -> None:
        self.log: list = []
        self.main = FakeStream("main", self.log)
        self.streams_made = 0

    def new_stream(self) -> FakeStream:
        self.streams_made += 1
        return FakeStream("side", self.log)

    def current_stream(self) -> FakeStream:
        return self.main

    def use_stream(self, stream):
        self.log.append(("use", stream.name))
        return contextlib.nullcontext()

    def new_event(self, timing: bool = False) -> FakeEvent:
        return FakeEvent(timing)

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        self.log.append(("record_stream", stream.name))


def test_accelerator_path_orders_copies_on_a_side_stream_and_times_stalls():
    fake = FakeAccelerator()
    model, rt = chain_with_offload(device=fake, depth=3)
    reference, _ = chain_with_offload(depth=3)
    x = torch.randn(8, 16)
    grads = []
    for net in (model, reference):
        inputs = x.clone().requires_grad_()
        net(inputs * 1).square().sum().backward()
        grads.append([inputs.grad, *(p.grad for p in net.parameters())])
    for got, want in zip(*grads):
        assert torch.equal(got, want)
    stats = rt.take()
    moved = stats["offload_tensors"]
    assert moved > 0 and fake.streams_made == 1
    assert fake.log.count(("wait_stream", "side", "main")) == 2  # copies out of a call wait for its work
    assert fake.log.count(("record_stream", "side")) == moved  # device blocks freed only after the copy out
    assert fake.log.count(("record_stream", "main")) == stats["offload_prefetched"] == moved  # copies back
    stalls = fake.log.count(("wait_event", "main"))
    assert stalls >= moved and stats["offload_wait_ms"] == pytest.approx(1.5 * stalls)


def layer_stack_grads(offload: bool, recompute: RecomputeConfig | None, min_bytes: int = 0):
    model = build_meta_model(load_hf_config(ModelConfig()))
    if recompute is not None:
        apply_recompute(model, recompute)
    if offload:
        apply_activation_offload(model, ActivationOffloadConfig(enabled=True, min_tensor_bytes=min_bytes), CPU)
    materialize(model, torch.device("cpu"), seed=5)
    torch.manual_seed(3)
    hidden = torch.randn(2, 12, 64, requires_grad=True)
    position = torch.arange(12).expand(3, 2, 12)
    text = model.model.language_model
    cos_sin = text.rotary_emb(hidden, position)
    out = hidden * 1
    for layer in text.layers:
        out = layer(out, position_embeddings=cos_sin, attention_mask=None, position_ids=position)
    out.square().sum().backward()
    grads = [hidden.grad] + [p.grad for p in text.layers.parameters()]
    return grads, find_offload_runtime(model)


RECOMPUTE_VARIANTS = {
    "none": None,
    "full": RecomputeConfig(enabled=True),
    "selective": RecomputeConfig(enabled=True, granularity="selective"),
    "reentrant": RecomputeConfig(enabled=True, use_reentrant=True),
}


@pytest.mark.parametrize("variant", list(RECOMPUTE_VARIANTS))
def test_gradients_equal_without_offload_alone_and_nested_with_recompute(variant):
    recompute = RECOMPUTE_VARIANTS[variant]
    reference, _ = layer_stack_grads(offload=False, recompute=recompute)
    grads, rt = layer_stack_grads(offload=True, recompute=recompute)
    for got, want in zip(grads, reference):
        assert got is not None and torch.equal(got, want)
    stats = rt.take()
    if recompute is None:
        assert stats["offload_tensors"] > 40  # every activation of the 4 layers, not only their inputs
    else:
        assert stats["offload_tensors"] == 3  # a checkpointed layer saves its input only; the last layer's stays
        assert stats["offload_stayed_tensors"] == 1
    # The router's index tensors are saved by graph pieces that die within forward (their output, the top-k
    # indices, needs no gradient): copied out, never back.
    assert 0 < stats["offload_bytes_in"] <= stats["offload_bytes_out"] and stats["offload_late"] == 0


def test_default_minimum_keeps_the_tiny_models_small_activations():
    _, rt = layer_stack_grads(offload=True, recompute=None, min_bytes=ActivationOffloadConfig().min_tensor_bytes)
    stats = rt.take()
    assert stats["offload_tensors"] == 0 and stats["offload_kept_tensors"] > 0


def test_cpu_device_layer_has_no_streams_and_config_names_bad_values():
    assert not CPU.has_streams and not CPU.pin_memory
    assert CPU.new_stream() is None and CPU.current_stream() is None and CPU.new_event(timing=True) is None
    with CPU.use_stream(None):
        CPU.record_stream(torch.ones(2), None)
    with pytest.raises(UserError, match="'features.activation_offload.min_tensor_bytes' = -1 is invalid"):
        load_config(None, ["features.activation_offload.min_tensor_bytes=-1"])
    with pytest.raises(UserError, match="features.activation_offload.apply_modules"):
        load_config(None, ["features.activation_offload.enabled=true", "features.activation_offload.apply_modules=[]"])
    with pytest.raises(UserError, match="features.activation_offload.apply_modules"):
        apply_activation_offload(
            build_meta_model(load_hf_config(ModelConfig())),
            ActivationOffloadConfig(enabled=True, apply_modules=["model.no_such.{*}"]),
            CPU,
        )


# ---- training parity ---------------------------------------------------------------------------------------------
OFFLOAD = ["features.activation_offload.enabled=true", "features.activation_offload.min_tensor_bytes=0"]
MODES = {
    "offload": OFFLOAD,
    "combined": OFFLOAD + ["features.chunk_loss.mode=static", "features.recompute.enabled=true"],
}


@pytest.fixture(scope="module")
def parity_runs(tmp_path_factory):
    """The four ON runs (2 modes x 1 and 2 ranks); the OFF runs come from the shared `parity_off` fixture."""
    root = tmp_path_factory.mktemp("offload")
    runs = {}
    for nproc, mode in [(nproc, mode) for nproc in (1, 2) for mode in MODES]:
        result = train(root / f"{mode}_{nproc}", PARITY + MODES[mode], nproc)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[nproc, mode] = result.stdout, read_metrics(root / f"{mode}_{nproc}")
    return runs


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("mode", ["offload", "combined"])
def test_offload_on_off_parity(parity_runs, parity_off, nproc, mode):
    off = parity_off(nproc)
    stdout, on = parity_runs[nproc, mode]
    assert off[0]["loss"] != off[-1]["loss"]
    assert "[plan activation_offload] 2 pattern(s)" in stdout
    assert "activation offload on cpu moves" in stdout and "saves no device memory" in stdout
    assert mean_relative_error([r["loss"] for r in on], [r["loss"] for r in off]) <= 1e-6
    assert mean_relative_error([r["grad_norm"] for r in on], [r["grad_norm"] for r in off]) <= 1e-5
    for record in on:
        assert record["offload_tensors"] > 0 and record["offload_bytes_out"] > 0 and record["offload_bytes_in"] > 0
        assert record["offload_late"] == 0 and record["offload_wait_ms"] >= 0
        if mode == "combined":  # recompute: the 6 planned modules save their inputs only; the last one's stays
            assert record["offload_tensors"] == 5 and record["offload_stayed_tensors"] == 1
    assert "offload_tensors" not in off[0]


def test_offload_with_expert_parallel_keeps_the_expert_shards_and_matches_off(tmp_path):
    """EP 2 without recompute: the grouped GEMM saves the transposed local shard of each expert stack (a DTensor
    parameter's to_local(), FSDP2's unsharded storage that the unit frees after forward). Offload must leave it in
    place: copying it out after the reshard read freed memory and crashed the ranks."""
    base = PARITY + ["parallel.expert_parallel_size=2"]
    off, on = train(tmp_path / "off", base, 2), train(tmp_path / "on", base + OFFLOAD, 2)
    assert off.returncode == 0, off.stderr[-3000:]
    assert on.returncode == 0, on.stderr[-3000:]
    off_records, on_records = read_metrics(tmp_path / "off"), read_metrics(tmp_path / "on")
    assert mean_relative_error([r["loss"] for r in on_records], [r["loss"] for r in off_records]) <= 1e-6
    assert all(record["offload_tensors"] > 0 for record in on_records)
