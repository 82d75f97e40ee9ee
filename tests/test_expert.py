"""Expert parallelism (parallel/expert.py, expert_route.py): the route planner, both dispatchers and EP balance
against the unsplit MoE block on 4 gloo ranks (outputs, every gradient, top-k, zero-token experts and ranks,
recompute's exchanges), the sharded layout under FSDP, and 20-step training parity on 2 and 4 ranks."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import PARITY, end_worker, free_port, mean_relative_error, spawn, train, train_many
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from glm45v_fsdp.config import EpBalanceConfig, ModelConfig, RecomputeConfig, load_config
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.memory.recompute import apply_recompute
from glm45v_fsdp.model import load_hf_config
from glm45v_fsdp.model.moe import MoEBlock
from glm45v_fsdp.ops.kernels import torch_grouped_mm
from glm45v_fsdp.parallel.expert import AllToAllDispatcher, apply_expert_parallel
from glm45v_fsdp.parallel.expert_route import plan_route
from glm45v_fsdp.tools.preflight import main as preflight_main

TEXT = load_hf_config(ModelConfig()).text_config
E = TEXT.n_routed_experts

# 1. The route planner ------------------------------------------------------------------------------------------------


def check_route(counts: list[list[int]], experts_per_rank: int, max_dup: int):
    """Plans a route and checks what every route must keep; returns it."""
    route = plan_route(counts, experts_per_rank, max_dup, trigger=1.1, target=1.02)
    size = len(counts)
    for source in range(size):  # each source's pairs of each expert all go somewhere, in its expert-sorted order
        pieces = route.pieces(source)
        assert sum(p.count for p in pieces) == sum(counts[source])
        for dest in range(size):
            sent = sum(p.count for p in pieces if p.dest == dest)
            assert sent == sum(route.received(dest)[source])
    per_expert = [sum(column) for column in zip(*counts)]
    for expert, shares in route.shares.items():  # a split expert's shares add up to its pairs, owner first
        assert sum(n for _, n in shares) == per_expert[expert] and shares[0][0] == route.owner(expert)
    assert sum(route.loads_after()) == sum(route.loads_before()) == sum(per_expert)
    for rank in range(size):
        assert len(route.replicas[rank] if route.replicas else []) <= max_dup
        assert route.slots(rank) == experts_per_rank + (len(route.replicas[rank]) if route.replicas else 0)
    return route


def max_over_mean(loads: list[int]) -> float:
    return max(loads) / (sum(loads) / len(loads))


def test_route_without_balance_sends_every_pair_to_its_owner():
    counts = [[3, 0, 1, 2], [0, 5, 0, 1]]
    route = check_route(counts, experts_per_rank=2, max_dup=0)
    assert not route.balanced
    assert [(p.dest, p.slot, p.count) for p in route.pieces(0)] == [(0, 0, 3), (0, 1, 0), (1, 0, 1), (1, 1, 2)]
    assert route.received(1) == [[1, 2], [0, 1]]  # [source][slot]
    assert route.loads_before() == route.loads_after() == [8, 4]


def test_balance_evens_a_skewed_load_and_conserves_every_pair():
    counts = [[40, 30, 2, 2, 1, 1, 1, 1], [50, 20, 3, 1, 1, 2, 1, 0]]  # rank 0 owns the two hot experts
    route = check_route([row[:] for row in counts] * 2, experts_per_rank=2, max_dup=2)  # 4 ranks
    assert max_over_mean(route.loads_before()) > 3
    assert max_over_mean(route.loads_after()) <= 1.10
    assert route.replica_count() > 0 and route.balanced
    assert all(route.slot(r, e) >= 2 for r in range(4) for e in route.replicas[r])  # replicas after own experts


def test_balance_leaves_an_even_step_alone():
    """Below the trigger nothing moves: a balanced step pays nothing (no replica, no weight exchange)."""
    counts = [[10, 11, 10, 9, 10, 10, 11, 9], [9, 10, 11, 10, 10, 9, 10, 11]]
    route = check_route(counts, experts_per_rank=4, max_dup=1)
    assert not route.balanced and route.replica_count() == 0


def test_random_routes_keep_the_invariants():
    rng = random.Random(0)
    for _ in range(300):
        size, per_rank = rng.choice([2, 4, 8]), rng.choice([1, 2, 4])
        hot = rng.random() * 50
        counts = [
            [
                int(rng.random() * 20 + (hot if e < per_rank else 0) * rng.random()) * (rng.random() > 0.2)
                for e in range(size * per_rank)
            ]
            for _ in range(size)
        ]
        max_dup = rng.choice([0, 1, 2, 3])
        route = check_route(counts, per_rank, max_dup)
        if sum(map(sum, counts)):
            assert max_over_mean(route.loads_after()) <= max_over_mean(route.loads_before()) + 1e-12


# 2. The dispatchers against the unsplit block, 4 gloo ranks -----------------------------------------------------------

# name: (ep, dispatcher, balance max_dup (0: off), router skew, tokens on rank 3[, dtype])
CASES = {
    "ep4 alltoall": (4, "alltoall", 0, 0.0, 24),
    "ep4 allgather": (4, "allgather", 0, 0.0, 24),
    "ep2 alltoall": (2, "alltoall", 0, 0.0, 24),
    "ep2 allgather": (2, "allgather", 0, 0.0, 24),
    "ep4 balance skew": (4, "alltoall", 2, 1.0, 24),
    "ep2 balance skew": (2, "alltoall", 1, 1.0, 24),
    "ep4 alltoall zero-token ranks": (4, "alltoall", 0, 50.0, 24),
    "ep4 allgather zero-token ranks": (4, "allgather", 0, 50.0, 24),
    "ep4 balance zero-token ranks": (4, "alltoall", 1, 50.0, 24),
    "ep4 alltoall empty rank": (4, "alltoall", 0, 0.0, 0),
    "ep4 allgather empty rank": (4, "allgather", 0, 0.0, 0),
    "ep4 balance skew bf16": (4, "alltoall", 2, 1.0, 24, "bf16"),
    "ep4 allgather fp16": (4, "allgather", 0, 0.0, 24, "fp16"),
}
# Largest relative error allowed per dtype: fp32 is exact up to summation order; in bf16 / fp16 the expert weight
# gradients are summed in another order (one rank's grouped GEMM over every source's rows instead of a per-rank sum),
# each rounding once at the dtype's precision (bf16: 2^-8, fp16: 2^-11).
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 3e-3}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WORLD = 4


def unsplit_block(skew: float, dtype: torch.dtype = torch.float32) -> MoEBlock:
    torch.manual_seed(0)
    block = MoEBlock(TEXT)
    for param in block.parameters():
        nn.init.normal_(param, std=0.2)
    block.gate.e_score_correction_bias.normal_(std=0.1)
    block.gate.skew = skew
    block.experts.use_kernels("grouped_mm", torch_grouped_mm)
    return block.to(dtype)  # the router computes in fp32 whatever its weight's dtype; its bias buffer stays fp32


def split_block(reference: MoEBlock, ep: int, dispatcher: str, max_dup: int):
    """The same weights under expert parallelism (no FSDP): (holder module, ep mesh, efsdp mesh)."""
    mesh = init_device_mesh("cpu", (WORLD // ep, ep), mesh_dim_names=("efsdp", "ep"))
    holder = nn.Module()
    holder.mlp = MoEBlock(TEXT).to(reference.experts.gate_up_proj.dtype)
    holder.mlp.load_state_dict(reference.state_dict())
    holder.mlp.gate.skew = reference.gate.skew
    holder.mlp.experts.use_kernels("grouped_mm", torch_grouped_mm)
    balance = EpBalanceConfig(enabled=True, max_dup_experts_num=max_dup) if max_dup else None
    apply_expert_parallel(holder, ["mlp.experts"], dispatcher, balance, mesh["ep"])
    return holder, mesh["ep"], mesh["efsdp"]


def top_k_of(block: MoEBlock) -> list[torch.Tensor]:
    captured = []
    block.gate.register_forward_hook(lambda module, args, output: captured.append(output[2].clone()))
    return captured


def summed(tensor: torch.Tensor, group=None) -> torch.Tensor:
    tensor = tensor.clone()
    dist.all_reduce(tensor, group=group)
    return tensor


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item() if b.numel() else 0.0


class CountCollectives(TorchDispatchMode):
    """Counts the functional collectives that really run (a selective-checkpoint cache hit never reaches here)."""

    OPS = {
        torch.ops._c10d_functional.all_to_all_single.default,
        torch.ops._c10d_functional.all_gather_into_tensor.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
    }

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.OPS
        return func(*args, **(kwargs or {}))


def _case(
    rank: int, ep: int, dispatcher: str, max_dup: int, skew: float, tokens_rank3: int, dtype: str = "fp32"
) -> dict:
    tokens = tokens_rank3 if rank == 3 else 24
    generator = torch.Generator().manual_seed(100 + rank)
    hidden = torch.randn(1, tokens, TEXT.hidden_size, generator=generator).to(DTYPES[dtype])
    grad = torch.randn(1, tokens, TEXT.hidden_size, generator=generator).to(DTYPES[dtype])

    reference = unsplit_block(skew, DTYPES[dtype])
    reference_topk = top_k_of(reference)
    x_ref = hidden.clone().requires_grad_()
    out_ref = reference(x_ref)
    out_ref.backward(grad)
    holder, ep_mesh, efsdp_mesh = split_block(reference, ep, dispatcher, max_dup)
    block = holder.mlp
    topk = top_k_of(block)
    x = hidden.clone().requires_grad_()
    out = block(x)
    out.backward(grad)

    per_rank = E // ep
    first = ep_mesh.get_local_rank() * per_rank
    result = {
        "output": relative(out, out_ref),
        "input_grad": relative(x.grad, x_ref.grad),
        "top_k_equal": torch.equal(topk[0], reference_topk[0]),
        "finite": bool(torch.isfinite(out).all() and torch.isfinite(x.grad).all()),
        "dtype": str(out.dtype),
    }
    global_load = summed(torch.bincount(reference_topk[0].reshape(-1), minlength=E))
    for name in ("gate_up_proj", "down_proj"):
        expected = summed(getattr(reference.experts, name).grad)[first : first + per_rank]
        local = summed(getattr(block.experts, name).grad.to_local(), efsdp_mesh.get_group())
        result[f"experts.{name}"] = relative(local, expected)
        silent = (global_load[first : first + per_rank] == 0).tolist()
        result[f"silent.{name}"] = [bool(torch.count_nonzero(local[i]) == 0) for i, s in enumerate(silent) if s]
    for name, param in block.named_parameters():
        if not name.startswith("experts."):
            result[name] = relative(summed(param.grad), summed(reference.get_parameter(name).grad))
    result["silent_experts"] = int((global_load == 0).sum())
    if isinstance(block.dispatcher, AllToAllDispatcher):
        stats = block.dispatcher.take_stats()
        result["load_before"], result["load_after"] = stats.before.tolist(), stats.after.tolist()
        result["replicas"] = stats.replicas
    return result


def _exchanges(rank: int, dispatcher: str, max_dup: int, skew: float) -> dict:
    """Collectives run by backward: selective recompute keeps the dispatch's outputs, full recompute runs it again."""
    counts = {}
    for granularity in ("off", "selective", "full"):
        holder, _, _ = split_block(unsplit_block(skew), 4, dispatcher, max_dup)
        if granularity != "off":
            cfg = RecomputeConfig(enabled=True, apply_modules=["mlp"], granularity=granularity, keep_attention=False)
            apply_recompute(holder, cfg)
        hidden = torch.randn(1, 24, TEXT.hidden_size, generator=torch.Generator().manual_seed(rank), requires_grad=True)
        output = holder.mlp(hidden)
        with CountCollectives() as counter:
            output.sum().backward()
        counts[granularity] = counter.count
    return counts


