"""One run of `bench deepspeed`: a training script written against the DeepSpeed API, on transformers' tiny GLM-4.5V.

`torchrun --nproc_per_node 2 -m glm45v_fsdp.bench.deepspeed_api_worker --backend deepspeed|ds_compat --zero N
--out FILE`: the same script for both backends, the only difference is the import (`import deepspeed` or
`import ds_compat as deepspeed`). The model is transformers' `Glm4vMoeForConditionalGeneration` (the tiny preset with
`--text-layers` text layers, 8 routed experts, a 2-block vision tower), built with the same seed on every rank and
backend; the batches come from the built-in synthetic image-text data (`--text-tokens` text tokens and one image of
`--image-size` px per sample), micro batch `--micro`, the same samples in the same order on both backends. The loss is
transformers' own (`model(**batch, labels=...)`). Rank 0 writes per step the wall ms (device synchronised), the loss
averaged over ranks, and the peak of live tensor bytes of one extra, untimed step (CPU: every tensor Python can
reach at its start counts as already live, so both backends' flat buffers and shards are included); with
`--profile`, torch.profiler's top ops of the timed steps 6-10.

`--backend alternate` (one process, no launcher) measures what this backend costs apart from communication: a 1-rank
gloo group, the bare step on one copy of the model and the ds_compat engine's on another, alternated step by step in
a rotating order so that the machine's drift hits both; it writes both ms lists and both loss lists.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

from glm45v_fsdp.bench.deepspeed_api import WORKLOAD, workload_overrides


def ds_config(args: argparse.Namespace) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.zero},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0, "torch_adam": True},
        },
        "steps_per_print": 10**6,
        "wall_clock_breakdown": False,
    }
    if args.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if args.schedule == "cosine":  # bench parity: the reference's acceptance run (warmup 10%, then cosine to 0)
        config["scheduler"] = {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": args.steps,
                "warmup_num_steps": max(1, round(0.1 * args.steps)),
                "warmup_type": "linear",
                "warmup_min_ratio": 0.0,
                "cos_min_ratio": 0.0,
            },
        }
    if args.ds_extra:  # bench door: the keys that switch the engine's plans
        from glm45v_fsdp.config import deep_merge

        config = deep_merge(config, json.loads(args.ds_extra))
    return config


def build_model(args: argparse.Namespace, world: int):
    """transformers' tiny GLM-4.5V, seeded: the same weights on every rank and backend."""
    from transformers import Glm4vMoeForConditionalGeneration

    from glm45v_fsdp.config import load_config
    from glm45v_fsdp.model.builder import load_hf_config

    config = load_config(None, [*workload_overrides(args, world), *args.model_override])
    hf_config = load_hf_config(config.model)
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(1234)
    model = Glm4vMoeForConditionalGeneration(hf_config)
    return config, hf_config, peft_lora(model, args.lora) if args.lora else model


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]  # and the routed experts' stacks (target_parameters)


