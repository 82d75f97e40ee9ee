"""Validation during training: eval loss and perplexity over the validation set (docs/training.md#validation). The
trainer's step loop only asks `Evaluator.due` and calls `Evaluator.run`.

Eval batches: the validation set in order, every sample counted once in every layout (data/validation.py,
`EvalBatches`).

The figures: eval_loss = summed token cross-entropy / supervised tokens over the whole eval (CE summed over the
context-parallel ranks by the model's sequence layout, both summed over the data-parallel group), eval_ppl =
exp(eval_loss). training.loss_type does not change them.

An eval leaves training as it found it: the model runs in eval mode under no_grad (recompute and activation offload
step aside without a graph), and the state the training forward feeds into the step metrics or later steps is set
aside and put back (`training_state_kept`): the MoE blocks' routing counts, the EP dispatchers' balance statistics,
the chunked head's last choice, the random generators and the model's training mode.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from glm45v_fsdp.checkpoint.state import capture_rng, set_rng
from glm45v_fsdp.config import TrainingConfig
from glm45v_fsdp.data.collate import move_batch
from glm45v_fsdp.data.validation import EvalBatches
from glm45v_fsdp.model.moe import moe_blocks
from glm45v_fsdp.parallel.expert import AllToAllDispatcher
from glm45v_fsdp.runtime.device import DeviceLayer

if TYPE_CHECKING:
    from glm45v_fsdp.builders import Runtime
    from glm45v_fsdp.metrics import MetricsSink


@dataclass(frozen=True)
class EvalResult:
    step: int
    loss: float
    samples: int
    tokens: int  # supervised tokens
    ms: float

    @property
    def ppl(self) -> float:
        return math.inf if self.loss > 700 else math.exp(self.loss)  # exp overflows a float beyond ~709

    def to_json(self) -> dict[str, Any]:
        """The metrics.jsonl record (non-finite figures as null, as the step records)."""
        record = {
            "step": self.step,
            "eval_loss": self.loss,
            "eval_ppl": self.ppl,
            "eval_samples": self.samples,
            "eval_tokens": self.tokens,
            "eval_ms": self.ms,
        }
        return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}


def format_eval_line(result: EvalResult, total_steps: int, best: EvalResult) -> str:
    """The one line rank 0 prints per eval."""
    return (
        f"eval step {result.step}/{total_steps} | eval loss {result.loss:.6f} | eval ppl {result.ppl:.4f} | "
        f"{result.samples} samples, {result.tokens} tokens | {result.ms:.1f} ms | best eval loss {best.loss:.6f} "
        f"(step {best.step})"
    )


@contextlib.contextmanager
def training_state_kept(model: nn.Module, device: DeviceLayer) -> Iterator[None]:
    """Eval mode and no_grad inside; the training forward's side channels set aside before and put back after:
    the EP dispatchers' balance statistics (ep_load_*), the chunked head's last choice (chunk_size / chunk_count),
    the random generators, and the training mode. The MoE routers' figures (router_health.py) count training
    forwards only: eval mode keeps the eval's tokens out of them."""
    blocks = moe_blocks(model)
    dispatchers = [block.dispatcher for block in blocks if isinstance(block.dispatcher, AllToAllDispatcher)]
    stats = [dispatcher.take_stats() for dispatcher in dispatchers]
    head = model.get_submodule("lm_head")
    choice = getattr(head, "last_choice", None)
    rng = capture_rng(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)
        set_rng(rng, device)
        for dispatcher, kept in zip(dispatchers, stats):
            dispatcher.stats = kept
        if hasattr(head, "last_choice"):
            head.last_choice = choice