def _dispatch_worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    results = {name: _case(rank, *case) for name, case in CASES.items()}
    results["exchanges alltoall"] = _exchanges(rank, "alltoall", 0, 0.0)
    results["exchanges allgather"] = _exchanges(rank, "allgather", 0, 0.0)
    results["exchanges balance"] = _exchanges(rank, "alltoall", 2, 1.0)
    Path(f"{out}.{rank}").write_text(json.dumps(results))
    end_worker()


@pytest.fixture(scope="module")
def dispatch_results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("dispatch") / "results"
    spawn(_dispatch_worker, args=(free_port(), str(out)), nprocs=WORLD)
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(WORLD)]


@pytest.mark.parametrize("case", list(CASES))
def test_split_block_equals_the_unsplit_one(dispatch_results, case):
    """Output, input gradient and every parameter gradient (each rank's experts, summed over efsdp) against the
    unsplit block on the same tokens; routing identical to EP1 (top-k indices compared)."""
    dtype = CASES[case][5] if len(CASES[case]) > 5 else "fp32"
    for rank, results in enumerate(dispatch_results):
        result = results[case]
        assert result["finite"] and result["top_k_equal"], (rank, result)
        assert result["dtype"] == str(DTYPES[dtype])
        errors = {k: v for k, v in result.items() if isinstance(v, float)}
        assert errors and max(errors.values()) < TOLERANCE[dtype], (rank, errors)
        if dtype != "fp32":  # what does not sum over ranks comes out as the unsplit block's to the dtype's precision
            assert max(result["output"], result["input_grad"]) < TOLERANCE[dtype] / 4, (rank, errors)
        assert all(result["silent.gate_up_proj"]) and all(result["silent.down_proj"]), (rank, result)


