"""`python -m glm45v_fsdp.tools.bench matrix`: the reference report's switch matrix, reproduced in one command.

Configurations (its §3.2), each relative to the baseline B = CP1 + EP over all ranks + static chunk loss + recompute,
activation offload and EP balance off:
  00_baseline, 01_ring_cp2, 02_ulysses_cp2, 03_ep1, 04_chunkloss_off, 05_dynamic_chunkloss, 06_recompute_off,
  07_async_offload, 08_ep_balance, 09_full_ring (Ring CP2 + EP + static chunk + recompute + offload + balance),
  10_full_ulysses (the same with Ulysses CP2).
A CP2 configuration keeps the global batch: half the data-parallel ranks, twice the accumulation.

Groups, as the reference runs them:
  F200  single switches (00-08), `steps` steps, statistics over the steps from `stats_from` on;
  F500  combined switches (00, 08, 09, 10) over a longer run;
  P32K  long input: recompute off -> on and offload off -> on on one OFF baseline (p32k_base: B without recompute),
        and Ulysses CP1 -> CP2 at a smaller micro batch (p32k_cp1, p32k_ulysses_cp2).
Presets: `cpu` (this kind of machine: 2 ranks, the tiny model, fp32, lengths scaled; the report says how) and
`npu8` / `gpu8` (one 8-device node with the reference's step counts, batch, cutoff and lengths, bf16).

Every run is its own process (the runner's), started from the same initial weights (one HF checkpoint written
first; optimizer and RNG not restored) and the same unshuffled data. Timing, memory and probe runs are separate
processes, as in the reference, so the probes never enter the timings:
  timing  the group's steps, memory tracking off: losses, grad norms, ms/iter, tokens, chunk choices;
  memory  a short run with training.track_memory=true: each rank's peak;
  probe   a short run with training.profile_steps: torch.profiler's communication share of the step (rank 0), and the
          EP rank load per step (the EP probe: 00 against 08).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from glm45v_fsdp.bench.options import DEVICES, add_run_options, bench_command, settle
from glm45v_fsdp.bench.runner import (
    PARITY_LIMIT,
    Run,
    Runner,
    errors,
    md_table,
    memory_pair,
    pair_figures,
    rank_peaks,
    read_json,
    run_figures,
    write_report,
)
from glm45v_fsdp.errors import UserError

HELP = "the reference report's switch matrix (00-10; F200 / F500 / P32K): parity, speed, memory, probes"
DESCRIPTION = (
    "The 00_baseline ... 10_full_ulysses configurations in the F200, F500 and P32K groups, every run "
    "its own process from the same initial weights; tables (md, json) and charts."
)

CPU_OFFLOAD_NOTE = (
    "On cpu the offload rows count the host copies too: host and device are one memory, so offload can only add to "
    "the figure here; its memory benefit is for cuda/npu (allocator peak)."
)
EXPERTS = 8  # the tiny model's routed experts: the EP size (= ranks) must divide them

# ----------------------------------------------------------------------------------------------------------------
# Configurations and groups
# ----------------------------------------------------------------------------------------------------------------

RING2 = "parallel.ring_attention_size=2"
ULYSSES2 = "parallel.ulysses_parallel_size=2"
OFFLOAD = "features.activation_offload.enabled=true"
BALANCE = "features.ep_balance.enabled=true"
NO_RECOMPUTE = "features.recompute.enabled=false"


@dataclass(frozen=True)
class MatrixConfig:
    """One configuration: its overrides on top of the baseline B, and its context-parallel size."""

    features: tuple[str, ...] = ()
    cp: int = 1
    ep1: bool = False


CONFIGS: dict[str, MatrixConfig] = {
    "00_baseline": MatrixConfig(),
    "01_ring_cp2": MatrixConfig((RING2,), cp=2),
    "02_ulysses_cp2": MatrixConfig((ULYSSES2,), cp=2),
    "03_ep1": MatrixConfig(ep1=True),
    "04_chunkloss_off": MatrixConfig(("features.chunk_loss.mode='off'",)),
    "05_dynamic_chunkloss": MatrixConfig(("features.chunk_loss.mode=dynamic",)),
    "06_recompute_off": MatrixConfig((NO_RECOMPUTE,)),
    "07_async_offload": MatrixConfig((OFFLOAD,)),
    "08_ep_balance": MatrixConfig((BALANCE,)),
    "09_full_ring": MatrixConfig((RING2, OFFLOAD, BALANCE), cp=2),
    "10_full_ulysses": MatrixConfig((ULYSSES2, OFFLOAD, BALANCE), cp=2),
    # P32K: recompute and offload share one OFF baseline (B without recompute); Ulysses has its own pair
    "p32k_base": MatrixConfig((NO_RECOMPUTE,)),
    "p32k_recompute": MatrixConfig(),
    "p32k_offload": MatrixConfig((NO_RECOMPUTE, OFFLOAD)),
    "p32k_cp1": MatrixConfig(),
    "p32k_ulysses_cp2": MatrixConfig((ULYSSES2,), cp=2),
}


@dataclass(frozen=True)
class Pair:
    """One OFF -> ON comparison inside a group."""

    label: str
    off: str
    on: str


@dataclass(frozen=True)
class Group:
    name: str
    configs: tuple[str, ...]
    pairs: tuple[Pair, ...]
    baseline: str  # what the configurations' loss and grad norm are compared against ...
    probes: tuple[str, ...]  # configurations with a probe run (profiler window; EP load)
    long_input: bool = False
    own_baselines: tuple[tuple[str, str], ...] = ()  # ... unless a configuration has its own (P32K's CP pair)

    def baseline_of(self, config: str) -> str:
        return dict(self.own_baselines).get(config, self.baseline)


GROUPS: dict[str, Group] = {
    "F200": Group(
        "F200",
        tuple(
            f"{i:02d}_{name}"
            for i, name in enumerate(
                (
                    "baseline",
                    "ring_cp2",
                    "ulysses_cp2",
                    "ep1",
                    "chunkloss_off",
                    "dynamic_chunkloss",
                    "recompute_off",
                    "async_offload",
                    "ep_balance",
                )
            )
        ),  # fmt: skip
        (
            Pair("Ring CP1→2", "00_baseline", "01_ring_cp2"),
            Pair("Ulysses CP1→2", "00_baseline", "02_ulysses_cp2"),
            Pair("EP1→all ranks", "03_ep1", "00_baseline"),
            Pair("ChunkLoss off→static", "04_chunkloss_off", "00_baseline"),
            Pair("ChunkLoss off→dynamic", "04_chunkloss_off", "05_dynamic_chunkloss"),
            Pair("ChunkLoss static→dynamic", "00_baseline", "05_dynamic_chunkloss"),
            Pair("Recompute off→on", "06_recompute_off", "00_baseline"),
            Pair("Async Offload off→on", "00_baseline", "07_async_offload"),
            Pair("EP Balance off→on", "00_baseline", "08_ep_balance"),
        ),
        "00_baseline",
        ("00_baseline", "01_ring_cp2", "02_ulysses_cp2", "03_ep1", "07_async_offload", "08_ep_balance"),
    ),
    "F500": Group(
        "F500",
        ("00_baseline", "08_ep_balance", "09_full_ring", "10_full_ulysses"),
        (
            Pair("EP Balance off→on", "00_baseline", "08_ep_balance"),
            Pair("B → full Ring (CP2 + offload + balance)", "00_baseline", "09_full_ring"),
            Pair("B → full Ulysses (CP2 + offload + balance)", "00_baseline", "10_full_ulysses"),
        ),
        "00_baseline",
        ("09_full_ring", "10_full_ulysses"),
    ),
    "P32K": Group(
        "P32K",
        ("p32k_base", "p32k_recompute", "p32k_offload", "p32k_cp1", "p32k_ulysses_cp2"),
        (
            Pair("Recompute off→on", "p32k_base", "p32k_recompute"),
            Pair("Async Offload off→on", "p32k_base", "p32k_offload"),
            Pair("Ulysses CP1→CP2", "p32k_cp1", "p32k_ulysses_cp2"),
        ),
        "p32k_base",
        ("p32k_base", "p32k_offload"),
        long_input=True,
        own_baselines=(("p32k_cp1", "p32k_cp1"), ("p32k_ulysses_cp2", "p32k_cp1")),
    ),
}
P32K_CP_CONFIGS = ("p32k_cp1", "p32k_ulysses_cp2")  # the CP pair runs at the smaller micro batch


@dataclass(frozen=True)
class Preset:
    """What a machine runs: ranks, device, dtype, lengths and step counts of each group."""

    device: str
    ranks: int
    dtype: str  # parameters; reductions are fp32
    vocab: int  # the text model's vocabulary: what the chunked loss saves grows with it
    cutoff: int  # F200/F500 data.cutoff_len
    text_tokens: int  # synthetic text per F sample (plus one image)
    samples: int  # F200/F500 data set size (the reference: 2048 fixed samples)
    f200_steps: int
    f500_steps: int
    stats_from: int  # first step of the F groups' statistics
    memory_steps: int
    probe_window: tuple[int, int]
    chunk_size: int
    dynamic_total_chunk_size: int
    offload_min_bytes: int
    long_cutoff: int
    long_images: int
    long_micro: int
    long_cp_micro: int
    long_samples: int
    long_steps: int
    long_stats_from: int
    long_memory_steps: int
    long_probe_window: tuple[int, int]
    note: str


PRESETS: dict[str, Preset] = {
    "cpu": Preset(
        device="cpu",
        ranks=2,
        dtype="fp32",
        vocab=16384,
        cutoff=512,
        text_tokens=440,
        samples=2048,
        f200_steps=200,
        f500_steps=500,
        stats_from=101,
        memory_steps=8,
        probe_window=(4, 6),
        chunk_size=128,
        dynamic_total_chunk_size=256,
        offload_min_bytes=1024,
        long_cutoff=4096,
        long_images=8,
        long_micro=2,
        long_cp_micro=1,
        long_samples=64,
        long_steps=12,
        long_stats_from=5,
        long_memory_steps=4,
        long_probe_window=(3, 4),
        note="cpu preset, scaled from the reference's 8 x Ascend 910B3 set-up: 2 ranks (EP2; CP2 leaves one "
        "data-parallel rank) instead of 8, fp32 parameters instead of bf16 (so every exact switch is judged at "
        "1e-5), the tiny model (4 text layers, hidden 64, 8 routed experts top-2) with a 16384-word vocabulary "
        "instead of GLM-4.5V's 151552 (the logits the chunked loss avoids keep a comparable share), cutoff 512 "
        "instead of 1024 (static chunk 128 / dynamic total 256 instead of 1024 / 4096, so a "
        "sample spans several chunks), the F200/F500 step counts and windows as the reference's; P32K at 4096 "
        "tokens instead of 32768, micro 2 (CP pair: 1) instead of 64 (16), 12 steps (statistics from step 5) "
        "instead of 40 (from 11); memory runs 8 steps (P32K: 4) instead of 30 (12); profiler windows steps 4-6 "
        "(P32K: 3-4) instead of 20-24 (10-12); offload moves saved tensors from 1 KiB (the default 1 MiB leaves "
        "the tiny model's activations in place).",
    ),
    "npu8": Preset(
        device="npu",
        ranks=8,
        dtype="bf16",
        vocab=151552,
        cutoff=1024,
        text_tokens=960,
        samples=2048,
        f200_steps=200,
        f500_steps=500,
        stats_from=101,
        memory_steps=30,
        probe_window=(20, 24),
        chunk_size=1024,
        dynamic_total_chunk_size=4096,
        offload_min_bytes=1 << 20,
        long_cutoff=32768,
        long_images=16,
        long_micro=64,
        long_cp_micro=16,
        long_samples=512,
        long_steps=40,
        long_stats_from=11,
        long_memory_steps=12,
        long_probe_window=(10, 12),
        note="npu8 preset: the reference's counts for one 8-device node (the tiny model with GLM-4.5V's 151552-word "
        "vocabulary): 8 ranks (EP8; CP2 with 4 data-parallel "
        "ranks and accumulation 2), bf16 parameters with fp32 reductions, cutoff 1024, global batch 8, F200 200 "
        "steps (statistics 101-200), F500 500 (101-500), memory runs of 30 steps, profiler steps 20-24; P32K at "
        "32768 tokens, micro 64 (global batch 512) and 16 for the CP pair (global 128), 40 steps (11-40), memory "
        "12 steps, profiler steps 10-12; static chunk 1024, dynamic total 4096.",
    ),
}
PRESETS["gpu8"] = replace(PRESETS["npu8"], device="cuda", note=PRESETS["npu8"].note.replace("npu8", "gpu8"))


# ----------------------------------------------------------------------------------------------------------------
# Planning runs
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One process to run: a configuration of a group, as a timing, memory or probe run."""

    group: str
    config: str
    kind: str  # "timing", "memory", "probe"

    @property
    def name(self) -> str:
        return f"{self.group}_{self.config}_{self.kind}"


