"""`deepspeed.runtime.sequence_parallel.ulysses_sp`: DeepSpeed's ALST names (Arctic Long Sequence Training) on this
backend's Ulysses context parallelism, for GLM-4.5V.

What accelerate's `ParallelismConfig(sp_backend="deepspeed", sp_size=N)` and the HF Trainer's `parallelism_config`
call, and what each does here:
- `UlyssesSPAttentionHF.register_with_transformers(model, core_attn_implementation, sequence_parallel_size, ...)`
  checks the model is GLM-4.5V, builds DeepSpeed's sequence-parallel groups (`parallel_state_sp`) and returns that
  module as the `mpu`. Nothing is registered with transformers: the engine applies the Ulysses plan to GLM-4.5V's
  attention when `deepspeed.initialize(mpu=...)` takes the mpu (the same plan as `sequence_parallel_size`). Any other
  model is refused here, with the reason.
- `UlyssesSPDataLoaderAdapter(dl, sp_rank, sp_group, sp_world_size, device)` walks the data as DeepSpeed's does
  ("SP over DP": the group trains each member's batch in turn, so it yields `len(dl) x sp` batches) and replaces
  `labels` by `shift_labels`, the targets already shifted, as DeepSpeed's does. It hands every rank of the group this
  rank's slice of `shift_labels` (what the loss code, e.g. transformers' `deepspeed_sp_compute_loss`, counts tokens
  on) and the rest of the batch whole: GLM-4.5V merges the image features into the embeddings and derives the mRoPE
  positions from the whole sequence, so the engine splits the inputs itself, once. Pre-sliced `shift_labels` are
  recognised by their length and not split again. `position_ids` are not required (DeepSpeed requires them).
- `TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards, compute_params, output_reduction)`: the loss over
  `shards` row shards, each recomputed in backward, so one shard's logits exist at a time. GLM-4.5V's own forward
  runs the chunked-loss plan and needs none of it.

The loss a GLM-4.5V forward returns for a pre-sliced batch is DeepSpeed's: the token mean over this rank's slice.
Gradients reduce over the sequence-parallel group as DeepSpeed 0.19.8 reduces them: summed at ZeRO 0-2, averaged at
ZeRO-3 (transformers' `deepspeed_sp_compute_loss` scales its loss for that), see `DeepSpeedEngine.backward`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ds_compat.runtime.sequence_parallel import parallel_state_sp
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.log import get_logger, setup_logging
from glm45v_fsdp.vocab import IGNORE_INDEX

GLM45V_MODEL_TYPE = "glm4v_moe"


class UlyssesSPAttentionHF:
    """DeepSpeed's entry point for Ulysses on HF models; here only `register_with_transformers` (the attention wrapper
    itself is this backend's Ulysses plan, applied by the engine)."""

    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path: Any,
        core_attn_implementation: str,
        sequence_parallel_size: int,
        micro_batch_size: int,
        seq_length: int | None = None,
        seq_length_is_variable: bool = True,
        disable_in_eval: bool = False,
        max_length: int | None = None,
    ) -> Any:
        """-> the mpu (`parallel_state_sp`) for `deepspeed.initialize(mpu=...)`, or None at size 1 (as DeepSpeed)."""
        if sequence_parallel_size == 1:
            return None
        seq_length = max_length if seq_length is None else seq_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError(
                "Either `seq_length_is_variable` needs to be `True` or `seq_length` needs to be set to an integer "
                "value of the fixed batch size length."
            )
        config = _model_config(model_name_or_path)
        if getattr(config, "model_type", None) != GLM45V_MODEL_TYPE:
            raise UserError(
                f"UlyssesSPAttentionHF.register_with_transformers(sequence_parallel_size={sequence_parallel_size}) "
                f"was given a {getattr(config, 'model_type', type(model_name_or_path).__name__)!r} model: this "
                "backend splits sequences for GLM-4.5V (model_type 'glm4v_moe') only, with its own Ulysses and Ring "
                "attention; other models get no sequence parallelism from the FSDP2 backend. Set sp_size=1 (no "
                "parallelism_config), or run this model on the real DeepSpeed (`ds-fsdp --backend deepspeed`)."
            )
        attention = getattr(config, "_attn_implementation", None)
        if hasattr(model_name_or_path, "config") and attention not in (None, core_attn_implementation):
            raise ValueError(
                f"core_attn_implementation='{core_attn_implementation}' does not match model config "
                f"attn_implementation='{attention}'. Set both to the same value so sequence-parallel wrapper can "
                "intercept the active attention path."
            )
        parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size)
        log = get_logger()
        if not log.handlers:  # before deepspeed.initialize, which sets the logging up otherwise
            setup_logging(dist.get_rank())
        log.info(
            "ds_compat: ALST register_with_transformers: GLM-4.5V, sequence_parallel_size %d (micro batch %d, %s); "
            "the engine applies the Ulysses context-parallel plan when deepspeed.initialize takes this mpu",
            sequence_parallel_size,
            micro_batch_size,
            "variable sequence length" if seq_length_is_variable else f"sequence length {seq_length}",
        )
        return parallel_state_sp


