"""The first call of every chosen fast kernel, against the reference, before the model trains.

Small random inputs on the run's device in its compute dtype; forward and input/weight gradients must agree with
ops/reference.py (relative to the largest reference value: 1e-4 in fp32, 3e-2 in bf16/fp16). A kernel that raises,
or disagrees, stops the run with a ConfigError naming `model.ops` and the setting that runs the reference instead.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from glm45v_fsdp.errors import ConfigError
from glm45v_fsdp.model.moe import LocalDispatcher
from glm45v_fsdp.ops import reference
from glm45v_fsdp.ops.kernels import KERNELS
from glm45v_fsdp.ops.registry import OpsChoice


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference relative to the largest reference value."""
    return (got.float() - want.float()).abs().max().item() / (want.float().abs().max().item() + 1e-6)


def tolerance_for(dtype: torch.dtype) -> float:
    """The largest relative error a fused kernel may show against the reference in `dtype`."""
    return 1e-4 if dtype == torch.float32 else 3e-2


@contextmanager
def kernel_check(chose: str, fallback: str) -> Iterator[None]:
    """Around a fused kernel's first call against the reference: whatever it raises (a missing function, a rejected
    argument or a wrong result alike) becomes a ConfigError naming the config key and what `chose` the kernel, and
    the `fallback` setting that runs the reference instead."""
    try:
        yield
    except Exception as error:
        raise ConfigError(
            f"Config key {chose}, and its first call failed against the reference: {type(error).__name__}: {error}. "
            f"Set {fallback}."
        ) from None


def check_close(got: torch.Tensor, want: torch.Tensor, tolerance: float, what: str) -> None:
    """ValueError naming `what` when `got` is further than `tolerance` (relative) from the reference's `want`."""
    error = relative_error(got, want)
    if not error <= tolerance:
        raise ValueError(f"{what}: relative error {error:.2e} against the reference (tolerance {tolerance:g})")


def _compare(
    kernel_fn: Callable, reference_fn: Callable, inputs: list[torch.Tensor], tolerance: float, backward_through: int = 0
) -> None:
    """Both functions on copies of `inputs` (the floating ones differentiable): every output, and every input's
    gradient from seeded random output gradients (through the first `backward_through` outputs; 0: all)."""
    results = []
    for fn in (kernel_fn, reference_fn):
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        outputs = fn(*leaves)
        outputs = [o for o in (outputs if isinstance(outputs, tuple) else (outputs,)) if o is not None]
        carried = outputs[:backward_through] if backward_through else outputs
        generator = torch.Generator().manual_seed(1)
        torch.autograd.backward(carried, [torch.randn(o.shape, generator=generator).to(o) for o in carried])
        results.append((outputs, [leaf.grad for leaf in leaves]))
    (got, got_grads), (want, want_grads) = results
    for index, (g, w) in enumerate(zip(got, want)):
        check_close(g, w, tolerance, f"output {index}")
    for index, (g, w) in enumerate(zip(got_grads, want_grads)):
        if w is not None:
            if g is None:
                raise ValueError(f"input {index} gets no gradient")
            check_close(g, w, tolerance, f"gradient of input {index}")


class _Inputs:
    """Seeded random inputs on the device in the dtype under test."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.generator = torch.Generator().manual_seed(0)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator).to(device=self.device, dtype=self.dtype)

    def angles(self, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of [..., 2d] angles laid out as transformers' rotary embeddings make them (cat of two halves)."""
        half = torch.rand(*shape, generator=self.generator) * 6.28
        full = torch.cat((half, half), dim=-1).to(self.device)
        return full.cos().to(self.dtype), full.sin().to(self.dtype)


def check_rms_norm(kernel, data: _Inputs, tolerance: float) -> None:
    _compare(
        lambda x, w: kernel(x, w, 1e-6),
        lambda x, w: reference.rms_norm(x, w, 1e-6),
        [data.randn(2, 5, 64), data.randn(64)],
        tolerance,
    )


