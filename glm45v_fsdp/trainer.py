"""The step loop: accumulation, loss normalisation, clipping, non-finite policy, optimizer, schedule, metrics,
checkpoint cadence and resume."""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from glm45v_fsdp.builders import Runtime
from glm45v_fsdp.checkpoint.dcp import Checkpointer, load_checkpoint
from glm45v_fsdp.checkpoint.deepspeed import DeepSpeedState, load_into
from glm45v_fsdp.checkpoint.layout import describe_diff
from glm45v_fsdp.checkpoint.state import capture_rng, read_trainer_state, restore_rng
from glm45v_fsdp.config import Config, dump_yaml
from glm45v_fsdp.data.collate import move_batch
from glm45v_fsdp.data.dump import BatchDumper
from glm45v_fsdp.data.mixture_metrics import MixtureFigures
from glm45v_fsdp.data.validation import EvalBatches
from glm45v_fsdp.errors import Preempted, TrainingStopped, UserError
from glm45v_fsdp.evaluation import Evaluator
from glm45v_fsdp.log import get_logger
from glm45v_fsdp.lora.peft_format import save_adapter
from glm45v_fsdp.loss_scale import LossScaler
from glm45v_fsdp.memory.chunk_loss import ChunkChoice, ChunkedLossHead
from glm45v_fsdp.memory.offload import find_offload_runtime
from glm45v_fsdp.metrics import (
    GIB,
    MetricsSink,
    StepRecord,
    format_line,
    format_summary,
    previous_run,
    summarize,
)
from glm45v_fsdp.model.moe import moe_blocks
from glm45v_fsdp.model.router_health import router_monitor
from glm45v_fsdp.optim import OptimizerRecipe, build_optimizer, build_scheduler, recipe_from_training
from glm45v_fsdp.parallel.expert import BalanceFigures
from glm45v_fsdp.parallel.fsdp import compute_precision, is_sharded
from glm45v_fsdp.runtime import MemoryMeter
from glm45v_fsdp.runtime.faults import Fault
from glm45v_fsdp.runtime.preemption import EXIT_PREEMPTED, PreemptionWatch
from glm45v_fsdp.runtime.profiling import StepProfiler
from glm45v_fsdp.runtime.stuck import StepDeadline, start_step_deadline
from glm45v_fsdp.step import DpSums, OptimizerStep, StepOutcome

Batch = dict[str, torch.Tensor]
OTHER_RANK_DATA_ERROR = "Another data-parallel rank stopped on a data error; its message is in that rank's output."


@dataclass
class NextStep:
    """The next step's micro batches, fetched inside a step after its backward and before its last all-reduce, which
    also sums their valid tokens and the ranks whose fetch failed over the data-parallel ranks: the next step then
    needs no all-reduce of its own before its forward. `error`: this rank's data error (`batches` is then empty)."""

    batches: list[Batch]
    error: UserError | None
    fetch_ms: float
    global_valid: float = 0.0
    failed_ranks: int = 0

    def local_sums(self) -> list[float]:
        """This rank's share of the sums the step's last all-reduce carries: valid tokens, 1 if its fetch failed."""
        return [float(sum(int(b["num_valid_tokens"]) for b in self.batches)), float(self.error is not None)]

    def take(self) -> list[Batch]:
        """The batches; a data error on any rank stops every rank here, the failing one with its own message."""
        if self.error is not None:
            raise self.error
        if self.failed_ranks:
            raise UserError(OTHER_RANK_DATA_ERROR)
        return self.batches


def micro_loss_scale(
    loss_type: str, valid_tokens: torch.Tensor, global_valid_tokens: torch.Tensor, accumulation: int, dp_size: int
) -> torch.Tensor:
    """Factor turning a micro batch's CE sum into its share of the step's loss; FSDP sums gradients over ranks.

    default:   sum(CE)/valid tokens of the micro batch, averaged over accumulation and over the DP ranks.
    per_token: sum(CE)/valid tokens of the whole global batch.
    A micro batch without supervised tokens contributes zero.
    """
    if loss_type == "default":
        return 1.0 / (valid_tokens.clamp(min=1).to(torch.float32) * accumulation * dp_size)
    return 1.0 / global_valid_tokens.clamp(min=1).to(torch.float32)