def _model_config(model_name_or_path: Any) -> Any:
    if hasattr(model_name_or_path, "config"):
        return model_name_or_path.config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_name_or_path)


class UlyssesSPDataLoaderAdapter:
    """DeepSpeed's loader adapter: see the module docstring for what it yields."""

    def __init__(self, dl: Any, sp_rank: int, sp_group: Any, sp_world_size: int, device: Any) -> None:
        self.dl = dl
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = device
        self.iter = iter(dl)
        self.micro_batches: deque[dict] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        """The group's next batches: one from each member's loader, each made ready for the whole group."""
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)  # the next epoch starts over, as DeepSpeed's adapter does
            raise
        if not isinstance(batch, dict) or "input_ids" not in batch or "labels" not in batch:
            keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
            raise UserError(
                f"UlyssesSPDataLoaderAdapter needs batches as dicts with input_ids and labels; the wrapped loader gave "
                f"{keys}. Use a collator that returns them (the HF collators do)."
            )
        members: list[Any] = [None] * self.sp_world_size
        cpu = {key: value.cpu() if torch.is_tensor(value) else value for key, value in batch.items()}
        dist.all_gather_object(members, cpu, group=self.sp_group)
        for member in members:
            self.micro_batches.append(self._for_this_rank(member))

    def _for_this_rank(self, batch: dict) -> dict:
        """`labels` -> this rank's slice of `shift_labels` (the whole sequence padded to a multiple of the group,
        sliced as the engine slices the inputs); every other entry whole."""
        batch = dict(batch)
        targets = F.pad(batch.pop("labels"), (0, 1), value=IGNORE_INDEX)[..., 1:]
        targets = F.pad(targets, (0, -targets.shape[-1] % self.sp_world_size), value=IGNORE_INDEX)
        batch["shift_labels"] = targets.chunk(self.sp_world_size, dim=-1)[self.sp_rank].contiguous()
        return batch


class TiledFusedLogitsLoss:
    """DeepSpeed's tiled loss: `fn(self, x_shard, y_shard[, mask_shard])` over `shards` row shards of the flattened
    batch, each under activation recomputation (its logits are freed after its forward and rebuilt in backward), so
    the peak holds one shard's logits. `output_reduction` "mean" averages the shards' outputs, "sum" adds them."""

    @staticmethod
    def apply(
        fn: Callable[..., torch.Tensor],
        self: Any,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor | None,
        shards: int,
        compute_params: Any = None,
        output_reduction: str = "mean",
    ) -> torch.Tensor:
        if output_reduction not in ("mean", "sum"):
            raise ValueError(f'unknown reduction {output_reduction}: valid values are: "mean"/"sum"')
        if x.dim() < 2 or y.dim() < 2:
            raise ValueError("x and y must be at least 2D [batch_size, seq_len, ...]")
        if x.shape[:2] != y.shape[:2]:
            raise ValueError("x and y batch/seq dims must match")
        if mask is not None and mask.shape != x.shape[:2]:
            raise ValueError("mask shape must match x and y batch/seq")
        rows = [x.reshape(-1, *x.shape[2:]).chunk(shards), y.reshape(-1, *y.shape[2:]).chunk(shards)]
        if mask is not None:
            rows.append(mask.reshape(-1).chunk(shards))
        outputs = [checkpoint(fn, self, *parts, use_reentrant=False) for parts in zip(*rows)]
        stacked = torch.stack(outputs)
        return stacked.mean() if output_reduction == "mean" else stacked.sum()
