"""`python -m glm45v_fsdp.tools.bench lora`: LoRA against full fine-tuning on the same layout, side by side.

Two configurations, each a real training run in its own process on the same model, data, layout (default: EP over
all ranks), and `--repeats` rounds of them, alternating (ABBA) so a drift in machine speed hits both: full
fine-tuning, and LoRA of rank `--rank` on the text attention and the routed experts (model.lora.experts=true). Per
configuration: the median ms/iter of the steps after `--warmup`, each rank's peak memory (cpu: live tensor bytes,
runtime/memory_meter.py), the trainable parameters and the optimizer state they carry (AdamW: two fp32 moments and a
step per trainable tensor), counted on the meta model the plans build (the same count the memory estimator uses).

Then LoRA through the DeepSpeed door against the real DeepSpeed on one script (`--ds-rounds` rotated rounds; 0 skips
it): the DeepSpeed-API worker of `bench deepspeed` (bench/deepspeed_api_worker.py) with `--lora`, which hands
`initialize` PEFT's LoRA model of transformers' tiny GLM-4.5V (text attention + routed experts via
target_parameters), ZeRO 3 and `expert_parallel.autoep_size` = the ranks in one ds_config. The real DeepSpeed trains
it with its generic ZeRO 3 (its AutoEP finds no MoE layer in a PEFT model and says so); `ds-fsdp` builds it on the
plan registry with EP. Figures: median ms/step per run after `--warmup`, DeepSpeed ms / door ms per round, the loss
error of the door against DeepSpeed, each side's peak of live tensor bytes per rank. torch DDP runs the same script in
the same rotation (`--backend ddp`: the whole model on every rank, only the adapters' gradients all-reduced), the floor
of a data-parallel step on it.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from glm45v_fsdp.bench.deepspeed_api import worker_command
from glm45v_fsdp.bench.ep import model_overrides, shape_defaults
from glm45v_fsdp.bench.memory import common_overrides
from glm45v_fsdp.bench.options import add_run_options, check_counts, report_head, settle
from glm45v_fsdp.bench.runner import (
    Run,
    Runner,
    errors,
    load_range,
    md_report,
    md_table,
    memory_pair,
    run_figures,
    write_report,
)

HELP = "LoRA vs full fine-tuning on the same layout: peak memory, optimizer state, ms/step"
DESCRIPTION = "Full fine-tuning and LoRA, each a real training run, alternating rounds."

MIB = 2**20
ADAM_BYTES_PER_PARAM = 8  # exp_avg + exp_avg_sq in fp32 (the step tensors are left out: 4 bytes per tensor)
DS_SIDES = ("ds_compat", "deepspeed", "ddp")  # the door (ds-fsdp), the real DeepSpeed and torch DDP, one script
DS_SPEED_GOAL = 3.0  # DeepSpeed ms / door ms
DS_PARITY_LIMIT = 1e-5  # fp32 mean relative loss error, door vs DeepSpeed


def lora_overrides(args: argparse.Namespace) -> list[str]:
    return [f"model.lora.rank={args.rank}", f"model.lora.alpha={2 * args.rank}", "model.lora.experts=true"]


def trainable_params(overrides: list[str]) -> tuple[int, int]:
    """(trainable, total) parameters of the model a run with these overrides builds (meta device, every plan but
    FSDP and the weights as a dry run, as tools.preflight applies them)."""
    from glm45v_fsdp.config import load_config
    from glm45v_fsdp.model import build_meta_model, load_hf_config
    from glm45v_fsdp.preflight import check_plans, minimal_dims

    config = load_config(None, overrides)
    hf_config = load_hf_config(config.model)
    model = build_meta_model(hf_config)
    _, errors = check_plans(model, config, minimal_dims(config), hf_config)
    assert not errors, errors
    trainable = sum(param.numel() for param in model.parameters() if param.requires_grad)
    return trainable, sum(param.numel() for param in model.parameters())


def door_vs_deepspeed(args: argparse.Namespace, runner: Runner) -> dict[str, Any]:
    """The worker script with PEFT's LoRA model on the real DeepSpeed and through the door, `--ds-rounds` rounds in
    alternating order (ABBA)."""
    extra = {"expert_parallel": {"enabled": True, "autoep_size": args.ranks}}
    worker = argparse.Namespace(
        steps=args.ds_steps, micro=2, ranks=args.ranks, profile=False, ds_extra=extra, bind_cores=args.bind_cores
    )
    results: dict[str, list[dict[str, Any]]] = {side: [] for side in DS_SIDES}
    for index in range(args.ds_rounds):
        for side in DS_SIDES if index % 2 == 0 else DS_SIDES[::-1]:
            run_dir = args.out / "vs_deepspeed" / f"{side}_{index}"
            run = Run(f"{side} lora {index}")
            command = [*worker_command(worker, side, 3, "fp32", run_dir / "result.json"), f"--lora={args.rank}"]
            runner.launch(run, command, run_dir, f"LoRA {side}, round {index + 1}/{args.ds_rounds}", "result")
            results[side].append(run.results[0])
    ms = {side: [statistics.median(r["ms"][args.warmup :]) for r in results[side]] for side in DS_SIDES}
    ratios = [reference / door for reference, door in zip(ms["deepspeed"], ms["ds_compat"])]
    ddp_ratios = [reference / ddp for reference, ddp in zip(ms["deepspeed"], ms["ddp"])]
    loss_error = errors(results["ds_compat"][0]["losses"], results["deepspeed"][0]["losses"])["mean_rel"]
    ratio = statistics.median(ratios)
    return {
        "ms_per_step": {side: statistics.median(ms[side]) for side in DS_SIDES},
        "ms_per_round": ms,
        "ratio_per_round": ratios,
        "speed_ratio": ratio,
        "ddp_ratio_per_round": ddp_ratios,
        "ddp_speed_ratio": statistics.median(ddp_ratios),
        "peak_mib": {side: max(r["peak_bytes_max"] for r in results[side]) / MIB for side in DS_SIDES},
        "loss_mean_rel_err": loss_error,
        "goal": f">= {DS_SPEED_GOAL}x DeepSpeed, loss error <= {DS_PARITY_LIMIT}",
        "bind_cores": args.bind_cores,
        "pass": ratio >= DS_SPEED_GOAL and loss_error <= DS_PARITY_LIMIT,
    }


def report(
    args: argparse.Namespace,
    runs: dict,
    figures: dict[str, dict[str, Any]],
    params: dict[str, tuple[int, int]],
    versus: dict[str, Any] | None,
):
    full, lora = figures["full"], figures["lora"]
    rows = {}
    for name, figure in figures.items():
        trainable, total = params[name]
        rows[name] = {
            "ms_per_iter": figure["ms_per_iter"],
            "mem_peak_max_gib": figure["mem_peak_max_gib"],
            "mem_peak_avg_gib": figure["mem_peak_avg_gib"],
            "trainable_params": trainable,
            "total_params": total,
            "optimizer_mib": trainable * ADAM_BYTES_PER_PARAM / MIB,
            "losses": figure["losses"],
        }
    return {
        **report_head("lora", args, "ranks"),
        "lora_rank": args.rank,
        "runs": rows,
        **memory_pair(full, lora),
        "speedup": full["ms_per_iter"] / lora["ms_per_iter"],
        "optimizer_ratio": rows["lora"]["optimizer_mib"] / rows["full"]["optimizer_mib"],
        "vs_deepspeed": versus,
        "load_avg": load_range(runs.values()),
        "notes": [
            f"{args.repeats} round(s) of both runs, alternating (ABBA); ms/iter: median of the steps after the first "
            f"{args.warmup} over all rounds; peak: each rank's largest over all steps and rounds.",
            "optimizer MiB = trainable parameters x 8 bytes (AdamW's two fp32 moments), counted on the meta model the "
            "plans build; a frozen parameter has no gradient, no reduce-scatter and no optimizer state.",
            f"OMP_NUM_THREADS per rank: {args.threads}; 1-minute load {load_range(runs.values())}.",
        ],
    }


def markdown(result: dict[str, Any]) -> str:
    columns = ("run", "trainable params", "optimizer MiB", "peak max GiB", "peak avg GiB", "ms/iter")
    cells = [
        [name, f"{row['trainable_params']:,} of {row['total_params']:,}", f"{row['optimizer_mib']:.2f}",
         f"{row['mem_peak_max_gib']:.3f}", f"{row['mem_peak_avg_gib']:.3f}", f"{row['ms_per_iter']:.1f}"]
        for name, row in result["runs"].items()
    ]  # fmt: skip
    title = (
        f"LoRA (rank {result['lora_rank']}, attention + routed experts) vs full fine-tuning, {result['ranks']} rank(s)"
    )
    saving = (
        f"peak per rank: {result['saving_max_pct']:.1f}% lower (max rank), {result['saving_avg_pct']:.1f}% (mean); "
        f"optimizer state x{result['optimizer_ratio']:.4f}; step time: LoRA {result['speedup']:.2f}x as fast"
    )
    lines = md_report(title, columns, cells, [saving, *result["notes"]])
    versus = result.get("vs_deepspeed")
    if versus:
        pinned = ["Every side's ranks pinned to their share of the cores (`--bind-cores`).", ""]
        pinned = pinned if versus["bind_cores"] else []
        cells = [
            [DS_NAMES[side], f"{versus['ms_per_step'][side]:.1f}",
             " / ".join(f"{value:.1f}" for value in versus["ms_per_round"][side]), f"{versus['peak_mib'][side]:.1f}"]
            for side in DS_SIDES
        ]  # fmt: skip
        lines += [
            "",
            f"## LoRA on one DeepSpeed-API script: the door (EP {result['ranks']}) vs the real DeepSpeed (ZeRO 3)",
            "",
            *pinned,
            *md_table(("side", "ms/step", "ms/step per round", "peak MiB per rank"), cells),
            "",
            f"- DeepSpeed ms / door ms: {versus['speed_ratio']:.2f} (per round "
            f"{', '.join(f'{r:.2f}' for r in versus['ratio_per_round'])}); loss error door vs DeepSpeed "
            f"{versus['loss_mean_rel_err']:.2e}; goal {versus['goal']}: {'pass' if versus['pass'] else 'MISSED'}",
            f"- DeepSpeed ms / torch DDP ms: {versus['ddp_speed_ratio']:.2f} (per round "
            f"{', '.join(f'{r:.2f}' for r in versus['ddp_ratio_per_round'])}): DDP replicates the whole model and "
            "exchanges only the adapters' gradients, the least any data-parallel step of this script can cost",
        ]
    return "\n".join(lines) + "\n"


DS_NAMES = {
    "ds_compat": "ds-fsdp door (plan registry, EP)",
    "deepspeed": "DeepSpeed (ZeRO 3, generic)",
    "ddp": "torch DDP (no sharding, no EP; floor)",
}


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("lora", help=HELP, description=DESCRIPTION)
    parser.add_argument("--ranks", type=int, default=2, help="processes per run (torchrun when > 1); EP over all")
    shape = shape_defaults(tokens=512, hidden=512, experts=16, top_k=4)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--ds-rounds", type=int, default=4, help="rounds of door vs real DeepSpeed (0: skip)")
    parser.add_argument("--ds-steps", type=int, default=12, help="steps per door / DeepSpeed run")
    parser.add_argument(
        "--bind-cores",
        action="store_true",
        help="door vs DeepSpeed: every side's ranks pinned to their share of the cores (numactl), as DeepSpeed's "
        "launcher pins them under --bind_cores_to_rank",
    )
    add_run_options(parser, Path("output/bench/lora"), device="cpu", steps=6, warmup=2, repeats=2, **shape)


def main_lora(args: argparse.Namespace, argv: list[str]) -> int:
    check_counts("lora", args, ("ranks", "steps", "repeats", "rank", "tokens", "hidden", "experts"))
    settle(args, argv, args.device)
    runner = Runner("bench lora", args.out, args.ranks, args.threads, args.run_timeout)
    layout = [f"parallel.expert_parallel_size={args.ranks}"] if args.experts % args.ranks == 0 else []
    features = {"full": layout, "lora": layout + lora_overrides(args)}

    def plan(name: str):
        def overrides(run_dir: Path) -> list[str]:
            return [*common_overrides(args, run_dir), *model_overrides(args), *features[name], *args.overrides]

        return overrides

    runs = runner.rounds({name: plan(name) for name in features}, args.repeats, alternate=True)
    figures = {name: run_figures(run, args.warmup + 1, stat="median") for name, run in runs.items()}
    shape = [*model_overrides(args), *args.overrides]
    params = {name: trainable_params(shape + features[name]) for name in features}
    versus = door_vs_deepspeed(args, runner) if args.ds_rounds else None
    result = report(args, runs, figures, params, versus)
    write_report(args.out, "lora", result, markdown(result))
    return 0
