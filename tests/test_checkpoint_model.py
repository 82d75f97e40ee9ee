"""Checkpoint time as part of the plan (planner/checkpoint_time.py): the size arithmetic on hand-made parameters, the
time bounds, and `tools.plan` / `tools.preflight` printing the figures. The sizes against a real save's bytes on disk
are checked where a save exists already (tests/test_checkpoint_integrity.py,
test_checkpoint_model_matches_the_bytes_on_disk)."""

from __future__ import annotations

import json
import math

from glm45v_fsdp.config import TrainingConfig
from glm45v_fsdp.memory.estimate import ADAM_STEP_BYTES, ParamSpec, ShardLayout
from glm45v_fsdp.planner import checkpoint_time
from glm45v_fsdp.planner.checkpoint_time import (
    DCP_ITEM_BYTES,
    GB,
    METADATA_CHUNK_BYTES,
    OPTIMIZER_GROUPS_BYTES,
    PARAM_NAME_BYTES,
    RNG_FILE_BYTES,
    SAFETENSORS_TENSOR_BYTES,
    TRAINER_STATE_BYTES,
    Storage,
)
from glm45v_fsdp.tools import plan, preflight

SPECS = [
    ParamSpec("w", (10, 4), 4, True, "a"),  # trainable: weight + exp_avg + exp_avg_sq
    ParamSpec("frozen", (6,), 4, False, "a"),  # frozen: the weight only
    ParamSpec("layers.0.mlp.experts.gate_up_proj", (4, 8, 2), 2, True, "b", expert=True, routed=True),
]


def test_sizes_count_weights_moments_framing_and_small_files():
    two = checkpoint_time.sizes(SPECS, ShardLayout(2, ep=2, efsdp=1), 2)
    # rank r: w's 5 rows (20 elements) x 3 copies; frozen's 3 elements; experts: 2 of 4 whole (32 elements) x 3
    shard = 3 * 20 * 4 + 3 * 4 + 3 * 32 * 2 + 7 * DCP_ITEM_BYTES
    steps = math.ceil(2 / 2) * (ADAM_STEP_BYTES + DCP_ITEM_BYTES)  # two step scalars spread over two ranks
    metadata = (2 * 7 + 2 + 24) * METADATA_CHUNK_BYTES  # chunks of both ranks, the steps, the 24 group entries
    groups = OPTIMIZER_GROUPS_BYTES + 2 * PARAM_NAME_BYTES  # rank 0: the param groups, naming the 2 trainable
    assert two.dcp_per_rank == [shard + steps + RNG_FILE_BYTES + metadata + groups + TRAINER_STATE_BYTES,
                                shard + steps + RNG_FILE_BYTES]  # fmt: skip
    # HF: every tensor whole in its dtype, the expert stack as 2 tensors per expert (gate, up)
    assert two.hf == 40 * 4 + 6 * 4 + 64 * 2 + 8 + (1 + 1 + 2 * 4) * SAFETENSORS_TENSOR_BYTES
    one = checkpoint_time.sizes(SPECS, ShardLayout(1, sharded=False), 1)
    assert one.hf == two.hf
    weights = 3 * 40 * 4 + 6 * 4 + 3 * 64 * 2
    assert one.dcp == weights + 7 * DCP_ITEM_BYTES + 2 * (ADAM_STEP_BYTES + DCP_ITEM_BYTES) + RNG_FILE_BYTES + (
        (7 + 2 + 24) * METADATA_CHUNK_BYTES + groups + TRAINER_STATE_BYTES
    )
    # HSDP: 4 ranks, 2 replicas of each shard: DCP writes each once, the replicas share it
    four = checkpoint_time.sizes(SPECS, ShardLayout(2, ep=2, efsdp=1), 4)
    assert sum(four.dcp_per_rank) < sum(two.dcp_per_rank) + 2 * (RNG_FILE_BYTES + 4 * DCP_ITEM_BYTES)
    # a LoRA checkpoint holds the trainable tensors only
    lora = checkpoint_time.sizes(SPECS, ShardLayout(1, sharded=False), 1, trainable_only=True)
    assert one.dcp - lora.dcp == 6 * 4 + DCP_ITEM_BYTES + METADATA_CHUNK_BYTES


