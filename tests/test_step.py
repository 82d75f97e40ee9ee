"""The end-of-step object both doors share (glm45v_fsdp/step.py), and the plan registry that build and preflight
read."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
from conftest import free_port
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

from glm45v_fsdp.parallel.local_shards import grad_norm
from glm45v_fsdp.plans import PLANS
from glm45v_fsdp.step import OptimizerStep
from glm45v_fsdp.tools.preflight import main as preflight_main


@pytest.fixture
def one_rank_group(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_grad_norm_is_combined_over_meshes(one_rank_group):
    """Gradients on two meshes (dense and expert) and plain ones: each group's norm, then the root of the squares."""
    dense, expert = (init_device_mesh("cpu", (1,), mesh_dim_names=(name,)) for name in ("fsdp", "ep"))
    values = [torch.full((3,), 1.0), torch.full((4,), 2.0), torch.full((2,), 3.0)]
    params = []
    for value, mesh in zip(values, (dense, expert, None)):
        param = torch.nn.Parameter(torch.zeros_like(value))
        param.grad = distribute_tensor(value, mesh, [Replicate()]) if mesh is not None else value.clone()
        params.append(param)
    expected = math.sqrt(sum(float(v.square().sum()) for v in values))
    assert grad_norm(params) == pytest.approx(expected, rel=1e-6)  # fp32 norms
    assert grad_norm(params[:1]) == pytest.approx(math.sqrt(3.0), rel=1e-6)


def test_step_clips_skips_and_runs_hooks_in_order():
    param = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([param], lr=1.0)
    events = []
    step = OptimizerStep([param], optimizer, clip=1.0, on_skip=lambda loss, outcome: events.append(("skip", loss)))
    step.post_backward_hooks.append(lambda: events.append("hook"))
    param.grad = torch.full((4,), 3.0)  # norm 6 -> clipped to 1
    outcome = step.finish(loss=1.0)
    assert outcome.stepped and outcome.grad_norm == pytest.approx(6.0)
    assert torch.allclose(param.detach(), torch.full((4,), -0.5), atol=1e-6) and param.grad is None
    param.grad = torch.full((4,), 1.0)
    outcome = step.finish(loss=float("nan"))
    assert not outcome.stepped and outcome.grad_norm == pytest.approx(2.0)
    assert events[:2] == ["hook", "hook"] and events[2][0] == "skip" and math.isnan(events[2][1])
    assert torch.allclose(param.detach(), torch.full((4,), -0.5), atol=1e-6)  # a skipped step moves nothing


def test_preflight_lists_the_registry_in_order(capsys):
    assert preflight_main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [plan["plan"] for plan in report["plans"]] == [plan.name for plan in PLANS]
    assert [plan.name for plan in PLANS] == [
        "moe",
        "ops",
        "freeze",
        "lora",
        "recompute",
        "activation_offload",
        "chunk_loss",
        "expert_parallel",
        "context_parallel",
        "fsdp",
        "weights",
    ]
    enabled = {plan["plan"]: plan for plan in report["plans"] if plan["enabled"]}
    assert set(enabled) == {"moe", "ops", "fsdp", "weights"} and all(plan["describe"] for plan in enabled.values())