class Trainer:
    def __init__(
        self,
        config: Config,
        runtime: Runtime,
        model: nn.Module,
        loader: Any,
        recipe: OptimizerRecipe | None = None,
        lora_base: dict | None = None,
        eval_batches: EvalBatches | None = None,
    ) -> None:
        """`recipe` (default: from training.*) names the optimizer and its schedule; ds_compat passes a ds_config's.
        `lora_base`: a LoRA run's reference to its frozen base (checkpoint/base_reference.py): its checkpoints then
        hold the trainable state only. `eval_batches`: the validation micro batches (builders.build_eval_batches),
        evaluated at training.eval_interval and after the last step."""
        self.config = config
        self.runtime = runtime
        self.model = model
        self.loader = loader
        self.log = get_logger()
        training = config.training
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        self.recipe = recipe if recipe is not None else recipe_from_training(training)
        self.optimizer = build_optimizer(model, self.recipe, fused=runtime.device.has_fused_adamw())
        self.scheduler = build_scheduler(self.optimizer, self.recipe)
        track = training.track_memory if training.track_memory is not None else runtime.device.type != "cpu"
        self.meter = MemoryMeter(runtime.device, enabled=track)
        self.precision = compute_precision(model, config.parallel.fsdp_plan, runtime.device.type)
        fp16 = config.parallel.fsdp_plan.param_dtype == "fp16"
        self.scaler = LossScaler(training.loss_scale) if fp16 else None
        if self.scaler is not None:
            self.log.info("fp16: %s", self.scaler.describe())
        self.router = router_monitor(model)  # MoE router figures and balancing (model/router_health.py)
        self.step_runner = OptimizerStep(
            self.parameters,
            self.optimizer,
            self.scheduler,
            clip=training.clip_grad,
            scaler=self.scaler,
            hsdp_root=model if is_sharded(model) and runtime.dims.hsdp_enabled else None,
            on_skip=self._skip_step,
            router=self.router,
        )
        self.sequence_layout = model.sequence_layout  # CP: how each micro batch's sequence lies over the ranks
        self.moe_blocks = moe_blocks(model)
        head = model.get_submodule("lm_head")
        self.chunk_head = head if isinstance(head, ChunkedLossHead) else None
        self.chunk_trace: list[ChunkChoice] = []  # this step's chunking, one entry per micro batch
        self.global_batch_size = training.micro_batch_size * training.gradient_accumulation_steps * runtime.dp_size
        self.step = 0
        self.skipped_steps = 0
        self.consumed_samples = 0
        self.records: list[StepRecord] = []
        self.output_dir = Path(training.output_dir).expanduser().absolute()  # a relative one is the cwd's
        self.sink: MetricsSink | None = None  # rank 0 opens it at the first record, after a resume set the step
        if runtime.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "config.yaml").write_text(dump_yaml(config))
            self.log.info("outputs: %s (config.yaml, metrics.jsonl, summary.json)", self.output_dir)
        self.fault = Fault.from_env()
        adapter = self._adapter_writer()
        self.checkpointer = (
            Checkpointer(training, runtime.env.rank, self.fault, adapter, lora_base) if training.save else None
        )
        self.preemption = PreemptionWatch()
        self.profiler = StepProfiler(training.profile_steps, self.output_dir, runtime.env.rank, runtime.device.type)
        self.preempted_ranks: list[int] = []  # ranks that got a preemption signal, known to all after a step
        self.dumper = (
            BatchDumper(self.output_dir, runtime.env.rank, training.dump_batches) if training.dump_batches else None
        )
        self.log.info(
            "optimizer: %s (%s) | loss %s, kernel: %s | memory figure: %s | global batch %d = micro %d x "
            "accumulation %d x dp %d",
            self.recipe.describe(),
            next((kind for kind in ("fused", "foreach") if self.optimizer.defaults.get(kind)), "single-tensor"),
            training.loss_type,
            "full-logits cross-entropy"
            if self.chunk_head is None
            else f"chunked lm_head + cross-entropy ({config.features.chunk_loss.mode})",
            self.meter.kind,
            self.global_batch_size,
            training.micro_batch_size,
            training.gradient_accumulation_steps,
            runtime.dp_size,
        )
        self.offload = find_offload_runtime(model)  # activation offload's per-step figures (None when off)
        self.ep_balance = BalanceFigures(self.moe_blocks)  # expert parallelism's EP rank load (idle without EP)
        self.mixture = MixtureFigures(loader, model, runtime)  # data.mixture's per-source figures (idle when off)
        self.evaluator = (
            Evaluator(training, runtime, model, eval_batches, self.precision, self._dp_all_reduce)
            if eval_batches is not None
            else None
        )

    # ----------------------------------------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        """What `trainer_state.pt` holds besides the DCP tensors."""
        return {
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "scheduler": self.scheduler.state_dict(),
            "consumed_samples": self.consumed_samples,
            "global_batch_size": self.global_batch_size,
            "world_size": self.runtime.env.world_size,
            "config": dump_yaml(self.config),
            "loss_scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "mixture": self.mixture.checkpoint(self.consumed_samples),
            "eval_best": self.evaluator.best_state() if self.evaluator is not None else None,
        }

    def resume_deepspeed(self, state: DeepSpeedState) -> None:
        """Continue a run the real DeepSpeed saved (any ZeRO stage and world size; read by train.py with
        read_deepspeed): weights, the Adam moments and step (unless training.no_load_optim), the schedule's position
        and the counters. The loader must already start at the checkpoint's data position (DeepSpeed's
        global_samples)."""
        training = self.config.training
        load_into(self.model, None if training.no_load_optim else self.optimizer, state, strict=training.load_strict)
        saved = state.model_states.get("lr_scheduler") or {}
        self.step = state.global_steps
        self.scheduler.step(last_batch_iteration=int(saved.get("last_batch_iteration", self.step - 1)))
        if self.scaler is not None and state.loss_scale is not None:
            self.scaler.scale = float(state.loss_scale["cur_scale"])
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr
        self.skipped_steps = int(state.model_states.get("skipped_steps") or 0)
        self.consumed_samples = int(state.model_states.get("global_samples") or 0)
        self.log.info(
            "resume: DeepSpeed checkpoint %s (ZeRO %d, %d rank(s), global step %d); optimizer %s",
            state.layout.tag_dir,
            state.layout.stage,
            state.layout.world_size,
            self.step,
            "restored" if state.moments and not training.no_load_optim else "not restored",
        )

    def resume(self, checkpoint: Path) -> None:
        """Restore model, optimizer (unless training.no_load_optim), scheduler, counters and RNG (unless
        training.no_load_rng) from a DCP checkpoint. The loader must already start at the checkpoint's data
        position (train.py builds it with `data_start_step`)."""
        training = self.config.training
        state = read_trainer_state(checkpoint)
        optimizer = None if training.no_load_optim else self.optimizer
        diff = load_checkpoint(self.model, optimizer, checkpoint, strict=training.load_strict)
        if not diff.ok:
            self.log.warning("resume: not loaded (training.load_strict=false): %s", describe_diff(diff))
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("loss_scaler") is not None:
            self.scaler.load_state_dict(state["loss_scaler"])
        if self.evaluator is not None:
            self.evaluator.restore_best(state.get("eval_best"))
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr  # the optimizer's own state holds it too, but not under no_load_optim
        self.step = state["step"]
        self.skipped_steps = state["skipped_steps"]
        self.consumed_samples = state["consumed_samples"]
        world = self.runtime.env.world_size
        if self.runtime.is_main and state["world_size"] != world:
            self.log.warning(
                "resume: the checkpoint was saved by %d rank(s), this run has %d: tensors are resharded; ranks "
                "without a saved RNG state keep their seeded generators",
                state["world_size"],
                world,
            )
        if self.runtime.is_main and state["global_batch_size"] != self.global_batch_size:
            start, repeated = divmod(self.consumed_samples, self.global_batch_size)
            self.log.warning(
                "resume: the global batch size changed from %d to %d; after %d consumed samples the data stream "
                "continues at step %d of the new batch size%s",
                state["global_batch_size"],
                self.global_batch_size,
                self.consumed_samples,
                start,
                f", so the last {repeated} consumed samples are seen again" if repeated else "",
            )
        if training.no_load_rng:
            rng = "not restored (training.no_load_rng=true)"
        else:
            rng = "restored" if restore_rng(checkpoint, self.runtime.env.rank, self.runtime.device) else "seeded"
        if self.checkpointer is not None:
            self.checkpointer.last_step = self.step
        self.log.info(
            "resumed from DCP checkpoint %s: step %d, skipped steps %d, consumed samples %d | model restored, "
            "optimizer %s, scheduler restored (lr %.3e), rng %s",
            checkpoint,
            self.step,
            self.skipped_steps,
            self.consumed_samples,
            "not restored (training.no_load_optim=true)" if training.no_load_optim else "restored",
            self.optimizer.param_groups[0]["lr"],
            rng,
        )

    def save_checkpoint(self, sync: bool = False, best: bool = False) -> None:
        assert self.checkpointer is not None
        rng = capture_rng(self.runtime.device)
        state = self.checkpoint_state()
        self.checkpointer.save(self.step, self.model, self.optimizer, state, rng, sync=sync, best=best)

    def _stop_for_preemption(self) -> None:
        """Every rank, at the same step: a synchronous checkpoint published as `latest`, then Preempted."""
        self.log.warning(
            "preemption signal on rank(s) %s: stopping after step %d with a checkpoint (exit %d)",
            self.preempted_ranks,
            self.step,
            EXIT_PREEMPTED,
        )
        if self.checkpointer is None:
            self.log.warning("training.save is not set: nothing is saved; the next run starts over")
        else:
            self.checkpointer.wait()
            if self.checkpointer.last_step != self.step:
                self.save_checkpoint(sync=True)
            if dist.is_initialized():  # no rank exits (and gets the others killed by its launcher) before rank 0
                dist.barrier()  # published the checkpoint
        where = f" (latest checkpoint: step {self.step})" if self.checkpointer is not None else ""
        raise Preempted(f"preempted at step {self.step} of {self.config.training.train_iters}{where}")

    def _dp_all_reduce(self, values: list[torch.Tensor | float]) -> list[float]:
        """Sum small scalars over the data-parallel ranks in one collective."""
        device = self.runtime.torch_device
        packed = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in values])
        if self.runtime.dp_size > 1:
            dist.all_reduce(packed, group=self.runtime.meshes.dp.get_group())
        return packed.tolist()

    def _gather_rank_figures(
        self, figures: list[float], to_sum: list[torch.Tensor | None]
    ) -> tuple[list[list[float]], list[torch.Tensor | None]]:
        """Every rank's per-step figures (step ms, peak memory, data ms, ...) and each tensor of `to_sum` (the router
        statistics, EP balance figures, a mixture's per-source sums; None: none this step) summed over the ranks,
        in one all-gather."""
        device = self.runtime.torch_device
        parts = [torch.tensor(figures, dtype=torch.float64, device=device)]
        parts += [part.flatten().to(device, torch.float64) for part in to_sum if part is not None]
        mine = torch.cat(parts)
        world = self.runtime.env.world_size
        gathered = [mine]
        skip = self.fault is not None and self.fault.hits("skip_collective", self.runtime.env.rank, self.step - 1)
        if world > 1 and not skip:
            gathered = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(gathered, mine)
        elif skip:
            get_logger().warning(
                "GLM45V_FAULT: rank %d skips the per-step all-gather of step %d", self.runtime.env.rank, self.step
            )
            gathered = [mine] * world
        per_rank = [[float(g[index]) for g in gathered] for index in range(len(figures))]
        sums = torch.stack(gathered).sum(dim=0)
        summed, offset = [], len(figures)
        for part in to_sum:
            if part is None:
                summed.append(None)
                continue
            summed.append(sums[offset : offset + part.numel()].view_as(part))
            offset += part.numel()
        return per_rank, summed

    def train_step(
        self,
        micro_batches: list[Batch],
        global_valid: float | None = None,
        fetch_next: Callable[[], NextStep] | None = None,
    ) -> tuple[float, float, int, bool, NextStep | None]:
        """One optimizer step over the accumulation micro batches. `global_valid`: their valid tokens summed over the
        data-parallel ranks, when the previous step's last all-reduce brought it (None: one all-reduce here, before
        the forward). `fetch_next` fetches the next step's micro batches after the backward, so that their count rides
        in this step's last all-reduce. Returns (loss, grad norm, tokens, skipped, the next step's batches or None)."""
        training = self.config.training
        accumulation = len(micro_batches)
        local_tokens = sum(int(b["num_tokens"]) for b in micro_batches)
        if global_valid is None:
            local_valid = sum(int(b["num_valid_tokens"]) for b in micro_batches)
            global_valid, failed_ranks = self._dp_all_reduce([local_valid, 0])
            if failed_ranks:
                raise UserError(OTHER_RANK_DATA_ERROR)
        global_valid_tensor = torch.tensor(global_valid, device=self.runtime.torch_device)
        loss_scale = self.step_runner.loss_scale
        report_loss = torch.zeros((), dtype=torch.float64, device=self.runtime.torch_device)
        for index, batch in enumerate(micro_batches):
            self.step_runner.before_backward(last_of_step=index == accumulation - 1)
            batch = move_batch(batch, self.runtime.torch_device)
            with self.precision:
                ce_sum, valid = self.model(batch)
            if self.chunk_head is not None:
                self.chunk_trace.append(self.chunk_head.last_choice)
            self.mixture.add(micro_batches[index])
            scale = micro_loss_scale(training.loss_type, valid, global_valid_tensor, accumulation, self.runtime.dp_size)
            if self.fault is not None:  # GLM45V_FAULT=R:S:nan
                scale = scale * self.fault.loss_factor(self.runtime.env.rank, self.step + 1)
            objective = ce_sum * (scale * loss_scale)
            aux = self.router.take_aux_loss() if self.router is not None else None
            if aux is not None:  # features.router.aux_loss_coef: averaged over the micro batches and the DP ranks
                objective = objective + aux * (
                    self.router.aux_loss_coef * loss_scale / (accumulation * self.runtime.dp_size)
                )
            objective.backward()
            report_loss += (ce_sum.detach() * scale).double()
        following = fetch_next() if fetch_next is not None else None
        self.sequence_layout.reduce(report_loss)  # CP: each rank holds the CE of its part of the sequence
        riders = [report_loss, report_loss.new_tensor(float(local_tokens))]
        riders += [report_loss.new_tensor(value) for value in following.local_sums()] if following is not None else []
        sums = DpSums(
            torch.stack(riders), self.runtime.meshes.dp.get_group() if self.runtime.dp_size > 1 else None
        )  # summed in the gradient norm's all-reduce when the data-parallel ranks are the whole job
        outcome = self.step_runner.finish(dp_sums=sums)
        loss, tokens, *next_sums = sums.values.tolist()
        if following is not None:
            following.global_valid, following.failed_ranks = next_sums[0], int(next_sums[1])
        return loss, outcome.grad_norm, int(tokens), not outcome.stepped, following

    def _skip_step(self, loss: float | None, outcome: StepOutcome) -> None:
        """A step with a non-finite loss or gradient norm: an fp16 overflow is the loss scaler's business (it halves
        the scale, and stops the run at its floor); otherwise training.on_nonfinite and max_skipped_steps decide."""
        training = self.config.training
        self.skipped_steps += 1
        reason = f"loss {loss} / grad norm {outcome.grad_norm} at step {self.step + 1}"
        if self.scaler is not None:
            self.log.info("fp16 gradient overflow at loss scale %g: step %d skipped", outcome.loss_scale, self.step + 1)
            return
        if training.on_nonfinite == "stop" or self.skipped_steps > training.max_skipped_steps:
            raise TrainingStopped(
                f"Training stopped: non-finite {reason} (training.on_nonfinite={training.on_nonfinite}, "
                f"{self.skipped_steps} skipped step(s), training.max_skipped_steps={training.max_skipped_steps}). "
                f"Lower training.lr, check the data, or use fp32 (parallel.fsdp_plan.param_dtype=fp32)."
            )
        self.log.warning("skipping the optimizer step: non-finite %s", reason)

    def _next_micro_batches(self, iterator: Iterator[Batch]) -> list[Batch]:
        """One step's micro batches from the loader (a data error raises UserError)."""
        rank = self.runtime.env.rank
        if self.fault is not None and self.fault.hits("hang", rank, self.step):
            get_logger().warning("GLM45V_FAULT: rank %d hangs in its data loader after step %d", rank, self.step)
            threading.Event().wait()
        if self.fault is not None and self.fault.hits("data_error", rank, self.step):
            raise UserError(f"GLM45V_FAULT: an injected data error on rank {rank} after step {self.step}.")
        return [next(iterator) for _ in range(self.config.training.gradient_accumulation_steps)]

    def _first_micro_batches(self, iterator: Iterator[Batch]) -> list[Batch]:
        """The micro batches of a step no earlier step fetched (the first of this process). A data error here stops
        every rank: the failing rank first tells the others through the collective they would otherwise wait in
        (train_step's all-reduce before the forward)."""
        try:
            return self._next_micro_batches(iterator)
        except UserError:
            self._dp_all_reduce([0, 1])
            raise

    def _fetch_next(self, iterator: Iterator[Batch]) -> NextStep:
        """The next step's micro batches, fetched inside this step (see NextStep); a data error is kept for later."""
        started = time.perf_counter()
        try:
            batches, error = self._next_micro_batches(iterator), None
        except UserError as caught:
            batches, error = [], caught
        return NextStep(batches, error, (time.perf_counter() - started) * 1000.0)

    def _live_state(self) -> list[torch.Tensor]:
        """Tensors alive before a step that count toward its peak: parameters and optimizer state."""
        state = [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return [*self.parameters, *state]

    def step_once(
        self,
        micro_batches: list[Batch],
        started: float | None = None,
        global_valid: float | None = None,
        fetch_next: Callable[[], NextStep] | None = None,
    ) -> tuple[StepRecord, NextStep | None]:
        """Train one step on the given micro batches, time it, gather every rank's figures, record them; the next
        step's batches when `fetch_next` fetched them (see train_step).

        `started` (a perf_counter value) lets the caller include the time it spent fetching the batches, which is
        also recorded (`data_ms`, with the time the step spent fetching the next step's).
        """
        data_ms = 0.0 if started is None else (time.perf_counter() - started) * 1000.0
        lr = self.optimizer.param_groups[0]["lr"]
        start = time.perf_counter() if started is None else started
        # Only the CPU tracker needs the live tensors; the list is not built on the hot path otherwise.
        with self.meter.track(self._live_state() if self.meter.kind == "tracked-tensors" else ()):
            loss, grad_norm, tokens, skipped, following = self.train_step(micro_batches, global_valid, fetch_next)
            self.runtime.device.synchronize()
        ms = (time.perf_counter() - start) * 1000.0
        data_ms += following.fetch_ms if following is not None else 0.0
        return self._record(lr, ms, data_ms, loss, grad_norm, tokens, skipped), following

    def _chunk_metrics(self) -> dict[str, list[int]]:
        """This step's chunked-loss choices on this rank (one entry per micro batch), then reset."""
        if self.chunk_head is None:
            return {}
        trace, self.chunk_trace = self.chunk_trace, []
        return {"chunk_size": [c.chunk_size for c in trace], "chunk_count": [c.chunks for c in trace]}

    def _loss_scale_metrics(self) -> dict[str, float]:
        """fp16: the loss scale the next step runs with (after this step's update)."""
        return {"loss_scale": self.scaler.scale} if self.scaler is not None else {}

    def _offload_metrics(self) -> dict[str, float | int]:
        """This step's activation-offload figures on this rank (bytes and tensors moved, stall time), then reset."""
        return self.offload.take() if self.offload is not None else {}

    def _record(
        self, lr: float, ms: float, data_ms: float, loss: float, grad_norm: float, tokens: int, skipped: bool
    ) -> StepRecord:
        self.step += 1
        self.consumed_samples += self.global_batch_size
        preempting = 1.0 if self.preemption.signal is not None else 0.0
        training = self.config.training
        router_report = self.router is not None and (
            self.step % training.log_interval == 0 or self.step == training.train_iters
        )  # the router figures of the log interval, over all ranks
        figures, (router_sums, balance_sums, mixture_sums) = self._gather_rank_figures(
            [ms, self.meter.peak_bytes() / GIB, data_ms, preempting],
            [
                self.router.interval_stats() if router_report else None,
                self.ep_balance.local_sums(),
                self.mixture.local_sums(),
            ],
        )
        ms_ranks, mem_ranks, data_ranks, preempting_ranks = figures
        self.preempted_ranks = [rank for rank, flag in enumerate(preempting_ranks) if flag]
        ms_max = max(ms_ranks)
        record = StepRecord(
            step=self.step,
            loss=loss,
            grad_norm=grad_norm,
            lr=lr,
            ms_per_iter=ms_max,
            samples_per_s=self.global_batch_size * 1000.0 / ms_max,
            tokens_per_s=tokens * 1000.0 / ms_max,
            mem_peak_max_gib=max(mem_ranks),
            mem_peak_avg_gib=sum(mem_ranks) / len(mem_ranks),
            global_batch_size=self.global_batch_size,
            tokens=tokens,
            skipped=skipped,
            skipped_steps_total=self.skipped_steps,
            ms_per_iter_per_rank=ms_ranks,
            mem_peak_per_rank_gib=mem_ranks,
            extra={
                "data_ms": max(data_ranks),
                "data_ms_per_rank": data_ranks,
                **self._chunk_metrics(),
                **self._offload_metrics(),
                **self._loss_scale_metrics(),
                **(self.router.take_figures(router_sums) if router_report else {}),
                **self.ep_balance.figures(balance_sums, self.runtime.env.world_size),
                **self.mixture.figures(mixture_sums),
            },
        )
        self.records.append(record)
        if self.runtime.is_main:
            if self.sink is None:
                self.sink = MetricsSink(self.output_dir, self.config.training.tensorboard, record.step - 1)
            self.sink.write(record)
        return record

    def run(self) -> dict[str, Any]:
        """Train until training.train_iters; ms/iter includes fetching the step's micro batches. A background
        checkpoint write still in flight is finished (and published) on the way out, also after an error."""
        training = self.config.training
        earlier = previous_run(self.output_dir) if self.runtime.is_main and self.step == 0 else None
        if earlier is not None:
            self.log.warning(
                "training.output_dir '%s' holds an earlier run (%s): this run starts at step 0 and replaces its "
                "metrics.jsonl, summary.json and config.yaml. Choose another training.output_dir to keep them.",
                self.output_dir,
                earlier,
            )
        iterator = iter(self.loader)
        bar = tqdm(
            total=training.train_iters,
            initial=self.step,
            disable=not (self.runtime.is_main and training.progress_bar),
            file=sys.stderr,
            dynamic_ncols=True,
            mininterval=1.0,
            desc="train",
        )
        self.model.train()
        self.deadline = self._step_deadline() if training.step_timeout_s != 0 else None
        try:
            with self.preemption.installed():
                self._loop(iterator, bar)
        finally:
            if self.deadline is not None:
                self.deadline.stop()
            bar.close()
            waited = self.checkpointer.wait() if self.checkpointer is not None else 0.0
        summary = self._summary()
        if summary:  # bad data records left out (data.on_bad_record=skip)
            summary["skipped_records"] = self.loader.dataset.skipped_records
            summary.update(self.evaluator.summary() if self.evaluator is not None else {})
        if self.checkpointer is not None:
            self.log.info(
                "checkpoints: step loop blocked %.3f s in total%s",
                self.checkpointer.blocked_s,
                f"; waited {waited:.3f} s at the end for the background write" if training.async_save else "",
            )
            if summary:
                summary["checkpoint_blocked_s"] = self.checkpointer.blocked_s
        if self.sink is not None:
            self.sink.write_summary(summary)
            self.sink.close()
            self.log.info("%s | results in %s", format_summary(summary), self.output_dir)
        return summary

    def _loop(self, iterator: Iterator[Batch], bar: tqdm) -> None:
        training = self.config.training
        following: NextStep | None = None  # fetched by the previous step (train_step)
        while self.step < training.train_iters:
            self.profiler.before_step(self.step + 1)
            start = time.perf_counter()
            if following is None:
                batches, global_valid = self._first_micro_batches(iterator), None
            else:
                batches, global_valid = following.take(), following.global_valid
            if self.dumper is not None:
                for batch in batches:
                    self.dumper.dump(batch)
            last = self.step + 1 == training.train_iters
            fetch_next = None if last else functools.partial(self._fetch_next, iterator)
            record, following = self.step_once(batches, start, global_valid, fetch_next)
            if self.deadline is not None:
                self.deadline.step_done(self.step, time.perf_counter() - start)
            self.profiler.after_step(self.step)
            bar.update(1)
            if self.runtime.is_main and (self.step % training.log_interval == 0 or self.step == training.train_iters):
                bar.write(format_line(record, training.train_iters, self.meter.kind), file=sys.stdout)
            if self.preempted_ranks:
                self._stop_for_preemption()
            if self.evaluator is not None and self.evaluator.due(self.step):
                self.evaluator.run(self.step, self.sink, bar.write, self.deadline and self.deadline.note_progress)
            best = training.save_best and self.evaluator.new_best(self.step)
            if self.checkpointer is not None:
                self.checkpointer.poll()
                if self.checkpointer.due(self.step) or best:
                    self.save_checkpoint(best=best)
            if self.fault is not None:
                self.fault.maybe_fire(self.runtime.env.rank, self.step)

    def _adapter_writer(self) -> Callable[[Path], None] | None:
        """LoRA: every checkpoint carries adapter/ in PEFT's format (collective: each rank gathers, rank 0 writes)."""
        if not self.config.model.lora.rank:
            return None
        base = self.config.model.name_or_path
        return lambda checkpoint: save_adapter(self.model, checkpoint / "adapter", base)

    def _step_deadline(self) -> StepDeadline:
        """The stuck-job deadline of this run (runtime/stuck.py), started now."""
        training = self.config.training
        env = self.runtime.env
        return start_step_deadline(training.step_timeout_s, env.rank, env.world_size, self.output_dir / "stuck")

    def _summary(self) -> dict[str, Any]:
        """summarize() over this process's steps; empty when a resume started at training.train_iters."""
        training = self.config.training
        if not self.records:
            self.log.info("nothing to train: the run is at step %d of %d", self.step, training.train_iters)
            return {}
        start_step = training.stats_start_step or min(training.train_iters, max(2, training.train_iters // 10 + 1))
        return summarize(self.records, start_step, self.meter.kind)