def test_times_are_the_bounds_the_docstring_states():
    big = [ParamSpec(f"layer{i}", (1000, 1000), 4, True, str(i)) for i in range(8)]  # 96 MB of checkpoint
    storage = Storage(fs_gbps=0.1, node_gbps=0.03, host_gbps=2.0, hash_gbps=4.0)
    training = TrainingConfig(save="ckpt", save_interval=10, async_save=True)
    figures = checkpoint_time.model(big, ShardLayout(4), 4, 2, training, storage, step_s=0.1)
    dcp, background = figures["dcp"], figures["async_save"]
    per_rank = checkpoint_time.sizes(big, ShardLayout(4), 4).dcp_per_rank
    node = max(per_rank[0] + per_rank[1], per_rank[2] + per_rank[3])
    write = max(sum(per_rank) / (0.1 * GB), node / (0.03 * GB))  # here one node's link is the bound
    assert write == node / (0.03 * GB)
    save = dcp["save_s"]
    assert save["write"] == write and save["staging"] == max(per_rank) / (2 * GB)
    assert save["total"] == save["staging"] + save["hashing"] + write
    assert dcp["verify_s"] == write and dcp["load_s"] == write + save["staging"]
    assert dcp["resume_s"] == dcp["verify_s"] + dcp["load_s"]
    assert background["stall_s"] == save["staging"] and background["interval_s"] == 1.0  # 10 steps of 0.1 s
    assert background["overrun_s"] == save["hashing"] + write - 1.0 > 0  # the next save waits for the rest
    assert figures["hf"]["export_write_s"] == figures["hf"]["total_bytes"] / (0.03 * GB)
    # more ranks per node: the node link carries more; a faster file system does not help past it
    denser = checkpoint_time.model(big, ShardLayout(4), 4, 4, training, storage)
    assert denser["dcp"]["save_s"]["write"] > write
    on_cpu = checkpoint_time.storage(0.1, 0.03, on_cpu=True)
    assert checkpoint_time.model(big, ShardLayout(4), 4, 2, training, on_cpu)["dcp"]["save_s"]["staging"] == 0


def test_preflight_and_plan_print_the_checkpoint_figures(capsys):
    code = preflight.main(["--world-size", "2", "--fs-gbps", "5", "--fs-node-gbps", "1.5", "training.save=/tmp/x",
                           "training.async_save=true"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "checkpoint (file system 5 GB/s aggregate, 1.5 GB/s per node; 2 ranks, 2 per node):" in out
    assert "  DCP (training.save): " in out and "model + optimizer; per rank per save" in out
    assert "verify" in out and "resume" in out and "(verify + load)" in out
    assert "async save (training.async_save=true): the step loop stalls" in out
    assert "HF export (training.save_hf, not set in this config)" in out
    code = preflight.main(["--world-size", "2", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["checkpoint"]["storage"]["fs_gbps"] == Storage().fs_gbps
    dcp = report["checkpoint"]["dcp"]
    assert dcp["total_bytes"] == dcp["bytes_per_rank"]["min"] + dcp["bytes_per_rank"]["max"]  # two ranks
    layout = "ep1-uly1-ring1-rep1-rc_off-loss_off-unit_default-mb1"
    job = ["--nodes", "1", "--nproc-per-node", "2", "--device", "910b", "--tokens", "64", "--global-batch", "2"]
    code = plan.main([*job, "--explain", layout, "--fs-gbps", "40"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "checkpoint (file system 40 GB/s aggregate" in out and "within save_interval" not in out
    code = plan.main([*job, "--top", "1", "--fs-node-gbps", "4"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "the best layout's checkpoint (file system 20 GB/s aggregate, 4 GB/s per node; 2 ranks" in out
    code = plan.main([*job, "--fs-gbps", "0"])
    assert code == 2 and "--fs-gbps = 0.0 is invalid" in capsys.readouterr().err