class Evaluator:
    """Runs the evals of a training run and keeps their results (the last and the best by eval loss; a resumed run
    also knows the best before it, from the checkpoint: `best_state` / `restore_best`)."""

    def __init__(
        self,
        training: TrainingConfig,
        runtime: Runtime,
        model: nn.Module,
        batches: EvalBatches,
        precision: contextlib.AbstractContextManager,
        reduce: Callable[[list[torch.Tensor | float]], list[float]],
    ) -> None:
        """`precision`: the training forward's compute context; `reduce`: sums scalars over the data-parallel
        group (the trainer's)."""
        self.interval = training.eval_interval
        self.final_step = training.train_iters
        self.runtime = runtime
        self.model = model
        self.batches = batches
        self.precision = precision
        self.reduce = reduce
        self.results: list[EvalResult] = []
        self.earlier_best: EvalResult | None = None  # the best eval before a resume

    def due(self, step: int) -> bool:
        """Every eval_interval steps (0: never in between) and after the last step."""
        return step == self.final_step or (self.interval > 0 and step % self.interval == 0)

    @property
    def best(self) -> EvalResult | None:
        """The eval with the lowest loss so far (the earliest of equal ones)."""
        earlier = [self.earlier_best] if self.earlier_best is not None else []
        finite = [r for r in [*earlier, *self.results] if math.isfinite(r.loss)]
        return min(finite, key=lambda r: r.loss) if finite else None

    def new_best(self, step: int) -> bool:
        """Whether an eval at `step` lowered the best eval loss."""
        return bool(self.results) and self.results[-1].step == step and self.best is self.results[-1]

    def best_state(self) -> dict[str, Any] | None:
        """The best eval so far, for the checkpoint's trainer state."""
        best = self.best
        return None if best is None else {"step": best.step, "loss": best.loss}

    def restore_best(self, state: dict[str, Any] | None) -> None:
        """The best eval of the run a checkpoint continues (`best_state`'s), so a later eval must beat it."""
        self.earlier_best = None if state is None else EvalResult(state["step"], state["loss"], 0, 0, 0.0)

    def evaluate(self, step: int, on_batch: Callable[[], None] | None = None) -> EvalResult:
        """One eval over every eval batch (collective: every rank calls it at the same step). `on_batch` is called
        after each forward (the stuck-job deadline's sign of progress)."""
        start = time.perf_counter()
        device = self.runtime.torch_device
        ce = torch.zeros((), dtype=torch.float64, device=device)
        tokens = torch.zeros((), dtype=torch.int64, device=device)
        samples = 0
        with training_state_kept(self.model, self.runtime.device):
            for batch in self.batches:
                samples += int(batch["num_samples"])
                with self.precision:
                    ce_sum, valid = self.model(move_batch(batch, device))
                ce += ce_sum.double()
                tokens += valid
                if on_batch is not None:
                    on_batch()
        self.model.sequence_layout.reduce(ce)  # CP: each rank holds the CE of its part of the sequences
        ce_total, token_total, sample_total = self.reduce([ce, tokens, samples])
        self.runtime.device.synchronize()
        assert token_total > 0, "a validation set without supervised tokens"  # every sample has one (data/encode.py)
        ms = (time.perf_counter() - start) * 1000.0
        result = EvalResult(step, ce_total / token_total, int(sample_total), int(token_total), ms)
        self.results.append(result)
        return result

    def run(
        self,
        step: int,
        sink: MetricsSink | None,
        write: Callable[..., None],
        on_batch: Callable[[], None] | None = None,
    ) -> EvalResult:
        """`evaluate`, then the record to `sink` (rank 0's) and rank 0's line through `write` (the progress bar's)."""
        result = self.evaluate(step, on_batch)
        if sink is not None:
            sink.write_eval(result.to_json())
        if self.runtime.is_main:
            write(format_eval_line(result, self.final_step, self.best or result), file=sys.stdout)
        return result

    def summary(self) -> dict[str, Any]:
        """summary.json's eval figures: the last eval's loss and perplexity, the best eval loss and its step."""
        if not self.results:
            return {}
        last, best = self.results[-1], self.best
        figures = {
            "evals": len(self.results),
            "eval_loss_last": last.loss,
            "eval_ppl_last": last.ppl,
            "eval_loss_best": best.loss if best is not None else None,
            "eval_best_step": best.step if best is not None else None,
        }
        return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in figures.items()}