def group_steps(group: Group, preset: Preset, steps: int | None) -> tuple[int, int]:
    """(steps, first step of the statistics) of a group's timing runs; --steps keeps the preset's window share."""
    if group.long_input:
        total, first = preset.long_steps, preset.long_stats_from
    else:
        total = preset.f200_steps if group.name == "F200" else preset.f500_steps
        first = preset.stats_from
    if steps is None:
        return total, first
    return steps, min(steps, max(1, round(steps * (first - 1) / total) + 1))


def model_shape(preset: Preset) -> list[str]:
    """The tiny model with the preset's vocabulary and room for the longest input (the initial weights' shape)."""
    text = "model.config_overrides.text_config"
    return [f"{text}.vocab_size={preset.vocab}", f"{text}.max_position_embeddings={max(4096, preset.long_cutoff)}"]


def model_and_data(preset: Preset, group: Group, config: str) -> list[str]:
    """The data of a group (the F groups' fixed samples or P32K's long ones) and the model's position limit."""
    if not group.long_input:
        return [
            *model_shape(preset),
            f"data.cutoff_len={preset.cutoff}",
            f"data.synthetic_text_tokens={preset.text_tokens}",
            "data.synthetic_images_per_sample=1",
            f"data.synthetic_samples={preset.samples}",
            "training.micro_batch_size=1",
        ]
    micro = preset.long_cp_micro if config in P32K_CP_CONFIGS else preset.long_micro
    return [
        *model_shape(preset),
        f"data.cutoff_len={preset.long_cutoff}",
        f"data.synthetic_text_tokens={preset.long_cutoff}",
        f"data.synthetic_images_per_sample={preset.long_images}",
        f"data.synthetic_samples={preset.long_samples}",
        f"training.micro_batch_size={micro}",
    ]


