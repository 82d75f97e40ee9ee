"""Per-source figures of a mixture run (data.mixture) for the step records, summed over every rank:

- `data/<name>/samples`: the source's samples in the step's global batch;
- `data/<name>/tokens`: their tokens (non-padding, as the record's `tokens`);
- `data/<name>/loss_tokens`: their supervised tokens (after the one-token shift);
- `data/<name>/loss`: the token mean of their cross-entropy (absent in a step where the source has no supervised
  token). Weighted by loss_tokens, the sources' losses average to the step's token-mean loss, which is the step
  loss with training.loss_type=per_token.

The counts come from the collated micro batches (`sample_sources`, `source_ids`); the cross-entropy from the
training forward's per-position losses (model/loss.py keep_token_losses), split by the source ids that the sequence
layout lays over the ranks as it lays the targets (padding, context-parallel slices), so they hold under packing,
the chunked loss and context parallelism alike. The loss that trains is computed exactly as without them. The
trainer sums each rank's `local_sums` over the ranks in its per-step all-gather (no collective of its own).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from glm45v_fsdp.data.mixture import MixtureSampler
from glm45v_fsdp.model.loss import keep_token_losses
from glm45v_fsdp.vocab import IGNORE_INDEX, shift_labels

FIGURES = ("samples", "tokens", "loss_tokens")


class MixtureFigures:
    """The step's per-source figures of this rank, reduced over every rank by `take`; idle (every method does nothing)
    when the loader's sampler is not a mixture's."""

    def __init__(self, loader: Any, model: nn.Module, runtime: Any) -> None:
        """`runtime`: the builders' Runtime. Every rank adds the cross-entropy of its part of the sequence; the batch
        counts only the first rank of each context-parallel group (they all hold the same micro batches)."""
        sampler = getattr(loader, "batch_sampler", None)
        self.stream = sampler.stream if isinstance(sampler, MixtureSampler) else None
        if self.stream is None:
            return
        keep_token_losses(model)
        self.model = model
        self.device = runtime.torch_device
        self.counts_here = runtime.meshes.cp.get_local_rank() == 0
        sources = len(self.stream.names)
        self._counts = torch.zeros(len(FIGURES), sources, dtype=torch.float64)
        self._losses = torch.zeros(sources + 1, dtype=torch.float64, device=self.device)  # bin 0: padding

    def add(self, batch: dict[str, torch.Tensor]) -> None:
        """Count a micro batch (collated, on the CPU) right after its training forward."""
        if self.stream is None:
            return
        sources = batch["source_ids"]
        if self.counts_here:
            count = len(self.stream.names)
            self._counts[0] += torch.bincount(batch["sample_sources"], minlength=count)
            self._counts[1] += torch.bincount(sources[sources >= 0], minlength=count)
            supervised = (shift_labels(batch["labels"]) != IGNORE_INDEX) & (sources >= 0)
            self._counts[2] += torch.bincount(sources[supervised], minlength=count)
        losses = self.model.token_losses
        layout = self.model.sequence_layout
        padded = F.pad(sources, (0, losses.shape[1] * layout.size - sources.shape[1]), value=-1)
        bins = layout.shard(padded, dim=1).to(self.device).reshape(-1) + 1
        self._losses.index_add_(0, bins, losses.reshape(-1).to(torch.float64))

    def local_sums(self) -> torch.Tensor | None:
        """This rank's counts and cross-entropy sums of the step (then reset), to be summed over every rank and
        handed to `figures`; None when idle."""
        if self.stream is None:
            return None
        packed = torch.cat([self._counts.to(self.device).flatten(), self._losses[1:]])
        self._counts.zero_()
        self._losses.zero_()
        return packed

    def figures(self, packed: torch.Tensor | None) -> dict[str, float]:
        """The step's per-source figures from `local_sums` summed over every rank; {} when idle."""
        if packed is None:
            return {}
        names = self.stream.names
        counts = packed[: len(FIGURES) * len(names)].view(len(FIGURES), len(names)).tolist()
        losses = packed[len(FIGURES) * len(names) :].tolist()
        figures: dict[str, float] = {}
        for index, name in enumerate(names):
            for figure, values in zip(FIGURES, counts):
                figures[f"data/{name}/{figure}"] = int(values[index])
            if counts[2][index]:
                figures[f"data/{name}/loss"] = losses[index] / counts[2][index]
        return figures

    def checkpoint(self, consumed_samples: int) -> dict[str, Any] | None:
        """The checkpoint's mixture record at the stream position of `consumed_samples` (data/mixture.py); None
        when idle."""
        return self.stream.checkpoint(consumed_samples) if self.stream is not None else None