def test_zero_token_experts_and_ranks_get_zero_gradients(dispatch_results):
    """Under a strong skew every pair goes to experts 0 and 1 (rank 0's): ranks 1-3 receive nothing, their experts'
    gradients are exactly zero, and the result is still EP1's (checked above)."""
    for case in ("ep4 alltoall zero-token ranks", "ep4 allgather zero-token ranks"):
        for rank, results in enumerate(dispatch_results):
            assert results[case]["silent_experts"] == E - 2
            assert len(results[case]["silent.gate_up_proj"]) == (0 if rank == 0 else E // 4), (case, rank)
    loads = dispatch_results[0]["ep4 alltoall zero-token ranks"]["load_before"]
    assert loads[0] > 0 and loads[1:] == [0, 0, 0]


def test_balance_evens_the_load_with_replicas(dispatch_results):
    for case in ("ep4 balance skew", "ep2 balance skew", "ep4 balance zero-token ranks"):
        result = dispatch_results[0][case]
        before, after = result["load_before"], result["load_after"]
        assert sum(before) == sum(after) and result["replicas"] > 0, (case, result)
        assert max_over_mean(before) > 1.5 and max_over_mean(after) <= 1.10, (case, before, after)


def test_selective_recompute_does_not_run_the_exchanges_again(dispatch_results):
    for rank, results in enumerate(dispatch_results):
        for case in ("exchanges alltoall", "exchanges allgather", "exchanges balance"):
            counts = results[case]
            assert counts["off"] > 0 and counts["selective"] == counts["off"], (rank, case, counts)
            assert counts["full"] > counts["off"], (rank, case, counts)


# 3. Configuration --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.expert_parallel_size=3"], "does not divide the model's 8 routed experts"),
        (["parallel.ep_plan.apply_modules=[model.language_model.layers.{*}.mlp]"], "not the experts of an MoE block"),
        (["parallel.ep_plan.apply_modules=[model.nothing.{*}]"], "parallel.ep_plan.apply_modules"),
    ],
)
def test_bad_expert_parallel_settings_name_the_key(overrides, message, capsys):
    """Preflight's dry run of the plans (the same plan code a training run applies on the meta model)."""
    world = "3" if overrides[0].endswith("=3") else "2"
    ep = [] if overrides[0].endswith("=3") else ["parallel.expert_parallel_size=2"]
    assert preflight_main(["--world-size", world, *ep, *overrides]) == 2
    err = capsys.readouterr().err
    assert "[plan expert_parallel]" in err and message in err and "Traceback" not in err