def common(preset: Preset, ranks: int, initial: Path) -> list[str]:
    """What every run shares: the device and dtype, the initial weights, unshuffled data, the reference's optimizer
    and schedule (AdamW lr 1e-5, cosine, warmup 0.1, no weight decay, seed 1234)."""
    return [
        f"training.device={preset.device}",
        f"training.load={initial}",
        f"parallel.fsdp_plan.param_dtype={preset.dtype}",
        "parallel.fsdp_plan.reduce_dtype=fp32",
        "data.dataset=synthetic",
        "data.shuffle=false",
        "training.lr=1e-5",
        "training.min_lr=0",
        "training.lr_scheduler=cosine",
        "training.lr_warmup_ratio=0.1",
        "training.weight_decay=0",
        "training.seed=1234",
        "training.progress_bar=false",
        "training.loss_type=default",
    ]


def baseline_features(preset: Preset, ranks: int) -> list[str]:
    """B: EP over all ranks, static chunk loss, recompute; offload and balance off (their sizes set for when on)."""
    return [
        f"parallel.expert_parallel_size={ranks}",
        "features.chunk_loss.mode=static",
        f"features.chunk_loss.chunk_size={preset.chunk_size}",
        f"features.chunk_loss.total_chunk_size={preset.dynamic_total_chunk_size}",
        "features.recompute.enabled=true",
        f"features.activation_offload.min_tensor_bytes={preset.offload_min_bytes}",
    ]


