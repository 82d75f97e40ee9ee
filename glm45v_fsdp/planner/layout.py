"""One candidate layout of a training job and the config it stands for.

A `Layout` holds what the planner chooses (expert, Ulysses, Ring and HSDP replicate sizes, recompute, chunk loss,
FSDP unit size, micro batch); the world size, sequence length and global batch are the job's (`Job`). `apply`
returns the config with the layout's keys set; `overrides` prints them as `key=value` ready to paste after
`python -m glm45v_fsdp.train --config ...`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from glm45v_fsdp.config import Config
from glm45v_fsdp.runtime.mesh import ParallelDims

RECOMPUTE = ("off", "selective", "full")
CHUNK_LOSS = ("off", "static", "dynamic")


@dataclass(frozen=True)
class Job:
    """What the team fixed: ranks (nodes x ranks per node), tokens per sample and samples per optimizer step."""

    nodes: int
    ranks_per_node: int
    tokens: int
    global_batch: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


@dataclass(frozen=True)
class Layout:
    ep: int = 1
    ulysses: int = 1
    ring: int = 1
    replicate: int = 1
    recompute: str = "off"
    chunk_loss: str = "off"
    unit_mib: float | None = None  # None: the device's default (parallel.fsdp_plan.unit_mib null)
    micro_batch: int = 1

    @property
    def cp(self) -> int:
        return self.ulysses * self.ring

    def dims(self, job: Job) -> ParallelDims:
        world = job.world_size
        return ParallelDims(
            world, self.replicate, world // (self.replicate * self.cp), self.ring, self.ulysses, self.ep
        )

    def accumulation(self, job: Job) -> int:
        """Micro batches per step that keep the global batch: global / (data-parallel ranks x micro batch)."""
        return job.global_batch // (self.dims(job).dp * self.micro_batch)

    def name(self) -> str:
        unit = "default" if self.unit_mib is None else f"{self.unit_mib:g}"
        return (
            f"ep{self.ep}-uly{self.ulysses}-ring{self.ring}-rep{self.replicate}-rc_{self.recompute}-"
            f"loss_{self.chunk_loss}-unit_{unit}-mb{self.micro_batch}"
        )

    @classmethod
    def parse(cls, text: str) -> Layout:
        """The inverse of `name` (what --explain takes)."""
        fields = {}
        try:
            for part in text.split("-"):
                for prefix, key, kind in _NAME_PARTS:
                    if part.startswith(prefix):
                        value = part[len(prefix) :]
                        fields[key] = None if value == "default" else kind(value)
                        break
                else:
                    raise ValueError(part)
            return cls(**fields)
        except (ValueError, TypeError):
            raise ValueError(
                f"--explain {text!r} is not a layout name: use one as the table prints it, e.g. {cls().name()!r}."
            ) from None

    def overrides(self, job: Job) -> list[str]:
        """The config keys this layout sets, as command-line overrides."""
        recompute = ["features.recompute.enabled=false"]
        if self.recompute != "off":
            recompute = ["features.recompute.enabled=true", f"features.recompute.granularity={self.recompute}"]
        unit = "null" if self.unit_mib is None else f"{self.unit_mib:g}"
        return [
            f"parallel.expert_parallel_size={self.ep}",
            f"parallel.ulysses_parallel_size={self.ulysses}",
            f"parallel.ring_attention_size={self.ring}",
            f"parallel.data_parallel_replicate_size={self.replicate}",
            *recompute,
            f"features.chunk_loss.mode={self.chunk_loss}",
            f"parallel.fsdp_plan.unit_mib={unit}",
            f"training.micro_batch_size={self.micro_batch}",
            f"training.gradient_accumulation_steps={self.accumulation(job)}",
            f"data.cutoff_len={job.tokens}",
        ]

    def apply(self, config: Config, job: Job) -> Config:
        """`config` with this layout's keys (and the job's sequence length) set."""
        features = config.features
        recompute = dataclasses.replace(
            features.recompute,
            enabled=self.recompute != "off",
            granularity=self.recompute if self.recompute != "off" else features.recompute.granularity,
        )
        chunk = dataclasses.replace(features.chunk_loss, mode=self.chunk_loss)
        fsdp_plan = dataclasses.replace(config.parallel.fsdp_plan, unit_mib=self.unit_mib)
        parallel = dataclasses.replace(
            config.parallel,
            expert_parallel_size=self.ep,
            ulysses_parallel_size=self.ulysses,
            ring_attention_size=self.ring,
            data_parallel_replicate_size=self.replicate,
            fsdp_plan=fsdp_plan,
        )
        training = dataclasses.replace(
            config.training, micro_batch_size=self.micro_batch, gradient_accumulation_steps=self.accumulation(job)
        )
        return dataclasses.replace(
            config,
            parallel=parallel,
            features=dataclasses.replace(features, recompute=recompute, chunk_loss=chunk),
            training=training,
            data=dataclasses.replace(config.data, cutoff_len=job.tokens),
        )

    @classmethod
    def of_config(cls, config: Config) -> Layout:
        """The layout a config runs."""
        p, f = config.parallel, config.features
        return cls(
            ep=p.expert_parallel_size,
            ulysses=p.ulysses_parallel_size,
            ring=p.ring_attention_size,
            replicate=p.data_parallel_replicate_size,
            recompute=f.recompute.granularity if f.recompute.enabled else "off",
            chunk_loss=f.chunk_loss.mode,
            unit_mib=p.fsdp_plan.unit_mib,
            micro_batch=config.training.micro_batch_size,
        )


_NAME_PARTS = (
    ("ep", "ep", int),
    ("uly", "ulysses", int),
    ("ring", "ring", int),
    ("rep", "replicate", int),
    ("rc_", "recompute", str),
    ("loss_", "chunk_loss", str),
    ("unit_", "unit_mib", float),
    ("mb", "micro_batch", int),
)