def test_an_impossible_ep_size_stops_a_real_run_before_the_process_group(tmp_path):
    result = train(tmp_path, ["parallel.expert_parallel_size=2", "training.train_iters=1"])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "'parallel.expert_parallel_size' = 2 does not divide dp_shard x cp = 1" in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_balance_needs_alltoall_expert_parallelism():
    with pytest.raises(UserError, match="needs expert parallelism with the alltoall dispatcher"):
        load_config(
            None,
            ["features.ep_balance.enabled=true", "parallel.expert_parallel_size=2", ALLGATHER],
        )


# 4. Training under expert parallelism against EP1, 20 steps (fp32, an image in every sample) --------------------------

EP2, EP4 = "parallel.expert_parallel_size=2", "parallel.expert_parallel_size=4"
ALLGATHER = "parallel.ep_plan.dispatcher=allgather"
SKEW = "model.router_skew=0.6"  # low-numbered experts (rank 0's) take most pairs
BALANCE = ["features.ep_balance.enabled=true", "features.ep_balance.max_dup_experts_num=2"]
CHUNK_LOSS = ["features.chunk_loss.mode=static", "features.chunk_loss.chunk_size=64"]


# One torchrun job per world size runs every configuration of that size (tests/multi_run.py): name -> overrides on top
# of PARITY. Each 4-rank configuration is compared with the 4-rank EP1 run of the same job, the 2-rank ones with the
# shared plain 2-rank run (parity_off).
EP_RUNS = {
    2: {
        "ep2 alltoall": [EP2],
        "ep2 allgather": [EP2, ALLGATHER],
        # the --deepspeed door: ZeRO-3 and AutoEP from a ds_config, recompute + activation offload (cpu_checkpointing)
        "ep2 deepspeed door offload": ["--deepspeed", "DS_CONFIG"],
        "skew ep2": [EP2, SKEW],
        "skew ep2 balance": [EP2, SKEW, *BALANCE],
    },
    4: {
        "ep1 4 ranks": [],
        "ep4 alltoall": [EP4],
        "ep4 allgather": [EP4, ALLGATHER],
        "ep2 hsdp 2x2": [EP2, "parallel.data_parallel_replicate_size=2"],
        # dp 2 x Ulysses 2 (EP groups are the CP groups, efsdp 2): the global batch of 2 plain ranks
        "ep2 cp2 chunk loss": [EP2, "parallel.ulysses_parallel_size=2", *CHUNK_LOSS],
    },
}
# name: the run it must match (a name, or the ranks of the shared plain run)
EP_PARITY = {
    "ep2 alltoall": 2,
    "ep2 allgather": 2,
    "ep2 deepspeed door offload": 2,
    "skew ep2 balance": "skew ep2",
    "ep4 alltoall": "ep1 4 ranks",
    "ep4 allgather": "ep1 4 ranks",
    "ep2 hsdp 2x2": "ep1 4 ranks",
    "ep2 cp2 chunk loss": 2,
}
DOOR_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": "auto"}},
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 3},
    "activation_checkpointing": {"cpu_checkpointing": True},
    "expert_parallel": {"enabled": True, "autoep_size": 2, "use_grouped_mm": True},
}


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory) -> dict[str, tuple[str, list[dict]]]:
    """Every EP training run once: (rank 0's log, metrics) by name."""
    root = tmp_path_factory.mktemp("ep_runs")
    door = root / "ds_config.json"
    door.write_text(json.dumps(DOOR_CONFIG))
    runs = {}
    for nproc, named in EP_RUNS.items():
        overrides = {name: PARITY + [o.replace("DS_CONFIG", str(door)) for o in extra] for name, extra in named.items()}
        runs.update(train_many(root / f"ranks{nproc}", overrides, nproc))
    return runs