def job_overrides(job: Job, args: argparse.Namespace, run_dir: Path) -> list[str]:
    """Everything a run is given, in order: common, data, B, the configuration, the kind's steps, the user's."""
    preset, group, config = args.preset_values, GROUPS[job.group], CONFIGS[job.config]
    overrides = common(preset, args.ranks, args.initial) + model_and_data(preset, group, job.config)
    overrides += baseline_features(preset, args.ranks)
    if config.ep1:
        overrides.append("parallel.expert_parallel_size=1")
    overrides += list(config.features)
    overrides.append(f"training.gradient_accumulation_steps={config.cp}")
    steps, stats_from = group_steps(group, preset, args.steps)
    if job.kind == "timing":
        overrides += [f"training.train_iters={steps}", f"training.stats_start_step={stats_from}"]
        overrides += ["training.track_memory=false", f"training.log_interval={max(1, steps // 10)}"]
    elif job.kind == "memory":
        memory_steps = preset.long_memory_steps if group.long_input else preset.memory_steps
        overrides += [f"training.train_iters={memory_steps}", "training.track_memory=true"]
        overrides.append(f"training.log_interval={memory_steps}")
    else:
        first, last = preset.long_probe_window if group.long_input else preset.probe_window
        overrides += [f"training.train_iters={last}", f"training.profile_steps=[{first},{last}]"]
        overrides += ["training.track_memory=false", f"training.log_interval={last}"]
    return overrides + [f"training.output_dir={run_dir}", *args.overrides]


def plan(args: argparse.Namespace) -> list[Job]:
    """The runs of the chosen groups and configurations: every timing run first, then memory, then probes."""
    jobs: list[Job] = []
    for kind in ("timing", "memory", "probe"):
        for name in args.groups:
            group = GROUPS[name]
            chosen = [c for c in group.configs if args.configs is None or c in args.configs]
            if kind == "probe":
                chosen = [c for c in chosen if c in group.probes]
            jobs += [Job(name, config, kind) for config in chosen]
    return jobs


def initial_weights(args: argparse.Namespace, runner: Runner) -> Path:
    """The one checkpoint every run starts from: the tiny model initialised from the seed, exported as HF safetensors
    after one step at lr 0 (the weights unchanged; the optimizer state is not saved with them)."""
    directory = args.out / "initial"
    if (directory / "model.safetensors").exists() or (directory / "model.safetensors.index.json").exists():
        return directory
    preset = args.preset_values
    run_dir = args.out / "runs" / "initial"
    overrides = [
        f"training.device={preset.device}",
        *model_shape(preset),
        "training.train_iters=1",
        "training.lr=0",
        "training.min_lr=0",
        "training.seed=1234",
        "training.progress_bar=false",
        f"training.save_hf={directory}",
        f"training.output_dir={run_dir}",
        *args.overrides,
    ]
    label = "initial weights (1 step at lr 0, exported as HF safetensors)"
    runner.train(Run("initial weights"), overrides, run_dir, label, ranks=1)
    return directory


# ----------------------------------------------------------------------------------------------------------------
# Figures
# ----------------------------------------------------------------------------------------------------------------


