"""Scripts written for DeepSpeed that get stuck: rank --hang-rank stops after optimizer step --hang-after, as a
deadlocked data loader would (it never calls into the engine again), while the other ranks wait for it in the next
step's collectives. The step deadline (ds_compat/step_watch.py, the extension section's training.step_timeout_s)
must end every rank with exit 5 and name the rank behind. tests/test_ds_stuck.py and tests/test_multinode.py run it.
With --pause-s instead, every rank pauses that long after the step (the script's own time, outside the engine),
trains --hang-after more steps and ends with exit 0: a healthy pause longer than the timeout ends nothing.

--mode api: a DeepSpeed-API loop (tests/ds_api_script.py's model and data: `loss = engine(batch)`,
`engine.backward(loss)`, `engine.step()`); --mode hf: the HF Trainer on a tiny Llama, stuck in a callback after
the step. Before it stops, the stuck rank writes <out>/fired (the tests time the end of the job from it).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ds_api_script as base  # noqa: E402  (`import deepspeed` or ds_compat, as that script decides)
import torch  # noqa: E402

deepspeed = base.deepspeed


def stop_or_pause(args: argparse.Namespace, rank: int) -> None:
    """After step --hang-after: the stuck rank stops for good; with --pause-s every rank pauses that long."""
    if args.pause_s:
        time.sleep(args.pause_s)
    elif rank == args.hang_rank:
        (args.out / "fired").write_text("")
        threading.Event().wait()


def extension(args: argparse.Namespace) -> dict:
    return {"glm45v_fsdp": {"training": {"step_timeout_s": args.timeout, "output_dir": str(args.out)}}}


def api(args: argparse.Namespace) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    config = {**base.ds_config(2, 1, 2), **extension(args)}
    torch.manual_seed(1234)
    model = base.TinyLM()
    engine, _, loader, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), training_data=base.Tokens(400 * world), config=config
    )
    for step, batch in enumerate(loader):
        if step == args.hang_after:
            stop_or_pause(args, rank)
        if step == 2 * args.hang_after and args.pause_s:
            return
        loss = engine(base.to_device(batch, engine.device))
        engine.backward(loss)
        engine.step()


def hf(args: argparse.Namespace) -> None:
    from accelerate import PartialState
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 400

        def __getitem__(self, index: int) -> dict:
            ids = torch.randint(0, 128, (32,), generator=torch.Generator().manual_seed(index))
            return {"input_ids": ids, "labels": ids}

    class StopAfterStep(TrainerCallback):
        def on_step_end(self, training_args, state, control, **kwargs):
            if state.global_step == args.hang_after:
                stop_or_pause(args, training_args.process_index)
            control.should_training_stop = state.global_step == 2 * args.hang_after

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # CPU: a state made for DeepSpeed over gloo, as hf_trainer_script
    PartialState(backend="gloo")
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 2},
        **extension(args),
    }
    training = TrainingArguments(
        output_dir=str(args.out / "hf"),
        per_device_train_batch_size=2,
        max_steps=100,
        report_to=[],
        deepspeed=ds_config,
        dataloader_num_workers=0,
        save_strategy="no",
        accelerator_config={"use_configured_state": True},
    )
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    Trainer(model=LlamaForCausalLM(config), args=training, train_dataset=Tokens(), callbacks=[StopAfterStep()]).train()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("api", "hf"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=5.0, help="training.step_timeout_s")
    parser.add_argument("--hang-rank", type=int, default=1)
    parser.add_argument("--hang-after", type=int, default=3, help="the optimizer steps before the rank stops")
    parser.add_argument("--pause-s", type=float, default=0.0, help="every rank pauses instead; the job ends with 0")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    api(args) if args.mode == "api" else hf(args)
    if not args.pause_s:
        raise SystemExit("the job was meant to get stuck and end with exit 5, but it trained to the end")
    (args.out / "done").write_text("")


if __name__ == "__main__":
    main()