def check_rotary(kernel, data: _Inputs, tolerance: float) -> None:
    cos, sin = data.angles(2, 6, 4)  # partial rotary: 8 of the 16 dims
    text = [data.randn(2, 4, 6, 16), data.randn(2, 2, 6, 16)]
    _compare(lambda q, k: kernel.text(q, k, cos, sin), lambda q, k: reference.rotary(q, k, cos, sin), text, tolerance)
    cos, sin = data.angles(10, 8)
    vision = [data.randn(10, 4, 16), data.randn(10, 4, 16)]
    _compare(
        lambda q, k: kernel.vision(q, k, cos.float(), sin.float()),
        lambda q, k: reference.vision_rotary(q, k, cos.float(), sin.float()),
        vision,
        tolerance,
    )


def check_attention(kernel, data: _Inputs, tolerance: float) -> None:
    """GQA (4 query heads on 2 key/value heads); causal and full; one padded-free row and one packed row."""
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=data.device)
    inputs = [data.randn(1, 4, 12, 16), data.randn(1, 2, 12, 16), data.randn(1, 2, 12, 16)]
    for causal, packed in itertools.product((True, False), (None, cu)):
        seqlens = packed.tolist() if packed is not None else None
        run = functools.partial(kernel, causal=causal, scale=0.25, cu_seqlens=packed, seqlens=seqlens)
        want = functools.partial(reference.attention, causal=causal, scale=0.25, cu_seqlens=packed)
        _compare(run, want, inputs, tolerance, backward_through=1)  # the log-sum-exp: compared, no gradient


def check_experts(kernel, data: _Inputs, tolerance: float) -> None:
    counts = torch.tensor([5, 0, 7], device=data.device)  # an expert without rows
    _compare(
        lambda rows, w: kernel(rows, w, counts),
        lambda rows, w: reference.grouped_gemm(rows, w, counts),
        [data.randn(12, 16), data.randn(3, 8, 16)],
        tolerance,
    )


def check_permute(kernel, data: _Inputs, tolerance: float) -> None:
    """dispatch -> a per-expert function of the rows -> combine, with the kernel and with the MoE block's own."""
    expert_ids = torch.tensor([[0, 3], [1, 0], [3, 2], [0, 1], [2, 3], [1, 0]], device=data.device)
    scales = torch.arange(1.0, 5.0, device=data.device, dtype=data.dtype)

    def through(dispatcher: LocalDispatcher):
        def run(hidden, weights):
            dispatched = dispatcher.dispatch(hidden, expert_ids, weights)
            scale = torch.repeat_interleave(scales, dispatched.counts)[:, None]
            return dispatcher.combine(dispatched.rows * scale, dispatched)

        return run

    weights = torch.rand(6, 2, generator=data.generator).to(data.device)
    _compare(through(LocalDispatcher(4, kernel)), through(LocalDispatcher(4)), [data.randn(6, 16), weights], tolerance)


def check_swiglu(kernel, data: _Inputs, tolerance: float) -> None:
    _compare(kernel, reference.swiglu, [data.randn(5, 32)], tolerance)


CHECKS = {
    "rms_norm": check_rms_norm,
    "rotary": check_rotary,
    "attention": check_attention,
    "experts": check_experts,
    "permute": check_permute,
    "swiglu": check_swiglu,
}


def verify_ops(choice: OpsChoice, device: torch.device, dtype: torch.dtype) -> None:
    """Each fast kernel of `choice` once against the reference (module docstring); ConfigError on failure."""
    tolerance = tolerance_for(dtype)
    for op in choice.fast():
        chose = f"'model.ops' chose {choice.label(op)} for {op} on {device} ({dtype})"
        fallback = f"model.ops={{{op}: reference}} to run the reference for {op} (or model.ops=reference for every op)"
        with kernel_check(chose, fallback):
            CHECKS[op](KERNELS[(op, choice.names[op])], _Inputs(device, dtype), tolerance)