def config_rows(group: Group, timing: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per configuration (its timing run's figures over the statistics window): loss and grad-norm errors against
    its baseline over every step, mean ms/iter, P95, P99, samples/s, non-padding tokens/s and their per-step series."""
    rows = {}
    for config, figures in timing.items():
        base = timing.get(group.baseline_of(config))
        loss = errors(figures["losses"], base["losses"]) if base else None
        grad = errors(figures["grad_norms"], base["grad_norms"]) if base else None
        rows[config] = {
            "config": config,
            "baseline": group.baseline_of(config),
            "loss_mean_rel_err": loss["mean_rel"] if loss else None,
            "loss_max_rel_err": loss["max_rel"] if loss else None,
            "grad_norm_mean_rel_err": grad["mean_rel"] if grad else None,
            **{key: figures[key] for key in ("ms_per_iter", "p95_ms", "p99_ms", "samples_per_s", "tokens_per_s")},
            "global_batch_size": figures["global_batch_size"],
            "losses": figures["losses"],
            "grad_norms": figures["grad_norms"],
            "tokens_per_s_per_step": figures["tokens_per_s_per_step"],
            "tokens_per_step": figures["tokens_per_step"],
        }
    return rows


def pair_rows(group: Group, timing: dict[str, dict[str, Any]], memory: dict[str, dict[str, Any]]) -> list[dict]:
    """Per switch pair present: the runner's OFF -> ON figures of the timing runs (loss errors over every step,
    ms/iter and samples/s over the statistics window, throughput change), parity against the limit, and the peaks
    and savings of the memory runs."""
    rows = []
    for pair in group.pairs:
        if pair.off not in timing or pair.on not in timing:
            continue
        row = {"label": pair.label, **pair_figures(timing[pair.off], timing[pair.on])}
        row["parity_pass"] = row["loss_mean_rel_err"] <= PARITY_LIMIT
        if pair.off in memory and pair.on in memory:
            row |= memory_pair(memory[pair.off], memory[pair.on])
        rows.append(row)
    return rows


def timing_figures(config: str, run: Run, stats_from: int) -> dict[str, Any]:
    """A timing run's figures (the runner's, mean ms/iter over the statistics window, named by its configuration)
    and its per-step series."""
    figures = run_figures(run, stats_from, stat="mean") | {"name": config}
    figures["tokens_per_s_per_step"] = [r["tokens_per_s"] for r in run.records]
    figures["tokens_per_step"] = [r["tokens"] for r in run.records]
    return figures


def _cv(values: list[float]) -> float:
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean else float("nan")


def ep_probe(off: list[dict], on: list[dict]) -> dict[str, Any] | None:
    """The EP probe (balance off: 00 against on: 08, probe runs): each EP rank's mean assignments ((token, expert)
    pairs it computed, summed over MoE layers) per step, the CV and max/mean of those means, the mean and max of the
    per-step CV, and whether the assignments are conserved: per step the same total before and after balance, and
    the same totals with balance off and on."""

    def side(records: list[dict], when: str) -> dict[str, Any]:
        loads = [r[f"ep_load_per_rank_{when}"] for r in records]
        per_rank = [statistics.fmean(step[i] for step in loads) for i in range(len(loads[0]))]
        per_step_cv = [_cv(step) for step in loads]
        return {
            "mean_per_rank": per_rank,
            "cv": _cv(per_rank),
            "max_over_mean": max(per_rank) / statistics.fmean(per_rank),
            "per_step_cv_mean": statistics.fmean(per_step_cv),
            "per_step_cv_max": max(per_step_cv),
            "total": sum(sum(step) for step in loads),
            "totals_per_step": [sum(step) for step in loads],
        }

    if not off or "ep_load_per_rank_before" not in off[0] or "ep_load_per_rank_after" not in on[0]:
        return None
    balance_off, balance_on = side(off, "before"), side(on, "after")
    routed = side(on, "before")["totals_per_step"]
    return {
        "off": balance_off,
        "on": balance_on,
        "steps": len(off),
        "conserved_within_step": routed == balance_on["totals_per_step"],
        "conserved_across_runs": balance_off["totals_per_step"] == balance_on["totals_per_step"],
    }


def comm_rows(probe_dirs: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """Rank 0's profiler summary per probed configuration (communication ms per step, its share, collectives)."""
    paths = {config: run_dir / "profile" / "rank0.json" for config, run_dir in probe_dirs.items()}
    return {config: read_json(path) for config, path in paths.items() if path.exists()}


def chunk_trace(records: list[dict]) -> dict[str, Any]:
    """Rank 0's chunked-loss choices per step (one entry per micro batch) and how often each (size, count) came."""
    steps = [
        {"step": r["step"], "chunk_size": r.get("chunk_size"), "chunk_count": r.get("chunk_count")} for r in records
    ]
    seen: dict[str, int] = {}
    for entry in steps:
        for size, count in zip(entry["chunk_size"] or [], entry["chunk_count"] or []):
            key = f"{count} x {size}"
            seen[key] = seen.get(key, 0) + 1
    return {"per_step": steps, "choices": seen}


# ----------------------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------------------


def _pct(value: float | None, digits: int = 6) -> str:
    return "–" if value is None or not math.isfinite(value) else f"{value * 100:.{digits}f}%"


def _arrow(values: list[float], fmt: str) -> str:
    return " → ".join(fmt.format(v) for v in values)


