"""The end of a step on FSDP2's local shards (glm45v_fsdp/parallel/local_shards.py) gives DTensor's figures: the same
parameters after several optimizer steps (bit for bit), the same global norm, optimizer states that stay DTensors
(DCP's optimizer state dict reads them), on FSDP and HSDP meshes with uneven shards (2 gloo ranks)."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from conftest import end_worker, free_port, spawn
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Shard

from glm45v_fsdp.parallel.local_shards import grad_norm, optimizer_step

OPTIMIZERS = {
    "AdamW": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True),
    "Adam amsgrad": lambda params: torch.optim.Adam(params, lr=1e-2, amsgrad=True, foreach=True),
    "SGD momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=True),
    "Adagrad": lambda params: torch.optim.Adagrad(params, lr=1e-2, foreach=True),
}
MESHES = {"fsdp 2": ((2,), ("shard",)), "hsdp 2x1": ((2, 1), ("replicate", "shard")), "hsdp 1x2": ((1, 2), ("r", "s"))}


class AdamWSubclass(torch.optim.AdamW):
    """A user's subclass: not known to be elementwise, so it keeps DTensor's path."""


def model_on(mesh) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3), nn.Linear(3, 1))  # 5 and 3 rows: uneven
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(mesh, make_optimizer, local: bool) -> tuple[nn.Module, torch.optim.Optimizer, list[float]]:
    model = model_on(mesh)
    optimizer = make_optimizer(list(model.parameters()))
    norms = []
    for step in range(4):
        torch.manual_seed(100 + step + dist.get_rank())
        model(torch.randn(4, 6)).square().mean().backward()
        params = list(model.parameters())
        if local:
            norms.append(grad_norm(params))
            optimizer_step(optimizer)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
            norms.append(float(norm.full_tensor()))
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer, norms


def _worker(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = {}
    cases = [(m, o, OPTIMIZERS[o]) for m in MESHES for o in OPTIMIZERS]
    cases.append(("fsdp 2", "AdamW subclass", lambda params: AdamWSubclass(params, lr=1e-2)))
    for mesh_name, optimizer_name, make in cases:
        shape, names = MESHES[mesh_name]
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        reference, reference_optimizer, reference_norms = train(mesh, make, local=False)
        model, optimizer, norms = train(mesh, make, local=True)
        states = [value for state in optimizer.state.values() for value in state.values() if value.dim() > 0]
        saved = get_optimizer_state_dict(model, optimizer)["state"]
        saved_reference = get_optimizer_state_dict(reference, reference_optimizer)["state"]
        results[f"{mesh_name} {optimizer_name}"] = {
            "params_equal": all(
                torch.equal(a.full_tensor(), b.full_tensor())
                for a, b in zip(model.parameters(), reference.parameters())
            ),
            "norms": norms,
            "reference_norms": reference_norms,
            "states": len(states),
            "states_dtensor": all(isinstance(value, DTensor) for value in states),
            "state_dict_equal": saved.keys() == saved_reference.keys()
            and all(
                torch.equal(saved[name][key].full_tensor(), saved_reference[name][key].full_tensor())
                for name in saved
                for key in saved[name]
                if isinstance(saved[name][key], DTensor)
            ),
        }
    mesh = init_device_mesh("cpu", (2,))
    sharded, partial = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))
    sharded.grad = DTensor.from_local(torch.full((1,), 3.0 + rank), mesh, [Shard(0)])  # [3, 4]
    partial.grad = DTensor.from_local(torch.full((3,), 1.0), mesh, [Partial()])  # sums to [2, 2, 2]
    results["partial"] = grad_norm([sharded, partial])
    results["two meshes"] = _norm_over_two_world_meshes(rank)
    with open(f"{out}.{rank}", "w") as handle:
        json.dump(results, handle)
    end_worker()


def _norm_over_two_world_meshes(rank: int) -> dict:
    """Gradients sharded over two meshes that each span both ranks (FSDP's and EP's at ep = dp = world size): the
    norm is the full tensors' and their sums of squares travel in one all-reduce, with the trainer's scalars."""
    fsdp_mesh = init_device_mesh("cpu", (2,))
    ep_mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("efsdp", "ep"))
    dense, experts = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(2, 3))
    dense.grad = DTensor.from_local(torch.tensor([1.0, 2.0]) * (rank + 1), fsdp_mesh, [Shard(0)])  # [1, 2, 2, 4]
    experts.grad = DTensor.from_local(torch.full((1, 3), 0.5 + rank), ep_mesh, [Shard(1), Shard(0)])  # 0.5s, 1.5s
    calls = []
    all_reduce = dist.all_reduce

    def counted(*args, **kwargs):
        calls.append(1)
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counted
    found = {}
    try:
        found["norm"], found["all_reduces"] = grad_norm([dense, experts]), len(calls)
        # the trainer's loss and token count ride in the same all-reduce (their group spans the job too)
        riders = torch.tensor([1.5 + rank, 10.0], dtype=torch.float64)
        found["norm_with_riders"] = grad_norm([dense, experts], riders, dist.group.WORLD)
        found["riders"], found["all_reduces_with_riders"] = riders.tolist(), len(calls) - found["all_reduces"]
        # no reduction over the whole job to ride in: the riders take one all-reduce of their own
        plain = nn.Parameter(torch.zeros(2))
        plain.grad = torch.tensor([3.0, 4.0])
        alone = torch.tensor([1.0, 2.0 * rank], dtype=torch.float64)
        before = len(calls)
        found["plain_norm"] = grad_norm([plain], alone, dist.group.WORLD)
        found["alone"], found["all_reduces_alone"] = alone.tolist(), len(calls) - before
    finally:
        dist.all_reduce = all_reduce
    return found


def test_local_shard_step_matches_dtensor_step(tmp_path):
    spawn(_worker, args=(free_port(), str(tmp_path / "result")), nprocs=2)
    for rank in range(2):
        results = json.loads((tmp_path / f"result.{rank}").read_text())
        assert len(results) == len(MESHES) * len(OPTIMIZERS) + 3
        for case, found in results.items():
            if case == "two meshes":  # sqrt(1 + 4 + 4 + 16 + 3 * 0.25 + 3 * 2.25), one all-reduce
                assert abs(found["norm"] - 32.5**0.5) < 1e-6 and found["all_reduces"] == 1, found
                assert found["norm_with_riders"] == found["norm"] and found["all_reduces_with_riders"] == 1, found
                assert found["riders"] == [4.0, 20.0], found
                assert found["plain_norm"] == 5.0 and found["alone"] == [2.0, 2.0], found
                assert found["all_reduces_alone"] == 1, found
                continue
            if case == "partial":  # a pending partial sum is left to DTensor's norm: sqrt(9 + 16 + 3 * 4)
                assert abs(found - 37**0.5) < 1e-6, found
                continue
            assert found["params_equal"], (rank, case)
            assert found["state_dict_equal"], (rank, case)
            assert found["states"] > 0 and found["states_dtensor"], (rank, case, found)
            for norm, expected in zip(found["norms"], found["reference_norms"]):
                assert abs(norm - expected) <= 1e-6 * expected, (rank, case, found)
