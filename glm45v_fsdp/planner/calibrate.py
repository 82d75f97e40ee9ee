"""Measure this machine as a device preset (`python -m glm45v_fsdp.tools.plan --calibrate`): two processes with one
thread each over gloo, as the CPU tests and benchmarks run.

  fp32_tflops   matmul rate at the tiny model's shapes (rows x hidden x width: 2048 x 64 x 128, both ranks at once):
                a planner for the tiny model needs the rate its small matmuls get, not a large GEMM's;
  hbm_tbps      a 64 MiB tensor copy (read + write), the optimizer's bound;
  intra_gbps    the bus bandwidth of a 4 MiB all-gather and all-to-all between the two ranks (the mean of both):
                bytes x (n-1)/n / (time - latency);
  latency       the mean time of a 4-byte all-reduce;
  causal_share  the time of a causal attention (forward and backward, sdpa, 1024 tokens) over a full one: the share
                of the scores the CPU kernel computes.
The rates are effective ones, so both efficiencies are 1. One machine is one node: inter-node figures equal the
intra-node ones and nothing crosses nodes. Nothing overlaps: gloo's threads run on the cores the compute uses.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from glm45v_fsdp.planner.devices import GIB, Device

MATMUL_SHAPE = (2048, 64, 128)
MESSAGE_BYTES = 4 << 20


def _timed(action, repeats: int) -> float:
    """Median seconds of `action` over `repeats` runs after two warm-ups (ranks in step: a barrier before each)."""
    for _ in range(2):
        action()
    times = []
    for _ in range(repeats):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _attention_s(causal: bool) -> float:
    q, k, v = (torch.randn(1, 2, 1024, 16, requires_grad=True) for _ in range(3))

    def step() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()

    return _timed(step, 10)


def _measure(rank: int, port: int, result_path: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    m, k, n = MATMUL_SHAPE
    a, b = torch.randn(m, k), torch.randn(k, n)
    matmul_s = _timed(lambda: a @ b, 50)
    causal_share = _attention_s(True) / _attention_s(False)
    source = torch.empty(16 << 20, dtype=torch.float32)
    target = torch.empty_like(source)
    copy_s = _timed(lambda: target.copy_(source), 10)
    small = torch.ones(1)
    latency_s = _timed(lambda: dist.all_reduce(small), 200)
    shard = torch.ones(MESSAGE_BYTES // 8)  # fp32: half the gathered output per rank
    gathered = torch.empty(MESSAGE_BYTES // 4)
    gather_s = _timed(lambda: dist.all_gather_single(gathered, shard), 20)
    send, receive = torch.ones(MESSAGE_BYTES // 4), torch.empty(MESSAGE_BYTES // 4)
    a2a_s = _timed(lambda: dist.all_to_all_single(receive, send), 20)
    if rank == 0:
        bus = [MESSAGE_BYTES / 2 / max(t - latency_s, 1e-9) for t in (gather_s, a2a_s)]
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
        device = Device(
            name="cpu (calibrated: 2 processes x 1 thread, gloo)",
            bf16_tflops=2 * m * k * n / matmul_s / 1e12,
            fp32_tflops=2 * m * k * n / matmul_s / 1e12,
            hbm_gib=memory / 2,
            hbm_tbps=2 * source.numel() * 4 / copy_s / 1e12,
            intra_gbps=statistics.fmean(bus) / 1e9,
            inter_gbps=statistics.fmean(bus) / 1e9,
            intra_latency_us=latency_s * 1e6,
            inter_latency_us=latency_s * 1e6,
            devices_per_node=2,
            compute_efficiency=1.0,
            comm_efficiency=1.0,
            reserve_gib=1.0,
            overlap=False,  # gloo's threads take the cores the compute runs on
            causal_share=causal_share,
        )
        Path(result_path).write_text(json.dumps({"device": device.__dict__}, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def calibrate(path: Path) -> Device:
    from glm45v_fsdp.runtime.dist import free_port

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    mp.start_processes(_measure, args=(free_port(), str(partial)), nprocs=2, join=True, start_method="spawn")
    partial.replace(path)  # nothing written half-way
    return Device(**json.loads(path.read_text())["device"])