def group_markdown(result: dict[str, Any]) -> list[str]:
    name = result["group"]
    lines = [
        f"## {name}: {result['steps']} steps, statistics over steps {result['stats_from']}–{result['steps']}",
        "",
    ]
    if result["pairs"]:
        columns = ("switch", "configs", "loss mean rel err", "max abs err", "ms/iter off→on", "samples/s off→on",
                   "throughput change", "parity ≤ 1e-5")  # fmt: skip
        lines += md_table(columns, [
            [p["label"], f"{p['off_run']} → {p['on_run']}", _pct(p["loss_mean_rel_err"]),
             f"{p['loss_max_abs_err']:.6f}", _arrow(p["ms_per_iter"], "{:.1f}"), _arrow(p["samples_per_s"], "{:.3f}"),
             f"{p['throughput_change_pct']:+.2f}%", "pass" if p["parity_pass"] else "FAIL"]
            for p in result["pairs"]
        ])  # fmt: skip
        lines.append("")
    columns = ("config", "loss mean rel err", "loss max rel err", "grad-norm mean rel err", "ms/iter (mean)",
               "P95 / P99 ms", "samples/s", "tokens/s (non-padding)")  # fmt: skip
    lines += md_table(columns, [
        [c["config"], _pct(c["loss_mean_rel_err"]), _pct(c["loss_max_rel_err"]), _pct(c["grad_norm_mean_rel_err"], 4),
         f"{c['ms_per_iter']:.1f}", f"{c['p95_ms']:.1f} / {c['p99_ms']:.1f}", f"{c['samples_per_s']:.3f}",
         f"{c['tokens_per_s']:.0f}"]
        for c in result["configs"].values()
    ])  # fmt: skip
    own = sorted({c["baseline"] for c in result["configs"].values()} - {result["baseline"]})
    against = result["baseline"] + (f" ({', '.join(own)} for the configurations at its micro batch)" if own else "")
    lines += ["", f"Errors against {against} over every step; timing over the statistics window.", ""]
    with_memory = [p for p in result["pairs"] if "peak_max_gib" in p]
    if with_memory:
        lines += [
            f"Per-rank peak memory ({result['memory_kind']}, GiB, {result['memory_steps']}-step memory runs):",
            "",
        ]
        columns = ("switch", "configs", "max-rank off→on", "avg-rank off→on", "max-rank saving", "avg-rank saving")
        if result["memory_kind"].endswith("CPU tracker") and any("offload" in p["on_run"] for p in with_memory):
            lines += [CPU_OFFLOAD_NOTE, ""]
        lines += md_table(columns, [
            [p["label"], f"{p['off_run']} → {p['on_run']}", _arrow(p["peak_max_gib"], "{:.6f}"),
             _arrow(p["peak_avg_gib"], "{:.6f}"), f"{p['saving_max_pct']:+.3f}%", f"{p['saving_avg_pct']:+.3f}%"]
            for p in with_memory
        ])  # fmt: skip
        lines.append("")
    if result["comm"]:
        first, last = result["probe_window"]
        lines += [f"Communication (rank 0, torch.profiler over steps {first}–{last} of a separate probe run; FSDP, "
                  "EP and CP traffic together):", ""]  # fmt: skip
        columns = ("config", "communication ms/step", "step ms", "communication share", "collectives (calls, ms)")
        lines += md_table(columns, [
            [config, f"{c['comm_ms']:.2f}", f"{c['step_ms']:.1f}", f"{c['comm_share'] * 100:.2f}%",
             "; ".join(f"{op} {v['calls']}, {v['ms']:.1f}" for op, v in c["collectives"].items())]
            for config, c in result["comm"].items()
        ])  # fmt: skip
        lines.append("")
    probe = result.get("ep_probe")
    if probe:
        off, on = probe["off"], probe["on"]
        lines += [f"EP probe (probe runs, {probe['steps']} steps; assignments = (token, expert) pairs an EP rank "
                  "computed, summed over MoE layers):", ""]  # fmt: skip
        lines += md_table(("EP rank", "balance off: mean assignments/step", "balance on"), [
            [str(i), f"{a:.1f}", f"{b:.1f}"] for i, (a, b) in enumerate(zip(off["mean_per_rank"], on["mean_per_rank"]))
        ])  # fmt: skip
        lines += [""]
        lines += md_table(("figure", "balance off", "balance on"), [
            ["CV of the ranks' mean load", f"{off['cv']:.6f}", f"{on['cv']:.6f}"],
            ["max/mean of the ranks' mean load", f"{off['max_over_mean']:.6f}", f"{on['max_over_mean']:.6f}"],
            ["per-step CV, mean", f"{off['per_step_cv_mean']:.6f}", f"{on['per_step_cv_mean']:.6f}"],
            ["per-step CV, max", f"{off['per_step_cv_max']:.6f}", f"{on['per_step_cv_max']:.6f}"],
            ["total assignments", f"{off['total']:.0f}", f"{on['total']:.0f}"],
        ])  # fmt: skip
        conserved = probe["conserved_within_step"] and probe["conserved_across_runs"]
        lines += ["", f"Assignments conserved (every step's total equal before/after balance and between the runs): "
                  f"{'yes' if conserved else 'NO'}.", ""]  # fmt: skip
    trace = result.get("chunk_trace")
    if trace:
        choices = ", ".join(f"{key}: {count}" for key, count in trace["choices"].items())
        lines += [f"Dynamic chunk loss trace (rank 0, every micro batch of the timing run; chunks x rows): {choices}. "
                  "Per step in the JSON.", ""]  # fmt: skip
    return lines


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Switch matrix ({report['preset']} preset: {report['device']}, {report['ranks']} ranks, {report['dtype']})",
        "",
        f"Command: `{' '.join(report['command'][2:])}`; wall time {report['wall_s'] / 60:.1f} min for "
        f"{report['processes']} training processes.",
        "",
        *[f"- {note}" for note in report["notes"]],
        "",
    ]
    for result in report["groups"].values():
        lines += group_markdown(result)
    return "\n".join(lines)


