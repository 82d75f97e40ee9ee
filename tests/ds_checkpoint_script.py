"""A DeepSpeed-API script that saves and resumes: tests/test_ds_checkpoint.py runs it on both backends.

    torchrun --nproc_per_node W tests/ds_checkpoint_script.py --backend deepspeed|ds_compat --phase train|resume
        [--zero 0,1,2,3] [--dtype fp32|bf16] --save_dir DIR --out result.json

`train` trains tests/ds_api_script.py's tiny LM for --steps optimizer steps from scratch and saves a checkpoint per
ZeRO stage under DIR/zero<Z> with a client state; `resume` builds a fresh engine, loads that checkpoint, checks the
client state and trains --steps more. Every step trains on the same global batch of --global_batch samples whatever
the world size (accumulation = global batch / (micro x world)), so a resume on any number of ranks sees the losses of
a resume on the saving world size. Rank 0 writes the loss per step (mean over the global batch) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--backend=deepspeed" in sys.argv:
    import deepspeed
else:
    import ds_compat as deepspeed

from ds_api_script import TinyLM, Tokens  # noqa: E402
from ds_api_script import ds_config as api_config  # noqa: E402

from glm45v_fsdp.runtime.watchdog import current_watchdog  # noqa: E402

CLIENT_STATE = {"note": "from the client", "values": [1, 2, 3]}


class OddLM(nn.Module):
    """ds_api_script's tiny LM plus a 7-element parameter: 29575 elements in all, so DeepSpeed pads its partitions
    (stages 1-2: the flat group to a multiple of 2 x world size; stage 3: that parameter to a multiple of the world
    size) and the reader and writer must place the padding as DeepSpeed does."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = TinyLM()
        self.odd = nn.Parameter(torch.linspace(-1.0, 1.0, 7))

    def forward(self, batch: dict) -> torch.Tensor:
        return self.lm(batch) + 0.1 * self.odd.square().sum()


def ds_config(zero: int, accumulation: int, micro: int, dtype: str) -> dict:
    """ds_api_script's config, warming up past the save (the resumed schedule must continue, not restart)."""
    config = api_config(zero, accumulation, micro)
    config["scheduler"]["params"]["warmup_num_steps"] = 15
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("deepspeed", "ds_compat"), required=True)
    parser.add_argument("--phase", choices=("train", "resume"), required=True)
    parser.add_argument("--zero", default="0,1,2,3")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--global_batch", type=int, default=8)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--save_dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    accumulation = args.global_batch // (args.micro * world)
    data = Tokens(2 * args.steps * args.global_batch)
    results = {}
    for zero in (int(z) for z in args.zero.split(",")):
        torch.manual_seed(1234)
        model = OddLM()
        config = ds_config(zero, accumulation, args.micro, args.dtype)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        save_dir = os.path.join(args.save_dir, f"zero{zero}")
        result: dict = {}
        if args.phase == "resume":
            path, client_state = engine.load_checkpoint(save_dir)
            result["client_state_ok"] = all(client_state.get(k) == v for k, v in CLIENT_STATE.items())
            result["global_steps_loaded"] = engine.global_steps
        losses = []
        for _ in range(args.steps):
            step = engine.global_steps
            micro_losses = []
            for k in range(accumulation):
                first = step * args.global_batch + (rank * accumulation + k) * args.micro
                batch = {"input_ids": data.data[first : first + args.micro].to(engine.device)}
                loss = engine(batch)
                engine.backward(loss)
                engine.step()
                micro_losses.append(loss.item())
            mean = torch.tensor(sum(micro_losses) / accumulation, dtype=torch.float64)
            deepspeed.comm.all_reduce(mean)
            losses.append(mean.item() / world)
        result["losses"] = losses
        result["lr"] = engine.get_lr()[0]
        if args.phase == "train":
            engine.save_checkpoint(save_dir, client_state=CLIENT_STATE)
        results[str(zero)] = result
    if rank == 0:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=1)
    watchdog = current_watchdog()  # ds_compat's fast-failure watchdog (none under DeepSpeed)
    if watchdog is not None:  # before the barrier: rank 0, the store's host, may exit first
        watchdog.finish()
    deepspeed.comm.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's process-group teardown aborts now and then after a finished run (conftest.end_worker)


if __name__ == "__main__":
    main()
