"""`bench ops`: each op's fast kernel against its reference on one device, then a short training run with
`model.ops=auto` against `model.ops=reference`.

Part 1 (in this process): for every op, the kernel `model.ops=auto` picks on the device and the reference
(ops/reference.py), on the same inputs of a realistic layer size: the largest relative error of the output and of
the input gradients, and the median forward + backward time of each, interleaved (speed-up = reference / kernel).
An op whose auto choice is the reference gets a row saying so (and why a faster kernel was skipped).

Part 2 (two training processes of the tiny model, same seed and batches): ms/iter (the summary's mean) of auto
and reference and the mean relative loss error between them.

Writes ops.md (both tables) and ops.json under --out. On a GPU: `python -m glm45v_fsdp.tools.bench ops --device
cuda`, or the whole device check at once: `.ci/device-ops` (docs/runtime.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from glm45v_fsdp.bench.runner import Run, Runner, errors, write_report
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.model.moe import LocalDispatcher
from glm45v_fsdp.ops import reference
from glm45v_fsdp.ops.kernels import KERNELS
from glm45v_fsdp.ops.registry import choose_ops
from glm45v_fsdp.ops.verify import relative_error
from glm45v_fsdp.runtime.device import import_torch_npu

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    elif device.type == "npu":
        import_torch_npu().npu.synchronize()


def _cases(tokens: int, device: torch.device, dtype: torch.dtype) -> dict[str, tuple]:
    """{op: (kernel caller, reference caller, inputs)}: GLM-4.5V-like layer sizes (heads 16 x 128, hidden 2048,
    16 experts of 512), scaled by `tokens`."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    half = torch.rand(1, tokens, 32, generator=generator) * 6.28
    angles = torch.cat((half, half), -1).to(device)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    vision_half = torch.rand(tokens, 32, generator=generator) * 6.28
    vision = torch.cat((vision_half, vision_half), -1).to(device)
    lengths = [tokens // 4, tokens // 2, tokens - tokens // 4 - tokens // 2]
    seqlens = [0, lengths[0], lengths[0] + lengths[1], tokens]
    cu = torch.tensor(seqlens, dtype=torch.int32, device=device)
    counts = torch.full((16,), 2 * tokens // 16, device=device)
    expert_ids = torch.stack([torch.randperm(16, generator=generator)[:2] for _ in range(tokens)]).to(device)
    route_weights = torch.rand(tokens, 2, generator=generator).to(device)

    def permute_with(kernel):
        dispatcher = LocalDispatcher(16, kernel)

        def run(hidden, weights):
            dispatched = dispatcher.dispatch(hidden, expert_ids, weights)
            return dispatcher.combine(dispatched.rows * 2.0, dispatched)

        return run

    return {
        "rms_norm": (
            lambda k: lambda x, w: k(x, w, 1e-6),
            lambda x, w: reference.rms_norm(x, w, 1e-6),
            [randn(tokens, 2048), randn(2048)],
        ),
        "rotary": (
            lambda k: lambda q, kk: k.text(q, kk, cos, sin),
            lambda q, kk: reference.rotary(q, kk, cos, sin),
            [randn(1, 16, tokens, 128), randn(1, 2, tokens, 128)],
        ),
        "vision rotary": (
            lambda k: lambda q, kk: k.vision(q, kk, vision.cos(), vision.sin()),
            lambda q, kk: reference.vision_rotary(q, kk, vision.cos(), vision.sin()),
            [randn(tokens, 16, 64), randn(tokens, 16, 64)],
        ),
        "attention": (
            lambda k: lambda q, kk, v: k(q, kk, v, causal=True, scale=128**-0.5, cu_seqlens=cu, seqlens=seqlens)[0],
            lambda q, kk, v: reference.attention(q, kk, v, causal=True, scale=128**-0.5, cu_seqlens=cu)[0],
            [randn(1, 16, tokens, 128), randn(1, 2, tokens, 128), randn(1, 2, tokens, 128)],
        ),
        "experts": (
            lambda k: lambda rows, w: k(rows, w, counts),
            lambda rows, w: reference.grouped_gemm(rows, w, counts),
            [randn(2 * tokens, 2048), randn(16, 1024, 2048)],
        ),
        "permute": (permute_with, permute_with(None), [randn(tokens, 2048), route_weights]),
        "swiglu": (lambda k: k, reference.swiglu, [randn(tokens, 2048)]),
    }


def _run(fn, inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.ones_like(out))
    return [out.detach()], [leaf.grad for leaf in leaves if leaf.grad is not None]


def _time(fn, inputs, repeats: int, device: torch.device) -> float:
    _run(fn, inputs)  # warm-up
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        _run(fn, inputs)
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(relative_error(g, w) for g, w in zip(got, want))


def op_rows(device: torch.device, dtype: torch.dtype, tokens: int, repeats: int) -> list[dict]:
    npu = import_torch_npu() if device.type == "npu" else None
    choice = choose_ops("auto", device.type, npu)
    rows = []
    for name, (make_kernel, reference_fn, inputs) in _cases(tokens, device, dtype).items():
        op = "rotary" if name == "vision rotary" else name
        implementation = choice.names[op]
        row = {"op": name, "kernel": choice.label(op)}
        if op not in choice.fast():
            skipped = [line for line in choice.fallbacks if line.startswith(f"{op}:")]
            rows.append(
                {**row, "note": "reference (no faster kernel here" + (f": {skipped[0]}" if skipped else "") + ")"}
            )
            continue
        kernel_fn = make_kernel(KERNELS[(op, implementation)])
        got, want = _run(kernel_fn, inputs), _run(reference_fn, inputs)
        kernel_ms, reference_ms = [], []
        for _ in range(2):  # interleaved
            kernel_ms.append(_time(kernel_fn, inputs, repeats, device))
            reference_ms.append(_time(reference_fn, inputs, repeats, device))
        rows.append(
            {
                **row,
                "output_error": _error(got[0], want[0]),
                "grad_error": _error(got[1], want[1]),
                "kernel_ms": min(kernel_ms),
                "reference_ms": min(reference_ms),
                "speedup": min(reference_ms) / min(kernel_ms),
            }
        )
    return rows


def training_rows(args: argparse.Namespace) -> list[dict]:
    """model.ops=auto against model.ops=reference: one training run each (the runner's), the loss parity and the
    speed-up of the summary's mean ms/iter."""
    rows = []
    runner = Runner("bench ops", args.out, 1, int(os.environ.get("OMP_NUM_THREADS", "1")), args.run_timeout)
    for setting in ("auto", "reference"):
        out = args.out / f"train_{setting}"
        overrides = [
            f"training.device={args.device}",
            f"training.train_iters={args.steps}",
            f"training.output_dir={out}",
            "training.progress_bar=false",
            f"model.ops={setting}",
            *args.overrides,
        ]
        run = Run(f"model.ops={setting}")
        runner.train(run, overrides, out)
        records = run.records
        summary = json.loads((out / "summary.json").read_text())
        log = (out / "train.log").read_text().splitlines()
        ops_line = next((line for line in log if "ops (model.ops=" in line), "")
        losses = [r["loss"] for r in records]
        rows.append({"ops": setting, "ms_per_iter": summary["ms_per_iter_mean"], "losses": losses, "log": ops_line})
    auto, ref = rows
    auto["loss_error"] = errors(auto["losses"], ref["losses"])["mean_rel"]
    auto["speedup"] = ref["ms_per_iter"] / auto["ms_per_iter"]
    return rows


def markdown(ops: list[dict], training: list[dict], device: str, dtype: str) -> str:
    lines = [
        f"# Accelerator ops on {device} ({dtype})",
        "",
        "| op | kernel | output error | gradient error | kernel ms | reference ms | speed-up |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in ops:
        if "note" in row:
            lines.append(f"| {row['op']} | {row['note']} | | | | | |")
        else:
            lines.append(
                f"| {row['op']} | {row['kernel']} | {row['output_error']:.1e} | {row['grad_error']:.1e} | "
                f"{row['kernel_ms']:.3f} | {row['reference_ms']:.3f} | {row['speedup']:.2f}x |"
            )
    if training:
        auto, ref = training
        lines += [
            "",
            "| model.ops | ms/iter | loss mean relative error | speed-up |",
            "|---|---|---|---|",
            f"| auto | {auto['ms_per_iter']:.1f} | {auto['loss_error']:.1e} | {auto['speedup']:.2f}x |",
            f"| reference | {ref['ms_per_iter']:.1f} | | |",
            "",
            f"auto ran: `{auto['log'].strip()}`",
        ]
    return "\n".join(lines) + "\n"


def main_ops(args: argparse.Namespace, argv: list[str]) -> int:
    device = torch.device(args.device)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("bench ops --device cuda: no CUDA device is visible. Run it on a GPU machine, or --device cpu.")
    dtype_name = args.dtype or ("fp32" if args.device == "cpu" else "bf16")
    args.out.mkdir(parents=True, exist_ok=True)
    ops = op_rows(device, DTYPES[dtype_name], args.tokens, args.repeats)
    training = training_rows(args) if args.steps > 0 else []
    report = {"device": args.device, "dtype": dtype_name, "ops": ops, "training": training, "argv": argv}
    write_report(args.out, "ops", report, markdown(ops, training, args.device, dtype_name))
    return 0