def charts(report: dict[str, Any]) -> dict[str, Any]:
    """File name -> drawing function: per group the ms/iter of each switch pair (OFF blue, ON orange) and the
    per-configuration peak memory (max-rank, avg-rank), and the loss comparison of every pair."""
    from glm45v_fsdp.bench.charts import config_bars, loss_comparison_chart

    drawn: dict[str, Any] = {}
    where = f"{report['device']}, {report['ranks']} ranks, {report['dtype']}"
    for name, result in report["groups"].items():
        pairs = result["pairs"]
        if pairs:
            drawn[f"{name}_ms_per_iter.png"] = lambda path, pairs=pairs, name=name: config_bars(
                [p["label"] for p in pairs],
                [[p["ms_per_iter"][0] for p in pairs], [p["ms_per_iter"][1] for p in pairs]],
                ("OFF", "ON"),
                f"{name}: ms/iter per switch, OFF → ON (mean over the statistics window) — {where}",
                "ms/iter",
                path,
                value_format="{:.1f}",
            )
        memory, kind = result["memory"], result["memory_kind"]
        offload = kind.endswith("CPU tracker") and any("offload" in config for config in memory)
        if memory:
            drawn[f"{name}_memory.png"] = lambda path, memory=memory, name=name, kind=kind, offload=offload: (
                config_bars(
                    list(memory),
                    [[m["max"] for m in memory.values()], [m["avg"] for m in memory.values()]],
                    ("max-rank", "avg-rank"),
                    f"{name}: peak memory per configuration, {kind} — {where}"
                    + ("\n(on cpu offload's host copies count too: host and device are one memory)" if offload else ""),
                    "GiB",
                    path,
                    value_format="{:.4f}",
                )
            )
        for index, pair in enumerate(pairs):
            configs = result["configs"]
            off, on = configs[pair["off_run"]]["losses"], configs[pair["on_run"]]["losses"]
            drawn[f"plots/{name}_{index + 1:02d}_{pair['off_run']}_vs_{pair['on_run']}.png"] = (
                lambda path, off=off, on=on, pair=pair, name=name: loss_comparison_chart(
                    list(range(1, min(len(off), len(on)) + 1)),
                    off,
                    on,
                    f"OFF: {pair['off_run']}",
                    f"ON: {pair['on_run']}",
                    f"{name} {pair['label']}: {pair['off_run']} vs {pair['on_run']} ({where})",
                    path,
                )
            )
    return drawn


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------