def peft_lora(model, rank: int):
    """`--lora R`: the script's model is PEFT's LoRA of it (rank R, alpha 2R) on the text attention and the routed
    experts, as ms-swift's and LLaMA-Factory's GLM-4.5V recipes; B is zero, A seeded (PEFT's initialisation)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(4321)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=LORA_TARGETS,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    return get_peft_model(model, config)


def context_parallel_size(args: argparse.Namespace) -> int:
    """The ranks that split one sequence (sequence_parallel_size x the extension's ring_attention_size)."""
    config = ds_config(args)
    ring = config.get("glm45v_fsdp", {}).get("parallel", {}).get("ring_attention_size", 1)
    return config.get("sequence_parallel_size", 1) * ring


def build_model_and_batches(args: argparse.Namespace, rank: int, world: int):
    """The model and this rank's batches: step s takes samples [(s * dp + dp_rank) * micro, + micro), in order, as
    the trainer's sampler does without shuffling (rank-major chunks of the global batch); the ranks of a context-
    parallel group (dp = world / cp) get the same whole batches, which the engine splits."""
    from glm45v_fsdp.builders import build_training_data
    from glm45v_fsdp.data.collate import BATCH_METADATA_KEYS, collate

    config, hf_config, model = build_model(args, world)
    data = build_training_data(config, hf_config)
    cp = context_parallel_size(args)
    batches = []
    for step in range(args.first_step, args.first_step + args.steps + 1):
        first = (step * (world // cp) + rank // cp) * args.micro
        samples = [data.dataset[index] for index in range(first, first + args.micro)]
        batch = collate(samples, data.tokenizer.pad_token_id)
        batches.append({key: value for key, value in batch.items() if key not in BATCH_METADATA_KEYS})
    return model, batches


def live_tensors() -> list[torch.Tensor]:
    return [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor) and not obj.is_meta]


def bare_step(args: argparse.Namespace, model: torch.nn.Module):
    """The step without any backend (one process, or each rank under torch DDP): plain foreach AdamW, clipping 1.0
    (bf16: autocast)."""
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, foreach=True
    )
    precision = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16")

    def step(batch: dict) -> torch.Tensor:
        with precision:
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach().float()

    return step


def engine_step(engine):
    """The script's step on a DeepSpeed-API engine (the real one or ds_compat's): forward, backward, step."""

    def step(batch: dict) -> torch.Tensor:
        inputs = {key: value.to(engine.device) for key, value in batch.items()}
        loss = engine(**inputs).loss
        engine.backward(loss)
        engine.step()
        return loss.detach().float()

    return step


def alternate(args: argparse.Namespace) -> dict:
    """The bare step and the ds_compat engine's step (1 rank: no collective moves data) alternated in one process."""
    import tempfile

    import ds_compat as deepspeed

    with tempfile.NamedTemporaryFile() as store:
        torch.distributed.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
        bare_model, batches = build_model_and_batches(args, 0, args.world_size)
        _, _, engine_model = build_model(args, args.world_size)
        engine, _, _, _ = deepspeed.initialize(
            model=engine_model, model_parameters=engine_model.parameters(), config=ds_config(args)
        )
        timed = {"bare": ([], [], bare_step(args, bare_model)), "engine": ([], [], engine_step(engine))}
        for index, batch in enumerate(batches[: args.steps]):
            for name in ("bare", "engine") if index % 2 == 0 else ("engine", "bare"):
                ms, losses, step = timed[name]
                started = time.perf_counter()
                losses.append(step(batch).item())
                ms.append((time.perf_counter() - started) * 1000.0)
    return {
        "ms": timed["engine"][0],
        "losses": timed["engine"][1],
        "bare_ms": timed["bare"][0],
        "bare_losses": timed["bare"][1],
    }


def _grad_norm(engine) -> float | None:
    """The engine's global gradient norm of the last step (before clipping), as DeepSpeed reports it."""
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


def save_initial(args: argparse.Namespace, directory: str) -> None:
    """The initial weights as an HF checkpoint and the ds_config, for the trainer door (`--deepspeed`)."""
    _, _, model = build_model(args, args.world_size)
    model.save_pretrained(directory)
    with open(os.path.join(directory, "ds_config.json"), "w") as handle:
        json.dump(ds_config(args), handle, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("deepspeed", "ds_compat", "bare", "ddp", "alternate"), required=True)
    parser.add_argument("--zero", type=int, default=2)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--schedule", choices=("constant", "cosine"), default="constant", help="the ds_config's lr")
    parser.add_argument("--text-layers", type=int, default=WORKLOAD["text_layers"])
    parser.add_argument("--text-tokens", type=int, default=WORKLOAD["text_tokens"])
    parser.add_argument("--image-size", type=int, default=WORKLOAD["image_size"], help="112 px: 8 x 8 = 64 patches")
    parser.add_argument("--cutoff-len", type=int, default=None, help="samples cut at this many tokens")
    parser.add_argument("--eval-split", type=float, default=None, help="data.validation_split held out (bench door)")
    parser.add_argument("--world-size", type=int, default=2, help="bare / --save-initial: the ranks of the others")
    parser.add_argument("--ds-extra", default=None, help="JSON merged into the ds_config (bench door)")
    parser.add_argument("--lora", type=int, default=0, help="the model is PEFT's LoRA of this rank (bench lora)")
    parser.add_argument("--model-override", action="append", default=[], help="our config key=value for the model")
    parser.add_argument("--save-initial", metavar="DIR", help="write the initial weights and ds_config to DIR")
    parser.add_argument("--save", metavar="DIR", help="save_checkpoint(DIR) after the timed steps")
    parser.add_argument("--resume", metavar="DIR", help="load_checkpoint(DIR) first; then --first-step must match")
    parser.add_argument("--first-step", type=int, default=0, help="the global step the batches start at")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    if args.save_initial:
        save_initial(args, args.save_initial)
        return
    if args.backend == "alternate":
        with open(args.out, "w") as handle:
            json.dump(alternate(args), handle)
        return
    if args.backend == "bare":
        rank, world, comm = 0, 1, None
        model, batches = build_model_and_batches(args, 0, args.world_size)
        step = bare_step(args, model)
        device = torch.device("cpu")
    elif args.backend == "ddp":
        torch.distributed.init_process_group("gloo")
        comm = torch.distributed
        rank, world = comm.get_rank(), comm.get_world_size()
        model, batches = build_model_and_batches(args, rank, world)
        step = bare_step(args, torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25))
        device = torch.device("cpu")
    else:
        if args.backend == "deepspeed":
            import deepspeed
        else:
            import ds_compat as deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        comm = deepspeed.comm
        rank, world = comm.get_rank(), comm.get_world_size()
        model, batches = build_model_and_batches(args, rank, world)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(args))
        device = engine.device
        if args.resume:
            engine.load_checkpoint(args.resume)
            assert engine.global_steps == args.first_step, (engine.global_steps, args.first_step)
        step = engine_step(engine)

    ms, losses, grad_norms, profile = [], [], [], None
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if args.profile else None
    for index, batch in enumerate(batches[: args.steps]):
        if profiler is not None and index == 5:
            profiler.start()
        started = time.perf_counter()
        mean = step(batch).clone()
        if comm is not None:
            comm.all_reduce(mean)
        ms.append((time.perf_counter() - started) * 1000.0)
        losses.append(mean.item() / world)
        grad_norms.append(_grad_norm(engine) if args.backend in ("deepspeed", "ds_compat") else None)
        if profiler is not None and index == 9:
            profiler.stop()
            profile = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)

    if args.save:
        engine.save_checkpoint(args.save)

    from glm45v_fsdp.runtime.device import DeviceLayer
    from glm45v_fsdp.runtime.memory_meter import MemoryMeter

    meter = MemoryMeter(DeviceLayer(device.type, "gloo"), enabled=True)
    with meter.track(live_tensors()):
        step(batches[args.steps])
    peak = torch.tensor(float(meter.peak_bytes()))
    if comm is not None:
        comm.all_reduce(peak, op=comm.ReduceOp.MAX)
    if rank == 0:
        result = {
            "ms": ms,
            "losses": losses,
            "grad_norms": grad_norms,
            "peak_bytes_max": peak.item(),
            "profile": profile,
        }
        with open(args.out, "w") as handle:
            json.dump(result, handle)
    if comm is not None:
        comm.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's process-group teardown aborts now and then after a finished run; nothing is left to do


if __name__ == "__main__":
    main()