@pytest.mark.parametrize("name", list(EP_PARITY))
def test_expert_parallel_training_matches_ep1(ep_runs, parity_off, name):
    stdout, records = ep_runs[name]
    reference = EP_PARITY[name]
    off = ep_runs[reference][1] if isinstance(reference, str) else parity_off(reference)
    assert {r["global_batch_size"] for r in records} == {r["global_batch_size"] for r in off}
    assert off[0]["loss"] - off[-1]["loss"] > 0.5  # it trains: equal flat curves would prove nothing
    assert mean_relative_error([r["loss"] for r in records], [r["loss"] for r in off]) <= 1e-5
    assert mean_relative_error([r["grad_norm"] for r in records], [r["grad_norm"] for r in off]) <= 1e-5
    assert "[plan expert_parallel] 1 pattern(s)" in stdout
    assert "model.language_model.layers.{*}.mlp.experts: 3 module(s)" in stdout
    dispatcher = "allgather" if any(ALLGATHER in named.get(name, []) for named in EP_RUNS.values()) else "alltoall"
    assert f"{dispatcher} dispatch" in stdout
    # ep = dp: each expert lives on one rank, so FSDP leaves the stacks alone; otherwise they are units over efsdp
    # (Ulysses ranks join it) or over the HSDP replicas
    if name in ("ep2 hsdp 2x2", "ep2 cp2 chunk loss"):
        assert "3 expert stack(s) over 2 rank(s)" in stdout
    else:
        assert "3 expert stack(s) left plain (efsdp has one rank: nothing to shard or reduce)" in stdout
    if "door" in name:
        assert "expert_parallel.autoep_size 2" in stdout and "[plan activation_offload]" in stdout
        assert "[plan recompute]" in stdout
    if dispatcher == "alltoall":
        assert all(r["ep_load_max_over_mean_before"] >= 1.0 for r in records)