def run_matrix(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    preset = args.preset_values
    runner = Runner("bench matrix", args.out, args.ranks, args.threads, args.run_timeout)
    args.initial = initial_weights(args, runner).absolute()
    jobs = plan(args)
    runs: dict[Job, Run] = {}
    for index, job in enumerate(jobs):
        run_dir = runner.run_dir(job.name)
        run = runs[job] = Run(job.name, job_overrides(job, args, run_dir))
        label = f"[{index + 1}/{len(jobs)}] {job.group} {job.config} {job.kind}"
        runner.train(run, run.overrides, run_dir, label=label)
    memory_kind = "allocator peak" if preset.device != "cpu" else "live tensor bytes, CPU tracker"
    groups = {}
    for name in args.groups:
        group = GROUPS[name]
        steps, stats_from = group_steps(group, preset, args.steps)
        by_kind = {
            kind: {job.config: run for job, run in runs.items() if job.group == name and job.kind == kind}
            for kind in ("timing", "memory", "probe")
        }
        timing = {config: timing_figures(config, run, stats_from) for config, run in by_kind["timing"].items()}
        memory = {config: run_figures(run, 1, stat="mean") for config, run in by_kind["memory"].items()}
        probe_dirs = {job.config: runner.run_dir(job.name) for job in runs if job.group == name and job.kind == "probe"}
        result: dict[str, Any] = {
            "group": name,
            "steps": steps,
            "stats_from": stats_from,
            "baseline": group.baseline,
            "memory_kind": memory_kind,
            "memory_steps": preset.long_memory_steps if group.long_input else preset.memory_steps,
            "probe_window": list(preset.long_probe_window if group.long_input else preset.probe_window),
            "configs": config_rows(group, timing),
            "pairs": pair_rows(group, timing, memory),
            "memory": {config: rank_peaks(run.repeats) for config, run in by_kind["memory"].items()},
            "comm": comm_rows(probe_dirs),
        }
        probes = {config: run.records for config, run in by_kind["probe"].items()}
        if "00_baseline" in probes and "08_ep_balance" in probes:
            result["ep_probe"] = ep_probe(probes["00_baseline"], probes["08_ep_balance"])
        if "05_dynamic_chunkloss" in by_kind["timing"]:
            result["chunk_trace"] = chunk_trace(by_kind["timing"]["05_dynamic_chunkloss"].records)
        groups[name] = result
    wall = time.perf_counter() - started
    report = {
        "benchmark": "matrix",
        "preset": args.preset,
        "device": preset.device,
        "ranks": args.ranks,
        "dtype": preset.dtype,
        "command": bench_command(args.argv),
        "wall_s": wall,
        "processes": len(jobs) + 1,
        "notes": notes(args, preset),
        "groups": groups,
    }
    write_report(args.out, "matrix", report, markdown(report), charts(report))
    return report


def notes(args: argparse.Namespace, preset: Preset) -> list[str]:
    return [
        preset.note if args.ranks == preset.ranks else f"{preset.note} Run here at --ranks {args.ranks}.",
        "Definitions (the reference's §3.3): loss mean relative error = mean(|test − ref| / (|ref| + 1e-8)) over "
        "every step; samples/s = global batch × 1000 / mean ms/iter of the statistics window; throughput change = "
        "(samples/s on / off − 1) × 100; memory saving = (off − on) / off × 100 on the max-rank and avg-rank peak "
        "(negative: more memory); tokens/s counts non-padding tokens.",
        "Every run starts from the same initial weights (one HF checkpoint; optimizer and RNG not restored) with the "
        "same unshuffled synthetic image-text samples; timing, memory and probe runs are separate processes. CP "
        "configurations keep the global batch (half the data-parallel ranks, twice the accumulation).",
        f"OMP_NUM_THREADS per rank: {args.threads}.",
    ]


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("matrix", help=HELP, description=DESCRIPTION)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--configs", default=None, help="comma-separated configurations (default: all of each group)")
    parser.add_argument("--groups", default="F200,F500,P32K", help="comma-separated, from F200, F500, P32K")
    parser.add_argument("--ranks", type=int, default=None, help="processes per run (default: the preset's)")
    parser.add_argument("--device", choices=DEVICES, default=None, help="default: the preset's")
    parser.add_argument("--steps", type=int, default=None, help="timing steps of every group (default: the preset's)")
    add_run_options(parser, Path("output/bench/matrix"))


def main_matrix(args: argparse.Namespace, argv: list[str]) -> int:
    from glm45v_fsdp.bench.charts import require_matplotlib

    require_matplotlib()  # before an hour of runs, not after
    preset = PRESETS[args.preset]
    if args.device is not None:
        preset = replace(preset, device=args.device)
    args.preset_values = preset
    args.ranks = args.ranks or preset.ranks
    args.groups = [name.strip() for name in args.groups.split(",") if name.strip()]
    unknown = [name for name in args.groups if name not in GROUPS]
    if unknown or not args.groups:
        raise UserError(f"bench matrix: --groups {unknown or args.groups} unknown; choose from {', '.join(GROUPS)}.")
    if args.configs is not None:
        args.configs = [name.strip() for name in args.configs.split(",") if name.strip()]
        known = {c for name in args.groups for c in GROUPS[name].configs}
        bad = [c for c in args.configs if c not in known]
        if bad or not args.configs:
            raise UserError(
                f"bench matrix: --configs {bad or args.configs} are not configurations of the groups "
                f"{', '.join(args.groups)}; choose from {', '.join(sorted(known))}."
            )
    if args.ranks < 2 or args.ranks % 2 or EXPERTS % args.ranks:
        raise UserError(
            f"bench matrix: --ranks {args.ranks}: the baseline runs EP over all ranks and the CP configurations "
            f"CP2, so the ranks must be even and divide the model's {EXPERTS} routed experts (2, 4 or 8)."
        )
    if args.steps is not None and args.steps < 2:
        raise UserError(f"bench matrix: --steps must be >= 2, got {args.steps}.")
    settle(args, argv, preset.device)
    report = run_matrix(args)
    failed = [
        f"{name} {pair['label']}" for name, result in report["groups"].items() for pair in result["pairs"]
        if not pair["parity_pass"]
    ]  # fmt: skip
    if failed:
        print(f"bench matrix: loss parity above {PARITY_LIMIT:g}: {', '.join(failed)}")
    return 0
