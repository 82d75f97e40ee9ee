"""data.mixture: several data sets sampled by weight into one sample stream (docs/data.md#mixtures).

- `MixtureDataset`: the sources side by side (source s holds indices [start_s, start_s + n_s)); each sample carries
  its source's index under "source", which collation turns into the batch's `source_ids` / `sample_sources`.
- `MixtureStream`: which sample sits at each position of the stream. The blend is Megatron's blended-dataset rule:
  position p goes to the source with the largest w_s * (p - origin + 1) - c_s, where c_s counts source s's positions
  in [origin, p) (ties: the lower index), so every prefix of the stream holds each source within one sample of its
  share. Each source walks its own epochs: its k-th position since the origin takes walk position offset_s + k, and
  walk position q is sample order_e[q mod n_s] of epoch e = q // n_s (order_e a permutation seeded with
  training.seed, the source's name and e when data.shuffle, else 0, 1, 2, ...).
- `MixtureSampler`: step k takes stream positions [k*G, (k+1)*G) and splits them over ranks and micro batches as
  `GlobalBatchSampler` does, so step k trains on the same samples whatever the dp x micro x accumulation split.
- Resume (`resume_stream`): the checkpoint holds the mixture (names, formats, paths, weights, caps, sizes), the blend's
  origin and each source's walk position at the saved step; they are checked against a replay of the blend before
  the run goes on, and a changed mixture is an error unless data.mixture_allow_change.

A fresh run has origin 0 and offsets 0. A resume that accepts a changed mixture restarts the blend at the resume
position (the new origin) with the new weights; sources kept by name start from the walk position they had reached.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from glm45v_fsdp.config import Config, DataConfig, mixture_names
from glm45v_fsdp.data.datasets import build_dataset
from glm45v_fsdp.data.sampler import StepSampler
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.log import get_logger

KEPT_MARKS = 64  # blend states remembered at the starts of the last served steps (the loader's prefetch is shorter)


@dataclass(frozen=True)
class SourceSpec:
    """One source as the stream and the checkpoint see it: `weight` normalised, `samples` after the cap."""

    name: str
    dataset: str
    data_path: str | None
    weight: float
    max_samples: int | None
    samples: int


class MixtureDataset(Dataset):
    """The sources' samples side by side; `__getitem__` adds "source" (the source's index) to each sample."""

    def __init__(self, specs: list[SourceSpec], datasets: list[Dataset]) -> None:
        self.specs = specs
        self.datasets = datasets
        self.starts = [0]
        for spec in specs[:-1]:
            self.starts.append(self.starts[-1] + spec.samples)

    def __len__(self) -> int:
        return self.starts[-1] + self.specs[-1].samples

    def __getitem__(self, index: int) -> dict:
        source = bisect.bisect_right(self.starts, index) - 1
        return {**self.datasets[source][index - self.starts[source]], "source": source}

    @property
    def skipped_records(self) -> int:
        """Bad records left out of every source (data.on_bad_record=skip)."""
        return sum(getattr(dataset, "skipped_records", 0) for dataset in self.datasets)

    def summary(self) -> str:
        parts = [
            f"[{index}] '{spec.name}' weight {spec.weight:.1%}, {spec.samples} of {len(dataset)} samples: "
            f"{dataset.summary()}"
            for index, (spec, dataset) in enumerate(zip(self.specs, self.datasets))
        ]
        return f"mixture of {len(self.specs)} source(s) (data.mixture): " + "; ".join(parts)


def build_mixture_dataset(data_cfg: DataConfig, hf_config, tokenizer, image_processor) -> MixtureDataset:
    """Every source of data.mixture built as data.dataset builds one (records checked), capped at max_samples."""
    total = math.fsum(source.weight for source in data_cfg.mixture)  # correctly rounded: the same in any order
    specs, datasets = [], []
    for index, (source, name) in enumerate(zip(data_cfg.mixture, mixture_names(data_cfg.mixture))):
        single = dataclasses.replace(data_cfg, dataset=source.dataset, data_path=source.data_path, mixture=None)
        try:
            dataset = build_dataset(single, hf_config, tokenizer, image_processor)
        except UserError as error:
            raise type(error)(f"data.mixture[{index}] ('{name}'): {error}") from None
        samples = len(dataset) if source.max_samples is None else min(len(dataset), source.max_samples)
        specs.append(
            SourceSpec(name, source.dataset, source.data_path, source.weight / total, source.max_samples, samples)
        )
        datasets.append(dataset)
    return MixtureDataset(specs, datasets)


def _order_seed(seed: int, name: str, epoch: int) -> int:
    """The permutation seed of one source's epoch: the same in every process and run, different per source."""
    digest = hashlib.sha256(f"{seed}/{name}/{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class MixtureStream:
    """Stream position -> sample index of a `MixtureDataset` (the module docstring gives the rule).

    The blend's state at a position is the count of each source's positions since the origin; `indices` walks it
    forward and remembers it at the start of each range it served (`KEPT_MARKS` of them), so the position a checkpoint
    asks for (behind the loader's prefetch) is found without a replay from the origin.
    """

    def __init__(
        self,
        specs: list[SourceSpec],
        seed: int,
        shuffle: bool,
        origin: int = 0,
        offsets: list[int] | None = None,
    ) -> None:
        self.specs = specs
        self.weights = [spec.weight for spec in specs]
        self.sizes = [spec.samples for spec in specs]
        self.starts = [sum(self.sizes[:index]) for index in range(len(specs))]
        self.seed = seed
        self.shuffle = shuffle
        self.origin = origin
        self.offsets = list(offsets) if offsets is not None else [0] * len(specs)
        self._position, self._counts = origin, [0] * len(specs)
        self._marks: dict[int, list[int]] = {}
        self._orders: dict[tuple[int, int], list[int]] = {}

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.specs]

    def _blend(self, counts: list[int], start: int, stop: int) -> list[tuple[int, int]]:
        """(source, its count before this position) for positions [start, stop), `counts` being the state at
        `start`; advances `counts` to `stop` in place."""
        picks = []
        weights = list(enumerate(self.weights))
        for share in range(start - self.origin + 1, stop - self.origin + 1):
            source, best = 0, weights[0][1] * share - counts[0]
            for candidate, weight in weights[1:]:
                if weight * share - counts[candidate] > best:
                    source, best = candidate, weight * share - counts[candidate]
            picks.append((source, counts[source]))
            counts[source] += 1
        return picks

    def counts_at(self, position: int) -> list[int]:
        """Each source's positions in [origin, position): from the nearest known state at or before `position`."""
        assert position >= self.origin, f"stream position {position} is before the blend's origin {self.origin}"
        known = {self.origin: [0] * len(self.specs), **self._marks, self._position: self._counts}
        base = max(p for p in known if p <= position)
        counts = list(known[base])
        if base != position:
            self._blend(counts, base, position)
            self._remember(position, counts)
        return counts

    def _remember(self, position: int, counts: list[int]) -> None:
        self._marks[position] = list(counts)
        if len(self._marks) > KEPT_MARKS:
            del self._marks[min(self._marks)]

    def walk_positions(self, position: int) -> list[int]:
        """Each source's walk position at stream `position`: the samples of it consumed by then (epochs included)."""
        return [offset + count for offset, count in zip(self.offsets, self.counts_at(position))]

    def _order(self, source: int, epoch: int) -> list[int]:
        key = (source, epoch)
        if key not in self._orders:
            self._orders = {k: v for k, v in self._orders.items() if k[0] != source or k[1] > epoch - 2}
            size = self.sizes[source]
            if self.shuffle:
                generator = torch.Generator().manual_seed(_order_seed(self.seed, self.specs[source].name, epoch))
                self._orders[key] = torch.randperm(size, generator=generator).tolist()
            else:
                self._orders[key] = list(range(size))
        return self._orders[key]

    def items(self, start: int, stop: int) -> list[tuple[int, int]]:
        """(source, walk position) of stream positions [start, stop)."""
        counts = self.counts_at(start)
        self._remember(start, counts)
        picks = self._blend(counts, start, stop)
        self._position, self._counts = stop, counts
        return [(source, self.offsets[source] + count) for source, count in picks]

    def indices(self, start: int, stop: int) -> list[int]:
        """The `MixtureDataset` indices of stream positions [start, stop)."""
        return [
            self.starts[source] + self._order(source, walk // self.sizes[source])[walk % self.sizes[source]]
            for source, walk in self.items(start, stop)
        ]

    def checkpoint(self, position: int) -> dict[str, Any]:
        """What the checkpoint holds for a resume at stream `position` (plain containers: loads with
        weights_only)."""
        return {
            "sources": [dataclasses.asdict(spec) for spec in self.specs],
            "origin": self.origin,
            "offsets": list(self.offsets),
            "position": position,
            "consumed": self.walk_positions(position),
        }


class MixtureSampler(StepSampler):
    """Step k: stream positions [k*G, (k+1)*G) of a `MixtureStream`, split over ranks and micro batches."""

    def __init__(
        self,
        stream: MixtureStream,
        micro_batch_size: int,
        gradient_accumulation_steps: int,
        dp_rank: int,
        dp_size: int,
        start_step: int = 0,
    ):
        super().__init__(micro_batch_size, gradient_accumulation_steps, dp_rank, dp_size, start_step)
        self.stream = stream

    def step_indices(self, step: int) -> list[int]:
        start = step * self.global_batch_size
        return self.stream.indices(start, start + self.global_batch_size)


# --------------------------------------------------------------------------------------------------------------
# Resume
# --------------------------------------------------------------------------------------------------------------


def _shown(before: object, now: object) -> str:
    """`before -> now`, floats to 6 digits unless that hides the difference."""
    if isinstance(before, float) and isinstance(now, float) and f"{before:.6g}" != f"{now:.6g}":
        return f"{before:.6g} -> {now:.6g}"
    return f"{before!r} -> {now!r}"


def _changes(saved: list[dict], current: list[SourceSpec]) -> list[str]:
    """What differs between the checkpoint's sources and this run's, in words; [] when they are the same."""
    now = {spec.name: dataclasses.asdict(spec) for spec in current}
    before = {source["name"]: source for source in saved}
    changes = [f"source '{name}' was removed" for name in before if name not in now]
    changes += [f"source '{name}' is new" for name in now if name not in before]
    for name in (name for name in now if name in before):
        changes += [
            f"source '{name}' {key} {_shown(before[name][key], now[name][key])}"
            for key in ("dataset", "data_path", "weight", "max_samples", "samples")
            if before[name][key] != now[name][key]
        ]
    if not changes and [source["name"] for source in saved] != list(now):
        changes.append(f"the order of the sources {[source['name'] for source in saved]} -> {list(now)}")
    return changes


def _refuse_change(changes: list[str]) -> UserError:
    return UserError(
        f"The checkpoint was trained on another data mixture than data.mixture now: {'; '.join(changes)}. Resuming "
        f"would not continue the saved sample stream. Restore the checkpoint's data.mixture (its config.yaml, and the "
        f"checkpoint's trainer_state.pt, hold it), or set data.mixture_allow_change=true to go on with this one "
        f"(sources kept by name continue where they were, new ones start at their first sample, and the blend "
        f"restarts at the resume point with the new weights; docs/data.md#mixtures)."
    )


def resume_stream(dataset: MixtureDataset, config: Config, saved: dict | None, start_position: int) -> MixtureStream:
    """The stream of a run that starts at stream `start_position`; `saved`: the trainer state of the checkpoint it
    resumes (None: a fresh run). Its mixture record is checked (the mixture list, then each source's position against
    a replay of the blend); a checkpoint without one (a DeepSpeed checkpoint) has its positions recovered by replaying
    this mixture from sample 0."""
    specs, data = dataset.specs, config.data
    seed, shuffle, log = config.training.seed, data.shuffle, get_logger()
    if saved is None:
        return MixtureStream(specs, seed, shuffle)
    if "mixture" not in saved:
        log.warning(
            "data.mixture: the checkpoint records no mixture (a DeepSpeed checkpoint, or an older one): each source's "
            "position is "
            "recovered by replaying this mixture from sample 0 to sample %d, which assumes the saved run trained on it",
            start_position,
        )
        return MixtureStream(specs, seed, shuffle)
    record = saved["mixture"]
    changes = ["the checkpoint trained on one data set (data.dataset), not a mixture"] if record is None else []
    changes = changes or _changes(record["sources"], specs)
    if changes:
        if not data.mixture_allow_change:
            raise _refuse_change(changes)
        kept = {} if record is None else dict(zip((s["name"] for s in record["sources"]), record["consumed"]))
        offsets = [kept.get(spec.name, 0) for spec in specs]
        log.warning(
            "data.mixture changed since the checkpoint (%s); data.mixture_allow_change=true: the blend restarts at "
            "sample %d with the new weights; each source starts at walk position %s",
            "; ".join(changes),
            start_position,
            dict(zip((spec.name for spec in specs), offsets)),
        )
        return MixtureStream(specs, seed, shuffle, origin=start_position, offsets=offsets)
    stream = MixtureStream(specs, seed, shuffle, origin=record["origin"], offsets=record["offsets"])
    replayed = stream.walk_positions(record["position"])
    if replayed != record["consumed"] or record["position"] != saved["consumed_samples"]:
        raise UserError(
            f"The checkpoint's data.mixture positions do not match a replay of its own mixture: it holds "
            f"{record['consumed']} samples consumed of {stream.names} at sample {record['position']} (consumed "
            f"samples {saved['consumed_samples']}), the replay gives {replayed}. The checkpoint's trainer_state.pt is "
            f"damaged or was written by another version: resume from another checkpoint."
        )
    if start_position < stream.origin:  # a smaller global batch steps back before the blend's last restart
        log.warning(
            "data.mixture: the global batch size changed and the resume starts at sample %d, before the blend's "
            "origin %d: the blend restarts there, each source continuing from its consumed samples %s",
            start_position,
            stream.origin,
            replayed,
        )
        return MixtureStream(specs, seed, shuffle, origin=start_position, offsets=replayed)
    log.info(
        "data.mixture: resumed at sample %d; samples consumed per source %s (checked against a replay)",
        start_position,
        dict(zip(stream.names, stream.walk_positions(start_position))),
    )
    return stream


def refuse_dropped_mixture(saved: dict | None, data: DataConfig) -> None:
    """A run on one data set (no data.mixture) that resumes a mixture's checkpoint: an error unless
    data.mixture_allow_change (the sampler then continues at the checkpoint's consumed samples)."""
    record = (saved or {}).get("mixture")
    if record is None:
        return
    names = [source["name"] for source in record["sources"]]
    if not data.mixture_allow_change:
        raise _refuse_change([f"the checkpoint trained on the mixture {names}, this run on data.dataset alone"])
    get_logger().warning(
        "data.mixture: the checkpoint trained on the mixture %s, this run on data.dataset=%s "
        "(data.mixture_allow_change=true): its sampler continues at sample %d",
        names,
        data.dataset,
        saved["consumed_samples"],
    )