def test_balance_evens_a_skewed_training_load(ep_runs):
    """Per-step metrics: EP rank load before / after balance (max/mean, CV, pairs per rank), replicas and the bytes
    their weights moved; the log line shows the load."""
    stdout, records = ep_runs["skew ep2 balance"]
    assert "balance up to 2 replica(s)/rank" in stdout
    before = [r["ep_load_max_over_mean_before"] for r in records]
    after = [r["ep_load_max_over_mean_after"] for r in records]
    assert min(before) > 1.3, before  # the skew is real
    assert max(after) <= 1.10 and max(r["ep_load_cv_after"] for r in records) <= 0.05, after
    assert all(r["ep_replicas"] > 0 and r["ep_replica_mib"] > 0 for r in records)
    for record in records:  # every pair computed somewhere, the busiest rank relieved
        first, second = record["ep_load_per_rank_before"], record["ep_load_per_rank_after"]
        assert sum(first) == sum(second) and max(second) < max(first)
    assert f"EP load max/mean {before[-1]:.2f} -> {after[-1]:.2f}" in stdout
    unbalanced = ep_runs["skew ep2"][1]
    assert all(r["ep_replicas"] == 0 and r["ep_replica_mib"] == 0 for r in unbalanced)
    assert all(r["ep_load_per_rank_before"] == r["ep_load_per_rank_after"] for r in unbalanced)
